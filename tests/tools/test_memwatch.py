"""The leak detector and the sweep fit on synthetic series whose truth is known."""
import numpy as np
import pytest

import memwatch as mw

STEPS = np.arange(1, 201, dtype=float)  # a 200-step run


def noisy(values, sd=3.0, seed=0):
    return np.asarray(values, dtype=float) + np.random.default_rng(seed).normal(0, sd, len(values))


def test_theil_sen_recovers_a_line_through_wild_outliers():
    y = 100 + 0.5 * STEPS
    y[::5] += 5000.0  # every fifth point a spike: least squares would be dragged far off
    slope, intercept, lo, hi = mw.theil_sen(STEPS, y)
    assert slope == pytest.approx(0.5, abs=1e-9)
    assert intercept == pytest.approx(100.0, abs=1e-6)
    assert lo <= slope <= hi


def test_flat_series_with_noise_is_ok_with_slope_near_zero():
    for seed in range(20):  # several noise draws: one lucky draw would prove little
        r = mw.judge_series(STEPS, noisy(np.full(200, 2000.0), sd=5.0, seed=seed))
        assert r["verdict"] == "ok"
        assert abs(r["slope_mb_per_step"]) < 0.1
        assert r["slope_low"] < 0 < r["slope_high"] or abs(r["slope_mb_per_step"]) < 0.05


def test_one_mb_per_step_leak_over_200_steps_is_a_leak():
    for seed in range(20):
        r = mw.judge_series(STEPS, noisy(2000 + 1.0 * STEPS, sd=5.0, seed=seed))
        assert r["verdict"] == "LEAK"
        assert r["slope_mb_per_step"] == pytest.approx(1.0, abs=0.05)
        assert r["growth_mb_per_10k_steps"] == pytest.approx(10_000, rel=0.05)
        assert r["points"] == 200 - mw.WARMUP


def test_growth_below_the_threshold_is_measured_but_not_a_leak():
    r = mw.judge_series(STEPS, noisy(2000 + 0.05 * STEPS, sd=1.0))
    assert r["verdict"] == "ok"
    assert r["slope_mb_per_step"] == pytest.approx(0.05, abs=0.01)
    # The same series is a leak to a user who sets a stricter threshold.
    assert mw.judge_series(STEPS, noisy(2000 + 0.05 * STEPS, sd=1.0), leak_mb_per_step=0.02)["verdict"] == "LEAK"


def test_a_jump_during_warm_up_is_not_fitted():
    # Caches fill over the first 8 steps (+150 MB each), then memory is flat.
    y = noisy(2000 + 150 * np.minimum(STEPS, 8))
    r = mw.judge_series(STEPS, y)
    assert r["verdict"] == "ok"
    assert abs(r["slope_mb_per_step"]) < 0.05
    assert r["from_step"] == STEPS[mw.WARMUP]


def test_sawtooth_is_ok_although_it_climbs_1_mb_per_step_between_drops():
    # A cache that grows 1 MB/step and is emptied every 25 steps: bounded, so not a leak.
    r = mw.judge_series(STEPS, noisy(2000 + (STEPS % 25) * 1.0, sd=0.5))
    assert r["verdict"] == "ok"
    assert abs(r["slope_mb_per_step"]) < 0.1


def test_a_step_up_that_then_levels_off_is_not_a_leak_but_a_late_leak_is():
    # A one-off 100 MB step in the first half of the window (steps 21-200), flat before and
    # after: the whole window's slope is large, but the second half does not grow.
    step_up = noisy(2000 + 100 * (STEPS > 100))
    r = mw.judge_series(STEPS, step_up)
    assert r["slope_low"] > mw.LEAK_MB_PER_STEP  # the overall fit alone would have said LEAK
    assert r["verdict"] == "ok"
    assert abs(r["recent_slope_mb_per_step"]) < 0.1
    # A leak of 1 MB/step that starts at step 100 is still growing at the end: LEAK.
    late = noisy(2000 + 1.0 * np.maximum(STEPS - 100, 0))
    assert mw.judge_series(STEPS, late)["verdict"] == "LEAK"


def test_too_few_points_after_warm_up_gives_no_verdict():
    r = mw.judge_series(STEPS[:25], 2000 + 5.0 * STEPS[:25])  # steep, but 5 points after warm-up
    assert r["verdict"] == "too few points"
    assert "slope_mb_per_step" not in r
    assert mw.analyse([{"step": int(s), "rss_mb": 1.0} for s in STEPS[:25]])["verdict"] == "too few points"
    assert mw.analyse([])["verdict"] == "too few points"


