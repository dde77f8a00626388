"""Configuration: Config, whose fields are the settings, each with its default, help, choices, range
and whether --resume may change it: the algorithm's (grpo/settings.py Settings, which it extends) and
the run's (model, task, devices, output, checkpoints, memory), below.

harness/cli.py makes every field (and every field of a task's options dataclass) a flag and a
GRPO_<FLAG> override; `batch_layout(cfg, world)` checks every range and size rule before anything
heavy is loaded and returns the derived sizes, `check_variants(cfg, tables)` the variants' rules
against the flags' tables (train_lean.py TABLES); harness/rundir.py compares the settings on
--resume.
User errors raise ConfigError with one line that names the bad value and a fix; harness/run.py (Run)
prints it and exits with code 2.
"""
import dataclasses
import importlib.util
import math
import os
import re
import typing
from dataclasses import dataclass

import torch

from grpo import variants
# Layout: the batch's sizes; opt: the fields below, and tasks' options import it from here
from grpo.settings import Layout, Settings, opt
from harness import log


# The shipped default model (models/rook-tiny, built by the default task's own script). An absolute
# path, so that the default works from any working directory.
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "rook-tiny")


class ConfigError(ValueError):
    """A bad flag, value or combination (exit code 2, one line, no traceback)."""


# The ranges a field may declare, opt(..., must=...): batch_layout checks each field's, and its words are the
# message ("--top-p 0.0 must be in (0, 1]"), followed by the field's note in brackets.
RANGES = {"at least 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0, "> 0": lambda v: v > 0,
          "in [0, 1)": lambda v: 0 <= v < 1, "in (0, 1)": lambda v: 0 < v < 1,
          "> 1": lambda v: v > 1, "in (0, 1]": lambda v: 0 < v <= 1,
          "in [0, 2**32)": lambda v: 0 <= v < 2**32,
          # durations (seconds): at most 11 days, within what a timer or a wait takes
          "in [0, 1e6]": lambda v: 0 <= v <= 1e6, "in (0, 1e6]": lambda v: 0 < v <= 1e6}


def launched_world() -> int:
    """The device count torchrun launched the run on (WORLD_SIZE; 1 without it). ConfigError where
    torchrun did not make the environment: WORLD_SIZE no whole number from 1, or above 1 without
    torchrun's other variables (a cluster's shell sets WORLD_SIZE for its own jobs)."""
    text = os.environ.get("WORLD_SIZE", "1")
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    count = text.isdigit() and int(text) >= 1
    if not count or int(text) > 1 and missing:
        raise ConfigError(f"WORLD_SIZE={text} " + (f"is set, but not {missing[0]}" if count else
                                                   "is no device count") +
                          f": torchrun sets it for a run on several devices (torchrun "
                          f"--nproc_per_node N train_lean.py ...); unset it to run in one process")
    return int(text)


# The checkpoint's adapters are built with these and loaded as saved (peft's adapter config wins): a new value
# would be recorded while the old one trains on, so --resume refuses it.
ADAPTERS_FIXED = ("the checkpoint's adapters were built with it and load as they were saved; start a new run "
                  "(--model OUT_DIR/model, the merged model) to train other adapters")


