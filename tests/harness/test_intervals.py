"""The interval formulas against known answers: Wilson's at published points, the bootstrap against its exact
distribution on a tiny case, the paired comparison and McNemar's exact test on cases whose answer is known."""
import itertools
import math
import re

import numpy as np
import pytest

import train_lean
from helpers import EVALUATED_TASK, SMALL, read_jsonl

from harness import intervals
from harness.task import TaskError, check_metrics, summarise_metrics


# Wilson's 95% interval, (hits, n) -> (lo, hi): the closed forms at 0 and n hits (z^2 / (n + z^2)), and the values
# Wilson's formula gives at 5/10 and 10/100, as statistics tables and online calculators list them to 4 decimals
@pytest.mark.parametrize("hits, n, lo, hi", [
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (5, 10, 0.2366, 0.7634),
    (10, 100, 0.0552, 0.1744),   # the example: 0.10 [0.06, 0.17] n=100
    (1, 1, 0.2065, 1.0),
])
def test_wilson_at_known_points(hits, n, lo, hi):
    got = intervals.wilson(hits, n)
    assert got == pytest.approx((lo, hi), abs=5e-5)


def test_wilson_is_the_score_formula_and_stays_inside_0_1():
    z = intervals.Z
    for n in (1, 7, 100, 1000):
        for hits in range(0, n + 1, max(1, n // 10)):
            p = hits / n
            # the roots of (p - x)^2 = z^2 x (1 - x) / n, the interval's definition
            a, b, c = 1 + z * z / n, -(2 * p + z * z / n), p * p
            root = math.sqrt(b * b - 4 * a * c)
            roots = sorted(((-b - root) / (2 * a), (-b + root) / (2 * a)))
            lo, hi = intervals.wilson(hits, n)
            assert (lo, hi) == pytest.approx(roots, abs=1e-12) and 0 <= lo <= p <= hi <= 1
    assert intervals.wilson(0, 5)[0] == 0.0 and intervals.wilson(5, 5)[1] == 1.0   # exactly, not a hair outside


def test_the_bootstrap_matches_its_exact_distribution_on_four_items():
    # every one of the 4^4 resamples of 4 items is equally likely: the exact distribution of the resampled mean.
    # The Monte Carlo percentiles must be its 2.5% and 97.5% quantiles, up to what 2000 draws can resolve.
    values = [0.0, 0.25, 0.5, 2.0]
    exact = np.array([np.mean(r) for r in itertools.product(values, repeat=4)])
    lo, hi = intervals.bootstrap(values)
    slack = 3 * math.sqrt(0.025 * 0.975 / intervals.RESAMPLES)   # 3 standard errors of a 2.5% tail's share
    assert np.mean(exact < lo) <= 0.025 + slack and np.mean(exact <= lo) >= 0.025 - slack
    assert np.mean(exact > hi) <= 0.025 + slack and np.mean(exact >= hi) >= 0.025 - slack


def test_the_bootstrap_is_seeded_and_degenerate_cases_are_exact():
    values = np.random.default_rng(5).random(50)
    assert intervals.bootstrap(values) == intervals.bootstrap(values)   # the same interval at every call
    assert intervals.bootstrap(values) != intervals.bootstrap(values, seed=1)
    assert intervals.bootstrap([0.3] * 7) == (pytest.approx(0.3), pytest.approx(0.3))   # no spread: no width
    # many items resampled in blocks give the same draws as the bound allows: a long list works and is sane
    long = np.random.default_rng(0).random(5000)
    lo, hi = intervals.bootstrap(long)
    se = long.std() / math.sqrt(len(long))
    assert lo < long.mean() < hi and (hi - lo) == pytest.approx(2 * intervals.Z * se, rel=0.15)


def test_summarise_picks_wilson_for_rates_and_the_bootstrap_otherwise():
    rate = intervals.summarise([True] * 10 + [False] * 90)
    assert rate["method"] == "wilson" and rate["value"] == 0.1 and rate["n"] == 100
    assert (rate["lo"], rate["hi"]) == pytest.approx((0.0552, 0.1744), abs=5e-5)
    partial = intervals.summarise([0.1, 0.5, 0.9, 0.3])
    assert partial["method"] == "bootstrap" and partial["value"] == sum([0.1, 0.5, 0.9, 0.3]) / 4
    assert partial["lo"] < partial["value"] < partial["hi"]


def test_the_console_form_shows_two_significant_digits_of_the_width():
    assert intervals.shown(0.1, 0.0552, 0.1744, 100) == "0.10 [0.06, 0.17] n=100"
    assert intervals.shown(0.004, 0.0011, 0.0146, 1000) == "0.004 [0.001, 0.015] n=1000"
    assert intervals.shown(0.004, 0.0032, 0.0049, 90000) == "0.0040 [0.0032, 0.0049] n=90000"
    assert intervals.shown(0.5, 0.5, 0.5, 3) == "0.50 [0.50, 0.50] n=3"


@pytest.mark.parametrize("b_only, a_only, p", [
    (0, 0, 1.0), (3, 0, 0.25), (6, 0, 2 / 64), (5, 5, 1.0), (1, 9, 2 * 11 / 1024)])
def test_mcnemar_exact_is_the_two_sided_binomial_test(b_only, a_only, p):
    assert intervals.mcnemar_p(b_only, a_only) == pytest.approx(p)


def test_a_paired_comparison_finds_a_clear_gain_and_none_in_identical_scores():
    rng = np.random.default_rng(1)
    a = (rng.random(200) < 0.3).astype(float)
    b = a.copy()
    b[np.flatnonzero(a == 0)[:40]] = 1   # 40 items gained, none lost
    gain = intervals.paired(a, b)
    assert gain["verdict"] == "B higher" and gain["diff"] == pytest.approx(0.2) and 0 < gain["lo"] < 0.2 < gain["hi"]
    assert (gain["b_only"], gain["a_only"]) == (40, 0) and gain["p"] < 1e-10
    assert intervals.paired(b, a)["verdict"] == "A higher"
    same = intervals.paired(a, a)
    assert same["verdict"] == "no detectable difference" and (same["diff"], same["lo"], same["hi"]) == (0, 0, 0)
    # means of partial credit: a shift that the item-to-item spread would hide unpaired is plain when paired
    x = rng.random(100)
    shifted = intervals.paired(x, x + 0.01)
    assert shifted["verdict"] == "B higher" and "p" not in shifted
    assert shifted["lo"] == pytest.approx(0.01) and shifted["hi"] == pytest.approx(0.01)


def test_on_few_items_the_exact_test_keeps_the_bootstrap_from_claiming_too_much():
    # 3 of 5 items gained, none lost: the bootstrap's interval is [0.2, 1.0], but such a split happens 1 time in 4
    # with no difference at all; McNemar's exact test says so and the verdict follows it
    got = intervals.paired([0, 0, 0, 0, 0], [1, 1, 1, 0, 0])
    assert got["lo"] > 0 and got["p"] == pytest.approx(0.25) and got["verdict"] == "no detectable difference"
    # 8 of 8 gained: p = 2 / 256, detectable
    assert intervals.paired([0] * 8, [1] * 8)["verdict"] == "B higher"


def test_a_paired_comparison_refuses_unpaired_scores():
    with pytest.raises(ValueError, match="the same items"):
        intervals.paired([0, 1, 1], [0, 1])


# ---- through the trainer: a user's task that gives per-item scores, and one that gives plain numbers ----------

PER_ITEM_TASK = '''
class Letters:
    name = "letters"

    def prompts(self, n, rng):
        return [f"Repeat {rng.choice('abc')}: " for _ in range(n)]

    def reward(self, prompt, completion):
        return completion[:4].count(prompt[7]) / 4

    def evaluate(self, complete):
        prompts = [f"Repeat {c}: " for c in "abcdefghij"]
        texts = complete(prompts)
        return {"starts_right": [t[:1] == p[7] for p, t in zip(prompts, texts)],    # a rate: Wilson
                "credit": [self.reward(p, t) + 0.5 for p, t in zip(prompts, texts)],  # a mean: the bootstrap
                "n_prompts": len(prompts)}                                           # a plain number, as ever
'''


@pytest.fixture
def letters(tmp_path):
    path = tmp_path / "letters.py"
    path.write_text(PER_ITEM_TASK)
    return f"{path}:Letters"


def test_a_user_task_with_per_item_scores_gets_intervals_with_no_code_of_its_own(letters, tiny_model_dir, tmp_path,
                                                                                 capsys, clean_env):
    run = tmp_path / "run"
    train_lean.main(["--model", tiny_model_dir, "--task", letters, *SMALL[:-4], "--steps", "2", "--eval-interval", "2",
                     "--log-level", "info", "--out-dir", str(run)])
    out = capsys.readouterr().out
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "eval"]
    items = read_jsonl(run / "metrics.items.jsonl")
    assert [r["step"] for r in evals] == [r["step"] for r in items] == [0, 2]
    for record, scored in zip(evals, items):
        rate, credit = scored["items"]["starts_right"], scored["items"]["credit"]
        assert set(scored["items"]) == {"starts_right", "credit"} and len(rate) == len(credit) == 10
        assert record["starts_right"] == sum(rate) / 10 and record["credit"] == sum(credit) / 10
        assert (record["starts_right_lo"], record["starts_right_hi"]) == intervals.wilson(int(sum(rate)), 10)
        assert (record["credit_lo"], record["credit_hi"]) == intervals.bootstrap(credit)
        assert record["starts_right_n"] == record["credit_n"] == 10 and record["n_prompts"] == 10
        assert "n_prompts_lo" not in record and scored["prompts"] == 10
        # the console: the value, its interval and n, as the record has them; the plain number as before
        shown = intervals.shown(record["starts_right"], record["starts_right_lo"], record["starts_right_hi"], 10)
        assert re.search(rf"^  starts_right  {re.escape(shown)}$", out, re.M)
        assert re.search(r"^  n_prompts     10$", out, re.M)
    assert items[0]["prompts_sha256"] == items[1]["prompts_sha256"]   # the same items at every evaluation
    # and the task that scored them: another task may ask the same prompts (compare_runs.py refuses)
    assert items[0]["task"] == "letters (grpo_user_task_letters.Letters)"


def test_a_task_with_plain_numbers_is_logged_as_before_and_writes_no_items(echo_task, tiny_model_dir, tmp_path,
                                                                          capsys, clean_env):
    train_lean.main(["--model", tiny_model_dir, "--task", echo_task, *SMALL[:-4], "--steps", "1", "--eval-interval",
                     "1", "--out-dir", str(tmp_path)])
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [set(r) for r in evals] == [{"kind", "step", "n", "first_letter_rate", "eval_time_s"}] * 2
    assert not (tmp_path / "metrics.items.jsonl").exists()
    assert re.search(r"^  first_letter_rate  \d\.\d{4}$", capsys.readouterr().out, re.M)


@pytest.fixture
def echo_task(tmp_path):
    path = tmp_path / "evaluated.py"
    path.write_text(EVALUATED_TASK)
    return f"{path}:Evaluated"


@pytest.mark.parametrize("result, message", [
    ({"acc": []}, "returned {'acc': []}: per-item scores need at least one item"),
    ({"acc": [1, float("nan")]}, "returned nan as item 1 of 'acc': each per-item score must be a finite number"),
    ({"acc": [1, "0"]}, "returned '0' as item 1 of 'acc'"),
    ({"acc": np.zeros((2, 2))}, "returned 'acc' as an array of shape (2, 2)"),
    ({"acc": [1, 0], "acc_lo": 0.1}, "returned the key 'acc_lo' beside the per-item scores of 'acc'"),
    # each finite, their mean inf (it showed inf [nan, nan] and wrote null)
    ({"acc": [1e308, 1e308]},
     "returned items of 'acc' as large as 1e+308: sums of 2 of them overflow"),
    ({"acc": [10 ** 400]},
     "returned 1000000000000000000000000000000000000... as item 0 of 'acc'"),
    ({"acc": 10 ** 400},
     "returned {'acc': 1000000000000000000000000000000000000...}: 'acc' must be a finite number"),
])
def test_per_item_scores_are_checked(result, message):
    with pytest.raises(TaskError, match=re.escape(f"the task's evaluate() {message}")):
        check_metrics(result)


def test_per_item_scores_may_be_a_numpy_array_or_a_tuple_and_a_0d_array_is_one_number():
    checked = check_metrics({"a": np.array([1, 0, 1]), "b": (0.5, 0.25), "c": np.array(0.5)})
    assert checked == {"a": [1.0, 0.0, 1.0], "b": [0.5, 0.25], "c": 0.5}
    record, items = summarise_metrics(checked)
    assert record["a"] == 2 / 3 and record["a_n"] == 3 and record["c"] == 0.5 and set(items) == {"a", "b"}


def test_the_items_file_follows_the_records_on_resume_and_in_a_new_run(tiny_model_dir, tmp_path, capsys, clean_env):
    # resumed from an older checkpoint, the run redoes the later evaluations: their earlier scores are dropped
    # (and kept aside with the file as it was), so each step has one line, the new run's
    args = ["--model", tiny_model_dir, "--task", "toy", *SMALL[:-4], "--steps", "2", "--eval-interval", "1",
            "--save-interval", "1", "--out-dir", str(tmp_path)]
    train_lean.main(args)
    train_lean.main([*args, "--resume", str(tmp_path / "checkpoints" / "step_000001")])
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.items.jsonl")] == [0, 1, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.items.jsonl.abandoned-after-step_000001")] == [0, 1, 2]
    capsys.readouterr()
    with pytest.raises(SystemExit):   # a new run into the folder: refused, the items named with the records
        train_lean.main(args)
    assert "metrics.items.jsonl" in capsys.readouterr().err


def test_the_trend_is_the_last_window_against_the_first():
    """The console's running mean: the last w steps' mean, its change since the first w (w = 20,
    or half the steps while fewer than 40), its bootstrap interval; up / down only when it
    leaves 0."""
    assert intervals.trend([0.1, 0.2, 0.3]) is None   # too few to say
    rising = [0.1 + 0.01 * i for i in range(50)]
    t = intervals.trend(rising)
    assert t["window"] == 20 and t["mean"] == pytest.approx(np.mean(rising[-20:]))
    assert t["diff"] == pytest.approx(np.mean(rising[-20:]) - np.mean(rising[:20]))
    assert t["lo"] > 0 and t["verdict"] == "up"
    t = intervals.trend(rising[:10])   # half the steps a side
    assert t["window"] == 5 and t["diff"] == pytest.approx(np.mean(rising[5:10]) - np.mean(rising[:5]))
    noisy = [0.2, 0.6] * 10
    t = intervals.trend(noisy)
    assert t["lo"] < 0 < t["hi"] and t["verdict"] == ""
    assert intervals.trend([0.5 - x for x in rising])["verdict"] == "down"
    assert intervals.trend(noisy) == intervals.trend(noisy)   # seeded: the same line every run
