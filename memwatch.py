"""Memory trends in a training log: does the run leak, and what is the biggest batch that fits?

Pure functions over numbers (numpy only), so that they can be tested on synthetic series. The
command line that starts the trainer, follows its log and draws the plots is monitor_memory.py.

Leak test. Drop a warm-up (the first records of the process, while caches and allocator pools
fill), then fit a Theil-Sen line (the median of all pairwise slopes) of each memory series
against the step. Theil-Sen rather than least squares because memory series are not Gaussian:
a single spike, or the sawtooth of a cache that fills and empties, would tilt a least-squares
line but moves the median of the pairwise slopes very little. A series is a LEAK when the whole
95% confidence interval of its slope lies above the threshold (the growth is both big enough to
matter and too steady to be noise) and the second half of the window alone still climbs faster
than the threshold (it has not levelled off).

Where it grows. A record also holds the memory at the end of each phase of its step (harness/memory.py:
start, gen, score, ref, train). The difference between consecutive readings is what that phase added
in that step (the step's start minus the previous step's end: what happened between steps, the log,
evaluation and checkpoints). A leak that one phase makes shows in that phase's increments alone; the
readings themselves all climb, since what a phase keeps stays for the phases after it. So each phase's
running sum of increments is fitted with the same Theil-Sen rule as a series: its slope is the MB/step
the phase adds, and the phases' slopes add up to about the step series' slope. A running sum of noise
is a random walk, for which the interval is too narrow, so a phase is named only when a step series is
itself a LEAK (the verdict never rests on the phases). The readings are taken after malloc_trim
(harness/memory.py), which keeps the increments' noise to about a page or two. The peak within each
phase (CUDA) is a level, fitted as a series.
"""
import math
import re

import numpy as np

# Judged series: the process RSS, and per CUDA device the memory allocated / reserved at the
# end of the step and the peak within the step (keys cuda_allocated_mb, cuda1_reserved_mb, ...).
# rss_peak_mb (the process's peak RSS so far) is not judged: it is a running maximum, so a single
# early spike stays in it for ever and its trend says nothing that rss_mb does not.
RSS = "rss_mb"
CUDA_KEY = re.compile(r"^(cuda\w*?)_(allocated|reserved|peak)_mb$")
# A phase's reading: {phase}_{family}_mb, the phases in the order the record lists them (the order they
# ran). The increments of rss and cuda_allocated are judged; cuda_peak (the peak within a phase) is a level.
PHASE_KEY = re.compile(r"^([a-z]+)_(rss|cuda_allocated|cuda_peak)_mb$")
INCREMENTS = ("rss", "cuda_allocated")
BETWEEN = "between"
PHASE_NAMES = {"gen": "gen (prompts, rollout)", "score": "score (rewards)", "ref": "ref (reference)",
               "train": "train (update)", BETWEEN: "between steps (log, eval)"}

# Defaults for the thresholds (all overridable from the command line).
#
# LEAK_MB_PER_STEP = 0.25: a leak of about 1 MB/step over 200 steps must always trip and a clean run
# never. A 1 MB/step leak fitted over 180 post-warm-up steps has a
# confidence interval of a few hundredths of a MB/step around 1.0, far above 0.25. A clean run's
# slope is zero within noise, and for noise to put the *lower* end of the interval above 0.25 it would have to
# fake a steady 0.25 MB/step climb over the whole window. 0.25 MB/step is still 2.5 GB per
# 10,000 steps, so anything below it is small enough to leave to the projected-growth column.
LEAK_MB_PER_STEP = 0.25
# WARMUP = 20 records: in the tiny-model runs RSS settles within the first handful of steps
# (first generate, first optimizer step allocating AdamW state); 20 leaves a margin and still
# leaves 180 of a 200-step run to judge.
WARMUP = 20
# FRAG_RATIO = 1.5: PyTorch's caching allocator rounds blocks up, so reserved runs 5-30% above
# the step's peak even in a healthy run; half again as much as the peak is cached but never used.
FRAG_RATIO = 1.5
# The gap must also be big enough to matter: a 40 MB pool over a 20 MB peak is not worth a word.
FRAG_MIN_GAP_MB = 256.0
# CHURN_SPREAD = 0.5: (90th - 10th percentile) / median of the per-step peak. Sequence lengths in
# GRPO vary from step to step, which moves the peak by some tens of percent; a peak that swings
# by half its typical value or more means the allocator keeps meeting new shapes.
CHURN_SPREAD = 0.5