def test_long_logs_are_thinned_but_fitted_correctly():
    steps = np.arange(1, 20_001, dtype=float)
    r = mw.judge_series(steps, noisy(2000 + 0.5 * steps, sd=5.0))
    assert r["slope_mb_per_step"] == pytest.approx(0.5, abs=0.01)
    assert r["points"] == 20_000 - mw.WARMUP


def records(n, **series):
    """n training records; each keyword is a function of the step giving that series."""
    return [{"step": s, "loss": 0.0, **{k: float(f(s)) for k, f in series.items()}} for s in range(1, n + 1)]


def test_analyse_judges_each_series_and_ignores_eval_records():
    recs = records(200, rss_mb=lambda s: 3000.0, cuda_allocated_mb=lambda s: 500 + 1.0 * s,
                   cuda_reserved_mb=lambda s: 2000.0, cuda_peak_mb=lambda s: 1800.0)
    # Eval records carry other numbers (here a huge RSS) and must not enter any series.
    recs += [{"kind": "eval", "step": s, "rss_mb": 1e6 * s} for s in range(10, 201, 10)]
    recs.sort(key=lambda r: (r["step"], "kind" in r))
    report = mw.analyse(recs)
    assert list(report["series"]) == ["rss_mb", "cuda_allocated_mb", "cuda_peak_mb", "cuda_reserved_mb"]
    assert report["series"]["rss_mb"]["verdict"] == "ok"
    assert report["series"]["cuda_allocated_mb"]["verdict"] == "LEAK"
    assert report["verdict"] == "LEAK"
    assert report["records"] == 200


def test_a_restarted_run_in_the_same_log_is_analysed_alone():
    first = records(100, rss_mb=lambda s: 5000 + 10.0 * s)       # a leaking run, killed at 100
    resumed = records(150, rss_mb=lambda s: 3000.0)[80:]          # resumed at step 81, clean
    report = mw.analyse(first + resumed)
    assert report["records"] == 70
    assert report["verdict"] == "ok"
    assert any("2 runs" in w for w in report["warnings"])


def test_fragmentation_warning_when_reserved_stays_far_above_the_step_peak():
    frag = records(100, cuda_allocated_mb=lambda s: 1000.0, cuda_peak_mb=lambda s: 2000.0,
                   cuda_reserved_mb=lambda s: 6000.0, cuda_inactive_split_mb=lambda s: 700.0)
    assert any("fragmentation on cuda" in w and "700 MB of it in free pieces of split blocks" in w
               for w in mw.analyse(frag)["warnings"])
    # Reserved far above the end-of-step allocation but close to the step's peak is the normal
    # state of a caching allocator in training: no warning.
    healthy = records(100, cuda_allocated_mb=lambda s: 1000.0, cuda_peak_mb=lambda s: 5000.0,
                      cuda_reserved_mb=lambda s: 5600.0)
    assert mw.analyse(healthy)["warnings"] == []


def test_churn_warning_when_the_step_peak_swings_widely():
    churn = records(100, cuda_peak_mb=lambda s: 1000.0 if s % 2 else 3000.0)
    assert any("shape churn on cuda" in w for w in mw.analyse(churn)["warnings"])
    steady = records(100, cuda_peak_mb=lambda s: 2000.0 + (s % 7) * 20)
    assert mw.analyse(steady)["warnings"] == []


def test_sweep_fit_and_largest_batch_in_budget():
    batches = [8, 16, 32, 64, 128]
    fixed, per_sample = mw.fit_memory(batches, [600 + 12.5 * b for b in batches])
    assert fixed == pytest.approx(600.0)
    assert per_sample == pytest.approx(12.5)
    # (4000 - 600) / 12.5 = 272, already a multiple of 8; with groups of 48 it rounds down to 240.
    assert mw.largest_batch(fixed, per_sample, 4000.0, multiple=8) == 272
    assert mw.largest_batch(fixed, per_sample, 4000.0, multiple=48) == 240
    # A batch measured to run out of memory caps the answer below it, whatever the line says.
    assert mw.largest_batch(fixed, per_sample, 4000.0, multiple=8, smallest_failed=128) == 120
    assert mw.largest_batch(fixed, per_sample, 500.0, multiple=8) is None       # nothing fits
    assert mw.largest_batch(fixed, 0.0, 4000.0, multiple=8) is None             # no growth, no limit
    with pytest.raises(ValueError):
        mw.fit_memory([64], [1000.0])


# --- where it grows: the phases of a step ------------------------------------------------------------

PHASES = ("start", "gen", "score", "ref", "train")


