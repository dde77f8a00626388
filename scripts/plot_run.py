"""Plot a run's metrics.jsonl: train reward per step (left) and held-out eval metrics (right).

    python scripts/plot_run.py out/default-run/metrics.jsonl docs/default_run.png
    python scripts/plot_run.py out/run-s0/metrics.jsonl out/run-s1/metrics.jsonl docs/two_seeds.png

Step records give the mean reward (and its P:/A: parts where logged); records with
"kind": "eval" (from --eval-interval) give the task's held-out metrics, every one, drawn as points
with lines and, for a metric given per item, its 95% interval. The title says what ran (--task and
--model, from the settings.txt beside a metrics file) unless --title names it.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")   # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import places  # noqa: E402

REWARD_LINES = [("reward_mean", "reward (all)"), ("reward_policy_legal", "P: share of legal B: moves"),
                ("reward_policy_best", "P: best-move credit"), ("reward_env_format", "A: format credit")]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean: single steps of 8 prompts are noisy, the trend is what the plot is for."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def eval_metrics(evals: list[dict], rates_only: bool = False) -> list[str]:
    """The eval records' metrics: every number but the record's own (step, timings) and a metric's
    interval and count (NAME_lo, NAME_hi, NAME_n); rates_only: the float ones in [0, 1]."""
    first = evals[0] if evals else {}
    return [k for k, v in first.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k != "step" and not k.endswith("_time_s")
            and not (k.endswith(("_lo", "_hi", "_n")) and k.rsplit("_", 1)[0] in first)
            and (not rates_only or isinstance(v, float) and 0 <= v <= 1)]


def what_ran(path: str) -> str:
    """--task and --model of the run that wrote a metrics file, from the settings.txt beside it (the
    trainer writes one), else the run's folder name."""
    settings = os.path.join(os.path.dirname(os.path.abspath(path)), "settings.txt")
    if os.path.isfile(settings):
        with open(settings, encoding="utf-8") as f:
            found = [" ".join(line.split()[:2]) for line in f
                     if line.startswith(("  --task ", "  --model "))]
        if found:
            return ", ".join(sorted(found, reverse=True))   # --task first
    return os.path.basename(os.path.dirname(os.path.abspath(path)))


class UsageError(Exception):
    """A bad input or output: one line, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, without argparse's usage block
        raise UsageError(message)


def read_records(path: str) -> list:
    """The records of a metrics file; a missing file, a folder or a line that is no record (a torn
    last line, what a run being written leaves, is skipped) is a UsageError naming it."""
    if os.path.isdir(path):
        inside = os.path.join(path, "metrics.jsonl")
        raise UsageError(f"{path} is a folder: pass the run's metrics file" +
                         (f", {inside}" if os.path.isfile(inside) else " in it"))
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or number == len(lines) and not line.endswith("\n"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UsageError(f"{path} line {number} is not a record of a run (a JSON object with "
                             f"its step): {line.strip()[:40]!r}")
        records.append(record)
    return records


def check_png(png: str, inputs: list) -> None:
    """The figure's path: a format matplotlib writes, not on (or around) an input, not a folder."""
    fmt = os.path.splitext(png)[1].lstrip(".").lower()
    if fmt not in plt.figure().canvas.get_supported_filetypes():
        raise UsageError(f"PNG {png}: a figure is written as .png (or .pdf, .svg, ...), not "
                         f"{('.' + fmt) if fmt else 'a name without one'}")
    if os.path.isdir(png):
        raise UsageError(f"PNG {png} is a folder: pass the path of the figure to write")
    clash = places.clash([("METRICS", path, "reads") for path in inputs], [("PNG", png)])
    if clash:
        raise UsageError(clash)


def main(argv=None) -> int:
    try:
        plot(argv)
    except UsageError as e:
        print(f"plot_run.py: error: {e}", file=sys.stderr)
        return 2
    return 0


def plot(argv) -> None:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", nargs="+", metavar="METRICS",
                        help="metrics.jsonl of one run, or of several (seeds) to compare")
    parser.add_argument("png", metavar="PNG", help="the figure to write (.png, .pdf, .svg, ...)")
    parser.add_argument("--title", help="the figure's title (default: GRPO, and what ran: --task "
                                        "and --model)")
    parser.add_argument("--window", type=int, default=10, help="steps in the reward's trailing mean")
    args = parser.parse_args(argv)
    runs = [read_records(path) for path in args.metrics]
    check_png(args.png, args.metrics)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["-", "--", ":", "-."]
    for run, records in enumerate(runs):
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
            values = [r[key] for r in evals]
            spread = [[v - r.get(f"{key}_lo", v) for v, r in zip(values, evals)],
                      [r.get(f"{key}_hi", v) - v for v, r in zip(values, evals)]]
            right.errorbar(ex, values, yerr=spread if f"{key}_lo" in evals[0] else None, marker="o",
                           markersize=3, capsize=3, color=f"C{colour}", linestyle=style,
                           label=(key + (" (95% interval)" if f"{key}_lo" in evals[0] else ""))
                           if run == 0 else None)
    runs = ", ".join(f"{s} {os.path.basename(os.path.dirname(os.path.abspath(p)))}"
                     for s, p in zip(styles, args.metrics)) if len(args.metrics) > 1 else ""
    left.set(xlabel="step", ylabel="train reward",
             title="train reward (sampled, T=1)" + (f"\nline styles: {runs}" if runs else ""))
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    right.set(xlabel="step", ylabel="held-out metric (the task's evaluate())",
              title="held-out eval" + (f"\nline styles: {runs}" if runs else ""))
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    title = args.title or "GRPO, " + " / ".join(dict.fromkeys(map(what_ran, args.metrics)))
    save(fig, title, args.png)


def save(fig, title: str, png: str, dpi: int = 110) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=dpi)
    print(png)


if __name__ == "__main__":
    sys.exit(main())
