"""Plot a run's metrics.jsonl: train reward, held-out rates and the other held-out numbers.

    python scripts/plot_run.py out/default-run/metrics.jsonl docs/default_run.png
    python scripts/plot_run.py out/run-s0/metrics.jsonl out/run-s1/metrics.jsonl docs/two_seeds.png

What is drawn where (one colour per quantity; one line style per run, for seeds to compare):
  train reward     each step record's mean reward (and its P:/A: parts where logged) faint, and
                   its trailing mean over --window steps solid (several runs: the means alone)
  held-out rates   the metrics of the records with "kind": "eval" (from --eval-interval) whose
                   every value lies in [0, 1], on an axis within [0, 1] (the tenths that hold
                   them): a point per evaluation and, for a metric given per item, its 95%
                   interval (NAME_lo to NAME_hi) as an error bar and its item count (NAME_n) in
                   its label; each metric has its own marker and is set a little after the one
                   before it along the step axis (the first at its steps), so that metrics of
                   equal value (all at 0) stay visible
  other held-out   the eval records' other numbers (a margin, a score beyond 1), on an axis of
                   their own, drawn alike; this panel only when there are some
  left out         counts (NAME_n, and any *_n or n, such as the chess task's p_n: items, not
                   scores), the records' own step and timings (*_time_s)
A triangle (up / down) marks an evaluation whose 95% interval lies wholly above / below that of the
run's first evaluation (the step-0 one, before training): a change the intervals detect. Two
intervals apart is a stricter test than compare_runs.py's paired one on the same items, which says
more. The title says what ran (--task and --model, from the settings.txt beside a metrics file)
unless --title names it.

Exit codes: 0 drawn; 2 bad input, one line naming it: a missing, empty or damaged metrics file or
one without step records, a --window below 1, a figure format matplotlib does not write, or a
figure on an input or inside a run's model or checkpoints folder (the trainer replaces them).
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")   # files only: no display on a server
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import intervals, places  # noqa: E402

REWARD_LINES = [("reward_mean", "reward (all)"),
                ("reward_policy_legal", "P: share of legal B: moves"),
                ("reward_policy_best", "P: best-move credit"),
                ("reward_env_format", "A: format credit")]
STYLES = ["-", "--", ":", "-."]
LEVEL = f"{intervals.LEVEL:.0%}"   # the trainer's intervals (harness/intervals.py): their level
UP, DOWN = "^", "v"                # the change markers: above / below the first evaluation
MARKERS = ["o", "s", "D", "P", "X", "*", "h", "p"]   # one a metric: equal values stay told apart
CHANGED = "changed"                # the gid of a change marker, for whoever inspects the figure


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean: single steps of a few prompts are noisy, the trend is what the plot is for."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out


def is_number(v) -> bool:
    """A finite int or float: not a bool, a NaN or an int beyond a float (a hand-edited log's)."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:
        return False


def is_count(key: str) -> bool:
    """An item count (NAME_n beside a per-item metric, the chess task's p_n and a_n, a task's n):
    it says how many items were scored, not how well."""
    return key == "n" or key.endswith("_n")


def eval_metrics(evals: list[dict], rates_only: bool = False) -> list[str]:
    """The eval records' metrics in the order they first appear: every number but a count, the
    record's own step and timings and a metric's interval (NAME_lo, NAME_hi); rates_only: those
    whose every value lies in [0, 1]."""
    keys = list(dict.fromkeys(k for r in evals for k, v in r.items() if is_number(v)))
    metrics = [k for k in keys if k != "step" and not k.endswith("_time_s") and not is_count(k)
               and not (k.endswith(("_lo", "_hi")) and k[:-3] in keys)]
    if rates_only:
        metrics = [k for k in metrics if all(0 <= r[k] <= 1 for r in evals if is_number(r.get(k)))]
    return metrics


def changes(evals: list[dict], key: str) -> list[tuple]:
    """(step, value, UP or DOWN) of each evaluation whose interval of `key` lies wholly above or
    below the first evaluation's: the change the intervals detect (none without intervals)."""
    def bounds(r):
        lo, hi = r.get(f"{key}_lo"), r.get(f"{key}_hi")
        return (lo, hi) if is_number(lo) and is_number(hi) and is_number(r.get(key)) else None
    first = bounds(evals[0]) if evals else None
    if first is None:
        return []
    found = []
    for r in evals[1:]:
        b = bounds(r)
        if b and (b[0] > first[1] or b[1] < first[0]):
            found.append((r["step"], r[key], UP if b[0] > first[1] else DOWN))
    return found


def rate_limits(evals_of_runs: list, keys: list) -> tuple:
    """The rate axis's y-limits: 0 to 1, or the tenths that hold every value and interval when
    those lie in a small part of it (rates near 0 are not flattened onto the axis)."""
    seen = [r[k + s] for evals in evals_of_runs for r in evals for k in keys
            for s in ("", "_lo", "_hi") if is_number(r.get(k + s))]
    lo, hi = math.floor(min(seen, default=0) * 10) / 10, math.ceil(max(seen, default=1) * 10) / 10
    if hi - lo < 0.2:   # at least two tenths: a flat metric is not drawn as a wild one
        lo, hi = max(0.0, min(lo, hi - 0.2)), min(1.0, max(hi, lo + 0.2))
    return max(0.0, lo), min(1.0, hi)


def dodge(evals_of_runs: list, count: int) -> list:
    """Each of count metrics' offset along the step axis: a small share of the evaluations' spacing,
    so that metrics of the same value (rates that all stay at 0) stay apart, each visible. The first
    metric at its steps, the others after them: none before the step it was taken at (step 0's
    at no negative step)."""
    steps = sorted({r["step"] for evals in evals_of_runs for r in evals})
    spacing = min((b - a for a, b in zip(steps, steps[1:])), default=1)
    share = min(0.05, 0.4 / count)   # all of them within less than half the spacing
    return [i * share * spacing for i in range(count)]


def draw_metrics(ax, runs: list, keys: list) -> None:
    """Each metric of `keys` over the evaluations of each run: a point per evaluation with its
    interval as an error bar, its changes against the run's first evaluation as triangles."""
    offsets = dodge(runs, len(keys))
    for run, evals in enumerate(runs):
        style = STYLES[run % len(STYLES)]
        for i, key in enumerate(keys):
            colour, marker = f"C{i % 10}", MARKERS[i % len(MARKERS)]
            have = [r for r in evals if is_number(r.get(key))]
            if not have:
                continue
            x, y = [r["step"] + offsets[i] for r in have], [r[key] for r in have]
            banded = all(is_number(r.get(f"{key}_lo")) and is_number(r.get(f"{key}_hi"))
                         for r in have)
            # error bars, not bands: the metrics' bands overlap into one grey field
            spread = [[v - r[f"{key}_lo"] for v, r in zip(y, have)],
                      [r[f"{key}_hi"] - v for v, r in zip(y, have)]] if banded else None
            counts = sorted({r[f"{key}_n"] for r in have if is_number(r.get(f"{key}_n"))})
            said = ([f"{LEVEL} interval"] if banded else []) + (
                [f"n={'/'.join(map(str, counts))}"] if counts else [])
            label = key + (f" ({', '.join(said)})" if said else "") if run == 0 else None
            bars = ax.errorbar(x, y, yerr=spread, marker=marker, markersize=4, capsize=3,
                               color=colour, linestyle=style, linewidth=1.2, elinewidth=0.9,
                               label=label, gid=key)
            for artist in bars.get_children():   # a point on 0 or 1, the axis' edge, stays whole
                artist.set_clip_on(False)
            for step, value, mark in changes(have, key):
                ax.plot([step + offsets[i]], [value], marker=mark, markersize=10, color=colour,
                        markeredgecolor="black", linestyle="none", gid=CHANGED, clip_on=False)


def change_legend(ax, first_step: str, banded: bool) -> None:
    """The panel's legend: its metrics, then what the change markers mean where a metric has
    intervals to compare."""
    handles, labels = ax.get_legend_handles_labels()
    for mark, side in ((UP, "above"), (DOWN, "below")) if banded else ():
        handles.append(Line2D([], [], marker=mark, color="grey", markeredgecolor="black",
                              linestyle="none"))
        labels.append(f"{LEVEL} interval wholly {side} the first evaluation's ({first_step})")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.13),
              borderaxespad=0)


