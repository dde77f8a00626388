import random
import re

import numpy as np
import pytest

import train_lean
from helpers import SMALL, read_jsonl, train

from grpo.task import TaskError, score
from tasks import get_task
from tasks.toy import ToyTask


def test_toy_task_prompts_are_seeded_and_rewards_verifiable():
    task = get_task("toy")
    assert task.prompts(5, random.Random(3)) == task.prompts(5, random.Random(3))
    assert task.reward("Repeat a: ", "aaaaaaaaaa") == 1.0
    assert task.reward("Repeat a: ", "aaaaa") == 0.5  # missing characters are misses
    assert task.reward("Repeat a: ", "") == 0.0
    assert task.reward("Repeat a: ", "bbbbbbbbbb") == 0.0


def test_user_task_from_a_file(tmp_path):
    path = tmp_path / "mytask.py"
    path.write_text("class Mine:\n    name = 'mine'\n    def prompts(self, n, rng): return ['x'] * n\n"
                    "    def reward(self, p, c): return float(len(c))\n")
    task = get_task(f"{path}:Mine")
    assert task.name == "mine" and task.reward("x", "abc") == 3.0


def test_user_task_from_a_module():
    assert isinstance(get_task("tasks.toy:ToyTask"), ToyTask)


@pytest.mark.parametrize("name, message", [
    ("nope", "unknown task 'nope'"),
    ("missing.py:X", "file missing.py not found"),
    ("tasks.toy:Nope", "has no attribute Nope"),
    ("no_such_module:X", "cannot import no_such_module"),
    ("tasks.toy:LETTERS", "has no 'name'"),
])
def test_bad_task_names(name, message):
    with pytest.raises(TaskError, match=message):
        get_task(name)


class Flaky:
    name = "flaky"
    min_reward = -1.0

    def prompts(self, n, rng):
        return ["p"] * n

    def reward(self, prompt, completion):
        if completion == "boom":
            raise KeyError(completion)
        if completion == "nan":
            return float("nan")
        return 1.0


def test_a_raising_reward_gets_the_minimum_and_is_counted():
    rewards, _, errors = score(Flaky(), ["p"] * 4, ["ok", "boom", "nan", "boom"])
    assert rewards.tolist() == [1.0, -1.0, -1.0, -1.0]
    assert errors == {"KeyError": 2, "FloatingPointError": 1}


class Parts:
    name = "parts"

    def prompts(self, n, rng):
        return ["p"] * n

    def reward(self, prompt, completion):
        return self.reward_breakdown(prompt, completion)["reward"]

    def reward_breakdown(self, prompt, completion):
        return {"reward": len(completion) / 2, "format": 1.0, "length": float(len(completion))}


def test_component_means_are_returned():
    rewards, means, errors = score(Parts(), ["p", "p"], ["ab", "abcd"])
    assert np.allclose(rewards, [1.0, 2.0])
    assert means == {"format": 1.0, "length": 3.0} and errors == {}


# A user's task with options and a held-out evaluation, as a file: the protocol end to end through the trainer.
USER_TASK = '''
from dataclasses import dataclass

from grpo.config import opt


@dataclass
class EchoOptions:
    letter: str = opt("a", "the letter to repeat")
    width: int = 4                       # a plain field works too: it becomes --width

    def __post_init__(self):
        if len(self.letter) != 1:
            raise ValueError(f"--letter {self.letter!r} must be one character")


class Echo:
    name = "echo"
    options = EchoOptions

    def __init__(self, letter, width):
        self.letter, self.width = letter, width

    def prompts(self, n, rng):
        return [f"Repeat {self.letter}: "] * n

    def reward(self, prompt, completion):
        return completion[:self.width].count(self.letter) / self.width

    def evaluate(self, complete):
        texts = complete(["Repeat a: ", "Repeat b: ", "Repeat c: "])
        assert all(isinstance(t, str) for t in texts)
        return {"first_letter_rate": sum(t[:1] == c for t, c in zip(texts, "abc")) / 3, "n": len(texts)}
'''


@pytest.fixture
def echo(tmp_path):
    path = tmp_path / "echo.py"
    path.write_text(USER_TASK)
    return f"{path}:Echo"


def test_a_user_tasks_options_are_flags_and_environment_overrides(echo, tiny_model_dir, tmp_path, capsys,
                                                                  monkeypatch, clean_env):
    monkeypatch.setenv("GRPO_WIDTH", "3")
    train_lean.main(["--model", tiny_model_dir, "--task", echo, "--letter", "b", *SMALL, "--steps", "1",
                     "--out-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    table = out[out.index(f"options of --task {echo}"):out.index("batch layout")]
    assert re.search(r"--letter\s+b\s+cli", table) and re.search(r"--width\s+3\s+env", table)
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["step"] == 1
    with pytest.raises(SystemExit):
        train_lean.main(["--task", echo, "--help"])
    assert "--letter LETTER" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--letter", "bb"], "--letter 'bb' must be one character"),
    (["--width", "x"], "--width 'x' is not a valid int"),
    (["--stockfish-depth", "3"], "--stockfish-depth does not apply to --task"),
])
def test_a_user_tasks_bad_options_exit_2_with_one_line(echo, args, message, tmp_path, capsys, clean_env):
    with pytest.raises(SystemExit) as exit_:
        train_lean.main(["--model", "unused", "--task", echo, *args, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().count("\n") == 0 and message in err


def test_a_user_task_that_can_evaluate_gets_eval_records(echo, tiny_model_dir, tmp_path, capsys, clean_env):
    train_lean.main(["--model", tiny_model_dir, "--task", echo, *SMALL, "--steps", "2", "--eval-interval", "1",
                     "--out-dir", str(tmp_path)])
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(r["n"] == 3 and 0 <= r["first_letter_rate"] <= 1 and r["eval_time_s"] > 0 for r in evals)
    # --eval-only evaluates the model folder a run saved, and writes no metrics unless asked to
    train_lean.main(["--model", str(tmp_path / "model"), "--task", echo, "--eval-only", "--out-dir", str(tmp_path / "e")])
    assert "first_letter_rate" in capsys.readouterr().out and not (tmp_path / "e" / "metrics.jsonl").exists()


def test_a_task_file_that_raises_on_import_is_a_usage_error(tmp_path):
    (tmp_path / "broken.py").write_text("import json\nraise RuntimeError('no data set here')\n")
    proc = train("--task", f"{tmp_path / 'broken.py'}:Broken", "--out-dir", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"train_lean.py: error: --task {tmp_path / 'broken.py'}:Broken: importing "
                                   f"{tmp_path / 'broken.py'} raised RuntimeError: no data set here")


def test_reward_values_that_are_not_numbers_get_the_minimum():
    class Odd(Flaky):
        def reward(self, prompt, completion):
            return {"s": "0.5", "none": None, "inf": float("inf"), "ok": 0.25}[completion]
    rewards, _, errors = score(Odd(), ["p"] * 4, ["s", "none", "inf", "ok"])
    assert rewards.tolist() == [-1.0, -1.0, -1.0, 0.25]
    assert errors == {"TypeError": 2, "FloatingPointError": 1}
