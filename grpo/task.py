"""The task protocol: where prompts come from, how completions are scored, and how a task is found.

A task is any object with
    name: str
    prompts(n: int, rng: random.Random) -> list[str]      n prompts, drawn with rng
    reward(prompt: str, completion: str) -> float          a verifiable reward
and optionally
    reward_breakdown(prompt, completion) -> dict[str, float]   the reward's components (and "reward")
    min_reward: float                     given to a completion whose scoring raised or was not finite
    options                               a dataclass type: its fields become flags (--field-name) and
                                          GRPO_FIELD_NAME overrides when this task is chosen, validated and
                                          shown like the trainer's own; the task is built as Task(**options)
    evaluate(complete) -> dict[str, float]    held-out metrics; complete(prompts) -> list[str] is the
                                          trainer's greedy decoding of the policy being trained
    close()                               release engines, pools, files

The trainer draws each step's prompts with an rng seeded by (seed, step), so the prompt stream needs no
state of its own: a resumed run draws exactly the prompts the killed one would have.

--task takes a built-in name (the trainer passes the registry of tasks/__init__.py), path/to/file.py:Name
or package.module:Name. Name may be a class (built with the task's options) or a ready object.
"""
import dataclasses
import importlib
import importlib.util
import os
import sys
from collections import Counter

import numpy as np


class TaskError(ValueError):
    """A task that cannot be found, built or run as configured (reported as a usage error)."""


def resolve(name: str, builtin: dict):
    """The class or object that --task NAME names, imported but not built.

    builtin maps short names to "module:Attribute" strings."""
    spec = builtin.get(name, name)
    if ":" not in spec:
        raise TaskError(f"unknown task {name!r}: use one of {', '.join(sorted(builtin))} "
                        f"or path/to/file.py:Name or module:Name")
    where, attr = spec.rsplit(":", 1)
    try:
        module = _load_file(where, name) if where.endswith(".py") else importlib.import_module(where)
    except TaskError:
        raise
    except ImportError as e:
        raise TaskError(f"--task {name}: cannot import {where} ({e})") from None
    except Exception as e:  # noqa: BLE001 - a user's file that fails on import is a usage error, not a crash
        raise TaskError(f"--task {name}: importing {where} raised {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise TaskError(f"--task {name}: {where} has no attribute {attr}")
    return getattr(module, attr)


def _load_file(path: str, name: str):
    if not os.path.isfile(path):
        raise TaskError(f"--task {name}: file {path} not found")
    module_name = "grpo_user_task_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def options_type(target):
    """The task's options dataclass, or None when it takes none."""
    options = getattr(target, "options", None)
    if options is None:
        return None
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise TaskError(f"the task's options must be a dataclass type, not {options!r}")
    return options


def build(target, options=None, name: str = ""):
    """The task object: a class is called with its options (a dataclass instance or a dict) as keywords;
    an object is used as it is."""
    if isinstance(target, type):
        if dataclasses.is_dataclass(options):
            options = dataclasses.asdict(options)
        try:
            task = target(**(options or {}))
        except TaskError:
            raise
        except (TypeError, ValueError) as e:
            raise TaskError(f"--task {name}: cannot build the task ({type(e).__name__}: {e})") from None
    else:
        task = target
    for need in ("name", "prompts", "reward"):
        if not hasattr(task, need):
            close(task)
            raise TaskError(f"--task {name}: the task has no {need!r} (see grpo/task.py)")
    return task


def close(task) -> None:
    """Release what the task holds (its optional close())."""
    if hasattr(task, "close"):
        task.close()


def _number(value) -> float:
    """A reward as a finite float; a string, None or NaN is the task's bug, counted like an exception."""
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise TypeError(f"reward is a {type(value).__name__}, not a number")
    value = float(value)
    if not np.isfinite(value):
        raise FloatingPointError("non-finite reward")
    return value


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
                r = _number(parts["reward"] if "reward" in parts else task.reward(p, c))
            else:
                r = _number(task.reward(p, c))
        except Exception as e:  # noqa: BLE001 - any scoring failure is the completion's fault
            errors[type(e).__name__] += 1
            r = floor
        rewards.append(r)
    # Each component is averaged over the completions that report it: in a task mixture the
    # components of one kind are means over that kind's completions, not diluted by the others.
    means = {k: v / reported[k] for k, v in components.items() if k != "reward"}
    return np.asarray(rewards, dtype=np.float32), means, dict(errors)
