"""Trainer processes for the tests, forked from a server that has imported the trainer once.

A fresh interpreter spends about 8 s importing torch and transformers before train_lean.py does
anything (a 2-step toy run: 10 s in all, 0.2 s of it training); the slow tier starts many such
runs. multiprocessing's fork server imports train_lean (and so torch and transformers) once per
test worker, started with a user's environment; each run is a fork of it that sets its own
environment, working folder and threads, sends fds 1 and 2 to files and runs train_lean.py as
__main__, as `python train_lean.py ARGS` would, then exits with its exit status. What a run does
stays in its process: state, signals, kill -9 and the exit code are a real process's.
"""
import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback

_context = None


def _start(environment: dict):
    """The fork server, started (once per test process) with the environment a run gets: what
    torch, transformers and huggingface_hub read when imported is a user's, OMP_NUM_THREADS unset
    so that torch's default threads are a fresh process's."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["train_lean"])
        saved, saved_tempdir = dict(os.environ), tempfile.tempdir
        os.environ.clear()
        os.environ.update({k: v for k, v in environment.items() if k != "OMP_NUM_THREADS"})
        # the server's socket lies in a folder of TMPDIR's, and a socket's path holds at most 107
        # bytes: under a long TMPDIR (a user's may be) the folder goes to /tmp
        if len(tempfile.gettempdir()) > 60 and os.access("/tmp", os.W_OK):
            tempfile.tempdir = "/tmp"
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
            tempfile.tempdir = saved_tempdir
        _context = ctx
    return _context


def _main(argv: list, environment: dict, cwd, out, err) -> None:
    """In the forked process: train_lean.py's __main__ with argv, as a fresh process runs it; out,
    err: a file's path, or a pipe's end (DupFd), or None (/dev/null)."""
    import torch
    default_threads = torch.get_num_threads()   # the server's: a fresh process's default
    os.environ.clear()
    os.environ.update(environment)
    if cwd is not None:
        os.chdir(cwd)
    for fd, to in ((1, out), (2, err)):
        f = (os.open(to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if isinstance(to, str)
             else os.open(os.devnull, os.O_WRONLY) if to is None else to.detach())
        os.dup2(f, fd)
        os.close(f)
    threads = environment.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else default_threads)
    sys.argv = list(argv)
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter's own last resort: print, exit 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(argv: list, environment: dict, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """argv (the script, then its arguments) run to its end: its exit status (-N when killed by
    signal N) and its stdout and stderr as text; TimeoutExpired (the process killed) past timeout."""
    ctx = _start(environment)
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = ctx.Process(target=_main, args=(list(argv), dict(environment), cwd, out, err))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess([sys.executable, *argv], proc.exitcode,
                                               o.read(), e.read())


class Popen:
    """start(): a running trainer as subprocess.Popen gives one (pid, stdout and stderr as text
    streams or None, poll, wait, send_signal, kill, communicate, returncode)."""

    def __init__(self, proc, stdout, stderr, argv):
        self.proc, self.stdout, self.stderr, self.args = proc, stdout, stderr, argv
        self.pid = proc.pid

    @property
    def returncode(self):
        return self.proc.exitcode

    def poll(self):
        return self.proc.exitcode

    def wait(self, timeout=None):
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.proc.exitcode

    def send_signal(self, signum) -> None:
        if self.proc.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.proc.kill()

    def communicate(self, timeout=None):
        """(stdout, stderr) to their ends (None for a stream not piped), once the process ended."""
        read = {}
        threads = [threading.Thread(target=lambda n, s: read.__setitem__(n, s.read()), args=(n, s))
                   for n, s in (("out", self.stdout), ("err", self.stderr)) if s is not None]
        for t in threads:
            t.start()
        self.wait(timeout)
        for t in threads:
            t.join()
        return read.get("out"), read.get("err")


def start(argv: list, environment: dict, stdout: bool = True, stderr: bool = True, cwd=None):
    """argv (the script, then its arguments) started: a Popen whose stdout / stderr are pipes when
    asked (else /dev/null)."""
    ctx = _start(environment)
    ends, mine = [], []
    for wanted in (stdout, stderr):
        if wanted:
            r, w = os.pipe()
            ends.append(w)
            mine.append((r, w))
        else:
            ends.append(None)
            mine.append(None)
    child = [multiprocessing.reduction.DupFd(w) if w is not None else None for w in ends]
    proc = ctx.Process(target=_main, args=(list(argv), dict(environment), cwd, *child))
    proc.start()
    streams = []
    for pair in mine:
        if pair is None:
            streams.append(None)
        else:
            os.close(pair[1])   # the child holds its own copy
            streams.append(open(pair[0], encoding="utf-8"))
    return Popen(proc, *streams, [sys.executable, *argv])
