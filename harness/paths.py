"""One run's paths, resolved once (symlinks, `..`, trailing slashes) before anything is created or
deleted.

What a run reads: its --model folder, its --task file, every setting marked path="in" (--ptx-file, a
task's) and a checkpoint --resume names from elsewhere. What it writes: its logs, wherever they lie,
and in OUT_DIR its checkpoints, model, reports, settings and lock; --overwrite deletes only what it
writes. One rule over them: a write may not land on, inside or around a path the run reads, another
path it writes, a path a running run writes (each run registers its writes while it runs: register)
or a folder a finished run replaces later (OUT_DIR/model, OUT_DIR/checkpoints); and a folder the run
writes may not hold another run's folder. A refusal is one line naming the setting to change
(ConfigError: exit 2).
"""
import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile

from harness import checkpoint, config, log, memory, places
from harness.places import LOCK, SETTINGS, WORDS, place

# OUT_DIR/.lock (harness/rundir.py): held while a run trains; left after, it marks a run's folder.
# OUT_DIR's folders that a run replaces as a whole later: no one else's file may lie inside
REPLACED = {name: "the run " + does for name, does in places.REPLACED.items()}
# what a run writes into OUT_DIR besides its logs, and what for (in messages: "..., which <role>")
OUT_DIR_WRITES = {**REPLACED, "tensorboard": "the run writes its TensorBoard events to",
                  "wandb": "the run writes its W&B run to",
                  memory.SUBDIR: "the run writes its memory evidence to",
                  checkpoint.temporary("model"): "the run writes its trained model to first",
                  SETTINGS: "the run writes its settings to", LOCK: "the run locks"}
# which of them are folders (the rest, and the logs, are files)
FOLDERS = {*REPLACED, "tensorboard", "wandb", memory.SUBDIR, checkpoint.temporary("model")}


@dataclasses.dataclass(frozen=True)
class Entry:
    setting: str    # the flag whose value places it (--out-dir for what the run writes there)
    given: str      # that flag's value
    shown: str      # the path itself, as given or joined to it
    role: str       # what is done there, to end "..., which <role>"
    real: str       # resolved
    folder: bool    # a folder the run makes there (else a file)


def entry(setting: str, given: str, shown: str, role: str, folder: bool = False) -> Entry:
    return Entry(setting, given, shown, role, os.path.realpath(shown), folder)


def _task_file(task: str):
    """The file of --task path/to/file.py:Name, or None (a built-in or a module)."""
    file = task.rsplit(":", 1)[0] if task else ""
    return file if file.endswith(".py") else None


def continues_own(cfg) -> bool:
    """Whether --resume names OUT_DIR's own checkpoints: latest, the folder, its checkpoints, one of
    them in line (checkpoint.in_line: not one set aside, which is read like any other's)."""
    if cfg.resume is None:
        return False
    out, named = os.path.realpath(cfg.out_dir), os.path.realpath(cfg.resume)
    return cfg.resume == "latest" or named in (out, os.path.join(out, checkpoint.SUBDIR)) or \
        checkpoint.in_line(cfg.resume, cfg.out_dir)


def reads(cfg, options) -> list:
    local = os.path.isdir(cfg.model)   # a hub id reads the hub's cache
    found = [entry("--model", cfg.model, cfg.model, "--model reads")] if local else []
    if _task_file(cfg.task):
        found.append(entry("--task", cfg.task, _task_file(cfg.task), "--task reads"))
    for settings in (cfg, options):
        for f in dataclasses.fields(settings) if settings is not None else ():
            value, name = getattr(settings, f.name), config.flag(f.name)
            if f.metadata.get("path") == "in" and value is not None:
                found.append(entry(name, value, value, f"{name} reads"))
    if cfg.resume and not continues_own(cfg):
        found.append(entry("--resume", cfg.resume, cfg.resume, "--resume reads"))
    return found


def writes(cfg) -> list:
    """Its logs, then what it writes in OUT_DIR (--eval-only: only a --log-file)."""
    metrics = log.metrics_path(cfg)
    where, given = ("--log-file", cfg.log_file) if cfg.log_file else ("--out-dir", cfg.out_dir)
    logs = [entry(where, given, metrics, f"{where} writes the run's records to"),
            entry(where, given, log.items_path(metrics), "the run writes its per-item scores to")]
    if cfg.log_completions:
        logs.append(entry("--log-completions", cfg.log_completions, cfg.log_completions,
                          "--log-completions writes"))
    if cfg.eval_only:
        return logs if cfg.log_file else []
    return logs + [entry("--out-dir", cfg.out_dir, os.path.join(cfg.out_dir, name), role,
                         name in FOLDERS) for name, role in OUT_DIR_WRITES.items()]


def inside(path: str, folder: str) -> bool:
    """Whether path lies in folder, both resolved."""
    return place(os.path.realpath(path), os.path.realpath(folder)) == "inside"


def _refusal(w: Entry, where: str, other: str, role: str, fix: str):
    head = f"{w.setting} {w.given}" + (f": {w.shown}" if w.shown != w.given else "")
    return config.ConfigError(f"{head} {WORDS[where]} {other}, which {role}: {fix} {w.setting}")


def _other_run_inside(folder: str):
    """A folder under `folder` that is another run's (it holds a lock file), or None."""
    for root, _, names in os.walk(folder):
        if LOCK in names:
            return root
    return None