# resume_free=True: --resume lets the setting differ from what the checkpoint recorded (any other difference is
# refused unless --resume-allow-change names it). Free are how long the run goes and when it evaluates, saves or
# gives up (none touches the weights); how the same arithmetic is cut into work on this machine (micro-batches
# accumulate to the same mini-batch; checkpointed layers, chunked log-softmax and compiled decoding compute the
# same values up to the order of float sums; another generation batch, like another device count, draws other
# samples from the same distribution); where it reports, what it traces, and the resume itself. The rest define
# the run, as do a task's options unless marked free: they change what is trained or how (the model is the start
# and the KL reference, --seed the prompt stream; bf16 changes the numbers the loss sees, not only sum orders).
@dataclass
class Config(Settings):
    # model and task
    model: str = opt(DEFAULT_MODEL, "hub id or local folder of a causal LM (AutoModelForCausalLM); the default is "
                     "the shipped models/rook-tiny, whose full-size sibling is jrahn/RookWorld-LM-124M")
    task: typing.Optional[str] = opt(None, "a built-in task (tasks/__init__.py), path/to/file.py:Name or "
                                     "module:Name; a task with options adds its own flags (see --task T --help)")
    system_prompt: typing.Optional[str] = opt(
        None, "the system message of every prompt of a task whose prompts are conversations "
        "(lists of {role, content} messages), in training and in its evaluation: it replaces "
        "the task's own system message (the command line over the task), else comes first; a "
        "task of str prompts is refused; any text is the message, none, auto and '' too", text=True)
    prompt_bos: str = opt("auto", "start each str prompt with the tokenizer's BOS/EOS token "
                          "(auto: on when BOS == EOS, as in GPT-2; a conversation's chat template writes "
                          "its own)", ["auto", "on", "off"])
    reward_errors: str = opt("stop", "a step in which every completion's reward failed (raised, or returned no "
                             "finite number): stop the run with the task's traceback, or tolerate it (those "
                             "completions get the task's min_reward, as a failed reward always does)",
                             ["stop", "tolerate"], resume_free=True)
    reward_timeout: float = opt(0.0, "give a step up when its rewards take longer than this many seconds "
                                "(saving the last finished step, exit 1); 0: off, a slow reward says so "
                                "every minute and Ctrl-C or SIGTERM stops it", must="in [0, 1e6]",
                                resume_free=True)
    # the task's held-out evaluation (its evaluate(complete), greedy decoding)
    eval_interval: int = opt(100, "evaluate before training, every N steps and after the last (0: off); "
                             "by default only for a task that has evaluate()", must=">= 0", resume_free=True)
    eval_only: bool = opt(False, "evaluate --model with the task's evaluate(), print the results and exit",
                          resume_free=True)
    # how the step's work is cut and run on this machine (the same arithmetic; --resume may change most)
    micro_batch_size: typing.Optional[typing.Union[int, str]] = opt(
        None, "completions per forward/backward on one device (default: mini / devices, no accumulation; "
        "auto: the largest that fits in memory, probed before training)", auto=True, must="at least 1",
        resume_free=True)
    micro_batch_tokens: typing.Optional[typing.Union[int, str]] = opt(
        None, "cut each mini-batch into micro-batches by real tokens instead of rows: as many rows, in "
        "order, as hold at most N prompt and completion tokens (a group's prompt counted once; a row "
        "over N runs alone); auto: N from the memory the device has free, checked before training "
        "(default: off, --micro-batch-size rows)", auto=True, must="at least 1", resume_free=True)
    update_threads: int = opt(
        1, "CPU threads of the update's forward and backward passes: 1 gives a seed the same bits "
        "run after run on one thread count (sampling uses every thread: its last bits follow "
        "OMP_NUM_THREADS); 0: every thread, faster, but the last bits of the gradients then vary "
        "from run to run, and runs drift apart", must=">= 0", resume_free=True)
    generation_batch_size: typing.Optional[int] = opt(None, "completions sampled at once on one device "
                                                      "(default: all of the device's share)", must="at least 1",
                                                      resume_free=True)
    gradient_checkpointing: bool = opt(False, "recompute each layer's activations in backward: less memory, "
                                       "more compute (a bare flag means true)", resume_free=True)
    compile: str = opt("off", "run each decode step through torch.compile (inductor on CPU, CUDA graphs on a GPU; "
                       "GPT-2 and Llama-family models): each prompt-width and live-row bucket compiles once "
                       "(seconds each), decoding then runs faster; off by default: the main job "
                       "decoded no faster for it on an H200 (BENCHMARKS.md; a bare flag means on)", ["on", "off"],
                       const="on", aliases={"true": "on", "false": "off"}, resume_free=True)
    decode_graph: str = opt("auto", "the decode step as one CUDA graph, recorded once per shape and replayed every "
                            "token (no compiler; GPT-2 and Llama-family models): auto on a GPU without --compile; "
                            "check: a stand-in on any device runs the step eagerly and stops the run where a "
                            "replay would differ (slow: to check a change to the decoder on a CPU)",
                            ["auto", "off", "check"], resume_free=True)
    lora_rank: int = opt(0, "train LoRA adapters of this rank instead of every weight (needs peft: pip install "
                         "peft); the KL reference is then the same weights with the adapters off, no second model "
                         "(0: full fine-tuning)", must=">= 0", resume_fixed=ADAPTERS_FIXED)
    lora_alpha: float = opt(16.0, "LoRA scale: an adapter adds alpha / rank x B A to its weight", must="> 0",
                            resume_fixed=ADAPTERS_FIXED)
    lora_target_modules: typing.Optional[str] = opt(None, "modules that get adapters, comma-separated names "
                                                    "(default: peft's for the architecture: GPT-2's c_attn, "
                                                    "Llama's and Qwen2's q_proj,v_proj)", resume_fixed=ADAPTERS_FIXED)
    ptx_file: typing.Optional[str] = opt(None, "--ptx-coef's text: a file whose lines are the texts, each learned "
                                         "whole (default: the task's demonstrations(n, rng))", path="in")
    # run control
    device: str = opt("auto", "auto (CUDA when present), cpu, cuda or cuda:N", resume_free=True)
    dtype: str = opt("auto", "compute dtype; bf16 uses autocast over fp32 weights and optimizer state (on a "
                     "CPU without native bf16 it is emulated and slower than fp32; auto: bf16 on a GPU)",
                     ["auto", "fp32", "bf16"])
    out_dir: str = opt("out", "folder for logs, checkpoints and the trained model", path="out", resume_free=True)
    log_file: typing.Optional[str] = opt(None, "JSONL metrics, one object per step (default: OUT_DIR/metrics.jsonl)",
                                         path="out", resume_free=True)
    log_completions: typing.Optional[str] = opt(None, "JSONL file with every sampled completion", path="out",
                                                resume_free=True)
    log_level: str = opt("info", "console verbosity", ["debug", "info", "warning"], resume_free=True)
    report_to: str = opt("none", "where every record goes", log.REPORTERS, resume_free=True)
    # long runs (see harness/checkpoint.py and harness/guards.py)
    save_final: bool = opt(True, "save the trained model at the end as a Hugging Face folder, OUT_DIR/model",
                           resume_free=True)
    save_interval: int = opt(0, "write a checkpoint to OUT_DIR/checkpoints every N steps and at the end "
                             "(0: at the end and when stopped or aborted)", must=">= 0", note="0: no periodic checkpoints",
                             resume_free=True)
    keep_checkpoints: int = opt(2, "keep the last K checkpoints", must="at least 1", resume_free=True)
    resume: typing.Optional[str] = opt(None, "continue from a checkpoint: bare (or 'latest') for the newest intact "
                                       "one in OUT_DIR, or a checkpoint / folder path", const="latest",
                                       resume_free=True)
    resume_allow_change: typing.Optional[str] = opt(None, "settings that may differ from the checkpoint's on --resume, "
                                                    "comma-separated (e.g. learning_rate,kl_coef); any other "
                                                    "difference in a setting that defines the run is refused",
                                                    resume_free=True)
    overwrite: bool = opt(False, "start over in an OUT_DIR that holds an earlier run: its logs, checkpoints, model "
                          "and reports are deleted first (without it such a folder is refused)",
                          resume_free=True)
    max_nonfinite: int = opt(10, "abort (saving a checkpoint) after this many non-finite updates in a row",
                             must="at least 1", resume_free=True)
    stop_grace: float = opt(20.0, "seconds a step may take to finish after Ctrl-C or SIGTERM; then it is "
                            "given up and the last finished step saved (torchrun, Slurm and Kubernetes "
                            "kill 30 s after their SIGTERM)", must="in (0, 1e6]", resume_free=True)
    # where memory goes (harness/memory.py; monitor_memory.py --trace sets both)
    trace_memory: int = opt(0, "trace N steps (0: off; at least 2) for leak evidence: allocation sites (tracemalloc), "
                            "live tensors by shape, on CUDA the allocator's history, in OUT_DIR/memory/trace.json; "
                            "the traced steps run 2.5-9x slower (the tiny model on CPU; BENCHMARKS.md)", must=">= 0",
                            resume_free=True)
    trace_memory_after: int = opt(20, "--trace-memory starts after this many steps of the process (the warm-up)",
                                  must=">= 0", resume_free=True)


