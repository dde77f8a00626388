"""Plot an ablation: each held-out metric over the steps, one line per setting (the mean of its seeds, a band
from the lowest to the highest seed), one panel per metric.

    python scripts/plot_ablation.py docs/ablation.png "GRPO + text=out/a-s0/metrics.jsonl,out/a-s1/metrics.jsonl" \
        "GRPO alone=out/b-s0/metrics.jsonl,out/b-s1/metrics.jsonl" "text alone=out/c-s0/metrics.jsonl,..."
"""
import argparse
import json
import math

import matplotlib

matplotlib.use("Agg")   # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402

from plot_run import eval_metrics, save  # noqa: E402


def evals(path: str) -> dict:
    """step -> eval record of one run's metrics.jsonl."""
    with open(path, encoding="utf-8") as f:
        return {r["step"]: r for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "eval"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("png")
    parser.add_argument("settings", nargs="+", help='"LABEL=run-s0/metrics.jsonl,run-s1/metrics.jsonl", one per line')
    parser.add_argument("--title", default="the chess demo: held-out metrics (greedy), mean of the seeds and their range")
    args = parser.parse_args(argv)
    settings = []
    for item in args.settings:
        label, _, paths = item.partition("=")
        if not paths:
            parser.error(f"{item!r} is not LABEL=PATH[,PATH...]")
        settings.append((label, [evals(p) for p in paths.split(",")]))
    first = next(iter(settings[0][1][0].values()))
    metrics = eval_metrics([first])
    cols = 3
    fig, axes = plt.subplots(math.ceil(len(metrics) / cols), cols, figsize=(4.2 * cols, 3.2 * math.ceil(len(metrics) / cols)),
                             squeeze=False)
    for ax, key in zip(axes.flat, metrics):
        for colour, (label, runs) in enumerate(settings):
            steps = sorted(set.intersection(*(set(r) for r in runs)))
            values = [[100 * r[s][key] for r in runs] for s in steps]
            ax.plot(steps, [sum(v) / len(v) for v in values], marker="o", markersize=3, color=f"C{colour}", label=label)
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=f"C{colour}", alpha=0.2)
        ax.set(title=key, xlabel="step", ylabel="%")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    save(fig, args.title, args.png, dpi=100)


if __name__ == "__main__":
    main()
