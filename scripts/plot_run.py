"""Plot a run's metrics.jsonl: train reward per step (left) and held-out eval metrics (right).

    python scripts/plot_run.py out/default-run/metrics.jsonl docs/default_run.png
    python scripts/plot_run.py out/run-s0/metrics.jsonl out/run-s1/metrics.jsonl docs/two_seeds.png

Step records give the mean reward (and its P:/A: components where logged); records with
"kind": "eval" (from --eval-interval) give the task's held-out metrics (every fractional one), drawn as
points with lines.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")   # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402

REWARD_LINES = [("reward_mean", "reward (all)"), ("reward_policy_legal", "P: share of legal B: moves"),
                ("reward_policy_best", "P: best-move credit"), ("reward_env_format", "A: format credit")]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean: single steps of 8 prompts are noisy, the trend is what the plot is for."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def eval_metrics(evals: list[dict]) -> list[str]:
    """The eval records' rates: float values in [0, 1] (counts, timings and a metric's interval NAME_lo / NAME_hi
    are not drawn as metrics of their own)."""
    first = evals[0] if evals else {}
    return [k for k, v in first.items() if isinstance(v, float) and 0 <= v <= 1 and not k.endswith("_time_s")
            and not (k.endswith(("_lo", "_hi")) and k[:-3] in first)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl of one run, or of several (seeds) to compare")
    parser.add_argument("png")
    parser.add_argument("--title", default="GRPO on the default model (python train_lean.py --batch-size 64)")
    parser.add_argument("--window", type=int, default=10, help="steps in the reward's trailing mean")
    args = parser.parse_args(argv)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["-", "--", ":", "-."]
    for run, path in enumerate(args.metrics):
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        steps = [r for r in records if r.get("kind") != "eval"]
        evals = [r for r in records if r.get("kind") == "eval"]
        # one colour per quantity, one line style per run: the runs' spread is the noise
        style = styles[run % len(styles)]
        x = [r["step"] for r in steps]
        for colour, (key, label) in enumerate(REWARD_LINES):
            if steps and all(key in r for r in steps):
                values = [r[key] for r in steps]
                if len(args.metrics) == 1:
                    left.plot(x, values, alpha=0.25, color=f"C{colour}")
                left.plot(x, smooth(values, args.window), color=f"C{colour}", linestyle=style,
                          label=f"{label} ({args.window}-step mean)" if run == 0 else None)
        ex = [r["step"] for r in evals]
        for colour, key in enumerate(eval_metrics(evals)):
            right.plot(ex, [r[key] for r in evals], marker="o", markersize=3, color=f"C{colour}",
                       linestyle=style, label=key if run == 0 else None)
    runs = ", ".join(f"{s} {os.path.basename(os.path.dirname(os.path.abspath(p)))}"
                     for s, p in zip(styles, args.metrics)) if len(args.metrics) > 1 else ""
    left.set(xlabel="step", ylabel="train reward",
             title="train reward (sampled, T=1)" + (f"\nline styles: {runs}" if runs else ""))
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.set(xlabel="step", ylabel="share of held-out items", ylim=(0, 1),
              title="held-out eval (greedy)" + (f"\nline styles: {runs}" if runs else ""))
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    save(fig, args.title, args.png)


def save(fig, title: str, png: str, dpi: int = 110) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=dpi)
    print(png)


if __name__ == "__main__":
    main()
