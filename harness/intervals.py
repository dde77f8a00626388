"""How sure a held-out number is: 95% intervals over the evaluation's items, and a paired comparison of two runs.

A metric given per item (a list of numbers, one per held-out item) is summarised by its mean and an interval:
    a rate (every item 0 or 1)   Wilson's score interval: near 0 or 1 and on few items it stays inside [0, 1] and
                                 keeps its coverage, where mean +- 1.96 standard errors does neither
    any other mean (partial      a percentile bootstrap over the items (RESAMPLES resamples drawn with a fixed
    credit, pass@k, mean@n)      seed): no assumption about the scores' distribution, and the same interval at
                                 every run of the same scores
Two evaluations of the same items (two runs, or one run before and after) are compared item by item: the
difference of the means with a paired bootstrap interval (each resample draws the same items for both, so what
the items share, such as their difficulty, cancels). Pure numpy: no global RNG is touched, so evaluating with
intervals leaves training bit-identical.
"""
import math
import sys

import numpy as np

LEVEL = 0.95
Z = 1.959963984540054      # the standard normal's 97.5% quantile: a two-sided 95% interval
RESAMPLES = 2000           # enough that the 2.5% and 97.5% percentiles move by well under the interval's width
SEED = 0                   # fixed: the same scores give the same interval in every run and on every machine
CHUNK = 2 ** 22            # resampled scores held at once (32 MiB of float64), whatever the number of items


def overflows(values, sides: int = 1) -> bool:
    """Whether a sum of `sides` x len(values) items as large as the largest of values overflows a
    float: then a mean, a resample's mean or (sides 2) a paired difference's would be inf."""
    return sides * len(values) * max(abs(float(v)) for v in values) > sys.float_info.max


def is_rate(values) -> bool:
    """Every item scored 0 or 1 (bools included): the mean is a rate."""
    values = np.asarray(values, dtype=np.float64)
    return bool(np.all((values == 0) | (values == 1)))


def wilson(hits: int, n: int, z: float = Z) -> tuple:
    """Wilson's score interval (lo, hi) for hits successes in n trials (Wilson 1927)."""
    if n <= 0:
        raise ValueError(f"a rate needs at least one item, not n={n}")
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at 0 or n hits one end is exactly 0 or 1; rounding must not put it a hair outside [0, 1]
    return (0.0 if hits == 0 else max(0.0, centre - half)), (1.0 if hits == n else min(1.0, centre + half))


