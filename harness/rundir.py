"""The output folder belongs to one run: locked while it runs, never overwritten after.

While a run trains, its rank 0 holds a lock on OUT_DIR/.lock (flock). The kernel releases it when the
process ends, however it ends (kill -9 included), so a killed run leaves no stale lock behind; a second
run started in the folder meanwhile exits 2 naming the pid that holds it. After a run, its records stay
its own: a new run into a folder that holds an earlier run's logs, checkpoints, model or reports is
refused, unless it continues that run (--resume) or starts over on purpose (--overwrite, which sets
them aside once the new run has loaded its model, and deletes them once it has written its first
step: Overwritten). --eval-only takes no lock on OUT_DIR and writes nothing but a --log-file it is
given; every path a run writes, that one too, is checked and locked by harness/paths.py.

All of this happens at start-up, before a model loads: every path a setting names is checked (a folder
that cannot be written says so at once), the lock file is created, --resume finds and checks its
checkpoint and compares the settings that define the run with those it recorded, and a disk that
clearly cannot hold a checkpoint and the trained model is refused.
"""
import contextlib
import dataclasses
import difflib
import fcntl
import json
import os
import shutil
import tempfile

from grpo import distributed
from harness import checkpoint, config, log, memory, paths
from harness.paths import LOCK, SETTINGS

# what a run writes into OUT_DIR besides the lock: its metrics, checkpoints, model, --report-to
# folders and memory evidence. Its settings table (SETTINGS, harness/screen.py) is written at
# start-up: alone it is what a run that stopped before its first record leaves (a bad --model,
# say), which the next run replaces; beside records it is one of them
OUTPUTS = (log.METRICS, checkpoint.SUBDIR, "model", "tensorboard", "wandb", memory.SUBDIR)
ASIDE = ".overwritten"   # --overwrite's earlier records until the run's first step: Overwritten


def check_paths(settings) -> None:
    """Every file a run reads exists and is readable; every folder it writes to can be written.

    Checked before anything heavy is loaded, so that a typo costs a second, not a model load. A field of
    the Config or of a task's options opts in with opt(..., path="in" | "out"); settings may be None.
    """
    for f in dataclasses.fields(settings) if settings is not None else ():
        name, value, kind = f.name, getattr(settings, f.name), f.metadata.get("path")
        if value is None or kind is None:
            continue
        if value != value.strip() or not value:   # " ": a folder the console shows as nothing
            raise config.ConfigError(f"{config.flag(name)} {value!r}: a path that is empty or starts "
                                     f"or ends with a blank reads as another on the console and in "
                                     f"every message; pass it without them")
        if kind == "in":
            if not os.path.isfile(value):
                raise config.ConfigError(f"{config.flag(name)} {value}: no such file: check the path")
            try:
                with open(value, "rb") as fh:
                    fh.read(1)
            except OSError as e:
                raise config.ConfigError(f"{config.flag(name)} {value} cannot be read ({e.strerror}): "
                                         f"fix its permissions or pass another file") from None
        elif name != "out_dir" and os.path.isdir(value):   # a log file: opening it would fail at the first step
            raise config.ConfigError(f"{config.flag(name)} {value} is a folder: pass the path of a file to write")
        else:
            folder = value if name == "out_dir" else (os.path.dirname(value) or ".")
            try:
                os.makedirs(folder, exist_ok=True)
                with tempfile.TemporaryFile(dir=folder):
                    pass
            except OSError as e:
                raise config.ConfigError(f"{config.flag(name)} {value}: cannot write to {folder} "
                                         f"({e.strerror or e}): pass a writable folder") from None


def ranks_differ(ranks: list) -> str | None:
    """The first setting in which a rank differs from rank 0, said with its sources (ranks: each
    rank's (settings, sources)), or None: all alike."""
    (first, first_from), *others = ranks
    for rank, (mine, mine_from) in enumerate(others, 1):
        for name in first:
            if mine.get(name) != first[name]:
                return (f"rank {rank}'s {config.flag(name)} {mine.get(name)} ({mine_from.get(name)}) "
                        f"differs from rank 0's {first[name]} ({first_from.get(name)}): every rank "
                        f"must train with the same settings; give each the same command line and "
                        f"GRPO_ variables")
    return None


