"""Logging: one JSON object per line (flushed at once, so a crash loses nothing written) and a console line."""
import json
import math
import os
import shutil
import sys
from collections import Counter

from grpo import distributed
from grpo.stats import group_reward_std, length_stats


def open_jsonl(path: str, append: bool = False):
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    return open(path, "a" if append else "w", encoding="utf-8", buffering=1)


def note(message: str) -> None:
    """A line on stderr from rank 0 only ("train_lean.py: MESSAGE"): errors and warnings that --log-level does not
    silence. Before the process group exists, torchrun's RANK says which rank this is."""
    if os.environ.get("RANK", "0") == "0":
        print(f"train_lean.py: {message}", file=sys.stderr, flush=True)


def say(enabled: bool, message: str) -> None:
    """A console line (the trainer binds enabled: rank 0 and --log-level info or debug)."""
    if enabled:
        print(message, flush=True)


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
        except ValueError:   # not JSON, or not UTF-8
            record = None
        if not isinstance(record, dict):
            bad.append(number)
        elif record.get("step", 0) <= step:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    if bad == [len(lines)]:
        note(f"{path}: dropped its torn last line ({len(lines[-1])} bytes, what a run killed mid-write or a full "
             f"disk leaves)")
    elif bad:
        shutil.copyfile(path, path + ".damaged")
        where = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        note(f"{path}: line(s) {where} of {len(lines)} hold no JSON record, and not only a torn last line (did "
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


STEP_FIELDS = [("reward_mean", "reward {:.3f}"), ("loss", "loss {:+.4f}"), ("kl", "kl {:.4f}"),
               ("clip_frac", "clip {:.3f}"), ("entropy", "ent {:.2f}"), ("grad_norm", "gnorm {:.3f}"),
               ("completion_len_mean", "len {:.1f}"), ("samples_per_s", "{:.1f} samples/s"),
               ("step_time_s", "{:.2f}s"), ("rss_mb", "rss {:.0f}MB"), ("cuda_peak_mb", "peak {:.0f}MB")]


def over_ranks(components: dict, errors: dict) -> tuple[dict, dict]:
    """The reward components averaged and the reward errors summed over all devices."""
    gathered = distributed.gather_objects((components, errors))
    means = {k: sum(c.get(k, 0.0) for c, _ in gathered) / len(gathered) for k in gathered[0][0]}
    return means, dict(sum((Counter(e) for _, e in gathered), Counter()))


def write_completions(f, step: int, rollout, rewards) -> None:
    """Every device's completions with their rewards, written by rank 0 (f is None on the others)."""
    lengths = rollout.completion_mask.sum(1).tolist()
    logprob_sums = (rollout.old_logp * rollout.completion_mask).sum(1).tolist()
    parts = distributed.gather_objects(list(zip(rollout.prompts, rollout.texts, lengths, logprob_sums)))
    if f is None:
        return
    for (prompt, text, n, s), r in zip([row for part in parts for row in part], rewards.tolist()):
        write(f, {"step": step, "prompt": prompt, "completion": text, "reward": r, "completion_tokens": n,
                  "logprob_sum": s})


def batch_stats(rollout, rewards, group_size: int, components: dict, errors: dict, oom_notes: list, micro: int) -> dict:
    """What a step's record says about its batch (every device's rows): completion lengths and the share cut
    off, the reward's spread within groups and its components, reward errors, out-of-memory retries."""
    lengths = distributed.gather_rows(rollout.completion_mask.sum(1).cpu())
    truncated = distributed.gather_rows(rollout.truncated.long().cpu())
    out = {**length_stats(lengths, truncated), "reward_std_group": group_reward_std(rewards, group_size),
           **{f"reward_{k}": v for k, v in components.items()}}
    if errors:
        out["reward_errors"] = errors
    if oom_notes:
        out["oom_retries"], out["micro_batch"] = len(oom_notes), micro
    return out


def step_record(step: int, rewards, frac_zero_std: float, totals: dict, times: dict, extra: dict, memory: dict) -> dict:
    """The JSONL record of one training step: rewards over the global batch, loss statistics summed over
    devices (ratios per loss token), timings, the caller's extra keys (lengths, rewards' parts) and memory."""
    tokens, updates = max(totals["tokens"], 1), max(totals["updates"], 1)
    return {
        "step": step,
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "frac_zero_std": frac_zero_std,
        "loss": totals["loss"] / updates,
        "kl": totals["kl"] / tokens,
        "clip_frac": totals["clip"] / tokens,
        "clip_low_frac": totals["clip_low"] / tokens,
        "clip_high_frac": totals["clip_high"] / tokens,
        "clip_dual_frac": totals["clip_dual"] / tokens,
        "ratio_mean": totals["ratio"] / tokens,
        "entropy": totals["entropy"] / tokens,
        "grad_norm": totals["grad_norm"] / updates,
        "skipped_nonfinite": totals["skipped"],
        **extra,
        "step_time_s": times["step"],
        "gen_time_s": times["gen"],
        "score_time_s": times["score"],
        "ref_time_s": times["ref"],
        "train_time_s": times["train"],
        "samples_per_s": len(rewards) / times["step"],
        "tokens_per_s": extra["completion_len_mean"] * len(rewards) / times["step"],
        **memory,
    }


def step_line(rec: dict, steps: int) -> str:
    parts = [f"step {rec['step']}/{steps}"]
    parts += [fmt.format(rec[k]) for k, fmt in STEP_FIELDS if rec.get(k) is not None]
    return " | ".join(parts)
