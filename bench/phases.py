"""Two checkouts' train_lean.py runs of one command, alternating: each phase's median time over the
steps after the first, and peak RSS (A and B: this checkout and another, e.g. a `git worktree` of an
older commit).

    python bench/phases.py OTHER_CHECKOUT PAIRS -- TRAIN_LEAN_FLAGS...
    python bench/phases.py /tmp/base 4 -- --steps 3 --eval-interval 0    # the main job, 4 pairs

Runs A B, B A, A B, ... (a noisy neighbour hits both alike), each in its own process with this
interpreter and its own out-dir; prints each side's medians and the ratio B / A of each phase.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("step_time_s", "gen_time_s", "ref_time_s", "train_time_s")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    trees, pairs, flags = {"A": REPO, "B": os.path.abspath(argv[0])}, int(argv[1]), argv[3:]
    runs = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="phases-") as work:
        for i in range(pairs):
            for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                out = os.path.join(work, f"{name}{i}")
                subprocess.run([sys.executable, "train_lean.py", *flags, "--out-dir", out],
                               cwd=trees[name], check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    runs[name].append([json.loads(line) for line in f if line.strip()])
    medians = {}
    for name, tree in trees.items():
        steps = [r for records in runs[name] for r in records[1:]]
        medians[name] = {k: statistics.median(r[k] for r in steps) for k in PHASES}
        peak = max(r["rss_peak_mb"] for records in runs[name] for r in records)
        print(f"{name} {tree}: " + ", ".join(f"{k} {v:.3f}" for k, v in medians[name].items())
              + f", peak RSS {peak:.0f} MB ({len(steps)} steps)")
    print("B / A: " + ", ".join(f"{k} {medians['B'][k] / medians['A'][k]:.3f}" for k in PHASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