def build_figure(runs: list, paths: list, window: int, title: str) -> Figure:
    """The figure of runs (each a metrics file's records, read from paths): the reward's panel,
    then the held-out rates' and the other held-out numbers' where there are some (the module's
    docstring says what is drawn where)."""
    steps_of = [[r for r in records if r.get("kind") != "eval"] for records in runs]
    evals_of = [sorted((r for r in records if r.get("kind") == "eval"), key=lambda r: r["step"])
                for records in runs]
    every = [r for evals in evals_of for r in evals]
    metrics = eval_metrics(every)
    rates = eval_metrics(every, rates_only=True)
    others = [k for k in metrics if k not in rates]
    panels = 1 + bool(rates) + bool(others)
    fig = Figure(figsize=(6 * panels, 6.5))
    axes = list(fig.subplots(1, panels, squeeze=False)[0])
    names = ", ".join(f"{style} {os.path.basename(os.path.dirname(os.path.abspath(p)))}"
                      for style, p in zip(STYLES, paths)) if len(paths) > 1 else ""
    styles_said = f"\nline styles: {names}" if names else ""

    reward = axes.pop(0)
    for run, steps in enumerate(steps_of):
        x = [r["step"] for r in steps]
        for colour, (key, label) in enumerate(REWARD_LINES):
            if not all(is_number(r.get(key)) for r in steps):
                continue
            values = [r[key] for r in steps]
            if len(runs) == 1:   # the raw steps of several runs would hide their means
                reward.plot(x, values, alpha=0.35, linewidth=0.8, color=f"C{colour}",
                            label=f"{label}, per step" if colour == 0 else None)
            reward.plot(x, smooth(values, window), color=f"C{colour}",
                        linestyle=STYLES[run % len(STYLES)], gid=f"mean {key}",
                        label=f"{label}, trailing {window}-step mean" if run == 0 else None)
    reward.set(xlabel="step", ylabel="train reward", title="train reward (sampled)" + styles_said)
    reward.grid(alpha=0.3)
    reward.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.13), borderaxespad=0)

    first = sorted({evals[0]["step"] for evals in evals_of if evals})
    first_step = f"step {'/'.join(map(str, first))}"
    for keys, ylabel, heading in ((rates, "rate", "held-out rates"),
                                  (others, "value", "other held-out numbers")):
        if not keys:
            continue
        ax = axes.pop(0)
        draw_metrics(ax, evals_of, keys)
        if keys is rates:
            ax.set_ylim(*rate_limits(evals_of, rates))
        ax.set(xlabel="step", ylabel=f"{ylabel} (the task's evaluate())")
        ax.set_title(heading + styles_said, pad=10)   # clear of a triangle on the axis' top
        ax.grid(alpha=0.3)
        banded = any(f"{k}_lo" in r for evals in evals_of for r in evals for k in keys)
        change_legend(ax, first_step, banded)
    evaluated = sorted({r["step"] for r in every})
    for ax in fig.axes:   # steps: no step 2.5; a held-out panel's at its evaluations where few
        if ax is reward or len(evaluated) > 12:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            ax.set_xticks(evaluated)
    fig.suptitle(title)
    return fig


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
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UsageError(f"{path} line {number} is not a record of a run (a JSON object with "
                             f"its step): {line.strip()[:40]!r}")
        records.append(record)
    return records


