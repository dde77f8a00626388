"""Logging: one JSON object per line (flushed at once, so a crash loses nothing written), a console line, and
TensorBoard or Weights & Biases as well (--report-to).

Every function here is local to its process: what the step's record needs from every device is gathered
once per step (device_part -> distributed.gather_objects -> whole_step, harness/run.py), so a logging call can sit under
`if main_rank:` without leaving another rank waiting.
"""
import hashlib
import importlib.util
import json
import math
import numbers
import os
import shutil
import sys
import threading
import time
from collections import Counter

import torch
from tqdm import tqdm

from grpo import distributed
from grpo.rollout import mean_parts


def open_jsonl(path: str, append: bool = False):
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    return open(path, "a" if append else "w", encoding="utf-8", buffering=1)


METRICS = "metrics.jsonl"   # in OUT_DIR, unless --log-file names another file


def metrics_path(cfg) -> str:
    """Where the run's step and eval records go: --log-file, else OUT_DIR/metrics.jsonl."""
    return cfg.log_file or os.path.join(cfg.out_dir, METRICS)


def items_path(metrics: str) -> str:
    """Where an evaluation's per-item scores go, beside its records: OUT_DIR/metrics.items.jsonl for metrics.jsonl.
    A file of their own keeps metrics.jsonl one short line per record (a chess evaluation has thousands of scores)."""
    root, ext = os.path.splitext(metrics)
    return f"{root}.items{ext or '.jsonl'}"


def warn(message: str) -> None:
    """A line on stderr from rank 0 only ("train_lean.py: MESSAGE"): errors and warnings that --log-level does not
    silence."""
    if distributed.is_main():
        print(f"train_lean.py: {message}", file=sys.stderr, flush=True)


def warn_here(message: str) -> None:
    """A line on stderr from whichever rank it concerns, named when there are several."""
    where = f"rank {distributed.rank()}: " if distributed.world_size() > 1 else ""
    print(f"train_lean.py: {where}{message}", file=sys.stderr, flush=True)


def info(enabled: bool, message: str) -> None:
    """A console line (the trainer binds enabled: rank 0 and --log-level info or debug)."""
    if enabled:
        print(message, flush=True)


class EvalProgress:
    """complete(prompts, ...) of an evaluation, said: a line when it starts, and on a terminal a
    running count of the prompts completed (how many the task asks for is not known in advance); off
    a terminal (a log file, make) a line every EVERY_S seconds, so a long evaluation is not silence.
    The count moves as each of complete()'s batches finishes when complete takes `progress` (the
    trainer's: harness/task.py eval_completions), else as each call returns. close() ends the count.
    What was asked is kept too: `asked` prompts, in order, whose digest() names the held-out items
    (two evaluations of the same items can be compared item by item; compare_runs.py refuses
    others)."""

    EVERY_S = 60.0

    def __init__(self, complete, what: str, batched: bool = False):
        print(f"{what}: evaluating ...", flush=True)
        self.complete, self.what, self.batched = complete, what, batched
        self.asked, self.done, self.hash = 0, 0, hashlib.sha256()
        # redrawn at every call: one call decodes a whole batch of prompts, never too often to show
        self.bar = tqdm(desc=what, unit=" prompts", disable=not sys.stderr.isatty(), file=sys.stderr, leave=False,
                        mininterval=0, miniters=1)
        # a thread: one complete() call may decode every prompt at once
        self.ticker = Ticker(what, "evaluating", lambda: f"{self.done} prompts completed",
                             self.EVERY_S) if self.bar.disable else None

    def __call__(self, prompts, *args, **kwargs):
        for prompt in prompts:   # each prompt's length first: no two lists of prompts hash alike
            text = _hashed(prompt).encode("utf-8", "surrogatepass")
            self.hash.update(len(text).to_bytes(8, "little") + text)
        self.asked += len(prompts)
        before = self.done
        if self.batched:   # prompts finished so far in this call
            kwargs["progress"] = lambda finished: self._count(before + finished)
        texts = self.complete(prompts, *args, **kwargs)
        self._count(before + len(prompts))
        return texts

    def _count(self, done: int) -> None:
        self.bar.update(done - self.done)
        self.done = done

    def digest(self) -> str:
        return self.hash.hexdigest()

    def close(self) -> None:
        if self.ticker is not None:
            self.ticker.close()
        self.bar.close()


