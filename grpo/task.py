"""Tasks: where prompts come from and how completions are scored.

A task is any object with
    name: str
    prompts(n: int, rng: random.Random) -> list[str]      n prompts, drawn with rng
    reward(prompt: str, completion: str) -> float          a verifiable reward
and optionally
    reward_breakdown(prompt, completion) -> dict[str, float]   the reward's components
    min_reward: float                                      given to a completion whose scoring raised
    close()                                                release engines, pools, files

The trainer draws each step's prompts with an rng seeded by (seed, step), so the prompt stream
needs no state of its own: a resumed run draws exactly the prompts the killed one would have.

`get_task("toy")` returns a built-in task; `get_task("path/to/file.py:Name")` or
`get_task("package.module:Name")` loads a user's own (a class is called with no arguments).
"""
import importlib
import importlib.util
import os
import sys
from collections import Counter

import numpy as np

BUILTIN = {
    "toy": ("tasks.toy", "ToyTask"),
    "chess-env": ("tasks.rookworld.task", "ChessEnvTask"),
    "chess-policy": ("tasks.rookworld.task", "ChessPolicyTask"),
    "chess": ("tasks.rookworld.task", "ChessMixTask"),
}


class TaskError(ValueError):
    """A task name that cannot be resolved (reported as a usage error)."""


def get_task(name: str, **options):
    """Resolve a task name to a task object. options go to built-in task constructors."""
    if name in BUILTIN:
        module_name, attr = BUILTIN[name]
        return getattr(importlib.import_module(module_name), attr)(**options)
    if ":" not in name:
        raise TaskError(f"unknown task {name!r}: use one of {', '.join(sorted(BUILTIN))} "
                        f"or path/to/file.py:Name or module:Name")
    where, attr = name.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise TaskError(f"--task {name}: file {where} not found")
        module_name = "grpo_user_task_" + os.path.splitext(os.path.basename(where))[0]
        spec = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise TaskError(f"--task {name}: cannot import {where} ({e})") from None
    if not hasattr(module, attr):
        raise TaskError(f"--task {name}: {where} has no attribute {attr}")
    obj = getattr(module, attr)
    task = obj() if isinstance(obj, type) else obj
    for need in ("name", "prompts", "reward"):
        if not hasattr(task, need):
            raise TaskError(f"--task {name}: the task has no {need!r} (see grpo/tasks/__init__.py)")
    return task


def score(task, prompts, completions):
    """Score completions. Returns (rewards [n] float32, component means, error counts by kind).

    A reward function that raises never stops training: that completion gets the task's
    min_reward and the error is counted by exception type.
    """
    floor = float(getattr(task, "min_reward", 0.0))
    errors = Counter()
    breakdown = getattr(task, "reward_breakdown", None)
    components, reported = Counter(), Counter()
    rewards = []
    for p, c in zip(prompts, completions):
        try:
            if breakdown is not None:
                parts = breakdown(p, c)
                components.update({k: float(v) for k, v in parts.items()})
                reported.update(parts.keys())
                r = float(parts["reward"]) if "reward" in parts else task.reward(p, c)
            else:
                r = float(task.reward(p, c))
            if not np.isfinite(r):
                raise FloatingPointError("non-finite reward")
        except Exception as e:  # noqa: BLE001 - any scoring failure is the completion's fault
            errors[type(e).__name__] += 1
            r = floor
        rewards.append(r)
    # Each component is averaged over the completions that report it: in a task mixture the
    # P: components are means over P: completions, not diluted by the A: ones.
    means = {k: v / reported[k] for k, v in components.items() if k != "reward"}
    return np.asarray(rewards, dtype=np.float32), means, dict(errors)
