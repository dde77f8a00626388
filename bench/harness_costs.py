"""What the harness costs on every step: a short run under cProfile, each harness call's time per step.

    python bench/harness_costs.py                      # GPT-2 124M's shape (bench/common.py), 3 steps
    python bench/harness_costs.py --model out/tiny --steps 5 -- --max-new-tokens 16

Runs train_lean.main in this process (one thread by default, as the update runs) on the chess A:
task, batch 8 = 1 x 8, 8 new tokens, no evaluation, and prints, per step, the cumulative seconds of
each harness call beside the step's and the optimizer's own, and each one's share of the step. The
algorithm's work (sampling, forwards, backward, the optimizer) is the rest. cProfile adds a little to
every Python call; the torch kernels it does not slow.
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import model_dir  # noqa: E402

# (file, function): what the harness does around the step, and the optimizer's step for scale
CALLS = [
    ("harness/memory.py", "release_free_heap", "heap trims (glibc malloc_trim before each reading)"),
    ("harness/memory.py", "rss_mb", "RSS readings"),
    ("harness/memory.py", "end", "phase bookkeeping (Phases.end, trims and readings included)"),
    ("harness/memory.py", "record", "the step's memory keys"),
    ("harness/guards.py", "step", "the non-finite guard (Guard.step, the optimizer's step included)"),
    ("harness/guards.py", "fit", "the out-of-memory guard (Guard.fit, its passes included)"),
    ("harness/checkpoint.py", "check_finite", "the finite-weights check (at saves only)"),
    ("harness/checkpoint.py", "_write", "a checkpoint (at saves only)"),
    ("harness/run.py", "check_rewards", "gathering the step's rows, reward-failure checks"),
    ("harness/run.py", "end_step", "the record, console line, logs (end_step)"),
    ("grpo/model.py", "trainable_parameters", "the trainable-parameter list (a Python loop)"),
    ("grpo/distributed.py", "sum_gradients", "gradient all-reduce (one process: returns)"),
    ("grpo/distributed.py", "all_sum", "sums over ranks (one process: returns)"),
    ("grpo/distributed.py", "gather_objects", "gathers over ranks (one process: returns)"),
    ("torch/optim/adam.py", "adam", "AdamW's update (for scale)"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m", help="a bench model name or a model folder")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model-root", default=os.path.join(REPO, "out", "bench-models"))
    ap.add_argument("extra", nargs="*", help="after --: more train_lean.py flags")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    import train_lean
    with tempfile.TemporaryDirectory(prefix="harness-costs-") as out:
        argv = ["--model", model_dir(args.model, args.model_root), "--task", "chess-env",
                "--batch-size", "8", "--group-size", "8", "--max-new-tokens", "8",
                "--steps", str(args.steps), "--eval-interval", "0", "--save-final", "false",
                "--out-dir", out, "--log-level", "warning", *args.extra]
        profile = cProfile.Profile()
        profile.runcall(train_lean.main, argv)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f if '"step_time_s"' in line]
    stats = pstats.Stats(profile).stats
    step = sum(r["step_time_s"] for r in recs) / len(recs)
    print(f"{len(recs)} steps, mean step {step:.2f} s, peak RSS {max(r['rss_peak_mb'] for r in recs):.0f} MB "
          f"({args.threads} thread(s))")
    print("| what | calls in the run | ms per call | ms per step | share of the step |\n"
          "|---|---|---|---|---|")
    for file, name, what in CALLS:
        hits = [(v[1], v[3]) for (path, _, fn), v in stats.items() if path.endswith(file) and fn == name]
        calls, seconds = sum(c for c, _ in hits), sum(s for _, s in hits)
        print(f"| {what} | {calls} | {1e3 * seconds / max(calls, 1):.2f} | "
              f"{1e3 * seconds / len(recs):.1f} | {100 * seconds / len(recs) / step:.2f}% |")


if __name__ == "__main__":
    main()