def absolute(settings) -> None:
    """Every path setting of settings (None: none) made absolute, before any task code runs: a task
    that changes the working folder (os.chdir in its __init__) must not move the run's folder under
    it, nor what it reads. Printed and recorded so; --resume compares paths by what they name."""
    for f in dataclasses.fields(settings) if settings is not None else ():
        value = getattr(settings, f.name)
        local = f.name in ("model", "resume") and isinstance(value, str) and os.path.exists(value)
        if value is not None and (f.metadata.get("path") or local) and value != "latest":
            setattr(settings, f.name, os.path.abspath(value))


def check_model(model: str) -> None:
    """A --model that looks like a local folder must be one: a typo of a path is said at once (it
    went to the hub, retried for most of a minute and blamed the network). Looks local: absolute,
    ./, ../ or ~, more than one /, or a first part that is a folder here (out/tniy when out/
    exists); a hub id is NAME or OWNER/NAME."""
    first = model.split("/")[0]
    local = (os.path.isabs(model) or model.startswith(("./", "../", "~")) or model.count("/") > 1
             or ("/" in model and os.path.isdir(first)))
    path = os.path.expanduser(model)
    if not local or os.path.isdir(path):
        return
    if os.path.exists(path):
        raise config.ConfigError(f"--model {model} is a file: pass the folder that holds the "
                                 f"model's config.json and weights, or a hub id")
    parent = os.path.dirname(path.rstrip("/")) or "."
    near = difflib.get_close_matches(os.path.basename(path.rstrip("/")),
                                     os.listdir(parent) if os.path.isdir(parent) else [], n=1)
    guess = f" (did you mean {os.path.join(os.path.dirname(model.rstrip('/')), near[0])}?)" \
        if near else ""
    raise config.ConfigError(f"--model {model}: no such folder{guess}: pass a local model folder, "
                             f"or a hub id (NAME or OWNER/NAME)")


def lock(out_dir: str):
    """OUT_DIR/.lock, locked by this process and holding its pid; ConfigError when another process holds it."""
    path = os.path.join(out_dir, LOCK)
    try:
        f = open(path, "a+", encoding="utf-8")
    except OSError as e:
        raise config.ConfigError(f"--out-dir {out_dir}: cannot create {path} ({e.strerror}): pass a writable "
                                 f"folder") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise config.ConfigError(f"--out-dir {out_dir} is in use by another run (pid {holder}): wait for it to end, "
                                 f"or pass another --out-dir") from None
    except OSError as e:   # a file system without locks (some network ones): run, but say what is not guarded
        log.warn(f"--out-dir {out_dir}: cannot lock {path} ({e.strerror}): a second run there would not be stopped")
        return f
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def where_now(lock, out_dir: str):
    """None while OUT_DIR is where the run started it (or where this cannot be told: no /proc);
    else where its folder is now, found from the lock file the run holds open ("" when deleted)."""
    try:
        held = os.readlink(f"/proc/self/fd/{lock.fileno()}")
    except (OSError, ValueError, AttributeError):
        return None
    if held.endswith(" (deleted)") or not os.path.exists(held):
        return ""
    folder = os.path.dirname(held)
    return None if folder == os.path.realpath(out_dir) else folder


def _holds_something(path: str) -> bool:
    return os.path.getsize(path) > 0 if os.path.isfile(path) else os.path.isdir(path) and bool(os.listdir(path))


def _records(cfg) -> list:
    """Where the run keeps its records: OUTPUTS in OUT_DIR and its logs, each once."""
    paths = [os.path.join(cfg.out_dir, name) for name in OUTPUTS]
    paths += [p for p in (cfg.log_file, log.items_path(log.metrics_path(cfg)), cfg.log_completions) if p]
    return list({os.path.abspath(p): p for p in paths}.values())


def earlier_run(cfg) -> list:
    """The records of an earlier run that this one would overwrite or mix with its own."""
    found = [p for p in _records(cfg) if _holds_something(p)]
    settings = os.path.join(cfg.out_dir, SETTINGS)
    return found + [settings] if found and os.path.exists(settings) else found


def set_aside_left(cfg) -> list:
    """What an --overwrite run killed (kill -9) before its first step left set aside
    (PATH.overwritten, PATH.overwritten.2, ...: Overwritten) where this run keeps its records."""
    left = set()
    for path in [*_records(cfg), os.path.join(cfg.out_dir, SETTINGS)]:
        folder, name = os.path.split(os.path.abspath(path))
        if os.path.isdir(folder):
            left |= {os.path.join(folder, n) for n in os.listdir(folder)
                     if n.startswith(name + ASIDE)}
    return sorted(left)


