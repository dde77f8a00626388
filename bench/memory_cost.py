"""What watching memory costs a step: the per-phase readings, and a --trace-memory window.

    python bench/memory_cost.py --model out/tiny --batch-size 64 --max-new-tokens 16 [--device cuda]

One run of train_lean.py in this process (--task toy): --steps steps, of which --trace steps right
after --warmup are traced. Prints the median step time of the traced steps and of the untraced ones
after the window, and what the per-phase readings took in the untraced steps (harness/memory.py times
nothing itself: its release_free_heap, malloc_trim, is the reading's cost and is timed in place here;
reading RSS from /proc is microseconds).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import train_lean  # noqa: E402
from harness import memory  # noqa: E402

PHASES = ("start", "gen", "score", "ref", "train")   # the readings of a step, in order


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder (scripts/make_tiny_model.py out/tiny)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--trace", type=int, default=20, help="steps traced right after the warm-up")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.steps <= args.warmup + args.trace:
        p.error("--steps must leave untraced steps after the warm-up and the trace window")

    spent, trim = [], memory.release_free_heap

    def timed_trim():
        t = time.perf_counter()
        trim()
        spent.append(time.perf_counter() - t)

    memory.release_free_heap = timed_trim
    with tempfile.TemporaryDirectory() as out:
        train_lean.main(["--model", args.model, "--task", "toy", "--device", args.device, "--steps", str(args.steps),
                         "--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens),
                         "--out-dir", out, "--trace-memory", str(args.trace), "--trace-memory-after", str(args.warmup),
                         "--log-level", "warning", "--save-final", "false", "--eval-interval", "0"])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            times = [json.loads(line)["step_time_s"] for line in f]
    window, after = slice(args.warmup, args.warmup + args.trace), slice(args.warmup + args.trace, args.steps)
    traced, plain = statistics.median(times[window]), statistics.median(times[after])
    per_step = [spent[i:i + len(PHASES)] for i in range(0, len(spent), len(PHASES))][after]
    readings = statistics.median(sum(s) for s in per_step)
    print(f"{args.device}, batch {args.batch_size} x {args.max_new_tokens} new tokens, {args.steps} steps, "
          f"steps {args.warmup + 1}-{args.warmup + args.trace} traced")
    print(f"untraced step (median of steps {args.warmup + args.trace + 1}-{args.steps}): {plain:.4f} s")
    print(f"traced step (median of steps {args.warmup + 1}-{args.warmup + args.trace}): {traced:.4f} s "
          f"({traced / plain:.1f}x)")
    print(f"readings in an untraced step: {readings * 1e3:.2f} ms ({readings / plain:.1%} of the step); median ms "
          + ", ".join(f"{name} {statistics.median(s[k] for s in per_step) * 1e3:.2f}" for k, name in enumerate(PHASES)))


if __name__ == "__main__":
    main()