# a knob (a setting that variants declare they read) set where the run's choice does not read it:
# the message, by flag, of (the knob, its value, the run's choice, the choices that read it)
def unused_knob_said(choice: str, knob: str, value, run: str, owners: list) -> str:
    """A knob of another choice of flag `choice` than the run's (--mismatch-correction's: its own)."""
    if choice in UNUSED_KNOB:
        return UNUSED_KNOB[choice](knob, value, run, owners)
    return (f"{flag(knob)} {value} is a knob of {flag(choice)} {' or '.join(owners)}, and the run's "
            f"is {run}: pass {flag(choice)} {owners[0]}, or leave it out")


UNUSED_KNOB = {
    "mismatch_correction": lambda knob, value, run, owners: (
        f"{flag(knob)} {value} with --mismatch-correction {run}, which does not use it: pass "
        f"{'a mask' if knob == 'mismatch_low' else 'a correction'}, or leave {flag(knob)} out"),
}


def reward_weights(cfg) -> dict:
    """--reward-weights as {part name: weight}, in the order given ({} without it); a ConfigError names a bad item."""
    weights = {}
    for item in cfg.reward_weights.split(",") if cfg.reward_weights is not None else ():
        name, _, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not name.strip() or not math.isfinite(weight) or name.strip() in weights:
            raise ConfigError(f"--reward-weights {cfg.reward_weights}: {item!r} is not name=weight (a finite number; "
                              f"each name once), as in correct=1,format=0.2")
        weights[name.strip()] = weight
    return weights


