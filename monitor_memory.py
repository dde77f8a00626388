#!/usr/bin/env python
"""Watch a training run's memory: does it leak, and what is the biggest batch that fits?

    python monitor_memory.py --steps 200 --batch-size 64 [-- train_lean.py flags]   watch a run
    python monitor_memory.py 200 64 [-- train_lean.py flags]                        the same, shorter
    python monitor_memory.py --from-log out/metrics.jsonl                           analyse a log
    python monitor_memory.py --steps 200 --trace [-- train_lean.py flags]          ... and where it leaks
    python monitor_memory.py --sweep 8,16,32,64,128 [-- train_lean.py flags]        batch sweep

Watching starts train_lean.py as a child process in a folder of its own (out/monitor-<time>-<random>,
kept: the run's log, output and model; unless the trainer flags give --out-dir), follows the JSONL
log it writes and prints a row every --every steps; when the run ends, or on Ctrl-C (which stops the child cleanly), it
prints the leak analysis of what it saw (memwatch.py): each memory series' trend, the memory
each phase of a step adds (generation, rewards, reference, update) and, on a LEAK, the phase that
grows. --trace has the trainer trace a window of steps after the warm-up (train_lean.py
--trace-memory): on a LEAK the monitor shows the allocation sites (file:line) and the tensors that
piled up, and on CUDA names the memory_viz snapshot. However the monitor ends (Ctrl-C, SIGTERM,
SIGHUP, an error of its own, or kill -9: the trainer gets SIGTERM when its parent dies), a trainer
it started is stopped, not left running; under `nohup` a closed terminal (SIGHUP) stops nothing.
A sweep runs --steps steps (default 5) at each batch size, each in a fresh process, and fits
memory = fixed + per_sample * batch.

Exit code: 0 no leak, 1 leak, 2 usage error, 3 nothing could be judged (too few steps after the
warm-up, or the training run failed), 4 the monitor itself failed (its traceback). A CI job can gate
on it.
"""
import argparse
import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import memwatch
from harness import places

HERE = os.path.dirname(os.path.abspath(__file__))
POLL_S = 0.2            # how often the log is read and the child looked at
SWEEP_STEPS = 5         # steps per batch size: the first allocates AdamW state, the rest time it
# Steps --trace traces: the evidence compares the end of the first with the end of the last, so what
# piles up over 19 steps stands against what one step holds.
TRACE_STEPS = 20
EVIDENCE = os.path.join("memory", "trace.json")   # written by the trainer in its --out-dir (harness/memory.py)
EXIT_OK, EXIT_LEAK, EXIT_USAGE, EXIT_UNJUDGED, EXIT_FAILED = 0, 1, 2, 3, 4


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line and exit 2, without argparse's usage block: a CI log should say what was wrong.
        raise UsageError(message)


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonneg_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def at_least_two(text):
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be 2 or more (the first traced step is the baseline), got {text}")
    return value


def batch_sizes(text):
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive batch sizes, got {text!r}")
    return sorted(set(sizes))