class Ticker:
    """While something long runs (an evaluation, a step's rewards), a line every `every` seconds
    from a thread: "WHAT: still DOING, 2m00s so far, PROGRESS" (progress() says how far)."""

    def __init__(self, what: str, doing: str, progress, every: float):
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True,
                                       args=(what, doing, progress, every, time.perf_counter()))
        self.thread.start()

    def _tick(self, what, doing, progress, every, start) -> None:
        while not self.stopped.wait(every):
            print(f"{what}: still {doing}, {duration(time.perf_counter() - start)} so far, "
                  f"{progress()}", flush=True)

    def close(self) -> None:
        self.stopped.set()   # gone before the process ends: a thread left running at exit can
        self.thread.join()   # abort it in C++ ("terminate called without an active exception")


def _hashed(prompt) -> str:
    """A prompt as EvalProgress hashes it: a str itself; a conversation as JSON with its keys
    sorted, so that the same messages hash alike whatever order a task wrote their keys in (a
    prompt that is neither is refused after this: its str)."""
    if isinstance(prompt, str):
        return prompt
    try:
        return json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(prompt)


def _finite(x) -> bool:
    try:
        return isinstance(x, (int, float)) and math.isfinite(x)
    except OverflowError:   # an int such as 10**400
        return False


def items_problem(record) -> str | None:
    """What makes a line no record of per-item scores (a hand-edited or damaged file), else None."""
    if not isinstance(record, dict):
        return f"it is a {type(record).__name__}, not a record"
    kinds = {"step": (int, "an int"), "prompts": (int, "an int"), "prompts_sha256": (str, "a str"),
             "items": (dict, "a dict")}
    for key, (kind, name) in kinds.items():
        if not isinstance(record.get(key), kind):
            return f"its {key!r} is not {name}"
    if not isinstance(record.get("task", ""), str):
        return "its 'task' is not a str"
    for name, scores in record["items"].items():
        if not isinstance(scores, list) or not scores:
            return f"its scores of {name!r} are not a list of items"
        bad = next((i for i, x in enumerate(scores) if not _finite(x)), None)
        if bad is not None:
            return f"item {bad} of {name!r}, {str(scores[bad])[:40]}, is not a finite number"
    return None


def open_run_logs(metrics_path: str, completions_path, resume_step, stack) -> tuple:
    """The metrics and completions JSONL files, closed by stack. A resumed run first drops the records of
    steps after its checkpoint: they belong to the killed run's lost future, and the resumed run redoes them."""
    files = []
    for path in (metrics_path, completions_path):
        if path is None:
            files.append(None)
            continue
        if resume_step is not None:
            keep_until(path, resume_step)
        files.append(stack.enter_context(open_jsonl(path, append=resume_step is not None)))
    return tuple(files)