def fields_of(cls) -> dict:
    """name -> dataclass Field, with its type resolved (a task may write `from __future__ import annotations`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        f.type = hints.get(f.name, f.type)
    return {f.name: f for f in dataclasses.fields(cls)}


FIELDS = fields_of(Config)
# a field's earlier names (opt's old_names): still read as flags, GRPO_ variables, a task's trainer_settings
# and a checkpoint's keys, so older commands, scripts and runs keep working
OLD_NAMES = {old: name for name, f in FIELDS.items() for old in f.metadata.get("old_names", ())}


def renamed(values: dict) -> dict:
    """values with each earlier name of a field (OLD_NAMES) under its name now."""
    return {OLD_NAMES.get(k, k): v for k, v in values.items()}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "GRPO_" + name.upper()


def settings(cfg: Config, options) -> dict:
    """Every setting of the run, the task's options included, by field name (what a checkpoint records)."""
    return {**dataclasses.asdict(cfg), **(dataclasses.asdict(options) if options is not None else {})}


def range_error(name: str, value) -> str | None:
    """The message when value lies outside the range field `name` declares ("--top-p 0.0 must be in (0, 1]"), else
    None (None and "auto" pass)."""
    f = FIELDS[name]
    must, note = f.metadata["must"], f.metadata["note"]
    if must and value is not None and value != "auto" and not RANGES[must](value):
        return f"{flag(name)} {value} must be {must}" + (f" ({note})" if note else "")
    return None


def _device_error(choice: str) -> str | None:
    """Why --device cannot be used here (it failed later, in a traceback), or None."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", choice):
        return "is not one of auto, cpu, cuda or cuda:N"
    count = torch.cuda.device_count() if choice.startswith("cuda") else 1
    if not count:
        return "this machine has no CUDA device that torch can use: pass --device cpu (or auto)"
    if ":" in choice and int(choice.split(":")[1]) >= count:
        return f"this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


def _multiples(value: int, of: int) -> str:
    low = value // of * of
    return f"use {low} or {low + of}" if low > 0 else f"use {of}"


def unused_knob(cfg: Config, tables: dict) -> str | None:
    """A knob that variants declare they read (knobs), set while the run's choice does not read it."""
    for name in FIELDS:
        for choice, table in tables.items():
            owners = [k for k, f in table.items() if name in variants.declared(f, "knobs")]
            run = getattr(cfg, choice)
            if owners and run not in owners and getattr(cfg, name) != FIELDS[name].default:
                return unused_knob_said(choice, name, getattr(cfg, name), run, owners)
    return None