def build_parser():
    """monitor_memory.py's own flags (the trainer's come after `--`)."""
    p = Parser(prog="monitor_memory.py", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--from-log", metavar="FILE", help="analyse this JSONL log instead of starting a run")
    mode.add_argument("--sweep", metavar="SIZES", type=batch_sizes,
                      help="comma-separated batch sizes to run a few steps each")
    p.add_argument("--steps", type=positive_int,
                   help=f"steps to train (in a sweep: per batch size, default {SWEEP_STEPS})")
    p.add_argument("--batch-size", type=positive_int, help="global completions per step")
    # `monitor_memory.py 200 64`, as the seed documents write it: shorthands for the two flags.
    p.add_argument("steps_given", nargs="?", type=positive_int, metavar="STEPS", help="the same as --steps")
    p.add_argument("batch_given", nargs="?", type=positive_int, metavar="BATCH_SIZE",
                   help="the same as --batch-size")
    p.add_argument("--every", type=positive_int, default=10, help="print a row every N steps")
    p.add_argument("--warmup", type=nonneg_int, default=memwatch.WARMUP,
                   help="records skipped before fitting trends (default %(default)s)")
    p.add_argument("--leak-mb-per-step", type=positive_float, default=memwatch.LEAK_MB_PER_STEP,
                   help="LEAK when the slope's whole 95%% interval is above this (default %(default)s)")
    p.add_argument("--frag-ratio", type=positive_float, default=memwatch.FRAG_RATIO,
                   help="warn when CUDA reserved / step peak exceeds this (default %(default)s)")
    p.add_argument("--churn-spread", type=positive_float, default=memwatch.CHURN_SPREAD,
                   help="warn when the per-step peak's (p90-p10)/median exceeds this (default %(default)s)")
    p.add_argument("--budget-gb", type=positive_float,
                   help="memory budget of a sweep (default: the device's total memory; RAM on CPU)")
    p.add_argument("--work-dir", default=os.path.join("out", "memwatch"),
                   help="where a sweep's runs write (default %(default)s)")
    p.add_argument("--trace", action="store_true",
                   help="have the trainer trace --trace-steps steps after the warm-up for leak evidence: the "
                        "allocation sites and tensors that grew, on CUDA a memory_viz snapshot (train_lean.py "
                        "--trace-memory); the traced steps run 2.5-9x slower (the tiny model on CPU; BENCHMARKS.md)")
    p.add_argument("--trace-steps", type=at_least_two, help=f"steps --trace traces (default {TRACE_STEPS})")
    p.add_argument("--summary", metavar="FILE", help="write a JSON summary here")
    p.add_argument("--plot", metavar="FILE", help="write a PNG plot here")
    p.add_argument("--trainer", default=os.path.join(HERE, "train_lean.py"),
                   help="the training script to run (default: train_lean.py next to this file)")
    return p


def parse_args(argv):
    """(args, trainer flags): everything after the first `--` goes to train_lean.py untouched."""
    own, train = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(own)
    for positional, name, flag in (("steps_given", "steps", "--steps"), ("batch_given", "batch_size", "--batch-size")):
        given, flagged = getattr(args, positional), getattr(args, name)
        if given is not None and flagged is not None and given != flagged:
            raise UsageError(f"{name.upper()} {given} and {flag} {flagged} disagree: give it once")
        if flagged is None:
            setattr(args, name, given)
    check_outputs(args, train)
    if args.trace_steps is not None and not args.trace:
        raise UsageError("--trace-steps applies with --trace")
    args.trace_steps = args.trace_steps or TRACE_STEPS
    if args.trace and (args.from_log or args.sweep):
        raise UsageError("--trace traces a run the monitor watches: not with --from-log or --sweep")
    if args.from_log is not None:
        check_from_log(args, train)
    else:
        check_trainer_flags(args, train)
    return args, train


def check_outputs(args, train):
    """--summary and --plot writable, neither on what the monitor reads or the watched run writes."""
    outputs = (("--summary", args.summary), ("--plot", args.plot))
    for flag, path in outputs:
        if path is not None:   # written after the whole run: a bad path is said now, not then
            writable(flag, path)
    wrong = args.plot and places.figure_error("--plot", args.plot)
    if wrong:
        raise UsageError(wrong)
    # the trainer's rule (harness/places.py): no output on what the monitor reads or the run writes
    watched = [] if args.from_log or args.sweep else \
        [("the watched run", watched_log(train), "writes")]
    clash = places.clash([("--from-log", args.from_log, "reads"), *watched], outputs)
    if clash:
        raise UsageError(clash)


def check_from_log(args, train):
    """--from-log names a log file, and nothing that would start a run comes with it."""
    if train or args.steps or args.batch_size:
        raise UsageError("--from-log analyses an existing log: it takes no --steps, --batch-size or trainer flags")
    if os.path.isdir(args.from_log):   # a run's folder: its log is named
        inside = os.path.join(args.from_log, "metrics.jsonl")
        raise UsageError(f"--from-log {args.from_log} is a folder: pass the run's log" +
                         (f", {inside}" if os.path.isfile(inside) else " file in it"))
    if not os.path.isfile(args.from_log):
        raise UsageError(f"--from-log {args.from_log}: no such file")


def check_trainer_flags(args, train):
    """The trainer exists, and its flags leave alone those the monitor sets itself."""
    if not os.path.isfile(args.trainer):
        raise UsageError(f"trainer {args.trainer} not found")
    controlled = ["--steps", "--batch-size"] + (["--out-dir", "--log-file"] if args.sweep else [])
    controlled += ["--trace-memory", "--trace-memory-after"] if args.trace else []
    for flag in controlled:
        if flag_value(train, flag) is not None:
            raise UsageError(f"a sweep sets {flag} for each batch size; leave it out of the trainer flags"
                             if args.sweep and flag in ("--out-dir", "--log-file") else
                             f"--trace sets {flag}; leave it out of the trainer flags" if flag.startswith("--trace")
                             else f"give {flag} to monitor_memory.py, not after --")
    if args.sweep and args.batch_size:
        raise UsageError("--sweep sets the batch size; leave out --batch-size")


def writable(flag, path):
    """UsageError unless the file `path` can be written (its folder exists and takes a file)."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder: pass the path of a file to write")
    folder = os.path.dirname(path) or "."
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write to {folder} ({e.strerror or e}): pass a "
                         f"writable path") from None


def group_size(args, train) -> int:
    """The group size the trainer runs with: train_lean.py's as it reads its settings (its flags,
    GRPO_ variables, the task's declared value, the default); another --trainer's from --group-size
    or GRPO_GROUP_SIZE, else 8."""
    if os.path.realpath(args.trainer) == os.path.realpath(os.path.join(HERE, "train_lean.py")):
        import tasks   # the trainer's own reading (it imports torch: only for a sweep)
        from harness import cli, config, task
        from train_lean import TABLES   # its variant flags' choices
        try:
            return cli.load(train, builtin=tasks.BUILTIN, default_task=tasks.DEFAULT,
                            tables=TABLES).cfg.group_size
        except (config.ConfigError, task.TaskError) as e:
            raise UsageError(f"the trainer's flags: {e}") from None
    try:
        return int(trainer_setting(train, "--group-size", 8))
    except ValueError:
        raise UsageError(f"--group-size must be an integer, got "
                         f"{trainer_setting(train, '--group-size', 8)!r}") from None


def flag_value(argv, flag):
    """The value of `flag` in a trainer command line (`--flag v` or `--flag=v`), else None."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def trainer_setting(train, flag, default):
    """A trainer setting as the trainer will see it: the flag, else its GRPO_* variable, else default."""
    value = flag_value(train, flag)
    if value is None:
        value = os.environ.get("GRPO_" + flag.lstrip("-").upper().replace("-", "_"))
    return default if value is None else value


# --- reading a log ------------------------------------------------------------------------------

class LogFollower:
    """Reads the records appended to a JSONL file since the last call, like `tail -f`.

    Only complete lines are parsed (the writer may be half-way through one). Lines already in the
    file when following starts are skipped unless from_start: a previous run's records in the same
    file are not this run's, while a resumed run appending to it adds new ones after them. A file
    that was replaced, shrank, or whose first bytes changed was rewritten from the top by its
    writer and is read again from the top. (The last test catches a writer that truncates and
    refills the file past our position between two polls; the size alone would miss it.)
    """

    HEAD = 4096

    def __init__(self, path, from_start=True):
        self.path, self.pos, self.partial, self.inode, self.head = path, 0, b"", None, b""
        if not from_start and os.path.exists(path):
            with open(path, "rb") as f:
                self.head = f.read(self.HEAD)
                self.pos, self.inode = f.seek(0, os.SEEK_END), os.fstat(f.fileno()).st_ino

    def poll(self):
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            rewritten = st.st_ino != self.inode or st.st_size < self.pos or f.read(len(self.head)) != self.head
            if rewritten:
                self.pos, self.partial, self.inode, self.head = 0, b"", st.st_ino, b""
            f.seek(self.pos)
            data = f.read()
        self.pos += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        records = []
        for line in lines:
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a corrupt or foreign line is not a step; skipping it is all we can do
            if isinstance(rec, dict):
                records.append(rec)
        return records


def read_log(path, memory_only: bool = False):
    """The records of a finished log, a line at a time and only their numbers (and kind; with
    memory_only, what the leak analysis reads: step, kind, the *_mb readings, the allocator's
    retries): memory grows with the steps, not with the file's texts. A line that is no record (not
    JSON, or nested past any depth; a step that is no whole number; a memory reading that is no
    number, NaN, inf, null or past a petabyte) is skipped and said by its number, so one damaged
    line neither splits the run nor enters it."""
    records, skipped = [], []
    try:
        f = open(path, "rb")
    except FileNotFoundError:   # a run that ended before its first record
        return records
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):   # not JSON, or nested past any depth
                rec = None
            wrong = "it is not JSON" if rec is None else not_a_record(rec)
            if wrong:
                skipped.append(f"{path} line {number} is no record ({wrong}): skipped")
                continue
            records.append({k: v for k, v in rec.items() if k == "kind" or not isinstance(
                v, (str, list, dict)) and (not memory_only or k in LEAK_FIELDS or k.endswith("_mb"))})
    for said in skipped[:5]:
        print(f"monitor_memory.py: {said}", file=sys.stderr)
    if len(skipped) > 5:
        print(f"monitor_memory.py: {len(skipped) - 5} more lines skipped", file=sys.stderr)
    return records