def keep_until(path: str, step: int) -> None:
    """Drop the records of steps after `step` (a resumed run redoes them); atomic like a checkpoint.

    A torn last line, what a run killed mid-write or a full disk leaves, is dropped with a note. A line
    that is no record before the last one is not what this trainer leaves (another writer, a damaged disk):
    it is dropped too, loudly, and the file as it was is kept beside it as PATH.damaged."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        lines = f.readlines()
    kept, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):   # not JSON (or nested past any depth), or not UTF-8
            record = None
        if not isinstance(record, dict):
            bad.append(number)
        elif record.get("step", 0) <= step:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    if bad == [len(lines)]:
        warn(f"{path}: dropped its torn last line ({len(lines[-1])} bytes, what a run killed mid-write or a full "
             f"disk leaves)")
    elif bad:
        shutil.copyfile(path, path + ".damaged")
        where = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        warn(f"{path}: line(s) {where} of {len(lines)} hold no JSON record, and not only a torn last line (did "
             f"something else write to it?): dropped; the file as it was is kept as {path}.damaged")
    with open(path + ".tmp", "wb") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null keeps every line parseable by strict readers
    return v


def write(f, record: dict) -> None:
    f.write(json.dumps({k: _plain(v) for k, v in record.items()}, ensure_ascii=False) + "\n")


# a variant's field (token_adv: --token-advantage shaping) is in a record, and so shown, only when it is on
STEP_FIELDS = [("reward_mean", "reward {:.3f}"), ("loss", "loss {:+.4f}"), ("token_adv", "token_adv {:+.3f}"),
               ("token_adv_std", "token_adv_std {:.3f}"), ("kl", "kl {:.4f}"), ("ptx_loss", "ptx {:.3f}"),
               ("clip_frac", "clip {:.3f}"), ("entropy", "ent {:.2f}"), ("grad_norm", "gnorm {:.3f}"),
               ("completion_len_mean", "len {:.1f}"), ("samples_per_s", "{:.1f} samples/s"),
               ("step_time_s", "{:.2f}s"), ("rss_mb", "rss {:.0f}MB"), ("cuda_peak_mb", "peak {:.0f}MB")]


def device_part(batch, scorer, with_rows: bool) -> dict:
    """This device's part of the step that the record needs from every device (the caller gathers it):
    rewards, lengths, reward parts and failures, and with_rows (--log-completions) every row."""
    lengths = batch.completion_mask.sum(1).cpu()
    out = {"rewards": batch.rewards, "lengths": lengths, "truncated": batch.truncated.cpu(),
           "part_means": batch.part_means, "errors": batch.errors, **scorer.to_gather(),
           "penalties": batch.penalties}   # what reward shaping took off the rewards, by name
    if with_rows:
        out["rows"] = list(zip(batch.prompts, batch.texts, lengths.tolist(),
                               (batch.old_logp * batch.completion_mask).sum(1).tolist()))
    return out


def whole_step(parts: list) -> dict:
    """The step over every device, from device_part() of each in rank order: rows concatenated (the rewards and
    each penalty reward shaping took off them), the reward's part means averaged over the devices,
    errors and scored rows summed, and of each reward failure's report the lowest rank's."""
    out = {k: torch.cat([s[k] for s in parts]) for k in ("rewards", "lengths", "truncated")}
    out["penalties"] = {k: torch.cat([s["penalties"][k] for s in parts]) for k in parts[0]["penalties"]}
    out["part_means"] = mean_parts([s["part_means"] for s in parts])
    out["errors"] = dict(sum((Counter(s["errors"]) for s in parts), Counter()))
    out["scored"] = sum(s["scored"] for s in parts)
    out["reports"] = {k: v for s in reversed(parts) for k, v in s["reports"].items()}
    out["rows"] = [row for s in parts for row in s.get("rows", ())]
    return out


def write_completions(f, step: int, step_rows: dict) -> None:
    """Every device's completions with their rewards (step_rows: whole_step()'s)."""
    for (prompt, text, n, s), r in zip(step_rows["rows"], step_rows["rewards"].tolist()):
        write(f, {"step": step, "prompt": prompt, "completion": text, "reward": r, "completion_tokens": n,
                  "logprob_sum": s})


def batch_stats(step_rows: dict, group_size: int) -> dict:
    """What a step's record says about its batch (every device's rows, whole_step()'s): the reward over the batch
    and its spread within groups (the spread the advantages are made of; the unbiased std, as the advantages
    divide by), completion lengths (EOS included) and the share cut off at max_new_tokens, the means of
    the reward's parts, reward errors, and each penalty reward shaping took off the rewards (overlong_penalty,
    kl_reward_penalty: the task's reward_mean is before them)."""
    rewards, lengths = step_rows["rewards"].float(), step_rows["lengths"].float()
    out = {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
           "reward_std_group": rewards.view(-1, group_size).std(1).mean().item(),
           "completion_len_min": lengths.min().item(), "completion_len_mean": lengths.mean().item(),
           "completion_len_max": lengths.max().item(), "truncated_frac": step_rows["truncated"].float().mean().item(),
           **{f"reward_{k}": v for k, v in step_rows["part_means"].items()}}
    if step_rows["errors"]:
        out["reward_errors"] = step_rows["errors"]
    out.update({name: values.float().mean().item() for name, values in step_rows["penalties"].items()})
    return out


def throughput(times: dict, step_rows: dict) -> dict:
    """Seconds per phase (harness/memory.py Phases.times) and samples and completion tokens per second."""
    rows, seconds = len(step_rows["rewards"]), times["step"]
    return {"step_time_s": seconds, **{f"{k}_time_s": v for k, v in times.items() if k != "step"},
            "samples_per_s": rows / seconds, "tokens_per_s": step_rows["lengths"].float().sum().item() / seconds}