def variant_problem(cfg: Config, tables: dict) -> str | None:
    """Why the run's variants cannot run together or with the other settings, from what each
    declares (grpo/variants.py DECLARED, Switch.check), tables the flags' (train_lean.py TABLES): a
    name a table lacks, a knob set for another choice, each choice's and each switch's own check, a
    per-sequence ratio under a loss of token ratios, --dual-clip with a loss it cannot bound."""
    try:
        chosen = {flag: table[getattr(cfg, flag)] for flag, table in tables.items()}
    except ValueError as e:   # a Config not built by the command line, which refuses it
        return str(e)
    checks = [variants.declared(f, "check") for f in chosen.values()]
    checks += [switch.check for switch in variants.SWITCHES.values()]
    for problem in (unused_knob(cfg, tables), *(check(cfg) for check in checks if check)):
        if problem:
            return problem
    loss = chosen["policy_loss"]
    if variants.declared(chosen["importance_level"], "per_sequence") and \
            variants.declared(loss, "token_ratios"):
        token = tables["importance_level"].default
        return (f"--policy-loss {cfg.policy_loss} works on token ratios: use --importance-level "
                f"{token} with it")
    if cfg.dual_clip is not None and not variants.declared(loss, "accepts_dual_clip"):
        return (f"--dual-clip {cfg.dual_clip} bounds PPO's clipped term, and --policy-loss "
                f"{cfg.policy_loss} has none: leave one out")
    return None


def batch_layout(cfg: Config, world: int = 1) -> Layout:
    """Check every field's range, then the rules between fields; return the derived sizes (per device, global)."""
    check_ranges(cfg)
    layout = split_batch(cfg, world)
    check_lengths_and_schedule(cfg)
    check_adapters(cfg)
    check_reward_weights(cfg)
    check_machine(cfg)
    return layout


def check_ranges(cfg: Config) -> None:
    """Each field's value inside the range it declares (opt's must)."""
    for name in FIELDS:
        problem = range_error(name, getattr(cfg, name))
        if problem:
            raise ConfigError(problem)


def split_batch(cfg: Config, world: int) -> Layout:
    """The batch arithmetic: a step's completions split into groups, devices, mini- and micro-batches."""
    if cfg.group_size < 2:
        raise ConfigError(f"--group-size {cfg.group_size}: GRPO needs at least 2 completions per prompt")
    if cfg.batch_size % cfg.group_size:
        raise ConfigError(f"--batch-size {cfg.batch_size} is not a multiple of --group-size "
                          f"{cfg.group_size}: {_multiples(cfg.batch_size, cfg.group_size)}")
    prompts = cfg.batch_size // cfg.group_size
    if prompts % world:
        raise ConfigError(f"--batch-size {cfg.batch_size} gives {prompts} prompts, which do not split over "
                          f"{world} devices in whole groups: {_multiples(cfg.batch_size, cfg.group_size * world)}")
    mini = cfg.mini_batch_size or cfg.batch_size
    if cfg.batch_size % mini:
        raise ConfigError(f"--batch-size {cfg.batch_size} is not a multiple of --mini-batch-size {mini}: "
                          f"use a divisor of {cfg.batch_size}")
    if mini % world:
        raise ConfigError(f"--mini-batch-size {mini} does not split over {world} devices: {_multiples(mini, world)}")
    mini_per_device = mini // world
    # auto: the whole per-device mini-batch to start; harness/run.py probes it down before training
    micro_auto = cfg.micro_batch_size == "auto"
    if cfg.micro_batch_tokens is not None and cfg.micro_batch_size is not None:
        raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} and --micro-batch-tokens "
                          f"{cfg.micro_batch_tokens}: cut the mini-batch one way, leave one out")
    tokens_auto = cfg.micro_batch_tokens == "auto"
    micro = (None if micro_auto else cfg.micro_batch_size) or mini_per_device
    if mini_per_device % micro:
        raise ConfigError(f"--micro-batch-size {micro} does not divide the per-device mini-batch "
                          f"{mini_per_device} (= --mini-batch-size {mini} / {world} devices): "
                          f"use a divisor of {mini_per_device}")
    per_device = cfg.batch_size // world
    return Layout(devices=world, prompts_per_step=prompts, prompts_per_device=prompts // world,
                  completions_per_step=cfg.batch_size, completions_per_device=per_device, mini_batch=mini,
                  mini_batch_per_device=mini_per_device, micro_batch=micro, micro_batch_auto=micro_auto,
                  micro_tokens=0 if tokens_auto else cfg.micro_batch_tokens or 0,
                  micro_tokens_auto=tokens_auto,
                  grad_accum_steps=mini_per_device // micro, updates_per_step=cfg.batch_size // mini * cfg.ppo_epochs,
                  generation_batch=min(cfg.generation_batch_size or per_device, per_device))


