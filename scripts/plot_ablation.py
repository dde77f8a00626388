"""Plot an ablation: each held-out metric over the steps, one line per setting (the mean of its seeds, a band
from the lowest to the highest seed), one panel per metric.

    python scripts/plot_ablation.py docs/ablation.png "GRPO + text=out/a-s0/metrics.jsonl,out/a-s1/metrics.jsonl" \
        "GRPO alone=out/b-s0/metrics.jsonl,out/b-s1/metrics.jsonl" "text alone=out/c-s0/metrics.jsonl,..."

A run that scores a whole held-out set at its ends and a part of it between (the chess task's first 200 items per
kind) draws its evaluations on different items; --first 200 draws every evaluation on the same items: each metric's
first 200 per-item scores, from the metrics.items.jsonl beside each metrics.jsonl.
"""
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")   # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402

from plot_run import Parser, UsageError, check_png, eval_metrics, read_records, save  # noqa: E402


def evals(path: str) -> dict:
    """step -> eval record of one run's metrics.jsonl."""
    return {r["step"]: r for r in read_records(path) if r.get("kind") == "eval"}


def first_items(path: str, n: int, error) -> dict:
    """step -> {metric: the mean of its first n per-item scores}, from the items file beside metrics.jsonl PATH;
    error(message) for a run without one or an evaluation with fewer than n items."""
    items = os.path.splitext(path)[0] + ".items.jsonl"
    if not os.path.isfile(items):
        error(f"--first {n}: {items} is missing (the trainer writes it when the task's evaluate() scores each item)")
    found = {}
    with open(items, encoding="utf-8") as f:
        for record in map(json.loads, filter(str.strip, f)):
            short = {k: len(v) for k, v in record["items"].items() if len(v) < n}
            if short:
                error(f"--first {n}: {items} step {record['step']} has fewer items: {short}")
            found[record["step"]] = {k: sum(v[:n]) / n for k, v in record["items"].items()}
    return found


def load(path: str, first: int, error) -> dict:
    """step -> eval record; with first, each per-item metric's value is the mean of its first items."""
    records = evals(path)
    if first:
        found = first_items(path, first, error)
        if set(found) != set(records):   # one drawn on other items would bring back the jump --first removes
            error(f"--first {first}: evaluations at steps {sorted(records)} in {path}, per-item scores at steps "
                  f"{sorted(found)}")
        for step, means in found.items():
            records[step].update(means)
    return records


def main(argv=None) -> int:
    try:
        plot(argv)
    except UsageError as e:   # plot_run.py's checks: one line, exit 2
        print(f"plot_ablation.py: error: {e}", file=sys.stderr)
        return 2
    return 0


def plot(argv) -> None:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("png")
    parser.add_argument("settings", nargs="+", help='"LABEL=run-s0/metrics.jsonl,run-s1/metrics.jsonl", one per line')
    parser.add_argument("--title", default="the chess demo: held-out metrics (greedy), mean of the seeds and their range")
    parser.add_argument("--first", type=int, default=0, metavar="N",
                        help="draw every evaluation on each metric's first N items (from metrics.items.jsonl)")
    args = parser.parse_args(argv)
    if args.first < 0:
        parser.error(f"--first must be >= 0, got {args.first}")
    settings = []
    for item in args.settings:
        label, _, paths = item.partition("=")
        if not paths:
            parser.error(f"{item!r} is not LABEL=PATH[,PATH...]")
        settings.append((label, [load(p, args.first, parser.error) for p in paths.split(",")]))
    check_png(args.png, [p for item in args.settings for p in item.partition("=")[2].split(",")])
    first = next(iter(settings[0][1][0].values()))
    metrics = eval_metrics([first], rates_only=True)
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
    sys.exit(main())