FLAT_SHOWN = 0.5   # the share of flat groups (frac_zero_std) from which the console line says it


def step_line(rec: dict, steps: int, eta_s: float = None, trend: str = "") -> str:
    """The console line of a step; eta_s: the seconds the run is expected to go on, when known;
    trend: the reward's running mean and its change (harness/progress.py)."""
    parts = [f"step {rec['step']}/{steps}"]
    parts += [fmt.format(rec[k]) for k, fmt in STEP_FIELDS if rec.get(k) is not None]
    if trend and rec.get("reward_mean") is not None:
        parts[1] += " " + trend
    beside = []   # the reward's: failed rewards are scored, not skipped; flat groups teach nothing
    if rec.get("reward_errors"):
        beside.append(f"failed {sum(rec['reward_errors'].values())}")
    if rec.get("frac_zero_std", 0.0) >= FLAT_SHOWN:
        beside.append(f"flat {rec['frac_zero_std']:.2f}")
    parts[2:2] = beside
    if eta_s is not None:
        parts.append(f"eta {duration(eta_s)}")
    return " | ".join(parts)


def duration(seconds: float) -> str:
    """A duration as a person reads it: 45s, 7m12s, 2h05m."""
    s = round(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else \
        f"{s // 3600}h{s % 3600 // 60:02d}m"


# ---- --report-to: TensorBoard or Weights & Biases as well as the JSONL file -------------------------------
# Neither package is a dependency of the trainer. Asking for one that is not installed raises ReportError,
# one line naming the package to pip install (the trainer exits with code 2). wandb runs offline unless
# WANDB_MODE says otherwise: the run is written under OUT_DIR/wandb and nothing leaves the machine; `wandb
# sync` uploads it later. Only the main rank reports.
REPORTERS = {"none": "the JSONL file only", "tensorboard": "also TensorBoard, in OUT_DIR/tensorboard",
             "wandb": "also Weights & Biases, offline unless WANDB_MODE says otherwise, in OUT_DIR/wandb"}


class ReportError(RuntimeError):
    """A --report-to backend that cannot be used (exit code 2, one line, no traceback)."""


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def missing_reporter(kind: str) -> str | None:
    """The line that says --report-to's package is not installed (config.batch_layout checks it at
    start-up), else None."""
    if kind in ("tensorboard", "wandb") and not installed(kind):
        return f"--report-to {kind} needs the {kind} package: pip install {kind}"
    return None


def scalars(record: dict, prefix: str = "") -> dict:
    """The numbers of a JSONL record by name, nested dicts as "outer/inner"; "step", text and bools left out."""
    out = {}
    for key, value in record.items():
        name = prefix + str(key)
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool) and name != "step":
            out[name] = float(value)
    return out


class _Nothing:
    def log(self, record: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class _TensorBoard:
    def __init__(self, out_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ReportError(missing_reporter("tensorboard") or "--report-to tensorboard: its "
                              "package is installed, but torch.utils.tensorboard cannot import "
                              "it") from None
        self.writer = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"))

    def log(self, record: dict, step: int) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, out_dir: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ReportError(missing_reporter("wandb") or "--report-to wandb: the wandb package "
                              "is installed, but cannot be imported") from None
        self.wandb = wandb
        os.makedirs(out_dir, exist_ok=True)
        # console "off": wandb leaves the trainer's stdout and stderr alone
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lean-grpo"), dir=out_dir, config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"), settings=wandb.Settings(console="off"))

    def log(self, record: dict, step: int) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # waits for wandb's service process to write out the run before returning


def open_reporter(kind: str, out_dir: str, config_dict: dict):
    """A reporter with log(record, step) and close(): "none" does nothing, "tensorboard" writes events to
    OUT_DIR/tensorboard, "wandb" a run under OUT_DIR/wandb with the run's config. Raises ReportError."""
    if kind == "none":
        return _Nothing()
    if kind == "tensorboard":
        return _TensorBoard(out_dir)
    if kind == "wandb":
        return _WandB(out_dir, config_dict)
    raise ReportError(f"--report-to {kind!r} is not one of {', '.join(REPORTERS)}")
