"""Plot a run's metrics.jsonl: train reward per step (left) and held-out eval metrics (right).

    python scripts/plot_run.py out/default-run/metrics.jsonl docs/default_run.png

Step records give the mean reward (and its P:/A: components where logged); records with
"kind": "eval" (from --eval-interval) give the held-out accuracies, drawn as points with lines.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")   # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.evaluate import ROWS  # noqa: E402

REWARD_LINES = [("reward_mean", "reward (all)"), ("reward_policy_legal", "P: share of legal B: moves"),
                ("reward_policy_best", "P: best-move credit"), ("reward_env_format", "A: format credit")]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean: single steps of 8 prompts are noisy, the trend is what the plot is for."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics")
    parser.add_argument("png")
    parser.add_argument("--title", default="GRPO on the default model (python train_lean.py --batch-size 64)")
    parser.add_argument("--window", type=int, default=10, help="steps in the reward's trailing mean")
    args = parser.parse_args(argv)
    with open(args.metrics, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if r.get("kind") != "eval"]
    evals = [r for r in records if r.get("kind") == "eval"]

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = [r["step"] for r in steps]
    for key, label in REWARD_LINES:
        if all(key in r for r in steps):
            values = [r[key] for r in steps]
            line, = left.plot(x, values, alpha=0.25)
            left.plot(x, smooth(values, args.window), color=line.get_color(),
                      label=f"{label} ({args.window}-step mean)")
    left.set(xlabel="step", ylabel="train reward", title="train reward (sampled, T=1)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)

    ex = [r["step"] for r in evals]
    for key, label in ROWS:
        if evals and key in evals[0]:
            right.plot(ex, [100 * r[key] for r in evals], marker="o", label=label)
    right.set(xlabel="step", ylabel="% of held-out items", ylim=(0, 100),
              title=f"held-out eval (greedy, {evals[0].get('p_n', 0)} P: + {evals[0].get('a_n', 0)} A:)"
              if evals else "held-out eval")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(args.png)


if __name__ == "__main__":
    main()