# With fewer points after the warm-up than this, no verdict: the normal approximation behind the
# slope's confidence interval needs about ten points.
MIN_POINTS = 10
# Theil-Sen looks at all n(n-1)/2 pairs; a long log is thinned to this many evenly spaced points
# (500k pairs) so a 100k-step log is analysed in well under a second. Thinning only widens the
# confidence interval, so it can hide a marginal leak but never invent one.
MAX_FIT_POINTS = 1000
Z95 = 1.959963984540054  # two-sided 95% normal quantile
PROJECT_STEPS = 10_000  # growth is reported as "MB over this many more steps"


def train_records(records):
    """The training records of the last process that wrote the log, and how many earlier runs.

    Eval records ("kind" other than "train") and records without a step are dropped. A step that
    does not increase means a new process started writing (a resumed run appends to the same
    log); its memory starts from scratch, so only the last run is analysed.
    """
    runs, last_step = [[]], None
    for r in records:
        if r.get("kind", "train") != "train" or not isinstance(r.get("step"), (int, float)):
            continue
        if last_step is not None and r["step"] <= last_step:
            runs.append([])
        runs[-1].append(r)
        last_step = r["step"]
    return runs[-1], len(runs) - 1


def series_names(records):
    """Names of the judged memory series present in the records, RSS first then CUDA keys sorted."""
    keys = set()
    for r in records:
        keys.update(k for k, v in r.items() if isinstance(v, (int, float)))
    cuda = sorted(k for k in keys if CUDA_KEY.match(k))
    return ([RSS] if RSS in keys else []) + cuda