def _placed_outside(cfg, path: str):
    """(the log setting, its value, path) when one places path outside OUT_DIR, else None."""
    if paths.inside(path, cfg.out_dir):
        return None
    for name in ("log_file", "log_completions"):
        value = getattr(cfg, name)
        if value and path in (value, log.items_path(value)):
            return config.flag(name), value, path
    return None


def check_space(cfg, model: str) -> None:
    """Refuse a disk that clearly cannot hold the trained model and the checkpoints the run holds at
    once (with periodic saves --keep-checkpoints and the one being written, else the last): the
    model's weights' files, and 3 x them a checkpoint (its weights and AdamW's two moments). A hub
    id's size is not known here."""
    if not os.path.isdir(model):
        return
    weights = sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model)
                  if n.endswith((".safetensors", ".bin")))
    held = cfg.keep_checkpoints + 1 if cfg.save_interval else 1
    free, need = shutil.disk_usage(cfg.out_dir).free, (1 + 3 * held) * weights
    if free < need:
        raise config.ConfigError(f"--out-dir {cfg.out_dir}: {free / 2**20:.0f} MB free on its "
                                 f"disk, but the trained model and the {held} checkpoint(s) it "
                                 f"holds at once take about {need / 2**20:.0f} MB "
                                 f"({1 + 3 * held} x the weights of {model}): free some space or "
                                 f"pass an --out-dir "
                                 f"on another disk")


def _continues(resume_from, out_dir: str) -> bool:
    """Whether the run continues one of OUT_DIR's own checkpoints (one from elsewhere, or one set
    aside, starts a new folder)."""
    return resume_from is not None and checkpoint.in_line(resume_from, out_dir)


def _free_name(path: str) -> str:
    """path, or path.2, path.3, ... whichever does not exist yet: what is set aside never replaces what was."""
    n, free = 1, path
    while os.path.lexists(free):
        n += 1
        free = f"{path}.{n}"
    return free


def check_finished_model(cfg, resume_from: str) -> None:
    """A bare --resume must not go back behind a finished run: when OUT_DIR/model was trained to a later step
    than the checkpoint (a run resumed and finished without a checkpoint at its end), resuming would replace
    that model and the records after the checkpoint. Only a checkpoint named by its path branches off it."""
    model = os.path.join(cfg.out_dir, "model")
    final, done = checkpoint.model_step(model), checkpoint.step_of(resume_from)
    named = os.path.isfile(os.path.join(cfg.resume, checkpoint.STATE))
    if final is not None and final > done and not named:
        replaced = f"steps {done + 1}-{final}" if final > done + 1 else f"step {final}"
        raise config.ConfigError(f"--resume: {model} was trained to step {final}, but the newest checkpoint, "
                                 f"{resume_from}, is at step {done}: resuming would replace {replaced} and that model; "
                                 f"pass --model {model} with another --out-dir to train on from it, or --resume "
                                 f"{resume_from} to branch off step {done} (the later model and records are kept "
                                 f"aside)")


def set_aside_later(cfg, step: int) -> None:
    """Move aside what OUT_DIR holds of after `step`: a run resumed from an older checkpoint starts another future,
    and a later --resume (or the pruning of --keep-checkpoints) must not take the old one, nor may it be lost.
    Later checkpoints become abandoned-step_N; a model trained further, abandoned-model-step_N; and the logs,
    whose later records the resumed run drops, are kept as they were beside them (PATH.abandoned-after-step_N)."""
    later = [path for path in checkpoint.candidates(os.path.join(cfg.out_dir, checkpoint.SUBDIR))
             if checkpoint.step_of(path) > step]
    model = os.path.join(cfg.out_dir, "model")
    final = checkpoint.model_step(model)
    if final is not None and final > step:
        later.append(model)
    for path in later:
        name = f"abandoned-model-step_{final:06d}" if path == model else "abandoned-" + os.path.basename(path)
        aside = _free_name(os.path.join(os.path.dirname(path), name))
        os.rename(path, aside)
        log.warn(f"resuming from step {step}: the later {'model' if path == model else 'checkpoint'} {path} is moved "
                 f"aside to {aside}")
    for path in (log.metrics_path(cfg), log.items_path(log.metrics_path(cfg)), cfg.log_completions) if later else ():
        if path and os.path.exists(path):
            aside = _free_name(f"{path}.abandoned-after-step_{step:06d}")
            shutil.copyfile(path, aside)
            log.warn(f"resuming from step {step}: {path}'s records after it are dropped; the file as it was is kept "
                     f"as {aside}")


