import random

import numpy as np
import pytest

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