def check_lengths_and_schedule(cfg: Config) -> None:
    """Lengths within --max-new-tokens, a warmup shorter than the run, a decay that keeps weights' sign."""
    for name, value in (("min_new_tokens", cfg.min_new_tokens), ("overlong_buffer", cfg.overlong_buffer)):
        if not 0 <= value <= cfg.max_new_tokens:
            raise ConfigError(f"{flag(name)} {value} must be in [0, --max-new-tokens {cfg.max_new_tokens}]")
    if cfg.lr_warmup_steps and cfg.lr_warmup_ratio:
        raise ConfigError(f"--lr-warmup-steps {cfg.lr_warmup_steps} and --lr-warmup-ratio {cfg.lr_warmup_ratio}: "
                          f"give the warmup one way")
    warmup = cfg.lr_warmup_steps or round(cfg.lr_warmup_ratio * cfg.steps)   # as grpo/optim.py learning_rate
    if warmup >= cfg.steps:
        given = (f"--lr-warmup-steps {warmup}" if cfg.lr_warmup_steps else
                 f"--lr-warmup-ratio {cfg.lr_warmup_ratio} ({warmup} steps)")
        raise ConfigError(f"{given} with --steps {cfg.steps}: the learning rate would rise over the whole run and "
                          f"train at --learning-rate {cfg.learning_rate:g} by the last step at best: give a warmup "
                          f"below {cfg.steps} steps, or more --steps")
    if cfg.learning_rate * cfg.weight_decay >= 1:   # AdamW and Muon scale each weight by 1 - lr wd
        raise ConfigError(f"--learning-rate {cfg.learning_rate:g} with --weight-decay {cfg.weight_decay:g}: "
                          f"each update would scale every weight by 1 - {cfg.learning_rate * cfg.weight_decay:g}, "
                          f"to 0 or past it; keep their product below 1")


def check_adapters(cfg: Config) -> None:
    """LoRA's settings need a rank, and peft."""
    if cfg.lora_target_modules and not cfg.lora_rank:
        raise ConfigError(f"--lora-target-modules {cfg.lora_target_modules} with --lora-rank 0 (full fine-tuning): "
                          f"give a rank above 0, or leave --lora-target-modules out")
    if cfg.lora_rank and importlib.util.find_spec("peft") is None:
        raise ConfigError(f"--lora-rank {cfg.lora_rank} needs the peft package, which is not installed: "
                          f"pip install peft (or --lora-rank 0 for full fine-tuning)")


def check_reward_weights(cfg: Config) -> None:
    weights = reward_weights(cfg)
    if weights and not any(weights.values()):   # every advantage 0: not the temperature's fault
        raise ConfigError(f"--reward-weights {cfg.reward_weights}: every weight is 0, so every "
                          f"completion's reward (and advantage) would be 0: give a part a weight")


def check_variants(cfg: Config, tables: dict) -> None:
    """The run's variants, against the flags' tables (train_lean.py TABLES; variant_problem)."""
    problem = variant_problem(cfg, tables)
    if problem:
        raise ConfigError(problem)


def check_machine(cfg: Config) -> None:
    """The device, the reporter's package and the memory trace, before anything is loaded."""
    device_error = _device_error(cfg.device)
    if device_error:
        raise ConfigError(f"--device {cfg.device}: {device_error}")
    if log.missing_reporter(cfg.report_to):   # at start-up, not once the model has loaded
        raise ConfigError(log.missing_reporter(cfg.report_to))
    if cfg.trace_memory == 1:
        raise ConfigError("--trace-memory 1: the evidence compares the first traced step with the last; trace 2 or more")