def bootstrap_means(values, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """The means of `resamples` resamples of values (items drawn with replacement), from default_rng(seed)."""
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    rng = np.random.default_rng(seed)
    rows = max(1, CHUNK // n)   # a long list of items is resampled a block of rows at a time
    means = [values[rng.integers(0, n, size=(min(rows, resamples - s), n))].mean(axis=1)
             for s in range(0, resamples, rows)]
    return np.concatenate(means)


def bootstrap(values, resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL) -> tuple:
    """The percentile bootstrap interval (lo, hi) of the mean of values."""
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(bootstrap_means(values, resamples, seed), [tail, 100 - tail])
    return float(lo), float(hi)


def mean(values) -> float:
    """The plain mean, summed in item order: a task that averaged its own items gets exactly the same float."""
    values = [float(v) for v in values]
    return sum(values) / len(values)


def summarise(values) -> dict:
    """{"value", "lo", "hi", "n", "method"} of per-item scores: Wilson for a rate, else the bootstrap."""
    n = len(values)
    if n == 0:
        raise ValueError("no items to summarise")
    value = mean(values)
    if is_rate(values):
        lo, hi = wilson(int(round(sum(float(v) for v in values))), n)
        return {"value": value, "lo": lo, "hi": hi, "n": n, "method": "wilson"}
    lo, hi = bootstrap(values)
    return {"value": value, "lo": lo, "hi": hi, "n": n, "method": "bootstrap"}


def decimals(lo: float, hi: float) -> int:
    """Decimals that show an interval of this width with two significant digits (at least 2, at most 6):
    0.10 [0.06, 0.17], but 0.004 [0.001, 0.015] and 0.0040 [0.0032, 0.0049]."""
    width = hi - lo
    if not width > 0:
        return 2
    return int(min(6, max(2, math.ceil(-math.log10(width)) + 1)))


def shown(value: float, lo: float, hi: float, n: int) -> str:
    """How the console shows a metric with its interval: 0.10 [0.06, 0.17] n=100."""
    d = decimals(lo, hi)
    return f"{value:.{d}f} [{lo:.{d}f}, {hi:.{d}f}] n={n}"


def mcnemar_p(b_only: int, a_only: int) -> float:
    """The exact two-sided McNemar test: of the items the two evaluations disagree on, how unlikely a split at least
    this uneven is when each way is equally likely (a binomial test with p = 1/2 on the discordant items)."""
    m, low = b_only + a_only, min(b_only, a_only)
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(low + 1)) / 2 ** m
    return min(1.0, 2 * tail)


def paired(a, b, resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL) -> dict:
    """B against A on the same items (a[i] and b[i] score item i): the difference of the means B - A, its paired
    percentile bootstrap interval, and a verdict, "B higher" / "A higher" / "no detectable difference".

    The verdict is the interval's: it says higher when the whole interval is on one side of 0. For a rate (every
    score 0 or 1 in both) the exact McNemar test must agree as well (p < 1 - level): on few items the percentile
    bootstrap's interval is too narrow (3 of 5 items gained and none lost gives [0.2, 1.0], while the chance of
    such a split under no difference is 1 in 4), and the exact test is not."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"a paired comparison needs the same items on both sides, not {a.shape} and {b.shape}")
    diff = mean(b) - mean(a)
    tail = (1 - level) / 2 * 100
    lo, hi = (float(x) for x in np.percentile(bootstrap_means(b - a, resamples, seed), [tail, 100 - tail]))
    out = {"a": mean(a), "b": mean(b), "diff": diff, "lo": lo, "hi": hi, "n": len(a)}
    side = "B higher" if lo > 0 else "A higher" if hi < 0 else None
    if is_rate(a) and is_rate(b):
        b_only, a_only = int(np.sum((b == 1) & (a == 0))), int(np.sum((a == 1) & (b == 0)))
        out.update(b_only=b_only, a_only=a_only, p=mcnemar_p(b_only, a_only))
        if out["p"] >= 1 - level:
            side = None
    out["verdict"] = side or "no detectable difference"
    return out


def signed(x: float, d: int) -> str:
    return f"{x:+.{d}f}"


def paired_row(a, b) -> tuple:
    """One metric's A and B [95% interval], B - A [paired 95% interval], items and verdict, as
    compare_runs.py and the run's before-and-after table show it: (the text, the verdict)."""
    sa, sb, c = summarise(a), summarise(b), paired(a, b)
    d = max(decimals(c["lo"], c["hi"]), decimals(sa["lo"], sa["hi"]), decimals(sb["lo"], sb["hi"]))
    value = lambda s: f"{s['value']:.{d}f} [{s['lo']:.{d}f}, {s['hi']:.{d}f}]"
    text = (f"{value(sa)}  {value(sb)}  {signed(c['diff'], d)} [{signed(c['lo'], d)}, "
            f"{signed(c['hi'], d)}]  n={c['n']}  {c['verdict']}")
    if "p" in c:   # a rate: the items only one side got right, and the exact test on them
        text += f" ({c['b_only']} only B, {c['a_only']} only A; McNemar p={c['p']:.2g})"
    return text, c["verdict"]


TREND_WINDOW = 20   # steps in the console's running mean of the reward


def trend(values, window: int = TREND_WINDOW) -> dict | None:
    """The mean of the last `window` values (of half of them while there are fewer than twice as
    many) and its change since as many first values, with a percentile bootstrap 95% interval
    (each end resampled apart) and a verdict, "up" / "down" when the interval leaves 0; None below
    4 values. Steps are not independent draws (the policy moves): a guide, not a test."""
    n = len(values)
    if n < 4:
        return None
    w = min(window, n // 2)
    first, last = values[:w], values[-w:]
    diffs = bootstrap_means(last, seed=SEED) - bootstrap_means(first, seed=SEED + 1)
    tail = (1 - LEVEL) / 2 * 100
    lo, hi = (float(x) for x in np.percentile(diffs, [tail, 100 - tail]))
    return {"mean": mean(last), "window": w, "diff": mean(last) - mean(first), "lo": lo, "hi": hi,
            "verdict": "up" if lo > 0 else "down" if hi < 0 else ""}
