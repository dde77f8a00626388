"""compare_runs.py: verdicts on synthetic runs whose answer is known, refusals of what cannot be paired (exit 2, one
line), --fail-if-lower, and two real runs of one seed (no detectable difference)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import compare_runs
import train_lean
from helpers import PROCESS_DEADLINE_S, REPO, SMALL, env

SCRIPT = os.path.join(REPO, "compare_runs.py")
SHA = "ab" * 32


def write_items(folder, evaluations: dict, sha: str = SHA, prompts: int = 200,
                task: str = "toy (tasks.toy.ToyTask)") -> str:
    """A run folder whose metrics.items.jsonl holds step -> {metric: per-item scores}, as the
    trainer writes it."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.items.jsonl"), "w") as f:
        for step, items in evaluations.items():
            items = {k: [float(x) for x in v] for k, v in items.items()}
            f.write(json.dumps({"step": step, "prompts": prompts, "prompts_sha256": sha,
                                "task": task, "items": items}) + "\n")
    return str(folder)


def compare(capsys, *args):
    """compare_runs.py's main in this process, as its command line calls it: its exit code and
    output."""
    capsys.readouterr()
    code = compare_runs.main([str(a) for a in args])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def script(*args):
    """compare_runs.py as a shell or CI runs it, in a process of its own."""
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, env=env(),
                          timeout=PROCESS_DEADLINE_S)


@pytest.fixture
def runs(tmp_path):
    """A: 30% correct and partial credit; B: the same items, 40 of the wrong ones gained and every credit up by
    0.1; C: A's scores exactly."""
    rng = np.random.default_rng(0)
    acc = (rng.random(200) < 0.3).astype(float)
    credit = rng.random(200)
    gained = acc.copy()
    gained[np.flatnonzero(acc == 0)[:40]] = 1
    a = write_items(tmp_path / "a", {0: {"acc": acc, "credit": credit}, 10: {"acc": acc, "credit": credit}})
    b = write_items(tmp_path / "b", {0: {"acc": acc, "credit": credit}, 10: {"acc": gained, "credit": credit + 0.1}})
    c = write_items(tmp_path / "c", {10: {"acc": acc, "credit": credit}})
    return a, b, c


def lines_of(out: str) -> dict:
    return {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}


def test_a_clear_gain_is_b_higher_and_identical_runs_show_no_difference(runs, capsys):
    a, b, c = runs
    gain = compare(capsys, a, b)
    assert gain.returncode == 0, gain.stderr
    rows = lines_of(gain.stdout)
    assert rows["acc"].endswith("n=200  B higher (40 only B, 0 only A; McNemar p=1.8e-12)")
    assert "+0.20 [" in rows["acc"] and rows["credit"].endswith("n=200  B higher")
    same = compare(capsys, a, c)
    assert same.returncode == 0 and all(r.endswith("no detectable difference") or "no detectable difference (" in r
                                        for r in lines_of(same.stdout).values())
    assert len(lines_of(same.stdout)) == 2
    worse = compare(capsys, b, a)
    assert worse.returncode == 0 and "A higher" in lines_of(worse.stdout)["acc"]


def test_one_run_compares_its_first_evaluation_with_its_last(runs, capsys):
    a, b, _ = runs
    out = compare(capsys, b)
    assert out.returncode == 0 and f"A: {b} step 0\nB: {b} step 10" in out.stdout
    assert "B higher (40 only B, 0 only A" in lines_of(out.stdout)["acc"]
    swapped = compare(capsys, b, "--step-a", 10, "--step-b", 0)   # after against before
    assert "A higher (0 only B, 40 only A" in lines_of(swapped.stdout)["acc"]


def test_fail_if_lower_exits_1_when_b_is_detectably_lower(runs, capsys):
    a, b, _ = runs
    assert script(b, a, "--fail-if-lower").returncode == 1   # the exit code a CI job sees
    assert compare(capsys, a, b, "--fail-if-lower").returncode == 0
    only_credit = compare(capsys, b, a, "--fail-if-lower", "--metrics", "credit")
    assert only_credit.returncode == 1 and list(lines_of(only_credit.stdout)) == ["credit"]


