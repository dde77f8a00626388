"""tasks/add.py, the task of `make demo`: its held-out sums are never trained on, its reward is
the README's partial credit, and the demo's run learns (slow: the 100-step run the Makefile
gives)."""
import os
import random
import re
import subprocess
import sys

import pytest

import train_lean
from helpers import read_jsonl
from tasks import add, get_task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_held_out_sums_are_never_drawn_for_training_and_are_all_evaluated():
    task = get_task("add")
    assert len(add.HELD_OUT) == 40 and len(add.TRAIN) == 60
    assert sorted(add.TRAIN + add.HELD_OUT) == [(a, b) for a in range(10) for b in range(10)]
    drawn = set(task.prompts(2000, random.Random(0)))
    assert drawn == {f"{a}+{b}=" for a, b in add.TRAIN}   # every trained sum, no held-out one
    asked = []
    right = [str(a + b) for a, b in add.HELD_OUT]
    scores = task.evaluate(lambda prompts: asked.extend(prompts) or right)
    assert asked == [f"{a}+{b}=" for a, b in add.HELD_OUT]
    assert all(scores[k] == [1] * 40 for k in ("credit", "number", "accuracy"))


def test_the_reward_is_partial_credit_for_the_number_a_completion_starts_with():
    task = get_task("add")
    assert [task.reward("3+4=", c) for c in (" 7", "7 and more", "9", "17", "x7", "")] == [
        1.0, 1.0, pytest.approx(0.8), 0.0, 0.0, 0.0]


def test_make_demo_runs_the_trainer_on_the_add_task_then_plots_it():
    """The slow test below runs these commands' steps: the Makefile's recipe is what it tests."""
    recipe = subprocess.run(["make", "-n", "-s", "demo", "SEED=1", "PY=python"], cwd=ROOT,
                            text=True, capture_output=True, check=True).stdout
    commands = [" ".join(line.split()) for line in recipe.replace("\\\n", "").splitlines()
                if line.startswith("python ")]
    assert commands == ["python scripts/make_tiny_model.py out/demo-model",
                        "python train_lean.py --task add --model out/demo-model --seed 1 "
                        "--out-dir out/demo --overwrite",
                        "python scripts/plot_run.py out/demo/metrics.jsonl out/demo.png"]


@pytest.mark.slow
def test_the_demo_learns_on_the_held_out_sums(tiny_model_dir, tmp_path, capsys, clean_env):
    """make demo's run (the tiny model is make_tiny_model.py's, seed 0): the running mean says up,
    the before/after says higher on the held-out credit, and plot_run.py draws it. Not timed:
    BENCHMARKS.md has the time."""
    out = tmp_path / "demo"
    train_lean.main(["--task", "add", "--model", tiny_model_dir, "--seed", "0",
                     "--out-dir", str(out)])
    stdout = capsys.readouterr().out
    assert re.search(r"^step \d+/100 \| reward \S+ ~\S+ \(\S+ \[\S+, \S+\] up\)", stdout, re.M)
    assert re.search(r"^  credit .* n=40  higher after$", stdout, re.M)
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 20, 40, 60, 80, 100]
    assert evals[-1]["credit_lo"] > evals[0]["credit_hi"]
    png = tmp_path / "demo.png"
    script = subprocess.run([sys.executable, "scripts/plot_run.py", str(out / "metrics.jsonl"),
                             str(png)], cwd=ROOT, capture_output=True, text=True)
    assert script.returncode == 0 and png.stat().st_size > 0, script.stderr