def check(cfg, options) -> list:
    """The run's writes, once each is checked against the rule (module docstring): ConfigError."""
    # a conflict is said of the flag that placed the path: the logs a flag names before OUT_DIR's
    ins, outs = reads(cfg, options), sorted(writes(cfg), key=lambda w: w.setting == "--out-dir")
    for e in (*ins, *outs):   # printed, such a path is another one (a newline breaks the line)
        if any(ord(c) < 32 or ord(c) == 127 for c in e.real):
            raise config.ConfigError(f"{e.setting} {e.given!r}: {e.real!r} holds a control "
                                     f"character: pass a path without one")
    for i, w in enumerate(outs):
        for other in (*ins, *outs[i + 1:]):
            where = place(w.real, other.real)
            if where:
                raise _refusal(w, where, other.shown, other.role, "pass another")
        replaced = places.replaced(w.real)
        if replaced:
            raise _refusal(w, "inside", *replaced, "pass another")
        held = os.path.isdir(w.real) and _other_run_inside(w.real)
        if held:
            raise _refusal(w, "around", held, "is another run's folder (it holds a lock file)",
                           "move it out first, or pass another")
    return outs


# The registry of running runs' writes: one folder for every run on this machine, whatever its
# TMPDIR, user or working directory (a registry in the temp folder let a run under another TMPDIR
# delete a running run's log); sticky and open to all, as /tmp itself
REGISTRY = "/tmp/lean-grpo-runs"


def _in_the_way(w: Entry):
    """What lies where the run makes w and would fail it then, steps later, or None: a file where
    a folder goes (or a folder where a file goes), a dangling link, or an entry, or a folder to
    make it in, that cannot be written."""
    if os.path.islink(w.shown) and not os.path.exists(w.shown):
        return "is a dangling link"
    if os.path.exists(w.shown):
        if os.path.isdir(w.shown) != w.folder:
            return "is a file" if w.folder else "is a folder"
        return None if os.access(w.shown, os.W_OK) else "cannot be written"
    parent = os.path.dirname(os.path.abspath(w.shown))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be made: {parent} is a file"
    writable = os.access(parent, os.W_OK | os.X_OK)
    return None if writable else f"cannot be made: {parent} cannot be written"


def check_made(cfg, outs: list) -> None:
    """Every path the run makes (checkpoints, the final model, their temporary names, the logs) can
    be made when the run gets to it: else a ConfigError now, before the model loads (a file named
    checkpoints lost every step trained). A reporter's folder counts only when it reports there."""
    unused = {os.path.join(cfg.out_dir, kind) for kind in log.REPORTERS if kind != cfg.report_to}
    for w in outs:
        problem = w.shown not in unused and _in_the_way(w)
        if problem:
            kind = "a folder" if w.folder else "a file"
            raise config.ConfigError(f"{w.setting} {w.given}: {w.shown} {problem}, where the run "
                                     f"makes {kind}, which {w.role}: move it away, or pass "
                                     f"another {w.setting}")


def _registry() -> str:
    os.makedirs(REGISTRY, exist_ok=True)
    if os.stat(REGISTRY).st_uid == os.getuid():
        os.chmod(REGISTRY, 0o1777)
    return REGISTRY


def _live_writes(folder: str):
    """(pid, [paths]) of each registered run still alive (its entry locked); ended runs' removed."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not name.endswith(".json"):
            continue
        try:
            f = open(path, encoding="utf-8")
        except OSError:   # gone meanwhile, or not readable
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:   # its run holds it: alive
                held = json.load(f)
                yield held["pid"], held["writes"]
                continue
        with contextlib.suppress(PermissionError):   # another user's: their next run removes it
            os.remove(path)   # the lock went with its run


def register(outs: list, stack) -> None:
    """Lock every path the run writes, wherever it lies, until stack closes; ConfigError when a
    running run writes on, inside or around one of them. Training and --eval-only alike."""
    try:
        folder = _registry()
        turn = open(os.path.join(folder, LOCK), "a")
        if os.fstat(turn.fileno()).st_uid == os.getuid():   # every user's runs take turns on it
            os.fchmod(turn.fileno(), 0o666)
    except OSError as e:   # no registry to write in: run, but say what is not guarded
        log.warn(f"cannot lock the paths this run writes in {REGISTRY} "
                 f"({e.strerror}): a second run writing them would not be stopped")
        return
    with turn:
        fcntl.flock(turn, fcntl.LOCK_EX)   # one run at a time checks and registers
        for pid, theirs in _live_writes(folder):
            for w in outs:
                for path in theirs:
                    where = place(w.real, path)
                    if where:
                        raise _refusal(w, where, path, f"another run (pid {pid}) writes",
                                       "wait for it to end, or pass another")
        handle, name = tempfile.mkstemp(".json", f"{os.getpid()}-", folder)
        os.fchmod(handle, 0o644)   # read (and its lock tested) by every user's runs
        mine = os.fdopen(handle, "w", encoding="utf-8")
        fcntl.flock(mine, fcntl.LOCK_EX)
        json.dump({"pid": os.getpid(), "writes": [w.real for w in outs]}, mine)
        mine.flush()
    stack.callback(mine.close)
    stack.callback(os.remove, name)