def series(records, name):
    """(steps, values) float arrays of one series, skipping records that lack it."""
    pts = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
    arr = np.asarray(pts, dtype=float).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def theil_sen(x, y):
    """Theil-Sen line through (x, y): (slope, intercept, slope_low, slope_high), 95% interval.

    The slope is the median of the slopes between all pairs of points with different x; the
    intercept the median of y - slope*x. The interval is Sen's (1968): ranks of the sorted
    pairwise slopes taken from the variance of Kendall's S, n(n-1)(2n+5)/18 (ties ignored,
    which only widens it).
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) > MAX_FIT_POINTS:
        keep = np.unique(np.linspace(0, len(x) - 1, MAX_FIT_POINTS).round().astype(int))
        x, y = x[keep], y[keep]
    n = len(x)
    i, j = np.triu_indices(n, k=1)
    dx = x[j] - x[i]
    ok = dx != 0
    slopes = np.sort((y[j] - y[i])[ok] / dx[ok])
    if len(slopes) == 0:
        raise ValueError("theil_sen needs at least two points with different x")
    slope = float(np.median(slopes))
    intercept = float(np.median(y - slope * x))
    m = len(slopes)
    c = Z95 * math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    lo_rank = max(int(math.floor((m - c) / 2.0)) - 1, 0)   # Sen's M1-th slope, 1-based
    hi_rank = min(int(math.ceil((m + c) / 2.0)), m - 1)     # Sen's (M2+1)-th slope, 1-based
    return slope, intercept, float(slopes[lo_rank]), float(slopes[hi_rank])


def judge_series(steps, values, warmup=WARMUP, leak_mb_per_step=LEAK_MB_PER_STEP):
    """Fit one series after its warm-up and give a verdict: "ok", "LEAK" or "too few points".

    warmup counts records, not step numbers: it is the start of *this process* that fills caches,
    whatever step a resumed run starts from.
    """
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    finite = np.isfinite(values)   # a verdict never rests on a NaN or inf reading's slopes
    steps, values = steps[finite], values[finite]
    s, v = steps[warmup:], values[warmup:]
    out = {"points": int(len(s)), "warmup": int(min(warmup, len(steps)))}
    if len(steps):
        out.update(first_mb=float(values[0]), last_mb=float(values[-1]), max_mb=float(values.max()))
    if len(s) < MIN_POINTS or len(np.unique(s)) < 2:
        out["verdict"] = "too few points"
        return out
    slope, intercept, lo, hi = theil_sen(s, v)
    # The slope of the window's second half: a leak is still growing at the end. Without this a
    # one-off step up early in the window (a new, larger pool block that is then reused for ever)
    # reads as a steady trend of jump/window MB/step.
    recent = theil_sen(s[len(s) // 2:], v[len(s) // 2:])[0]
    out.update(from_step=float(s[0]), to_step=float(s[-1]), slope_mb_per_step=slope,
               slope_low=lo, slope_high=hi, intercept_mb=intercept, recent_slope_mb_per_step=recent,
               growth_mb_per_10k_steps=slope * PROJECT_STEPS,
               verdict="LEAK" if lo > leak_mb_per_step and recent > leak_mb_per_step else "ok")
    return out


def phase_marks(records):
    """family -> the phases whose readings the records hold, in the order they ran (the record's order)."""
    marks = {}
    for r in records:
        for k, v in r.items():
            m = PHASE_KEY.match(k)
            if m and isinstance(v, (int, float)) and m.group(1) not in marks.setdefault(m.group(2), []):
                marks[m.group(2)].append(m.group(1))
    return marks


def phase_increments(records, family, phases):
    """phase -> (steps, MB) the phase added in each step: its reading minus the one before it. The first
    reading is the step's start; the start minus the previous record's last reading is BETWEEN."""
    out = {p: [] for p in phases[1:] + [BETWEEN]}
    prev = None
    for r in records:
        v = [r.get(f"{p}_{family}_mb") for p in phases]
        if not all(isinstance(x, (int, float)) for x in v):
            prev = None
            continue
        for p, a, b in zip(phases[1:], v, v[1:]):
            out[p].append((r["step"], round(b - a, 4)))   # readings are to 0.1 MB: no float dust
        if prev is not None:
            out[BETWEEN].append((r["step"], round(v[0] - prev, 4)))
        prev = v[-1]
    return {p: tuple(np.asarray(pts, dtype=float).reshape(-1, 2).T) for p, pts in out.items()}


def judge_phases(records, warmup=WARMUP, leak_mb_per_step=LEAK_MB_PER_STEP):
    """family -> phase -> judge_series of the running sum of its increments (rss, cuda_allocated) or of
    its level (cuda_peak); a phase that would be a LEAK "grows"."""
    report, after = {}, records[warmup - 1]["step"] if 0 < warmup <= len(records) else -math.inf
    for family, phases in phase_marks(records).items():
        fits = {}
        for p in phases if family not in INCREMENTS else ():
            fits[p] = judge_series(*series(records, f"{p}_{family}_mb"), warmup, leak_mb_per_step)
        for p, (s, added) in phase_increments(records, family, phases).items() if family in INCREMENTS else ():
            fits[p] = judge_series(s, np.cumsum(added), int((s <= after).sum()), leak_mb_per_step)
        for fit in fits.values():
            fit["verdict"] = "grows" if fit["verdict"] == "LEAK" else fit["verdict"]
        report[family] = fits
    return report


def growing_phases(phases):
    """The phases whose running sum of increments grows (family, phase, MB/step); failing those, the
    phases whose peak grows."""
    grows = [{"family": f, "phase": p, "mb_per_step": s["slope_mb_per_step"]}
             for f, fits in phases.items() for p, s in fits.items() if s["verdict"] == "grows"]
    return [g for g in grows if g["family"] in INCREMENTS] or grows


def retry_warnings(records, warmup=WARMUP):
    """Warn when the CUDA allocator had to free its cache and retry a cudaMalloc after the warm-up."""
    counts = [r["cuda_alloc_retries"] for r in records if isinstance(r.get("cuda_alloc_retries"), (int, float))]
    if len(counts) <= warmup or counts[-1] <= counts[warmup - 1 if warmup else 0]:
        return []
    n = counts[-1] - counts[warmup - 1 if warmup else 0]
    return [f"the CUDA allocator retried {n:.0f} allocation(s) after the warm-up (cudaMalloc failed; it freed its "
            f"whole cache and tried again): the run is at the edge of the device's memory and slowed by it; "
            f"a smaller --micro-batch-size or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]


def fragmentation_warnings(records, warmup=WARMUP, ratio=FRAG_RATIO, min_gap_mb=FRAG_MIN_GAP_MB):
    """Warn for each CUDA device whose reserved pool stays well above what the step needed.

    Compared with the larger of the end-of-step allocation and the step's peak: the pool
    legitimately holds the peak's activations between steps, so reserved >> allocated alone is
    normal in training. Reserved far above the *peak* is memory the allocator cached and could
    not reuse.
    """
    warnings = []
    for prefix in sorted({CUDA_KEY.match(k).group(1) for k in series_names(records) if k != RSS}):
        rows = [r for r in records[warmup:]
                if isinstance(r.get(f"{prefix}_reserved_mb"), (int, float))
                and isinstance(r.get(f"{prefix}_allocated_mb"), (int, float))]
        if len(rows) < MIN_POINTS:
            continue
        reserved = np.median([r[f"{prefix}_reserved_mb"] for r in rows])
        needed = np.median([max(r[f"{prefix}_allocated_mb"], r.get(f"{prefix}_peak_mb") or 0.0)
                            for r in rows])
        split = [r[f"{prefix}_inactive_split_mb"] for r in rows if isinstance(r.get(f"{prefix}_inactive_split_mb"), (int, float))]
        if reserved > ratio * max(needed, 1e-9) and reserved - needed > min_gap_mb:
            warnings.append(f"fragmentation on {prefix}: reserved {reserved:.0f} MB stays at "
                            f"{reserved / max(needed, 1e-9):.1f}x the {needed:.0f} MB the steps use "
                            f"(median after warm-up"
                            + (f"; {np.median(split):.0f} MB of it in free pieces of split blocks" if split else "")
                            + "); try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or fewer distinct "
                            "sequence lengths")
    return warnings


def churn_warnings(records, warmup=WARMUP, spread=CHURN_SPREAD):
    """Warn for each CUDA device whose per-step peak swings widely: the allocator meets new shapes."""
    warnings = []
    for name in series_names(records):
        m = CUDA_KEY.match(name)
        if not m or m.group(2) != "peak":
            continue
        _, v = series(records, name)
        v = v[warmup:]
        if len(v) < MIN_POINTS or np.median(v) <= 0:
            continue
        p10, med, p90 = np.percentile(v, [10, 50, 90])
        if (p90 - p10) / med > spread:
            warnings.append(f"shape churn on {m.group(1)}: the per-step peak ranges {p10:.0f}-"
                            f"{p90:.0f} MB (10th-90th percentile) around a median of {med:.0f} MB; "
                            f"padding batches to a few fixed lengths keeps the allocator's pool stable")
    return warnings


def analyse(records, warmup=WARMUP, leak_mb_per_step=LEAK_MB_PER_STEP, frag_ratio=FRAG_RATIO,
            churn_spread=CHURN_SPREAD):
    """The full leak report of a log's records: per-series fits and verdicts, warnings, verdict."""
    recs, restarts = train_records(records)
    report = {"records": len(recs), "warmup": warmup, "leak_mb_per_step": leak_mb_per_step,
              "series": {}, "warnings": []}
    if recs:
        report["steps"] = [recs[0]["step"], recs[-1]["step"]]
    if restarts:
        report["warnings"].append(f"the log holds {restarts + 1} runs (the step number went back "
                                  f"{restarts} time(s)); only the last run is analysed")
    for name in series_names(recs):
        report["series"][name] = judge_series(*series(recs, name), warmup=warmup,
                                              leak_mb_per_step=leak_mb_per_step)
    report["warnings"] += fragmentation_warnings(recs, warmup, frag_ratio)
    report["warnings"] += churn_warnings(recs, warmup, churn_spread)
    report["warnings"] += retry_warnings(recs, warmup)
    verdicts = [s["verdict"] for s in report["series"].values()]
    report["verdict"] = ("LEAK" if "LEAK" in verdicts else "ok" if "ok" in verdicts
                         else "too few points")
    report["phases"] = judge_phases(recs, warmup, leak_mb_per_step)
    report["growing"] = growing_phases(report["phases"]) if report["verdict"] == "LEAK" else []
    return report


# --- batch-size sweep ------------------------------------------------------------------------

def fit_memory(batches, peaks_mb):
    """Least-squares memory = fixed + per_sample * batch: (fixed_mb, per_sample_mb).

    Least squares, not Theil-Sen: a sweep has a handful of points, each the peak of a whole run,
    with no outliers to be robust against, and a model that is linear by construction.
    """
    b, p = np.asarray(batches, dtype=float), np.asarray(peaks_mb, dtype=float)
    if len(np.unique(b)) < 2:
        raise ValueError("fitting memory against batch size needs at least two batch sizes")
    per_sample, fixed = np.polyfit(b, p, 1)
    return float(fixed), float(per_sample)


def largest_batch(fixed_mb, per_sample_mb, budget_mb, multiple=1, smallest_failed=None):
    """The largest batch (a multiple of `multiple`) whose fitted memory fits in budget_mb.

    None when nothing fits or memory does not grow with the batch (no finite answer from the
    fit). smallest_failed, the smallest batch measured not to fit, caps the answer: a
    measurement beats the line.
    """
    if per_sample_mb <= 0:
        return None
    # The small tolerance keeps a fit's last-bit rounding (33.9999999 groups) from costing a group.
    best = int(math.floor((budget_mb - fixed_mb) / per_sample_mb / multiple + 1e-9)) * multiple
    if smallest_failed is not None:
        best = min(best, (int(smallest_failed) - 1) // multiple * multiple)
    return best if best >= multiple else None