LEAK_FIELDS = ("step", "cuda_alloc_retries")   # besides kind and the *_mb readings


def not_a_record(rec):
    """What makes a parsed line no record of the trainer's log, else None."""
    if not isinstance(rec, dict):
        return f"it is a {type(rec).__name__}"
    if not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
        return f"its step is {str(rec.get('step'))[:40]!r}, not a whole number"
    bad = next((k for k, v in rec.items() if k.endswith("_mb") and (
        isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= 1e12)), None)
    return None if bad is None else f"its {bad!r} is {str(rec[bad])[:40]!r}, not a number"


# --- watching a run -----------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1   # <linux/prctl.h>
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def end_with_parent(parent):
    """Run in the child between fork and exec: SIGTERM (the trainer's clean stop: it finishes its step,
    saves a checkpoint and exits) as soon as this process dies, by any signal, kill -9 included. If this
    process died before the signal was armed, it will never come: the child exits at once."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)

def stop_child(child, grace_s=30.0):
    """SIGINT (the trainer's own clean stop), then SIGTERM, then SIGKILL, each after a grace period.

    A second Ctrl-C while waiting skips to the next signal instead of leaving an orphan behind.
    """
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        if child.poll() is not None:
            return
        child.send_signal(sig)
        try:
            child.wait(wait_s)
            return
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue


@contextlib.contextmanager
def trainer_process(cmd, output):
    """The trainer as a child process, stopped with stop_child however the block is left.

    Its own session: a Ctrl-C at the terminal reaches only this process, which then stops the child
    exactly once (a trainer hit by two SIGINTs may abandon its clean shutdown). The same session
    keeps it from the terminal's SIGHUP, so this process must stop it on every way out: an
    exception here (a closed stdout, a bad record) would otherwise leave it training unwatched; and a
    kill -9, which no handler sees, reaches it as its parent-death signal (end_with_parent).
    """
    end = {"preexec_fn": functools.partial(end_with_parent, os.getpid())} if _PRCTL is not None else {}
    child = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, start_new_session=True, **end)
    try:
        yield child
    finally:
        stop_child(child)


class RowPrinter:
    """Prints the live table: step, RSS, and per CUDA device allocated / reserved / peak."""

    def __init__(self, every):
        self.every, self.columns, self.first = every, None, True

    def __call__(self, rec):
        if rec.get("kind", "train") != "train" or "step" not in rec:
            return
        if self.columns is None:
            self.columns = memwatch.series_names([rec])
            print(f"{'step':>7}" + "".join(f"{c.replace('_mb', ''):>18}" for c in self.columns), flush=True)
        if self.first or rec["step"] % self.every == 0:
            cells = "".join(f"{rec[c]:>15.1f} MB" if isinstance(rec.get(c), (int, float)) else f"{'-':>18}"
                            for c in self.columns)
            print(f"{rec['step']:>7}{cells}", flush=True)
            self.first = False


def own_out_dir(train):
    """The trainer flags with an --out-dir of the watched run's own, unless they (or GRPO_OUT_DIR) name one: the
    trainer's default out/ holds whatever ran before, and the trainer refuses to write into an earlier run's
    records. A new folder out/monitor-<time>-<random> is kept: it holds the run's log, output and model."""
    if trainer_setting(train, "--out-dir", None) is not None:
        return train
    os.makedirs("out", exist_ok=True)
    return train + ["--out-dir", tempfile.mkdtemp(prefix=time.strftime("monitor-%Y%m%d-%H%M%S-"), dir="out")]


def evidence_file(args, train):
    """Where this run's leak evidence will be; None when it is not traced."""
    if not (args.trace or trainer_setting(train, "--trace-memory", "0") not in ("", "0")):
        return None
    return os.path.join(trainer_setting(train, "--out-dir", "out"), EVIDENCE)


def watched_log(train):
    """The log the watched run writes: its --log-file, GRPO_LOG_FILE, else OUT_DIR/metrics.jsonl."""
    return flag_value(train, "--log-file") or os.environ.get("GRPO_LOG_FILE") or \
        os.path.join(trainer_setting(train, "--out-dir", "out"), "metrics.jsonl")


def watch(args, train):
    """Run the trainer as a child, follow its log; returns (records, child return code, interrupted)."""
    log = watched_log(train)
    if flag_value(train, "--log-file") is None:
        train = train + ["--log-file", log]
    if args.trace:
        train = train + ["--trace-memory", str(args.trace_steps), "--trace-memory-after", str(args.warmup)]
    cmd = [sys.executable, args.trainer]
    cmd += ["--steps", str(args.steps)] if args.steps else []
    cmd += ["--batch-size", str(args.batch_size)] if args.batch_size else []
    cmd += train
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    output = os.path.join(os.path.dirname(os.path.abspath(log)), "train_output.txt")
    print(f"running: {' '.join(cmd)}\nfollowing {log}; trainer output in {output}", flush=True)

    follower = LogFollower(log, from_start=False)
    show = RowPrinter(args.every)
    records, interrupted = [], False
    with open(output, "wb") as out, trainer_process(cmd, out) as child:
        try:
            while True:
                for rec in follower.poll():
                    records.append(rec)
                    show(rec)
                if child.poll() is not None:
                    break
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping the trainer", flush=True)
            stop_child(child)
    for rec in follower.poll():  # whatever the child wrote while it was stopping
        records.append(rec)
        show(rec)
    if child.returncode != 0 and not interrupted:
        print(f"the trainer exited with code {child.returncode}"
              + ("" if memwatch.train_records(records)[0] else " before its first step's record")
              + f"; last lines of {output}:")
        with open(output, errors="replace") as f:
            print("".join(f.readlines()[-15:]).rstrip())
    return records, child.returncode, interrupted


# --- the leak report ----------------------------------------------------------------------------

def fit_row(name, s):
    """A table row: name, points, MB/step with its 95% interval, MB per 10k steps, verdict."""
    if "slope_mb_per_step" not in s:
        return f"{name:<26}{s['points']:>7}{'-':>10}{'-':>22}{'-':>18}  {s['verdict']}"
    interval = f"[{s['slope_low']:+.4f}, {s['slope_high']:+.4f}]"
    return (f"{name:<26}{s['points']:>7}{s['slope_mb_per_step']:>+10.4f}{interval:>22}"
            f"{s['growth_mb_per_10k_steps']:>+18.0f}  {s['verdict']}")


def print_report(report):
    print(f"\nmemory trend after a warm-up of {report['warmup']} records "
          f"({report['records']} training records"
          + (f", steps {report['steps'][0]}-{report['steps'][1]})" if report.get("steps") else ")"))
    header = f"{'points':>7}{'MB/step':>10}{'95% interval':>22}{'MB per 10k steps':>18}  verdict"
    print(f"{'series':<26}{header}")
    for name, s in report["series"].items():
        print(fit_row(name, s))
    for family, phases in report["phases"].items():
        added = family in memwatch.INCREMENTS
        print(f"\n{family}: " + ("memory each phase adds per step (slope of the running sum of its changes)"
                                 if added else "trend of the peak within each phase"))
        print(f"{'phase':<26}{header}")
        for phase, s in phases.items():
            print(fit_row(memwatch.PHASE_NAMES.get(phase, phase), s))
    for w in report["warnings"]:
        print(f"warning: {w}")
    print(f"LEAK means the whole interval is above {report['leak_mb_per_step']} MB/step.")
    for g in report["growing"]:
        print(f"it grows in {memwatch.PHASE_NAMES.get(g['phase'], g['phase'])}: {g['mb_per_step']:+.3f} MB/step "
              f"of {g['family']}")
    if report["verdict"] == "LEAK" and report["phases"] and not report["growing"]:
        print("no phase grows by itself: the growth is spread over the phases (see their MB/step above)")


def print_evidence(evidence, path, leak, records):
    """The trainer's trace: the window, what tracing cost in this run, and on a LEAK what grew in it."""
    recs, _ = memwatch.train_records(records)
    first, last = evidence["from_step"], evidence["to_step"]
    print(f"\nevidence of steps {first}-{last}" + (" (the run ended first)" if evidence["ended_early"] else "")
          + f": {path}")
    times = [[r["step_time_s"] for r in rs if isinstance(r.get("step_time_s"), (int, float))]
             for rs in ([r for r in recs if first <= r["step"] <= last], [r for r in recs if r["step"] > last])]
    if all(times):
        traced, plain = (sorted(t)[len(t) // 2] for t in times)
        print(f"tracing cost: a traced step took {traced:.3f} s, an untraced one after the window {plain:.3f} s "
              f"({traced / plain:.1f}x; medians)")
    if not leak:
        return
    print("Python allocations that grew (tracemalloc: numpy and Python objects; torch tensors are not in it):")
    for site in evidence["sites"][:5]:
        file, line = site["site"].rsplit(":", 1)
        short = os.path.relpath(file)   # a file under the working directory by its short name
        print(f"  {site['mb']:+10.3f} MB {site['blocks']:+8d} blocks  {file if short.startswith('..') else short}:{line}"
              f"  {site['code']}")
    print("tensors that piled up (live tensors by shape, dtype, device):")
    for t in evidence["tensors"][:5]:
        print(f"  {t['mb']:+10.3f} MB {t['count']:+8d} x {tuple(t['shape'])} {t['dtype']} {t['device']} "
              f"({t['count_end']} alive)")
    if evidence.get("cuda_snapshot"):
        print(f"CUDA memory history: {evidence['cuda_snapshot']} (open it in https://pytorch.org/memory_viz)")


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only: works on a headless CI machine
    import matplotlib.pyplot as plt
    return plt


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def run_figure(records, report):
    """The leak plot: each memory series with its fit, then what each phase added, summed over the run."""
    import numpy as np

    plt = pyplot()
    recs, _ = memwatch.train_records(records)
    names = list(report["series"])
    groups = [g for g in ([n for n in names if n == memwatch.RSS], [n for n in names if n != memwatch.RSS]) if g]
    marks = memwatch.phase_marks(recs)
    added = [f for f in memwatch.INCREMENTS if f in marks]
    panels = max(len(groups) + len(added), 1)
    fig, axes = plt.subplots(panels, 1, figsize=(12, 3.6 * panels), squeeze=False)
    for ax, family in zip(axes[len(groups):, 0], added):
        phases = report["phases"][family]
        for phase, (steps, mb) in memwatch.phase_increments(recs, family, marks[family]).items():
            s = phases[phase]
            ax.plot(steps, np.cumsum(mb), lw=1.2, label=f"{memwatch.PHASE_NAMES.get(phase, phase)}"
                    + (f": {s['slope_mb_per_step']:+.3f} MB/step ({s['verdict']})" if "slope_mb_per_step" in s else ""))
        ax.set_ylabel(f"MB added, summed ({family})")
        ax.set_title(f"memory each phase added since step {recs[0]['step']}")
    for ax, group in zip(axes[:, 0], groups):
        for name in group:
            steps, values = memwatch.series(recs, name)
            s = report["series"][name]
            line, = ax.plot(steps, values, lw=1, label=name)
            if "slope_mb_per_step" in s:
                x = [s["from_step"], s["to_step"]]
                ax.plot(x, [s["intercept_mb"] + s["slope_mb_per_step"] * v for v in x], "--", lw=2,
                        color=line.get_color(),
                        label=f"Theil-Sen {s['slope_mb_per_step']:+.3f} MB/step ({s['verdict']})")
        ax.set_ylabel("process RSS (MB)" if group[0] == memwatch.RSS else "CUDA memory (MB)")
    axes[0, 0].set_title(f"memory per step: {report['verdict']}")
    # The y axis spans at least the leak threshold over the run: flat memory looks flat, and a leak at
    # the threshold climbs the whole height (autoscaling would blow noise of a few MB up to fill it).
    span = report["leak_mb_per_step"] * (recs[-1]["step"] - recs[0]["step"]) if recs else 0.0
    for ax in axes[:, 0]:
        low, high = ax.get_ylim()
        if high - low < span:
            ax.set_ylim((low + high - span) / 2, (low + high + span) / 2)
        if report["warmup"] and len(recs) > 1:
            ax.axvspan(recs[0]["step"], recs[min(report["warmup"], len(recs)) - 1]["step"],
                       color="0.9", label="warm-up (not fitted)")
        ax.set_xlabel("step")
        # beside the panel, not on it: flat memory runs along the middle, where "best" would cover it
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        ax.grid(alpha=0.3)
    return fig


# --- the batch-size sweep -----------------------------------------------------------------------

def sweep_device(train):
    device = trainer_setting(train, "--device", "auto")
    if device == "auto":
        import torch  # only here: the trainer's own rule for "auto"
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def device_memory_mb(device):
    if device == "cuda":
        import torch
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**20
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20


def rss_mb(pid):
    """Current RSS of a process from /proc (Linux); None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_size(args, train, batch, device, budget_mb):
    """One sweep point in a fresh process: a row of the table."""
    out = os.path.join(args.work_dir, f"bs{batch}")
    log = os.path.join(out, "metrics.jsonl")
    os.makedirs(out, exist_ok=True)
    if os.path.exists(log):
        os.remove(log)  # this sweep's own file from an earlier sweep: its records are not this run's
    cmd = [sys.executable, args.trainer, "--steps", str(args.steps or SWEEP_STEPS), "--batch-size", str(batch),
           "--out-dir", out, "--log-file", log, "--overwrite"] + train   # the folder is this sweep point's own
    output = os.path.join(out, "train_output.txt")
    row = {"batch_size": batch, "peak_mb": None, "step_time_s": None, "samples_per_s": None}
    over_budget = interrupted = False
    with open(output, "wb") as f, trainer_process(cmd, f) as child:
        try:
            while child.poll() is None:
                # On CPU the budget is RAM: a batch that outgrows it is stopped here, before it
                # drives a shared machine into swap or the kernel's OOM killer picks a victim.
                rss = rss_mb(child.pid) if device == "cpu" else None
                if rss is not None and rss > budget_mb:
                    over_budget = True
                    child.kill()
                    child.wait()
                    break
                time.sleep(POLL_S / 2)
        except KeyboardInterrupt:
            interrupted = True
            stop_child(child)
    with open(output, errors="replace") as f:
        text = f.read()
    recs, _ = memwatch.train_records(read_log(log))
    row["exit_code"] = child.returncode
    # Only a run that ended normally has a peak: one stopped part-way never reached its own.
    if recs and child.returncode == 0:
        if device == "cuda":
            peaks = [v for r in recs for k, v in r.items()
                     if (m := memwatch.CUDA_KEY.match(k)) and m.group(2) == "peak" and isinstance(v, (int, float))]
        else:
            peaks = [r.get("rss_peak_mb", r.get(memwatch.RSS)) for r in recs]
        peaks = [p for p in peaks if isinstance(p, (int, float))]
        row["peak_mb"] = max(peaks) if peaks else None
        # The first step pays for one-off work (allocating optimizer state, warming kernels):
        # time the rest.
        timed = recs[1:] or recs
        for key in ("step_time_s", "samples_per_s"):
            vals = sorted(r[key] for r in timed if isinstance(r.get(key), (int, float)))
            row[key] = vals[len(vals) // 2] if vals else None
    oom = over_budget or child.returncode == -signal.SIGKILL or "out of memory" in text.lower()
    if interrupted:
        row["status"] = "stopped"
    elif oom or (row["peak_mb"] is not None and row["peak_mb"] > budget_mb):
        row["status"] = "OOM"
        row["note"] = ("killed at the budget" if over_budget else
                       "ran, but its peak is over the budget" if child.returncode == 0 else "out of memory")
    elif child.returncode != 0 or not recs:
        row["status"] = "FAIL"
        lines = text.strip().splitlines()
        row["note"] = f"exit code {child.returncode}: {lines[-1] if lines else 'no output'} (see {output})"
    else:
        row["status"] = "OK"
    return row


def sweep(args, train):
    """Run each batch size; returns the sweep summary (rows, fit, budget, largest batch)."""
    group = group_size(args, train)
    if any(b % group for b in args.sweep):
        raise UsageError(f"every batch size must be a multiple of the group size {group} "
                         f"(completions per step = prompts x group size)")
    device = sweep_device(train)
    budget_mb = args.budget_gb * 1024 if args.budget_gb else device_memory_mb(device)
    print(f"sweep on {device}, budget {budget_mb / 1024:.1f} GiB, {args.steps or SWEEP_STEPS} steps per size", flush=True)
    print(f"{'batch':>7}{'peak MB':>11}{'step s':>9}{'samples/s':>11}  status", flush=True)
    rows = []
    for batch in args.sweep:
        row = run_size(args, train, batch, device, budget_mb)
        rows.append(row)
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{batch:>7}{fmt(row['peak_mb'], '>11.0f')}{fmt(row['step_time_s'], '>9.3f')}"
              f"{fmt(row['samples_per_s'], '>11.1f')}  {row['status']}"
              + (f" ({row['note']})" if row.get("note") else ""), flush=True)
        if row["status"] == "stopped":
            break
    result = {"device": device, "budget_mb": budget_mb, "group_size": group, "rows": rows}
    # Every run that finished has a measured peak, one over the budget included.
    measured = [r for r in rows if r["peak_mb"] is not None]
    if len({r["batch_size"] for r in measured}) >= 2:
        fixed, per_sample = memwatch.fit_memory([r["batch_size"] for r in measured], [r["peak_mb"] for r in measured])
        failed = [r["batch_size"] for r in rows if r["status"] == "OOM"]
        best = memwatch.largest_batch(fixed, per_sample, budget_mb, group, min(failed) if failed else None)
        result.update(fixed_mb=fixed, per_sample_mb=per_sample, largest_batch=best)
        print(f"\nfit: peak memory = {fixed:.0f} MB + {per_sample:.3f} MB x batch")
        if best is None:
            print("no batch size fits the budget by this fit" if per_sample > 0 else
                  "peak memory does not grow with the batch size here: the fit gives no limit")
        else:
            biggest = max(r["batch_size"] for r in measured)
            note = (f" (extrapolated: the largest measured batch is {biggest})" if best > 2 * biggest else "")
            print(f"largest batch that fits in {budget_mb / 1024:.1f} GiB: {best}{note}")
    else:
        print("\nfewer than two batch sizes ran to the end: no fit")
    return result


def sweep_figure(result):
    """Peak memory and throughput against the batch size, the sizes as the ticks."""
    plt = pyplot()
    rows = [r for r in result["rows"] if r["peak_mb"] is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot([r["batch_size"] for r in rows], [r["peak_mb"] for r in rows], "o", label="measured peak")
    if "fixed_mb" in result:
        # Many points: the straight line of the fit is a curve on the log batch axis.
        lo, hi = min(r["batch_size"] for r in result["rows"]), max(r["batch_size"] for r in result["rows"])
        xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
        ax1.plot(xs, [result["fixed_mb"] + result["per_sample_mb"] * x for x in xs], "--",
                 label=f"{result['fixed_mb']:.0f} MB + {result['per_sample_mb']:.2f} MB x batch")
    for r in result["rows"]:
        if r["status"] == "OOM":
            ax1.axvline(r["batch_size"], color="red", ls=":", label=f"OOM at {r['batch_size']}")
    ax1.set(xscale="log", xlabel="batch size", ylabel="peak memory (MB)",
            title=f"peak memory ({result['device']}, budget {result['budget_mb'] / 1024:.1f} GiB)")
    ax1.legend(fontsize=8)
    timed = [r for r in rows if r["samples_per_s"] is not None]
    ax2.plot([r["batch_size"] for r in timed], [r["samples_per_s"] for r in timed], "o-")
    ax2.set(xscale="log", xlabel="batch size", ylabel="samples/s", title="throughput")
    for ax in (ax1, ax2):
        ax.minorticks_off()   # a log axis labels its minor ticks ("6x10^1") when it spans less than a decade
        ax.set_xticks([r["batch_size"] for r in result["rows"]], [str(r["batch_size"]) for r in result["rows"]])
        ax.grid(alpha=0.3)
    return fig


# --- main ---------------------------------------------------------------------------------------

def main(argv):
    try:
        args, train = parse_args(argv)
    except UsageError as e:
        print(f"monitor_memory.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    # A `kill` (SIGTERM) of the monitor, or its terminal closing (SIGHUP), stops the child the same
    # clean way a Ctrl-C does; a signal this process was started ignoring stays ignored (`nohup` ignores
    # SIGHUP so that the run outlives its terminal).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler)

    if args.sweep:
        try:
            code, summary = swept(args, train)
        except UsageError as e:
            print(f"monitor_memory.py: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    else:
        code, summary = watched(args, train)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=2)
    return code


def swept(args, train) -> tuple:
    """--sweep: a few steps at each batch size; (the exit code, the summary)."""
    result = sweep(args, train)
    code = EXIT_OK if "fixed_mb" in result or any(r["status"] == "OK" for r in result["rows"]) else EXIT_UNJUDGED
    if any(r["status"] == "FAIL" for r in result["rows"]):
        code = EXIT_UNJUDGED
    summary = dict(mode="sweep", command=train, exit_code=code, **result)
    if args.plot:
        save(sweep_figure(result), args.plot)
    return code, summary


def watched(args, train) -> tuple:
    """A run watched (or --from-log, its log read) and judged; (the exit code, the summary)."""
    if args.from_log:
        records, returncode, interrupted = read_log(args.from_log, memory_only=True), 0, False
        evidence_path, started = os.path.join(os.path.dirname(os.path.abspath(args.from_log)), EVIDENCE), 0.0
    else:
        train = own_out_dir(train)
        evidence_path, started = evidence_file(args, train), time.time()
        records, returncode, interrupted = watch(args, train)
    report = memwatch.analyse(records, args.warmup, args.leak_mb_per_step, args.frag_ratio, args.churn_spread)
    if report["records"]:   # a trainer that failed before its first step leaves nothing to tabulate
        print_report(report)
    evidence = None
    # a file from before this run started is an earlier run's evidence, not this one's
    if evidence_path and os.path.exists(evidence_path) and os.path.getmtime(evidence_path) >= started:
        with open(evidence_path) as f:
            evidence = json.load(f)
        print_evidence(evidence, evidence_path, report["verdict"] == "LEAK", records)
    elif args.trace:
        print("\nno evidence: the run ended before its trace window's first step did")
    failed = returncode != 0 and not interrupted
    code = (EXIT_LEAK if report["verdict"] == "LEAK" else
            EXIT_UNJUDGED if report["verdict"] != "ok" or failed else EXIT_OK)
    # The trainer rejecting its flags before its first step is the user's usage error too.
    if failed and returncode == EXIT_USAGE and not records:
        code = EXIT_USAGE
    print({EXIT_OK: "verdict: no leak", EXIT_LEAK: "verdict: LEAK",
           EXIT_USAGE: "verdict: not judged (the trainer rejected its flags)",
           EXIT_UNJUDGED: "verdict: not judged" + (" (the trainer failed)" if failed else
                                                  " (too few records after the warm-up)")}[code])
    summary = dict(mode="log" if args.from_log else "watch", source=args.from_log, command=train,
                   trainer_exit_code=None if args.from_log else returncode, interrupted=interrupted,
                   exit_code=code, evidence=evidence, **report)
    if args.plot:
        save(run_figure(records, report), args.plot)
    return code, summary


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception:   # Python's exit status 1 would read as the verdict LEAK
        traceback.print_exc()
        sys.exit(EXIT_FAILED)
