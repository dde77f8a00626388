"""Configuration: one dataclass that is the CLI, the GRPO_<FLAG> environment overrides and the defaults.

Precedence: command line > environment > default. The chosen task may bring an options dataclass of its
own (grpo/task.py); its fields become flags and overrides in the same way, for that task only.
`load(argv)` returns the config, the task's options and where each value came from;
`batch_layout(cfg, world)` checks every size rule before anything heavy is loaded and returns the
derived sizes. User errors raise ConfigError with one line that names the bad value and a fix;
train_lean.py prints it and exits with code 2.
"""
import argparse
import dataclasses
import math
import os
import sys
import tempfile
import typing
from dataclasses import dataclass, field

from grpo import algorithm, log
from grpo import task as tasks


# The shipped default model (models/rook-tiny, built by the default task's own script). An absolute
# path, so that the default works from any working directory.
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "rook-tiny")


class ConfigError(ValueError):
    """A bad flag, value or combination (exit code 2, one line, no traceback)."""


class Loaded(typing.NamedTuple):
    cfg: "Config"
    options: typing.Any       # an instance of the task's options dataclass, or None
    sources: dict             # field name -> "cli" | "env" | "default", the task's options included
    task: typing.Any          # the class or object --task names, imported, not yet built


def opt(default, help, choices=None, const=None, path=None, auto=False, resume_free=False):
    """A field. With const the flag may be given bare (`--resume` means `--resume latest`); path="in" marks
    a file the run reads and path="out" one it writes (a file, or with the name out_dir a folder), which
    check_paths tests before anything heavy is loaded; auto=True keeps the value "auto" as itself.
    resume_free=True marks a task's option that may differ on --resume (see RESUME_FREE). choices given as a
    dict (name -> what it does, defined by the module that owns them) are listed in the help."""
    if isinstance(choices, dict):
        help = f"{help}: " + "; ".join(f"{k}: {v}" for k, v in choices.items())
    return field(default=default, metadata={"help": help, "choices": choices, "const": const, "path": path,
                                            "auto": auto, "resume_free": resume_free})


