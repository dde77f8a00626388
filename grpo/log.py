"""Logging: one JSON object per line (flushed at once, so a crash loses nothing written) and a console line."""
import json
import math
import os


def open_jsonl(path: str, append: bool = False):
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    return open(path, "a" if append else "w", encoding="utf-8", buffering=1)


def keep_until(path: str, step: int) -> None:
    """Drop the records of steps after `step` (a resumed run redoes them); atomic like a checkpoint."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null keeps every line parseable by strict readers
    return v


def write(f, record: dict) -> None:
    f.write(json.dumps({k: _plain(v) for k, v in record.items()}, ensure_ascii=False) + "\n")


STEP_FIELDS = [("reward_mean", "reward {:.3f}"), ("loss", "loss {:+.4f}"), ("kl", "kl {:.4f}"),
               ("clip_frac", "clip {:.3f}"), ("grad_norm", "gnorm {:.3f}"),
               ("completion_len_mean", "len {:.1f}"), ("samples_per_s", "{:.1f} samples/s"),
               ("step_time_s", "{:.2f}s"), ("rss_mb", "rss {:.0f}MB"), ("cuda_peak_mb", "peak {:.0f}MB")]


def step_line(rec: dict, steps: int) -> str:
    parts = [f"step {rec['step']}/{steps}"]
    parts += [fmt.format(rec[k]) for k, fmt in STEP_FIELDS if rec.get(k) is not None]
    return " | ".join(parts)