def phase_records(n, adds, family="rss", noise=0.05, seed=0):
    """n records of one family's readings at each phase's end, the phases adding adds[phase] MB each step
    (a negative value frees); each reading with its own noise, rounded to 0.1 MB as the trainer writes it."""
    rng, level, recs = np.random.default_rng(seed), 1000.0, []
    for s in range(1, n + 1):
        rec = {"step": s}
        for p in PHASES:
            level += adds.get(p, 0.0)
            rec[f"{p}_{family}_mb"] = round(level + rng.normal(0, noise), 1)
        rec["rss_mb" if family == "rss" else "cuda_allocated_mb"] = rec[f"train_{family}_mb"]
        recs.append(rec)
    return recs


def test_the_leaking_phase_is_named_and_the_phases_add_up_to_the_series():
    recs = phase_records(200, {"score": 1.0})
    report = mw.analyse(recs)
    assert report["verdict"] == "LEAK"
    fits = report["phases"]["rss"]
    assert list(fits) == ["gen", "score", "ref", "train", mw.BETWEEN]
    assert {p: f["verdict"] for p, f in fits.items()} == {"gen": "ok", "score": "grows", "ref": "ok", "train": "ok",
                                                          mw.BETWEEN: "ok"}
    assert fits["score"]["slope_mb_per_step"] == pytest.approx(1.0, abs=0.01)
    total = sum(f["slope_mb_per_step"] for f in fits.values())
    assert total == pytest.approx(report["series"]["rss_mb"]["slope_mb_per_step"], abs=0.02)
    assert report["growing"] == [{"family": "rss", "phase": "score", "mb_per_step": fits["score"]["slope_mb_per_step"]}]


def test_a_leak_between_steps_is_named_between():
    # what the step's start reads above the previous step's end was kept by the log, eval or a checkpoint
    report = mw.analyse(phase_records(200, {"start": 0.6}))
    assert [g["phase"] for g in report["growing"]] == [mw.BETWEEN]


def test_a_leak_that_comes_in_bursts_is_still_named():
    # 4 MB every 8th step: the median step adds nothing, the running sum climbs 0.5 MB/step
    recs = phase_records(200, {})
    for r in recs:
        burst = 4.0 * (r["step"] // 8)
        for p in ("ref", "train"):
            r[f"{p}_rss_mb"] += burst
        r["rss_mb"] = r["train_rss_mb"]
        r["start_rss_mb"] += 4.0 * ((r["step"] - 1) // 8)
        r["gen_rss_mb"] += 4.0 * ((r["step"] - 1) // 8)
        r["score_rss_mb"] += 4.0 * ((r["step"] - 1) // 8)
    report = mw.analyse(recs)
    assert report["verdict"] == "LEAK" and [g["phase"] for g in report["growing"]] == ["ref"]
    assert report["growing"][0]["mb_per_step"] == pytest.approx(0.5, abs=0.05)


def test_memory_a_phase_keeps_until_a_later_phase_frees_it_is_no_leak_and_names_nothing():
    report = mw.analyse(phase_records(200, {"gen": 300.0, "train": -300.0}))
    assert report["verdict"] == "ok" and report["growing"] == []


def test_cuda_phases_allocated_increments_and_the_peak_within_each_phase():
    recs = phase_records(200, {"train": 2.0}, family="cuda_allocated")
    for r in recs:   # the generation's peak grows by itself (a cache that is never trimmed); the others' stay
        r.update(gen_cuda_peak_mb=3000.0 + 0.5 * r["step"], score_cuda_peak_mb=3050.0,
                 ref_cuda_peak_mb=3100.0, train_cuda_peak_mb=3200.0)
    report = mw.analyse(recs)
    assert report["phases"]["cuda_allocated"]["train"]["verdict"] == "grows"
    assert report["phases"]["cuda_peak"]["gen"]["verdict"] == "grows"
    # the allocated increments name the phase that keeps memory; a growing peak is named only without one
    assert [(g["family"], g["phase"]) for g in report["growing"]] == [("cuda_allocated", "train")]
    assert mw.growing_phases({"cuda_peak": report["phases"]["cuda_peak"]}) == [
        {"family": "cuda_peak", "phase": "gen", "mb_per_step": pytest.approx(0.5)}]


def test_allocator_retries_after_the_warm_up_are_a_warning():
    recs = records(100, cuda_alloc_retries=lambda s: 2 if s < 10 else 2 + (s > 60))
    assert any("retried 1 allocation(s) after the warm-up" in w for w in mw.analyse(recs)["warnings"])
    steady = records(100, cuda_alloc_retries=lambda s: 2 if s > 5 else 0)   # retries while warming up only
    assert mw.analyse(steady)["warnings"] == []
