"""harness/progress.py: the console's running mean of the reward, the time the job takes with its
evaluations, and each evaluation against the first of the same items; and a real run that says
all three."""
import re
from types import SimpleNamespace

import pytest

import train_lean
from harness import intervals
from harness.progress import Progress
from helpers import SMALL


def progress(tmp_path, steps=10, interval=4, evaluating=True, start=0):
    cfg = SimpleNamespace(steps=steps, eval_interval=interval, task="toy")
    return Progress(cfg, start, evaluating, str(tmp_path / "m.jsonl"), str(tmp_path / "i.jsonl"))


def test_the_time_left_counts_the_evaluations_to_come(tmp_path):
    p = progress(tmp_path)   # 10 steps; evaluations at 0 (whole), 4 and 8 (between), 10 (whole)
    p.evaluated(0, 30.0, full=True)
    assert p.evals_left(1) == (2, 1) and p.evals_left(4) == (1, 1) and p.evals_left(9) == (0, 1)
    assert p.evals_left(10) == (0, 0)
    # until one between is timed, each costs what the whole one did (an upper bound)
    assert p.eval_cost(1) == (90.0, 30.0) and p.eta(1, 2.0) == 2.0 * 9 + 90.0
    p.evaluated(4, 6.0, full=False)
    assert p.eval_cost(5) == (36.0, 30.0) and p.eta(10, 2.0) is None and p.eta(3, None) is None
    quiet = progress(tmp_path, evaluating=False)
    assert quiet.eval_cost(1) == (0.0, 0.0)


def test_the_pace_leaves_out_the_first_step_and_the_evaluations(tmp_path, monkeypatch):
    clock = iter([100.0, 110.0, 150.0])
    monkeypatch.setattr("harness.progress.time.perf_counter", lambda: next(clock))
    p = progress(tmp_path)
    assert p.pace(1) is None            # the first step: warm-up, compiling
    assert p.pace(2) == 10.0
    p.evaluated(4, 20.0, full=False)   # 20 of the next 40 s evaluated
    assert p.pace(4) == (50.0 - 20.0) / 3


def test_the_whole_job_is_said_once_with_the_last_evaluations_cost(tmp_path, monkeypatch):
    clock = iter([0.0, 2.0])
    monkeypatch.setattr("harness.progress.time.perf_counter", lambda: next(clock))
    p = progress(tmp_path)
    p.evaluated(0, 30.0, full=True)
    assert p.job(1, p.pace(1)) is None
    line = p.job(2, p.pace(2))
    # 10 steps at 2 s; evaluations: step 0's 30, two between at 30 (until timed) and the last's 30
    assert line.startswith("the whole job: about 2m20s on this machine: 10 steps at 2.0 s (20s), "
                           "evaluations 2m00s (86%; estimated from the first)")
    assert "The evaluation after the last step (about 30s) costs more than the training" in line
    assert p.job(3, 2.0) is None   # once


def entry(step, items, sha="abc"):
    return {"step": step, "prompts": len(next(iter(items.values()))), "prompts_sha256": sha,
            "task": "toy", "items": items}


def test_an_evaluation_is_paired_with_the_first_of_the_same_items(tmp_path):
    p = progress(tmp_path)
    before = {"acc": [0.0] * 30, "score": [0.1] * 30}
    after = {"acc": [1.0] * 20 + [0.0] * 10, "score": [0.1] * 30}
    assert p.compare(0, entry(0, before)) == []   # nothing before it
    assert p.compare(4, entry(4, {"acc": [0.0] * 5}, sha="subset")) == []   # other items
    assert p.compare(8, entry(8, after)) == [
        "against step 0 (the same items, paired): acc up of 2 per-item metrics"]
    lines = p.compare(10, entry(10, after))
    assert lines[0].startswith("before and after: step 0 -> 10, the same 30 held-out prompts")
    text, _ = intervals.paired_row(before["acc"], after["acc"])
    assert lines[1] == "  acc    " + text.replace("B higher", "higher after").replace(
        " only B", " only after").replace(" only A", " only before")
    assert lines[2].endswith("no detectable difference")
    assert p.compare(10, None) == []   # a task of plain numbers


def test_a_resumed_run_keeps_its_trend_and_first_evaluation(tmp_path):
    (tmp_path / "m.jsonl").write_text(
        "".join(f'{{"step": {s}, "reward_mean": {0.1 * s}}}\n' for s in range(1, 4))
        + '{"kind": "eval", "step": 3, "acc": 0.5}\nnot json\n')
    (tmp_path / "i.jsonl").write_text(
        '{"step": 0, "prompts": 2, "prompts_sha256": "abc", "task": "toy", "items": {"acc": [0, 0]}}\n'
        '{"step": 1, "prompts": "damaged"}\n')
    p = progress(tmp_path, start=3)
    assert p.rewards == pytest.approx([0.1, 0.2, 0.3]) and list(p.evals) == [0]
    assert p.reward({"reward_mean": 0.4}).startswith("~0.35")   # 4 steps: the last 2 against the first 2


def test_a_run_says_whether_it_learns_how_long_it_takes_and_ends_with_before_and_after(
        tiny_model_dir, tmp_path, capsys):
    train_lean.main(["--model", tiny_model_dir, *SMALL, "--task", "toy", "--steps", "6",
                     "--eval-interval", "3", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    lines = out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert "~" not in steps[2] and re.search(r"reward [\d.]+ ~[\d.]+ \([+-][\d.]+ \[[+-][\d.]+, "
                                             r"[+-][\d.]+\]( up| down)?\) \|", steps[3])
    assert any(line.startswith("the whole job: about ") for line in lines)
    assert any(line.startswith("against step 0 (the same items, paired): ") for line in lines)
    table = lines.index(next(line for line in lines if line.startswith("before and after: step 0 -> 6")))
    assert lines[table + 1].startswith("  ") and "n=" in lines[table + 1]