@pytest.mark.parametrize("make, message", [
    (lambda t, a: write_items(t / "x", {10: {"acc": [1, 0]}}, sha="cd" * 32, prompts=2),
     "evaluated different held-out items (200 and 2 prompts asked, sha256 abababababab and cdcdcdcdcdcd): a paired "
     "comparison needs the same items"),
    (lambda t, a: write_items(t / "x", {10: {"acc": [1, 0, 1]}}),
     "scored 'acc' on 200 and 3 items: a paired comparison needs the same items"),
    (lambda t, a: str(t / "nowhere"), "does not exist"),
    # another task that asks the same prompts (it was paired, and its verdicts given)
    (lambda t, a: write_items(t / "x", {10: {"acc": [0] * 200}},
                              task="add (grpo_user_task_add.Add)"),
     "evaluated different tasks (toy (tasks.toy.ToyTask) and add (grpo_user_task_add.Add)) on the "
     "same prompts"),
    # one evaluation under two names (it was "no detectable difference")
    (lambda t, a: os.path.join(a, "metrics.jsonl"), "A and B are the same evaluation"),
    # scores whose differences overflow (1e308: a NaN interval and "no detectable difference")
    (lambda t, a: write_items(t / "x", {10: {"acc": [1e308] * 200}}),
     "scored 'acc' with items too large to compare"),
    (lambda t, a: str(t), "holds no per-item scores"),
])
def test_what_cannot_be_paired_is_refused_in_one_line(runs, tmp_path, make, message, capsys):
    a = runs[0]
    out = compare(capsys, a, make(tmp_path, a))
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("compare_runs.py: error: ") and message in out.stderr, out.stderr


@pytest.mark.parametrize("line, message", [
    ("{", "line 3 is not a record of per-item scores: it is not JSON"),
    ('{"step": 3, "prompts": 2, "prompts_sha256": "ab", "items": {"acc": [1, "x"]}}',
     "item 1 of 'acc', x, is not a finite number"),
    ('{"step": 3, "prompts": 2, "prompts_sha256": "ab", "items": {"acc": [1, 1e400]}}',
     "item 1 of 'acc', inf, is not a finite number"),
    ('{"step": 3, "prompts": 2, "prompts_sha256": "ab", "items": {"acc": [1, 1' + "0" * 400 + ']}}',
     "item 1 of 'acc', 1000000000000000000000000000000000000000, is not a finite number"),
    ('{"step": 3, "prompts": 2, "prompts_sha256": "ab", "items": {"acc": 1}}',
     "its scores of 'acc' are not a list of items"),
    ('{"step": "3", "prompts": 2, "prompts_sha256": "ab", "items": {}}',
     "its 'step' is not an int"),
    ('{"step": 3, "prompts_sha256": "ab", "items": {}}', "its 'prompts' is not an int"),
    ("[1, 2]", "it is a list, not a record"),
])
def test_a_damaged_items_file_is_refused_in_one_line(runs, line, message, capsys):
    """A hand-damaged metrics.items.jsonl (it was a KeyError, TypeError or OverflowError
    traceback)."""
    a = runs[0]
    with open(os.path.join(a, "metrics.items.jsonl"), "a") as f:
        f.write(line + "\n")
    code = compare_runs.main([a])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: RUN"),
    (["{c}"], "has one evaluation (step 10): nothing to compare it with"),
    (["{a}", "--step-a", "5"], "has no evaluation at step 5 (it has 0, 10)"),
    (["{a}", "{b}", "{c}"], "give one run or two, not 3"),
    (["{a}", "{b}", "--metrics", "acc,pass@4"], "--metrics 'pass@4' is not a per-item metric of both"),
    (["{a}", "--step-a", "x"], "argument --step-a: invalid int value"),
])
def test_bad_arguments_exit_2_with_one_line(runs, args, message, capsys):
    a, b, c = runs
    code = compare_runs.main([arg.format(a=a, b=b, c=c) for arg in args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_two_real_runs_of_one_seed_show_no_detectable_difference(tiny_model_dir, tmp_path, capsys,
                                                                 clean_env, user_threads):
    args = ["--model", tiny_model_dir, "--task", "toy", *SMALL[:-4], "--steps", "2", "--eval-interval", "2",
            "--eval-k", "2", "--eval-n", "4"]
    for name in ("one", "two"):
        train_lean.main([*args, "--out-dir", str(tmp_path / name)])
    capsys.readouterr()
    assert compare_runs.main([str(tmp_path / "one"), str(tmp_path / "two")]) == 0
    rows = lines_of(capsys.readouterr().out)
    assert set(rows) == {"acc", "reward", "pass@2", "mean@4"}
    assert all("+0.00 [+0.00, +0.00]" in r and "no detectable difference" in r for r in rows.values()), rows