def branch_off(cfg, resume_from) -> None:
    """A run resumed from an older checkpoint of OUT_DIR sets aside what is later (set_aside_later), on rank 0: once
    everything that may refuse the run (its settings, its model, its task) has passed, so a refused --resume leaves
    the folder as it was."""
    if resume_from and _continues(resume_from, cfg.out_dir) and distributed.is_main():
        set_aside_later(cfg, checkpoint.step_of(resume_from))


def allowed_changes(text) -> list:
    """The names --resume-allow-change gives: comma-separated, as fields (learning_rate) or flags (--learning-rate)."""
    names = [n.strip().lstrip("-").replace("-", "_") for n in (text or "").split(",") if n.strip()]
    return [config.OLD_NAMES.get(n, n) for n in names]


def resume_free(option_fields) -> frozenset:
    """The settings that may change on --resume: the trainer's and the task's marked opt(..., resume_free=True)."""
    return frozenset(f.name for f in (*config.FIELDS.values(), *option_fields) if f.metadata.get("resume_free"))


def resume_fixed(option_fields) -> dict:
    """The settings --resume may not change even on request: name -> why (opt(..., resume_fixed=why))."""
    return {f.name: f.metadata["resume_fixed"] for f in (*config.FIELDS.values(), *option_fields)
            if f.metadata.get("resume_fixed")}


def check_resume_flags(cfg, options) -> None:
    """--overwrite and --resume exclude each other; --resume-allow-change names settings that exist, that
    --resume would refuse to change, and comes with --resume."""
    if cfg.overwrite and cfg.resume:
        raise config.ConfigError("--overwrite starts a run over and --resume continues one: pass only one of them")
    text = cfg.resume_allow_change
    if text is None:
        return
    names = allowed_changes(text)
    if not names:
        raise config.ConfigError(f"--resume-allow-change {text!r} names no setting: pass e.g. learning_rate,kl_coef")
    option_fields = dataclasses.fields(options) if options is not None else ()
    free, fixed = resume_free(option_fields), resume_fixed(option_fields)
    for name in names:
        if name not in config.FIELDS and name not in {f.name for f in option_fields}:
            raise config.ConfigError(f"--resume-allow-change: {name!r} is not a setting of train_lean.py nor of "
                                     f"--task {cfg.task}")
        if name in free:
            raise config.ConfigError(f"--resume-allow-change: {config.flag(name)} may change on --resume without "
                                     f"it: leave it out")
        if name in fixed:
            raise config.ConfigError(f"--resume-allow-change: {config.flag(name)} cannot change on --resume: "
                                     f"{fixed[name]}")
    if not cfg.resume:
        raise config.ConfigError(f"--resume-allow-change {text}: it applies only with --resume")


def _same(old, new) -> bool:
    """Equal, or two spellings of one existing path (a --model folder given relative, then absolute)."""
    if old == new:
        return True
    return isinstance(old, str) and isinstance(new, str) and os.path.exists(old) and os.path.exists(new) \
        and os.path.samefile(old, new)


def _changes(names, old: dict, new: dict) -> str:
    return "; ".join(f"{config.flag(n)} {old.get(n, '(not recorded)')} -> {new[n]}" for n in names)