def check_png(png: str, inputs: list) -> None:
    """The figure's path: a format matplotlib writes, not on (or around) an input, not inside a
    run's model or checkpoints folder (harness/places.py), not a folder."""
    wrong = places.figure_error("PNG", png)
    if wrong:
        raise UsageError(wrong)
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
    parser.add_argument("--window", type=int, default=10,
                        help="steps in the reward's trailing mean (at least 1)")
    args = parser.parse_args(argv)
    if args.window < 1:
        raise UsageError(f"--window {args.window}: the trailing mean needs at least 1 step")
    check_png(args.png, args.metrics)
    runs = [read_records(path) for path in args.metrics]
    for path, records in zip(args.metrics, runs):
        steps = [r for r in records if r.get("kind") != "eval"]
        if not steps:   # a blank reward panel says nothing
            what = "only eval records" if records else "it is empty"
            raise UsageError(f"{path} holds no step record ({what}): nothing to plot")
        if not any(all(is_number(r.get(key)) for r in steps) for key, _ in REWARD_LINES):
            wrong = sum(not is_number(r.get("reward_mean")) for r in steps)
            raise UsageError(f"{path} holds no reward to plot: {wrong} of its {len(steps)} step "
                             f"records have no finite reward_mean")
    title = args.title or "GRPO, " + " / ".join(dict.fromkeys(map(what_ran, args.metrics)))
    save(build_figure(runs, args.metrics, args.window, title), title, args.png)


def save(fig, title: str, png: str, dpi: int = 110) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    # tight: the legends below the panels are inside the written figure
    fig.savefig(png, dpi=dpi, bbox_inches="tight")
    print(png)


if __name__ == "__main__":
    sys.exit(main())