@dataclass
class Config:
    # model and task
    model: str = opt(DEFAULT_MODEL, "hub id or local folder of a causal LM (AutoModelForCausalLM); the default is "
                     "the shipped models/rook-tiny, whose full-size sibling is jrahn/RookWorld-LM-124M")
    task: typing.Optional[str] = opt(None, "a built-in task (tasks/__init__.py), path/to/file.py:Name or "
                                     "module:Name; a task with options adds its own flags (see --task T --help)")
    prompt_bos: str = opt("auto", "start each prompt with the tokenizer's BOS/EOS token "
                          "(auto: on when BOS == EOS, as in GPT-2)", ["auto", "on", "off"])
    reward_errors: str = opt("stop", "a step in which every completion's reward failed (raised, or returned no "
                             "finite number): stop the run with the task's traceback, or tolerate it (those "
                             "completions get the task's min_reward, as a failed reward always does)",
                             ["stop", "tolerate"])
    # the task's held-out evaluation (its evaluate(complete), greedy decoding)
    eval_interval: int = opt(100, "evaluate before training, every N steps and after the last (0: off); "
                             "by default only for a task that has evaluate()")
    eval_only: bool = opt(False, "evaluate --model with the task's evaluate(), print the results and exit",
                          const="true")
    # batch arithmetic (see batch_layout)
    batch_size: int = opt(64, "completions per step, global across devices")
    group_size: int = opt(8, "completions per prompt; prompts per step = batch / group")
    mini_batch_size: typing.Optional[int] = opt(None, "completions per optimizer update (default: batch)")
    ppo_epochs: int = opt(1, "passes over each step's rollouts")
    micro_batch_size: typing.Optional[typing.Union[int, str]] = opt(
        None, "completions per forward/backward on one device (default: mini / devices, no accumulation; "
        "auto: the largest that fits in memory, probed before training)", auto=True)
    generation_batch_size: typing.Optional[int] = opt(None, "completions sampled at once on one device "
                                                      "(default: all of the device's share)")
    logprob_chunk_size: int = opt(2048, "token rows of the vocabulary log-softmax computed at once")
    gradient_checkpointing: bool = opt(False, "recompute each layer's activations in backward: less memory, "
                                       "more compute (a bare flag means true)", const="true")
    # sampling
    max_new_tokens: int = opt(144, "new tokens per completion at most")
    min_new_tokens: int = opt(0, "new tokens every completion gets at least: EOS cannot be sampled before "
                              "(its probability still counts in the logprobs; 0: off)")
    temperature: float = opt(1.0, "sampling temperature; 0 means greedy")
    top_k: int = opt(0, "sample from the k most likely tokens (0: off)")
    top_p: float = opt(1.0, "nucleus sampling threshold (1: off)")
    compile: bool = opt(False, "run each decode step through torch.compile (inductor on CPU, CUDA graphs on a GPU; "
                        "GPT-2 and Llama-family models): compiling costs seconds once, a step then runs faster",
                        const="true")
    # algorithm
    learning_rate: float = opt(1e-4, "AdamW learning rate (1e-4 suits the shipped 5M-parameter default model; "
                               "use about 1e-5 for a 124M model such as RookWorld-LM)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "gradient-norm clipping")
    clip_range: float = opt(0.2, "PPO clip range (low side, and high side unless --clip-range-high)")
    clip_range_high: typing.Optional[float] = opt(None, "PPO clip range on the high side (default: --clip-range)")
    kl_coef: float = opt(0.02, "k3 KL penalty against the frozen reference (0: no reference model)")
    scale_rewards: str = opt("group", "each completion's advantage", algorithm.ADVANTAGES)
    loss_agg: str = opt("token-mean", "the loss normaliser", {
        **algorithm.LOSS_AGGS, **{k: f"TRL's name for {v}" for k, v in algorithm.TRL_LOSS_TYPES.items()}})
    importance_level: str = opt("token", "the importance ratio", algorithm.IMPORTANCE_LEVELS)
    dual_clip: typing.Optional[float] = opt(None, "dual-clip PPO: for negative advantages the loss is at most "
                                            "C x |A| (C > 1, e.g. 3; default off)")
    kl_estimator: str = opt("k3", "the KL estimator (grpo/algorithm.py says which belongs where)",
                            algorithm.KL_ESTIMATORS)
    kl_in: str = opt("loss", "where the KL penalty goes", algorithm.KL_PLACES)
    entropy_coef: float = opt(0.0, "entropy bonus: the loss minus this x the mean token entropy (0: off)")
    top_entropy_quantile: float = opt(1.0, "only this share of a mini-batch's tokens, the highest-entropy ones, "
                                      "carry the policy-gradient loss (1: all)")
    dynamic_sampling: bool = opt(False, "DAPO: drop groups whose rewards are all equal and sample more prompts "
                                 "until the batch is full of groups that carry a signal", const="true")
    max_sampling_rounds: int = opt(4, "--dynamic-sampling: extra generation rounds per step at most")
    mask_truncated: bool = opt(False, "completions cut off at --max-new-tokens (no EOS) carry no loss", const="true")
    overlong_buffer: int = opt(0, "DAPO's soft overlong penalty: the last N tokens before --max-new-tokens "
                               "lower the reward linearly, down to -overlong-penalty at the limit (0: off)")
    overlong_penalty: float = opt(1.0, "the reward lost by a completion that reaches --max-new-tokens "
                                  "(with --overlong-buffer)")
    # run control
    steps: int = opt(700, "training steps")
    seed: int = opt(0, "seed for prompts, sampling and initialisation")
    device: str = opt("auto", "auto (CUDA when present), cpu, cuda or cuda:N")
    dtype: str = opt("fp32", "compute dtype; bf16 uses autocast over fp32 weights and optimizer state (on a "
                     "CPU without native bf16 it is emulated and slower than fp32)", ["fp32", "bf16"])
    out_dir: str = opt("out", "folder for logs, checkpoints and the trained model", path="out")
    log_file: typing.Optional[str] = opt(None, "JSONL metrics, one object per step (default: OUT_DIR/metrics.jsonl)",
                                         path="out")
    log_completions: typing.Optional[str] = opt(None, "JSONL file with every sampled completion", path="out")
    log_level: str = opt("info", "console verbosity", ["debug", "info", "warning"])
    report_to: str = opt("none", "where every record goes", log.REPORTERS)
    # long runs (see grpo/checkpoint.py and grpo/guards.py)
    save_final: bool = opt(True, "save the trained model at the end as a Hugging Face folder, OUT_DIR/model",
                           const="true")
    save_interval: int = opt(0, "write a checkpoint to OUT_DIR/checkpoints every N steps and at the end "
                             "(0: only when interrupted or aborted)")
    keep_checkpoints: int = opt(2, "keep the last K checkpoints")
    resume: typing.Optional[str] = opt(None, "continue from a checkpoint: bare (or 'latest') for the newest intact "
                                       "one in OUT_DIR, or a checkpoint / folder path", const="latest")
    resume_allow_change: typing.Optional[str] = opt(None, "settings that may differ from the checkpoint's on --resume, "
                                                    "comma-separated (e.g. learning_rate,kl_coef); any other "
                                                    "difference in a setting that defines the run is refused")
    overwrite: bool = opt(False, "start over in an OUT_DIR that holds an earlier run: its logs, checkpoints, model "
                          "and reports are deleted first (without it such a folder is refused)", const="true")
    max_nonfinite: int = opt(10, "abort (saving a checkpoint) after this many non-finite updates in a row")
    # where memory goes (grpo/memory.py; monitor_memory.py --trace sets both)
    trace_memory: int = opt(0, "trace N steps (0: off; at least 2) for leak evidence: allocation sites (tracemalloc), "
                            "live tensors by shape, on CUDA the allocator's history, in OUT_DIR/memory/trace.json; "
                            "the traced steps run 2.5-9x slower (the tiny model on CPU; BENCHMARKS.md)")
    trace_memory_after: int = opt(20, "--trace-memory starts after this many steps of the process (the warm-up)")


def fields_of(cls) -> dict:
    """name -> dataclass Field, with its type resolved (a task may write `from __future__ import annotations`)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        f.type = hints.get(f.name, f.type)
        out[f.name] = f
    return out


FIELDS = fields_of(Config)

# The settings a resumed run may change freely. Every other setting defines the run, and so does every option
# of the task unless the task marks it opt(..., resume_free=True): --resume refuses a difference from what the
# checkpoint recorded unless --resume-allow-change names it. They define it because they change what is
# trained or how: --model (the start and the KL reference), the task, its options and --prompt-bos (prompts and
# rewards), --seed (the prompt stream), the batch arithmetic (batch, group, mini-batch, PPO epochs), sampling
# (token limits, temperature, top-k/p), the optimizer, every loss and algorithm knob, and --dtype (bf16 changes
# the numbers the loss sees, not only the order of float sums).
RESUME_FREE = frozenset({
    # how long it runs, how often it is evaluated and saved, when it gives up: extending a run is normal, and
    # none of these touches the weights
    "steps", "eval_interval", "eval_only", "save_final", "save_interval", "keep_checkpoints", "max_nonfinite",
    "reward_errors",
    # how the same arithmetic is cut into work on this machine: micro-batches accumulate to the same
    # mini-batch, checkpointed layers recompute the same activations, chunked log-softmax and compiled decoding
    # compute the same values (up to the order of float sums); another generation batch draws other samples
    # from the same distribution (as another device count does)
    "micro_batch_size", "generation_batch_size", "logprob_chunk_size", "gradient_checkpointing", "compile", "device",
    # where and how it reports
    "out_dir", "log_file", "log_completions", "log_level", "report_to",
    # what it traces for memory evidence: the traced steps compute what untraced ones do
    "trace_memory", "trace_memory_after",
    # the resume itself
    "resume", "resume_allow_change", "overwrite",
})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "GRPO_" + name.upper()


def _base_type(f):
    args = typing.get_args(f.type)
    if args and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return f.type, False


BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _convert(f, text: str, where: str):
    base, optional = _base_type(f)
    if f.metadata.get("auto") and text.lower() == "auto":
        return "auto"
    if optional and text.lower() in ("", "none", "auto"):
        return None
    if base is bool:   # bool("false") is True: spell the values out
        if text.lower() not in BOOLS:
            raise ConfigError(f"{where} {text!r} is not a valid bool (true/false, 1/0, yes/no, on/off)")
        return BOOLS[text.lower()]
    try:
        value = base(text)
    except ValueError:
        raise ConfigError(f"{where} {text!r} is not a valid {base.__name__}") from None
    if base is float and not math.isfinite(value):
        raise ConfigError(f"{where} {text!r} is not a finite number")
    choices = f.metadata.get("choices")
    if choices and isinstance(value, str) and value not in choices and value.lower() in choices:
        value = value.lower()   # --log-level INFO means info
    if choices and value not in choices:
        raise ConfigError(f"{where} {text!r} is not one of {', '.join(choices)}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: ConfigError is printed by the caller
        raise ConfigError(message)


def build_parser(task_name: str = "", task_fields: dict = None) -> argparse.ArgumentParser:
    p = _Parser(prog="train_lean.py", allow_abbrev=False, description="GRPO on a small causal LM. Every flag also reads "
                "GRPO_<FLAG> from the environment (CLI > environment > default).")
    groups = [(p, FIELDS)]
    if task_fields:
        groups.append((p.add_argument_group(f"options of --task {task_name}"), task_fields))
    for group, fields in groups:
        for name, f in fields.items():
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = default if default is not None else "derived"
            const = f.metadata.get("const")
            bare = {"nargs": "?", "const": const} if const is not None else {}
            group.add_argument(flag(name), dest=name, default=argparse.SUPPRESS, metavar=name.upper(), **bare,
                               help=f"{f.metadata.get('help', '')} [{env_name(name)}; default {shown}]")
    return p


def _read(fields: dict, given: dict, environ) -> tuple[dict, dict]:
    """Each field's value and its source: the command line, else the environment, else the default."""
    values, sources = {}, {}
    for name, f in fields.items():
        if name in given:
            values[name], sources[name] = _convert(f, given[name], flag(name)), "cli"
        elif env_name(name) in environ:
            values[name], sources[name] = _convert(f, environ[env_name(name)], env_name(name)), "env"
        elif f.default is not dataclasses.MISSING:
            values[name], sources[name] = f.default, "default"
        elif f.default_factory is not dataclasses.MISSING:
            values[name], sources[name] = f.default_factory(), "default"
        else:
            raise ConfigError(f"{flag(name)} is required by the task")
    return values, sources


def load(argv=None, environ=None, builtin: dict = None, default_task: str = None) -> Loaded:
    """Parse argv and environ into the Config, the chosen task's options and each value's source.

    The task is found first (--task, else GRPO_TASK, else default_task; builtin maps short names to
    "module:Attribute"), because its options add flags. Raises ConfigError (or task.TaskError)."""
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    first = _Parser(add_help=False, allow_abbrev=False)
    first.add_argument("--task")
    task_name = first.parse_known_args(argv)[0].task or environ.get(env_name("task")) or default_task
    if not task_name:
        raise ConfigError("no --task given: pass --task NAME, path/to/file.py:Name or module:Name")
    target = tasks.resolve(task_name, builtin or {})
    options_cls = tasks.options_type(target)
    task_fields = fields_of(options_cls) if options_cls else {}
    clash = sorted(FIELDS.keys() & task_fields.keys())
    if clash:
        raise tasks.TaskError(f"--task {task_name}: its option {clash[0]!r} has the name of a trainer setting "
                              f"({flag(clash[0])}): rename it")
    given, extra = build_parser(task_name, task_fields).parse_known_args(argv)
    if extra:
        raise ConfigError(f"unrecognized arguments: {' '.join(extra)}: {extra[0]} does not apply to --task "
                          f"{task_name} (see train_lean.py --task {task_name} --help)")
    given = vars(given)
    values, sources = _read(FIELDS, given, environ)
    option_values, option_sources = _read(task_fields, given, environ)
    known = FIELDS.keys() | task_fields.keys()
    unknown = sorted(k for k in environ if k.startswith("GRPO_") and k[5:].lower() not in known)
    if unknown:
        raise ConfigError(f"unknown environment variable {unknown[0]}: not a setting of train_lean.py nor of "
                          f"--task {task_name} (see train_lean.py --task {task_name} --help)")
    values["task"] = task_name
    values["loss_agg"] = algorithm.TRL_LOSS_TYPES.get(values["loss_agg"], values["loss_agg"])
    _check_resume_flags(values, task_fields, task_name)
    asked = values["eval_only"] or (values["eval_interval"] > 0 and sources["eval_interval"] != "default")
    if asked and not hasattr(target, "evaluate"):
        raise ConfigError(f"{'--eval-only' if values['eval_only'] else '--eval-interval'}: --task {task_name} "
                          f"has no evaluate(complete) method (grpo/task.py says how to add one)")
    try:
        options = options_cls(**option_values) if options_cls else None
    except (TypeError, ValueError) as e:   # the options' own checks (__post_init__) say what is wrong
        raise ConfigError(str(e).splitlines()[0] if str(e) else f"bad options for --task {task_name}") from None
    return Loaded(Config(**values), options, {**sources, **option_sources}, target)


def allowed_changes(text) -> list:
    """The names --resume-allow-change gives: comma-separated, as fields (learning_rate) or flags (--learning-rate)."""
    return [n.strip().lstrip("-").replace("-", "_") for n in (text or "").split(",") if n.strip()]


def resume_free(option_fields) -> frozenset:
    """The settings that may change on --resume: RESUME_FREE and the task's options marked resume_free."""
    return RESUME_FREE | {f.name for f in option_fields if f.metadata.get("resume_free")}


def _check_resume_flags(values: dict, task_fields: dict, task_name: str) -> None:
    if values["overwrite"] and values["resume"]:
        raise ConfigError("--overwrite starts a run over and --resume continues one: pass only one of them")
    text = values["resume_allow_change"]
    if text is None:
        return
    names = allowed_changes(text)
    if not names:
        raise ConfigError(f"--resume-allow-change {text!r} names no setting: pass e.g. learning_rate,kl_coef")
    free = resume_free(task_fields.values())
    for name in names:
        if name not in FIELDS and name not in task_fields:
            raise ConfigError(f"--resume-allow-change: {name!r} is not a setting of train_lean.py nor of --task "
                              f"{task_name}")
        if name in free:
            raise ConfigError(f"--resume-allow-change: {flag(name)} may change on --resume without it: leave it out")
    if not values["resume"]:
        raise ConfigError(f"--resume-allow-change {text}: it applies only with --resume")


def settings(cfg: "Config", options) -> dict:
    """Every setting of the run, the task's options included, by field name (what a checkpoint records)."""
    return {**dataclasses.asdict(cfg), **(dataclasses.asdict(options) if options is not None else {})}


def _same(old, new) -> bool:
    """Equal, or two spellings of one existing path (a --model folder given relative, then absolute)."""
    if old == new:
        return True
    return isinstance(old, str) and isinstance(new, str) and os.path.exists(old) and os.path.exists(new) \
        and os.path.samefile(old, new)


def _changes(names, old: dict, new: dict) -> str:
    return "; ".join(f"{flag(n)} {old[n]} -> {new[n]}" for n in names)


def check_resume(saved, cfg: "Config", options, checkpoint: str) -> list:
    """Compare the settings that define the run with those `checkpoint` recorded (saved: its settings, None
    when an older trainer recorded none). A difference is a ConfigError naming each (old -> new), unless
    --resume-allow-change names it. Returns the notes to print: the changes allowed, and the settings the
    checkpoint does not record (an older trainer's), which are not compared."""
    if saved is None:
        return [f"{checkpoint} records no settings (an older trainer's checkpoint): they are not compared"]
    current, free = settings(cfg, options), resume_free(dataclasses.fields(options) if options is not None else ())
    changed = [n for n in current if n in saved and n not in free and not _same(saved[n], current[n])]
    refused = [n for n in changed if n not in allowed_changes(cfg.resume_allow_change)]
    if refused:
        raise ConfigError(f"--resume: {checkpoint} was trained with other settings: "
                          f"{_changes(refused, saved, current)}: pass the checkpoint's values, or "
                          f"--resume-allow-change {','.join(refused)} to change them on purpose")
    notes = [f"resuming with changed settings (--resume-allow-change): {_changes(changed, saved, current)}"] \
        if changed else []
    unrecorded = [flag(n) for n in current if n not in saved and n not in free]
    if unrecorded:
        notes.append(f"{checkpoint} does not record {', '.join(unrecorded)} (an older trainer's checkpoint): "
                     f"not compared")
    return notes


def _multiples(value: int, of: int) -> str:
    low = value // of * of
    return f"use {low} or {low + of}" if low > 0 else f"use {of}"


@dataclass(frozen=True)
class Layout:
    """The batch arithmetic of a run: how a step's completions split over devices, updates and passes."""
    devices: int
    prompts_per_step: int           # = groups per step
    prompts_per_device: int
    completions_per_step: int       # = --batch-size
    completions_per_device: int
    mini_batch: int                 # completions per optimizer update, global
    mini_batch_per_device: int
    micro_batch: int                # completions per forward/backward on one device (auto: where probing starts)
    micro_batch_auto: bool
    grad_accum_steps: int
    updates_per_step: int
    generation_batch: int           # completions sampled at once on one device


def batch_layout(cfg: Config, world: int = 1) -> Layout:
    """Check every size and range rule and return the derived sizes (per device and global)."""
    for name in ("batch_size", "group_size", "ppo_epochs", "logprob_chunk_size", "max_new_tokens", "steps",
                 "keep_checkpoints", "max_nonfinite"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{flag(name)} {getattr(cfg, name)} must be at least 1")
    if cfg.save_interval < 0:
        raise ConfigError(f"--save-interval {cfg.save_interval} must be >= 0 (0: no periodic checkpoints)")
    micro_auto = cfg.micro_batch_size == "auto"
    micro_given = None if micro_auto else cfg.micro_batch_size
    for name, v in (("mini_batch_size", cfg.mini_batch_size), ("micro_batch_size", micro_given),
                    ("generation_batch_size", cfg.generation_batch_size)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag(name)} {v} must be at least 1")
    if cfg.group_size < 2:
        raise ConfigError(f"--group-size {cfg.group_size}: GRPO needs at least 2 completions per prompt")
    if cfg.batch_size % cfg.group_size:
        raise ConfigError(f"--batch-size {cfg.batch_size} is not a multiple of --group-size "
                          f"{cfg.group_size}: {_multiples(cfg.batch_size, cfg.group_size)}")
    prompts = cfg.batch_size // cfg.group_size
    if prompts % world:
        raise ConfigError(f"--batch-size {cfg.batch_size} gives {prompts} prompts, which do not split over "
                          f"{world} devices in whole groups: "
                          f"{_multiples(cfg.batch_size, cfg.group_size * world)}")
    mini = cfg.mini_batch_size or cfg.batch_size
    if cfg.batch_size % mini:
        raise ConfigError(f"--batch-size {cfg.batch_size} is not a multiple of --mini-batch-size {mini}: "
                          f"use a divisor of {cfg.batch_size}")
    if mini % world:
        raise ConfigError(f"--mini-batch-size {mini} does not split over {world} devices: "
                          f"{_multiples(mini, world)}")
    mini_per_device = mini // world
    # auto: start from the whole per-device mini-batch; train_lean probes it down before training
    micro = micro_given or mini_per_device
    if mini_per_device % micro:
        raise ConfigError(f"--micro-batch-size {micro} does not divide the per-device mini-batch "
                          f"{mini_per_device} (= --mini-batch-size {mini} / {world} devices): "
                          f"use a divisor of {mini_per_device}")
    if not 0 <= cfg.min_new_tokens <= cfg.max_new_tokens:
        raise ConfigError(f"--min-new-tokens {cfg.min_new_tokens} must be in [0, --max-new-tokens "
                          f"{cfg.max_new_tokens}]")
    if cfg.temperature < 0:
        raise ConfigError(f"--temperature {cfg.temperature} must be >= 0 (0 means greedy)")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"--top-p {cfg.top_p} must be in (0, 1]")
    if cfg.top_k < 0:
        raise ConfigError(f"--top-k {cfg.top_k} must be >= 0 (0 means off)")
    for name in ("clip_range", "clip_range_high", "learning_rate"):
        v = getattr(cfg, name)
        if v is not None and v <= 0:
            raise ConfigError(f"{flag(name)} {v} must be > 0")
    if cfg.dual_clip is not None and cfg.dual_clip <= 1:
        raise ConfigError(f"--dual-clip {cfg.dual_clip} must be > 1 (the bound is C x |A|)")
    if not 0 < cfg.top_entropy_quantile <= 1:
        raise ConfigError(f"--top-entropy-quantile {cfg.top_entropy_quantile} must be in (0, 1] (1: every token)")
    if not 0 <= cfg.overlong_buffer <= cfg.max_new_tokens:
        raise ConfigError(f"--overlong-buffer {cfg.overlong_buffer} must be in [0, --max-new-tokens {cfg.max_new_tokens}]")
    for name in ("kl_coef", "weight_decay", "max_grad_norm", "eval_interval", "entropy_coef", "overlong_penalty",
                 "max_sampling_rounds", "trace_memory", "trace_memory_after"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{flag(name)} {getattr(cfg, name)} must be >= 0")
    if cfg.trace_memory == 1:
        raise ConfigError("--trace-memory 1: the evidence compares the first traced step with the last; trace 2 or more")
    per_device = cfg.batch_size // world
    return Layout(devices=world, prompts_per_step=prompts, prompts_per_device=prompts // world,
                  completions_per_step=cfg.batch_size, completions_per_device=per_device, mini_batch=mini,
                  mini_batch_per_device=mini_per_device, micro_batch=micro, micro_batch_auto=micro_auto,
                  grad_accum_steps=mini_per_device // micro, updates_per_step=cfg.batch_size // mini * cfg.ppo_epochs,
                  generation_batch=min(cfg.generation_batch_size or per_device, per_device))


def check_paths(settings) -> None:
    """Every file a run reads exists and is readable; every folder it writes to can be written.

    Checked before anything heavy is loaded, so that a typo costs a second, not a model load. A field of
    the Config or of a task's options opts in with opt(..., path="in" | "out"); settings may be None.
    """
    for f in dataclasses.fields(settings) if settings is not None else ():
        name, value, kind = f.name, getattr(settings, f.name), f.metadata.get("path")
        if value is None or kind is None:
            continue
        if kind == "in":
            if not os.path.isfile(value):
                raise ConfigError(f"{flag(name)} {value}: no such file: check the path")
            try:
                with open(value, "rb") as fh:
                    fh.read(1)
            except OSError as e:
                raise ConfigError(f"{flag(name)} {value} cannot be read ({e.strerror}): "
                                  f"fix its permissions or pass another file") from None
        else:
            folder = value if name == "out_dir" else (os.path.dirname(value) or ".")
            try:
                os.makedirs(folder, exist_ok=True)
                with tempfile.TemporaryFile(dir=folder):
                    pass
            except OSError as e:
                raise ConfigError(f"{flag(name)} {value}: cannot write to {folder} ({e.strerror or e}): "
                                  f"pass a writable folder") from None


def describe(cfg: Config, options, sources: dict, layout: Layout) -> str:
    """The start-up table: every setting with its source (the task's options after the trainer's), then
    the derived batch sizes."""
    settings = [(cfg, name) for name in FIELDS]
    settings += [(options, f.name) for f in dataclasses.fields(options)] if options is not None else []
    rows = [(flag(n), "derived" if getattr(obj, n) is None else str(getattr(obj, n)), sources[n]) for obj, n in settings]
    w = max(len(r[0]) for r in rows)
    v = max(len(r[1]) for r in rows)
    lines = ["settings (source: cli > env > default)"]
    lines += [f"  {a:<{w}}  {b:<{v}}  {c}" for a, b, c in rows[:len(FIELDS)]]
    if options is not None:
        lines.append(f"options of --task {cfg.task}")
        lines += [f"  {a:<{w}}  {b:<{v}}  {c}" for a, b, c in rows[len(FIELDS):]]
    lines.append("batch layout (per device | global)")
    d = layout
    auto = d.micro_batch_auto
    table = [
        ("devices", "", d.devices),
        ("prompts (groups) per step", d.prompts_per_device, d.prompts_per_step),
        ("completions per step", d.completions_per_device, d.completions_per_step),
        ("mini-batch (completions per update)", d.mini_batch_per_device, d.mini_batch),
        ("micro-batch (per forward/backward)", *(("auto", "auto") if auto else (d.micro_batch, d.micro_batch * d.devices))),
        ("gradient-accumulation steps", *(("auto", "auto") if auto else (d.grad_accum_steps, d.grad_accum_steps))),
        ("optimizer updates per step", d.updates_per_step, d.updates_per_step),
        ("generation batch", d.generation_batch, d.generation_batch * d.devices),
    ]
    lines += [f"  {name:<37} {str(a):>6} | {b}" for name, a, b in table]
    return "\n".join(lines)