def check_resume(saved, cfg, options, checkpoint_path: str) -> list:
    """Compare the settings that define the run with those the checkpoint recorded (saved). A difference (a
    setting it does not record included) is a ConfigError naming each (old -> new), unless --resume-allow-change
    names it. Returns the notes to print: the changes allowed, and what they do to the schedule."""
    current, saved = config.settings(cfg, options), config.renamed(saved)
    option_fields = dataclasses.fields(options) if options is not None else ()
    free, fixed = resume_free(option_fields), resume_fixed(option_fields)
    changed = [n for n in current if n not in free and (n not in saved or not _same(saved[n], current[n]))]
    for n in changed:
        if n in fixed:
            raise config.ConfigError(f"--resume {checkpoint_path}: {_changes([n], saved, current)}: this setting "
                                     f"cannot change on --resume: {fixed[n]}")
    refused = [n for n in changed if n not in allowed_changes(cfg.resume_allow_change)]
    if refused:
        raise config.ConfigError(f"--resume: {checkpoint_path} was trained with other settings: "
                                 f"{_changes(refused, saved, current)}: pass the checkpoint's values, or "
                                 f"--resume-allow-change {','.join(refused)} to change them on purpose")
    notes = [f"resuming with changed settings (--resume-allow-change): {_changes(changed, saved, current)}"] \
        if changed else []
    if saved.get("steps", cfg.steps) != cfg.steps and (cfg.lr_scheduler != "constant" or cfg.lr_warmup_ratio):
        notes.append(f"--steps {saved['steps']} -> {cfg.steps}: the learning-rate schedule (--lr-scheduler "
                     f"{cfg.lr_scheduler}, --lr-warmup-ratio {cfg.lr_warmup_ratio}) is a function of --steps, so the "
                     f"steps from here on follow the {cfg.steps}-step schedule, not the one the run began with")
    return notes


def _evaluated(metrics: str, step: int) -> bool:
    """Whether the records hold an evaluation at step (a torn or foreign line is no record)."""
    try:
        with open(metrics, "rb") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "eval" and record.get("step") == step:
            return True
    return False


def owed(cfg, resume_from: str, evaluating: bool) -> list:
    """What a run resumed at its last step still owes, which an error or a kill after that step's
    checkpoint left out: "model" (OUT_DIR/model of that step), "eval" (the evaluation after it)."""
    step = checkpoint.step_of(resume_from)
    model = checkpoint.model_step(os.path.join(cfg.out_dir, "model")) == step or not cfg.save_final
    evaluated = _evaluated(log.metrics_path(cfg), step) or not evaluating
    return [name for name, done in (("model", model), ("eval", evaluated)) if not done]


def prepare(cfg, options, outs: list, evaluating: bool) -> tuple:
    """Make OUT_DIR this run's and find what it resumes: (a context that holds the lock until the
    run ends, the intact checkpoint to resume from or None, the earlier records --overwrite
    replaces, on rank 0: Overwritten). outs: the run's writes (harness/paths.py), each locked too;
    evaluating: whether the run evaluates (an evaluation after its last step is owed).
    Raises ConfigError / CheckpointError, lock released."""
    check_resume_flags(cfg, options)
    main = distributed.is_main()
    lock_held = contextlib.ExitStack()
    lock_held.file = None   # the lock file, open while the run lives: where OUT_DIR is (where_now)
    try:
        if not cfg.eval_only and main:
            lock_held.file = lock_held.enter_context(lock(cfg.out_dir))
        if outs and main:
            paths.register(outs, lock_held)
        left = set_aside_left(cfg) if main and not cfg.eval_only else []
        if left and not cfg.overwrite:   # unsaid, --resume missed them, --overwrite left them
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise config.ConfigError(f"{left[0]}{more}: an --overwrite run set these earlier "
                                     f"records aside and was killed before it put them back or "
                                     f"deleted them: rename each back without {ASIDE} to keep "
                                     f"them, or pass --overwrite to delete them")
        resume_from = resume_point(cfg, options, evaluating, main) if cfg.resume else None
        found = earlier_records(cfg, resume_from, left)
        if not cfg.eval_only:
            check_space(cfg, resume_from or cfg.model)
    except BaseException:
        lock_held.close()
        raise
    return lock_held, resume_from, found if main else []


def resume_point(cfg, options, evaluating: bool, main: bool) -> str:
    """The intact checkpoint --resume names, checked against this run: its settings (notes said),
    its device count, a step before --steps, its finished model."""
    # only a locked run moves damaged checkpoints aside: no one else is writing them
    resume_from = checkpoint.resolve(cfg.resume, cfg.out_dir, set_aside=main and not cfg.eval_only)
    for note in [] if cfg.eval_only else check_resume(checkpoint.saved_settings(resume_from), cfg, options,
                                                      resume_from):
        log.warn(note)
    saved_devices = checkpoint.saved_devices(resume_from)
    world = config.launched_world()
    if not cfg.eval_only and saved_devices != world:
        raise config.ConfigError(
            f"--resume: {resume_from} was saved by a run on {saved_devices} device(s) and this "
            f"one runs on {world}: a step's samples and random streams follow the device count, "
            f"so the run would not go on as it would have; resume it on {saved_devices} (torchrun "
            f"--nproc_per_node {saved_devices}), or start a new run from its weights (--model "
            f"{resume_from})")
    done = checkpoint.step_of(resume_from)
    # it would train nothing; at the last step it may still finish what a failure left out
    if not cfg.eval_only and (cfg.steps < done or cfg.steps == done and
                              not owed(cfg, resume_from, evaluating)):
        raise config.ConfigError(f"--steps {cfg.steps}: the checkpoint {resume_from} is at step {done} already "
                                 f"(nothing to train): pass --steps above {done}")
    if not cfg.eval_only and _continues(resume_from, cfg.out_dir):
        check_finished_model(cfg, resume_from)   # what is later is moved aside by branch_off, at the start
    return resume_from


def earlier_records(cfg, resume_from, left: list) -> list:
    """The earlier records this run would overwrite (left: those an --overwrite run set aside), which
    only --overwrite may replace: a ConfigError without it that says where they are and what to pass.
    """
    if cfg.eval_only:   # it writes only a --log-file, and that only when it holds no earlier records
        found = [p for p in (cfg.log_file, log.items_path(cfg.log_file)) if _holds_something(p)] \
            if cfg.log_file else []
    else:
        found = [] if _continues(resume_from, cfg.out_dir) else earlier_run(cfg) + left
    if found and not cfg.overwrite and cfg.eval_only:   # it writes nothing in --out-dir
        raise config.ConfigError(f"--log-file {cfg.log_file} holds earlier records "
                                 f"({', '.join(found)}): --eval-only would overwrite them; "
                                 f"pass another --log-file, or --overwrite to replace them")
    placed = next(filter(None, (_placed_outside(cfg, p) for p in found)), None)
    if placed and not cfg.overwrite:   # another --out-dir would not help
        setting, value, path = placed
        raise config.ConfigError(f"{setting} {value} holds earlier records ({path}): the run "
                                 f"would overwrite them; pass another {setting}, or "
                                 f"--overwrite to replace them")
    if found and not cfg.overwrite:
        if cfg.resume:
            hint = "another --out-dir for this run, which resumes a checkpoint from elsewhere"
        elif checkpoint.candidates(cfg.out_dir):
            hint = "--resume to continue that run, another --out-dir, or --overwrite to delete them and start over"
        else:  # no checkpoint to continue from (it ran with --save-interval 0): --resume would fail too
            hint = "another --out-dir, or --overwrite to delete them and start over (it kept no checkpoint " \
                   "to --resume; --save-interval N keeps them)"
        raise config.ConfigError(f"--out-dir {cfg.out_dir} holds an earlier run's records ({', '.join(found)}): "
                                 f"pass {hint}")
    return found


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


class Overwritten:
    """--overwrite's earlier records, set aside (PATH.overwritten) only once the run has passed
    every check and loaded its model, deleted once it has written its first step (drop), and put
    back as they were if it ends before (restore: its own files there go): a failing --overwrite
    strands no one. A kill -9 before either leaves them as PATH.overwritten: the next run in the
    folder finds them (set_aside_left)."""

    def __init__(self, found: list):
        self.found, self.moved = found, []

    def set_aside(self) -> None:
        """Each moved in turn, then counted: restore() puts back those moved (one a signal stops
        between the two stays aside, for the next run to find)."""
        for path in self.found:
            aside = _free_name(path + ASIDE)
            os.rename(path, aside)
            self.moved.append((path, aside))

    def drop(self) -> None:
        for _, aside in self.moved:
            _remove(aside)
        if self.moved:
            log.warn(f"--overwrite: deleted the earlier run's "
                     f"{', '.join(p for p, _ in self.moved)}")
        self.moved = []

    def restore(self) -> None:
        for path, aside in self.moved:
            _remove(path)
            os.rename(aside, path)
        if self.moved:
            log.warn(f"--overwrite: the run ended before its first step: the earlier run's "
                     f"{', '.join(p for p, _ in self.moved)} are back as they were")
        self.moved = []
