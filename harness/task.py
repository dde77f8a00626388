"""The task protocol: where prompts come from, how completions are scored, and how a task is found.

A task is any object with
    name: str
    prompts(n: int, rng: random.Random) -> list           n prompts drawn with rng, each a str or
                                                          a conversation (below)
    reward(prompt, completion: str) -> float              a verifiable reward (a bool counts as
                                                          1.0 / 0.0) of the prompt as prompts()
                                                          gave it and the completion's text
and optionally
    reward_breakdown(prompt, completion) -> dict[str, float]   the reward's parts (and "reward")
    reward_parts: tuple[str, ...]         every name reward_breakdown may give: --reward-weights is then checked
                                          at start-up, and each step's parts against it (undeclared, a weight's
                                          name is checked against the first step's parts, which a mixture of
                                          kinds may draw without some)
    min_reward: float                     given to a completion whose reward failed: raised, or returned no
                                          number finite in float32 (default: 1 below the lowest
                                          valid reward of its group: a failure never outscores one)
    options                               a dataclass type: its fields become flags (--field-name) and
                                          GRPO_FIELD_NAME overrides when this task is chosen, validated and
                                          shown like the trainer's own; the task is built as Task(**options)
    evaluate(complete) -> dict            held-out metrics, each a number or a list of per-item scores (the
                                          trainer writes their mean, its 95% interval and the item count, and
                                          keeps the scores for compare_runs.py: docs/evaluation.md);
                                          complete(prompts) -> list[str] is the
                                          trainer's greedy decoding of the policy being trained, and
                                          complete(prompts, n=8, temperature=1.0) -> a list of 8-lists
                                          samples (seeded: the same at every evaluation of the run);
                                          sampled_metrics() turns them into per-prompt pass@k and mean@n.
                                          evaluate(complete, full) when it takes a `full` argument: True at the
                                          run's first and last evaluation and with --eval-only, False between, so
                                          that a large held-out set can be scored whole where a run's before and
                                          after are compared, and a fixed subset of it every --eval-interval
    demonstrations(n, rng) -> list        n texts for --ptx-coef to learn (grpo/ptx.py): each a str, or a
                                          (context, target) pair whose target alone is learned
    trainer_settings: dict                trainer settings the task needs, {Config field name: value}, e.g.
                                          {"ptx_coef": 1.0}: each is the trainer's default while this task is
                                          chosen (command line > GRPO_ environment > the task's > the default),
                                          shown with the source "task" in the header and settings.txt, checked at
                                          start-up as the same value given as a flag (harness/cli.py)
    close()                               release engines, pools, files

A task whose options inherit SampledEvalOptions gets --eval-k, --eval-n and --eval-temperature for that.

A conversation is a prompt for an instruct model: a list of messages {"role": ..., "content": str},
as in TRL's conversational datasets, rendered once with the tokenizer's chat template and its
generation prompt (a tokenizer without one is refused at start-up). Roles are "system", "user",
"assistant" and "tool"; a system message comes first or not at all; the last message is the user's
or a tool's, which the assistant's turn then answers (a last assistant message would get a second
assistant turn, not be continued: refused). The completion is the assistant's text without its
end-of-turn token. reward(), reward_breakdown() and complete(prompts) get the conversation itself;
--system-prompt puts its system message in every conversation, training's and evaluation's, in place
of the task's own (with_system), and reward() then gets it so: what the model saw. docs/chat.md has
a worked example.

The trainer draws each step's prompts with an rng seeded by (seed, step), so the prompt stream needs no
state of its own: a resumed run draws exactly the prompts the killed one would have.

What a task gives is checked where it enters (a TaskError names the bad value): prompts() must return
exactly n non-empty strings or well-formed conversations (prompt_problem), demonstrations() n
texts none of which (nor a pair's target) is empty, min_reward must be a finite number, evaluate() a
dict of names to finite numbers or to non-empty lists of them. A reward that fails gets min_reward
and is counted; Scorer prints the first failure of each kind with its traceback, stops the run when
every reward of a step failed (--reward-errors), and says at the end when most steps learned nothing
(only flat groups).

--task takes a built-in name (the trainer passes the registry of tasks/__init__.py), path/to/file.py:Name
or package.module:Name. Name may be a class (built with the task's options) or a ready object.
"""
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import random
import sys
import time
import traceback
from collections import Counter

import numpy as np
import torch

from grpo.decoders import generate
from grpo.model import context_length, end_ids
from grpo.rollout import decode_completions, encode_prompts, left_pad, shown, stream_seed
from harness import guards, intervals, log
from harness.config import opt

FLOAT32_MAX = float(np.finfo(np.float32).max)   # rewards are stored as float32: a larger one is inf there


class TaskError(ValueError):
    """A task that cannot be found, built or run as configured, or that returned what the protocol does not
    allow (at start-up a usage error; at a later step an error with its traceback)."""


class RewardError(RuntimeError):
    """Every reward of a step failed: the run would train on nothing (--reward-errors stop)."""


class WeightError(RewardError):
    """--reward-weights names a part no completion of the first step reported (a typo): a usage
    error found once the first rewards are in, said in one line, exit 2 (harness/run.py)."""


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
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:   # its modules importable beside it, as for `python file.py`
        sys.path.insert(0, folder)
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
            with fenced("__init__()"):
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
            raise TaskError(f"--task {name}: the task has no {need!r} (see harness/task.py)")
    floor = getattr(task, "min_reward", 0.0)
    if not (isinstance(floor, numbers.Real) and abs(floor) <= FLOAT32_MAX):  # NaN fails the comparison too
        close(task)
        raise TaskError(f"--task {name}: min_reward {floor!r} is not a finite number (it is the reward a failed "
                        f"completion gets)")
    return task


def draw_prompts(task, n: int, rng) -> list:
    """task.prompts(n, rng), checked: exactly n prompts, each a non-empty str or a conversation."""
    got = task.prompts(n, rng)
    if not isinstance(got, (list, tuple)):
        raise TaskError(f"the task's prompts({n}, rng) returned a {type(got).__name__}, not a list "
                        f"of {n} prompts")
    if len(got) != n:
        raise TaskError(f"the task's prompts({n}, rng) returned {len(got)} prompts, not {n}: it must return "
                        f"exactly n (the batch is n groups)")
    for i, p in enumerate(got):
        if prompt_problem(p):
            raise TaskError(f"the task's prompts({n}, rng) returned {_short(p)} as prompt {i}: "
                            f"{prompt_problem(p)}")
    return list(got)


# TRL's and the OpenAI API's roles: a typo ("User") is refused, not rendered as a role of its own
ROLES = ("system", "user", "assistant", "tool")
ANSWERED = ("user", "tool")   # what the assistant's turn may answer (TRL's rule too)
PROMPT_KINDS = ("each prompt must be a non-empty str or a conversation (a non-empty list "
                "of {'role': ..., 'content': ...} dicts)")


def prompt_problem(p) -> str | None:
    """Why p cannot be a prompt (the tokenizer's TypeError was a traceback), or None."""
    if isinstance(p, list):
        return conversation_problem(p)
    if not isinstance(p, str) or not p:
        return PROMPT_KINDS
    return _surrogate(p, "it")


def _surrogate(text: str, where: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:   # what a decode with errors="surrogateescape" leaves
        return (f"{where} holds {text[e.start]!r}, a lone surrogate, which no tokenizer encodes "
                f"(decode the text with errors='replace')")
    return None


def conversation_problem(messages: list) -> str | None:
    """Why a list of messages cannot be a conversation prompt (the module's docstring), or None."""
    if not messages:
        return PROMPT_KINDS + ": this one holds no message"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return (f"message {i} is of type {type(m).__name__}, not a dict with 'role' and "
                    f"'content'")
        missing = [k for k in ("role", "content") if k not in m]
        if missing:
            return (f"message {i} has no {missing[0]!r} (a message is "
                    f"{{'role': ..., 'content': ...}})")
        other = sorted(map(str, m.keys() - {"role", "content"}))
        if other:   # the template would use or drop them unseen; the logs would not show them
            return (f"message {i} has the key {other[0]!r}: a message holds 'role' and 'content' "
                    f"only (tool calls, names and content parts are not supported)")
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or role not in ROLES:
            return f"message {i}'s role {role!r} is not one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            return (f"message {i}'s content is of type {type(content).__name__}, not a str "
                    f"(content parts such as images are not supported)")
        if role == "system" and i:   # templates place it first; --system-prompt replaces it
            return f"message {i} is a system message: only the first message may be one"
        surrogate = _surrogate(content, f"message {i}'s content")
        if surrogate:
            return surrogate
    last = messages[-1]["role"]
    if last not in ANSWERED:
        why = ("the generation prompt would open a second assistant turn after it, not continue it"
               if last == "assistant" else "it leaves the assistant nothing to answer")
        return (f"its last message is the {last}'s: {why}; end the conversation with the user's "
                f"(or a tool's)")
    return None


def with_system(prompts: list, system: str, task_name: str, given: str = "gives") -> list:
    """The prompts with --system-prompt `system` as each conversation's system message, in place of
    its own or first (new lists and dicts: the task's are left as they are). A prompt that is no
    conversation is kept as it is for its check to name, except a str: a TaskError, as a system
    message needs a conversation ("--task NAME {given} str prompts")."""
    out = []
    for p in prompts:
        if isinstance(p, str) and not prompt_problem(p):
            raise TaskError(f"--system-prompt {_short(system)}: --task {task_name} {given} str "
                            f"prompts ({_short(p)}); a system prompt needs conversations "
                            f"(docs/chat.md)")
        if isinstance(p, list) and not prompt_problem(p):
            rest = p[1:] if p[0]["role"] == "system" else p
            p = [{"role": "system", "content": system}, *(dict(m) for m in rest)]
        out.append(p)
    return out


class CheckedTask:
    """The task as the trainer uses it: every attribute the task's own, its prompts(n, rng) checked
    (draw_prompts) and, with --system-prompt (system), given that system message (with_system)."""

    def __init__(self, task, system: str = None, task_name: str = ""):
        # underscored: every other attribute is the task's own (name included)
        self.task, self._system, self._task_name = task, system, task_name

    def __getattr__(self, name):
        value = getattr(self.task, name)
        if not callable(value) or isinstance(value, type):
            return value

        @functools.wraps(value)
        def call(*args, **kwargs):   # every call into the task's code, fenced
            with fenced(f"{name}()"):
                return value(*args, **kwargs)
        return call

    def prompts(self, n: int, rng) -> list:
        with fenced("prompts()"):
            got = draw_prompts(self.task, n, rng)
        return got if self._system is None else with_system(got, self._system, self._task_name)


class TaskEnded(RuntimeError):
    """The task's code raised SystemExit, KeyboardInterrupt or another BaseException of its own: a
    task may not end the run, so the run fails as on any error (the last finished step saved)."""


@contextlib.contextmanager
def fenced(what: str):
    """Around each call of the trainer into the task's code (CheckedTask, build). The task's own
    BaseException (sys.exit(0), KeyboardInterrupt) becomes TaskEnded: never an exit 0, an unsaid
    stop or a run unsaved. A process the task forked that comes back here, returning or raising,
    ends at once: the trainer's clean-up (its locks, logs and files) is the parent's alone."""
    pid = os.getpid()
    try:
        yield
    except BaseException as e:
        if os.getpid() != pid:
            _leave(e.code if isinstance(e, SystemExit) else 1)
        if isinstance(e, (Exception, guards.StoppedBySignal, guards.Exiting)):
            raise
        raise TaskEnded(f"the task's {what} raised {type(e).__name__}"
                        f"{f' ({e})' if str(e) else ''}: a task's code may not end the run") from e
    if os.getpid() != pid:
        _leave(0)


def _leave(code) -> None:
    """A forked process of the task's ends here: what it printed is flushed, nothing else run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def complete_with_system(complete, system: str, task_name: str, prompts, *args, **kwargs):
    """complete(prompts, ...) of an evaluation with --system-prompt: the held-out conversations get
    it as training's do (functools.partial binds complete, system and task_name)."""
    given = "asks complete() in its evaluation for"
    return complete(with_system(prompts, system, task_name, given), *args, **kwargs)


def identity(task) -> str:
    """The task an evaluation scored, as compare_runs.py tells tasks apart: its name and class,
    "toy (tasks.toy.ToyTask)" (two tasks may ask the same held-out prompts and score them
    otherwise)."""
    task = task.task if isinstance(task, CheckedTask) else task
    return f"{getattr(task, 'name', '')} ({type(task).__module__}.{type(task).__qualname__})"


# the trainer's own modules: never the task's helpers, wherever the task's file lies
TRAINER_MODULES = ("__main__", "train_lean", "harness", "grpo")


def code_fingerprint(task) -> str | None:
    """A short hash of the task's code, kept with the checkpoints: a --resume after it was edited
    says so. Its code: the source file of the task's class (what --task path/to/file.py:Name or a
    module names) and every module imported from that file's folder or below it (the helpers it
    imports), the trainer's own left out. None where the class has no file (a notebook's)."""
    task = task.task if isinstance(task, CheckedTask) else task
    try:
        source = os.path.realpath(inspect.getsourcefile(type(task)))
        folder = os.path.dirname(source) + os.sep
        helpers = {os.path.realpath(m.__file__) for name, m in list(sys.modules.items())
                   if name.split(".")[0] not in TRAINER_MODULES
                   and str(getattr(m, "__file__", None)).endswith(".py")}
        digest = hashlib.sha256()
        for path in [source, *sorted(p for p in helpers - {source} if p.startswith(folder))]:
            digest.update(b"" if path == source else os.path.relpath(path, folder).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
        return digest.hexdigest()[:16]
    except (TypeError, OSError):
        return None


def mix_source(task, path: str | None):
    """The function (n, rng) -> n texts that --ptx-coef learns: the lines of `path`, else the task's demonstrations.
    A TaskError (one line, exit 2) when there is none."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise TaskError(f"--ptx-file {path} has no text: --ptx-coef learns its non-empty lines")
        return functools.partial(random_lines, lines)
    if not callable(getattr(task, "demonstrations", None)):
        raise TaskError(f"--ptx-coef needs text: give --ptx-file PATH (a file of lines), or a task with "
                        f"demonstrations(n, rng) ({getattr(task, 'name', type(task).__name__)} has none)")
    source = functools.partial(checked_texts, task.demonstrations)
    source(2, random.Random(0))   # a task's mistake shows at start-up, not after the first step
    return source


def checked_texts(source, n: int, rng) -> list:
    """source(n, rng), checked: exactly n texts, each a string or a (context, target) pair of strings."""
    texts = source(n, rng)
    if not isinstance(texts, (list, tuple)):
        raise TaskError(f"the task's demonstrations({n}, rng) returned a {type(texts).__name__}, not a list of {n} texts")
    if len(texts) != n:
        raise TaskError(f"the task's demonstrations({n}, rng) returned {len(texts)} texts, not {n}")
    for text in texts:
        if not _text_pair(text)[1].strip():   # learned, an empty text is EOS at once: the model learns to stop
            raise TaskError(f"the task's demonstrations({n}, rng) returned {_short(text, 80)}: an empty "
                            f"{'text' if isinstance(text, str) else 'target'} teaches the model to end at once "
                            f"(EOS): leave such texts out")
    return texts


def random_lines(lines: list, n: int, rng) -> list:
    return [rng.choice(lines) for _ in range(n)]


def _text_pair(text) -> tuple[str, str]:
    if isinstance(text, str):
        return "", text
    if isinstance(text, (tuple, list)) and len(text) == 2 and all(isinstance(t, str) for t in text):
        return text[0], text[1]
    raise TaskError(f"a --ptx-coef text must be a string or a (context, target) pair of strings, not {text!r:.80}")


def close(task) -> None:
    """Release what the task holds (its optional close()). A close() that raises is said in one
    line and goes no further: the run's own outcome (its exit status, the error that ended it)
    stands, and stays the last thing said."""
    if not hasattr(task, "close"):
        return
    try:
        task.close()
    except Exception as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        log.warn(f"the task's close() raised {type(e).__name__}: {_first_line(e)} "
                 f"({frame.filename} line {frame.lineno}); what it holds may not be released")


class NotANumber(Exception):
    """A reward or metric that is no finite number; kind names it for the counts ("returned str")."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _number(value, limit: float = FLOAT32_MAX) -> float:
    """value as a float no larger than limit in size (a bool is 1.0 or 0.0), else NotANumber saying what it was."""
    name = type(value).__name__
    if value is None:
        raise NotANumber("returned None", "returned None, not a number")
    try:
        if isinstance(value, (str, bytes)):   # float("0.5") would parse it: a str reward is a bug, not a number
            raise TypeError
        number = float(value)
    except OverflowError:   # an int such as 10**400: inf as a float
        number = math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        raise NotANumber(f"returned {name}", f"returned a {name} ({_short(value)}), not a number") from None
    if math.isnan(number):
        raise NotANumber("returned nan", "returned nan")
    if abs(number) > limit:
        size = "inf" if math.isinf(number) else f"{abs(number):g}, which is inf in float32 (the rewards' dtype)"
        raise NotANumber("returned inf", f"returned {'-' if number < 0 else ''}{size}")
    return number


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""


def _short(value, width: int = 40) -> str:
    if isinstance(value, list) and value and isinstance(value[-1], dict):   # a conversation: its
        last = _short(value[-1], 60)   # last message says more than its first (a system message)
        return f"[{last}]" if len(value) == 1 else f"[..., {last}] ({len(value)} messages)"
    return shown(value, width)


def score(task, prompts, completions, failures: dict = None, weights: dict = None,
          rows: list = None, group_size: int = None, done: list = None):
    """Score completions. Returns (rewards [n] float32, part means, error counts by kind).

    A reward that fails gets the task's min_reward, or where the task declares none, 1 below the
    lowest valid reward of its group (group_size rows in a row; default: all of them; 0 when none is
    valid), and is counted by kind: the exception's type when it raised, "returned str" /
    "returned nan" / "returned inf" ... when it returned no finite number.
    failures, when given, keeps the first failure of each kind: kind -> (exception, prompt, completion).
    weights ({part: weight}, --reward-weights): the reward is the weighted sum of those reward_breakdown parts, a
    part a completion does not report counting 0 (a task mixture's kinds report different parts); rows, when
    given, gets each completion's parts in the weights' order (a failed reward's as its reward's); done, when
    given, each reward as it is scored (how far a long scoring is).
    """
    declared = getattr(task, "min_reward", None)
    floor = 0.0 if declared is None else float(declared)
    errors, failed = Counter(), []
    breakdown = getattr(task, "reward_breakdown", None)
    sums, reported = Counter(), Counter()
    rewards = []
    for p, c in zip(prompts, completions):
        values = [floor] * len(weights or ())
        try:
            if breakdown is not None:
                parts = breakdown(p, c)
                sums.update({k: _number(v) for k, v in parts.items()})
                reported.update(parts.keys())
                if weights:
                    values = [_number(parts.get(k, 0.0)) for k in weights]
                    r = _number(sum(w * v for w, v in zip(weights.values(), values)))
                else:
                    r = _number(parts["reward"] if "reward" in parts else task.reward(p, c))
            else:
                r = _number(task.reward(p, c))
        except TaskEnded:   # not a score: the task tried to end the run
            raise
        except Exception as e:  # noqa: BLE001 - any scoring failure is the completion's fault
            kind = e.kind if isinstance(e, NotANumber) else type(e).__name__
            errors[kind] += 1
            if failures is not None and kind not in failures:
                failures[kind] = (e, p, c)
            r, values = floor, [floor] * len(weights or ())
            failed.append(len(rewards))
        rewards.append(r)
        if done is not None:
            done.append(r)
        if rows is not None:
            rows.append(values)
    # Each part is averaged over the completions that report it: in a task mixture the parts of
    # one kind are means over that kind's completions, not diluted by the others.
    means = {k: v / reported[k] for k, v in sums.items() if k != "reward"}
    rewards = np.asarray(rewards, dtype=np.float32)
    if failed and declared is None:   # a default of 0 gave a crash a positive advantage beside
        mask = np.zeros(len(rewards), dtype=bool)   # rewards below 0
        mask[failed] = True
        rewards = below_valid(rewards, mask, group_size or len(rewards))
        if rows:
            parts = below_valid(np.asarray(rows, dtype=np.float64), mask, group_size or len(rows))
            rows[:] = parts.tolist()
    return rewards, means, dict(errors)


def below_valid(values: np.ndarray, failed: np.ndarray, group_size: int) -> np.ndarray:
    """values [n] (or [n, parts]) with each failed row 1 below the lowest valid value of its group
    (each part's own; 0 where no row of the group is valid): a failure ranks below every valid
    completion it is compared with."""
    out = values.reshape(-1, group_size, *values.shape[1:]).copy()
    for group, bad in zip(out, failed.reshape(-1, group_size)):
        group[bad] = group[~bad].min(0) - 1 if (~bad).any() else 0.0
    return out.reshape(values.shape)


class Scorer:
    """score() for a run, its failures made loud. Called like score() without the task; to_gather() gives what the
    step's record gathers from every device; after_step() reads the gathered step on every rank: the first
    failure of each kind is printed with its traceback (the task's file and line), a step in which every
    reward failed stops the run (unless tolerate), and the first step whose groups all got equal rewards is
    named, with what to try."""

    def __init__(self, task, tolerate: bool, weights: dict = None, group_size: int = None,
                 timeout: float = 0, stuck=None):
        self.task, self.tolerate, self.weights, self.timeout = task, tolerate, weights or {}, timeout
        self.stuck = stuck   # the run's way out of a timeout the task swallows (guards.time_limit)
        self.group_size = group_size   # a failed reward ranks below its group's valid ones (score)
        self.shown, self.flat_named = set(), False
        self.steps, self.flat_steps = 0, 0   # this process's steps, and those whose groups were all flat
        self.scored, self.failures = 0, {}

    EVERY_S = 60.0   # a step's rewards that take longer say so, as a long evaluation does

    def __call__(self, prompts, completions):
        """(rewards, part means, errors by kind, and with --reward-weights each row's parts, else None)."""
        self.scored += len(completions)
        rows, done = [] if self.weights else None, []
        ticker = log.Ticker("rewards", "scoring", lambda: f"{len(done)} of {len(completions)} scored"
                            + " (Ctrl-C or SIGTERM gives the step up, saving the last one)",
                            self.EVERY_S)
        try:
            with guards.time_limit(self.timeout, self.stuck):
                return (*score(self.task, prompts, completions, self.failures, self.weights, rows,
                               self.group_size, done=done), rows)
        except guards.RewardTimeout as e:
            log.warn_here(f"rewards: {len(done)} of {len(completions)} scored in {e.why}: the step "
                          f"is given up")
            raise
        finally:
            ticker.close()

    def to_gather(self) -> dict:
        """This device's rows scored this step, and a report of its first failure of each kind not yet shown."""
        return {"scored": self.scored,
                "reports": {k: self._report(*f) for k, f in self.failures.items() if k not in self.shown}}

    def after_step(self, step: int, step_rows: dict, frac_zero_std: float) -> None:
        """step_rows: the step over every device (harness/log.py whole_step: errors by kind, rows scored, reports), the
        same on each rank, so is the decision here. Raises RewardError when every reward failed."""
        errors, failures, self.failures, self.scored = step_rows["errors"], self.failures, {}, 0
        all_failed = bool(errors) and sum(errors.values()) >= step_rows["scored"]
        if all_failed and not self.tolerate:   # the most frequent kind's first failure: its traceback, or where
            e = failures[max(failures, key=errors.get)][0]
            counts = ", ".join(f"{k} {n}" for k, n in sorted(errors.items()))
            error = RewardError(f"step {step}: every reward failed ({counts}; the first "
                                f"{self._what(e)}): a step like this trains on nothing. Fix the task's "
                                f"reward, or pass --reward-errors tolerate to score such "
                                f"completions as failures and go on")
            raise error from (None if isinstance(e, NotANumber) else e.with_traceback(_from_task(e)))
        declared = getattr(self.task, "reward_parts", None)
        undeclared = [k for k in step_rows["part_means"] if declared is not None and k not in declared]
        if undeclared:   # a declaration the breakdown outgrew would pass a weight's typo at start-up
            raise RewardError(f"step {step}: the task's reward_breakdown gave {', '.join(undeclared)}, which its "
                              f"reward_parts ({', '.join(declared)}) do not name: declare every part")
        unknown = [k for k in self.weights if k != "reward" and k not in step_rows["part_means"]]
        if unknown and step_rows["part_means"] and not self.steps and declared is None:   # a typo: 0 all run long
            raise WeightError(f"--reward-weights names {', '.join(unknown)}: no completion of step {step} reported "
                              f"such a part (the task's reward_breakdown gave {', '.join(step_rows['part_means'])})")
        for kind in sorted(errors.keys() - self.shown):   # each kind new to the run, the lowest rank's first
            log.warn(f"step {step}: the task's reward {step_rows['reports'][kind]}")
            self.shown.add(kind)
        self.steps += 1
        self.flat_steps += frac_zero_std == 1.0
        if frac_zero_std == 1.0 and not all_failed and not self.flat_named:
            self.flat_named = True
            log.warn(f"step {step}: every group's completions got equal rewards (frac_zero_std 1.0), so every "
                     f"advantage is 0 and the step learns nothing. Try a higher --temperature, a larger --group-size, "
                     f"a reward with partial credit, or a model that sometimes solves the task (said once)")

    def flat_summary(self) -> str | None:
        """At the end of the run: a line when most of its steps had only flat groups (one note at step 1 is easily
        lost above hundreds of step lines, and the run still ends by saving "the trained model"), else None."""
        if self.flat_steps * 2 <= self.steps:
            return None
        return (f"{self.flat_steps} of {self.steps} steps had only flat groups (every advantage 0): the model barely "
                f"trained. Try a higher --temperature, a larger --group-size, a reward with partial credit, or a "
                f"model that sometimes solves the task")

    def _what(self, e) -> str:
        """What the reward did: "raised NameError: ..." or "returned a str ('0.5'), not a number (where)"."""
        if isinstance(e, NotANumber):
            return f"{e}{_where(getattr(self.task, 'reward_breakdown', None) or self.task.reward)}"
        return f"raised {type(e).__name__}: {_first_line(e)}"

    def _report(self, e, prompt, completion) -> str:
        floor = getattr(self.task, "min_reward", None)
        given = (f"min_reward {float(floor):g}" if floor is not None else
                 "1 below the lowest valid reward of their group (the task declares no min_reward)")
        text = (f"{self._what(e)}, for the prompt {_short(prompt)} and completion {_short(completion)}; such "
                f"completions get {given} and are counted in reward_errors (each kind shown once)")
        if not isinstance(e, NotANumber):
            text += "\n" + "".join(traceback.format_exception(type(e), e, _from_task(e))).rstrip()
        return text


def _from_task(e):
    """The traceback of an exception caught in score() without this module's frames (score's, the
    fence's): the task's frames first."""
    tb = e.__traceback__
    while tb.tb_next and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _where(fn) -> str:
    try:
        fn = inspect.unwrap(fn)   # CheckedTask's fence
        return f" ({fn.__qualname__}, {inspect.getsourcefile(fn)} line {inspect.getsourcelines(fn)[1]})"
    except (TypeError, OSError, AttributeError):
        return ""


EVAL_RECORD_KEYS = ("kind", "step", "eval_time_s")   # the eval record's own keys, not the task's to give
INTERVAL_KEYS = ("_lo", "_hi", "_n")   # beside a per-item metric NAME in the record: NAME_lo, NAME_hi, NAME_n


def check_metrics(result) -> dict:
    """What evaluate() returned, checked: a dict of names (str) to finite numbers (ints stay ints), or to per-item
    scores (a list, tuple or 1-D array of finite numbers, one per held-out item; bools count 1 / 0), kept as a list
    of floats."""
    if not isinstance(result, dict):
        raise TaskError(f"the task's evaluate() returned a {type(result).__name__} ({_short(result)}), not a dict "
                        f"of metric names to numbers")
    out = {}
    for k, v in result.items():
        if not isinstance(k, str) or k in EVAL_RECORD_KEYS:
            raise TaskError(f"the task's evaluate() returned the key {k!r}: metric names are str, and "
                            f"{', '.join(EVAL_RECORD_KEYS)} are the eval record's own")
        if isinstance(v, (list, tuple)) or isinstance(v, np.ndarray) and v.ndim:   # a 0-d array is one number
            out[k] = _items(k, v)
            continue
        try:
            # an int beyond a float (10**400) is inf
            exact = isinstance(v, numbers.Integral) and abs(v) <= sys.float_info.max
            out[k] = int(v) if exact else _number(v, sys.float_info.max)
        except NotANumber:
            raise TaskError(f"the task's evaluate() returned {{{k!r}: {_short(v)}}}: {k!r} must be a finite "
                            f"number") from None
    for k, v in out.items():   # NAME_lo, NAME_hi and NAME_n of a per-item metric are the trainer's to write
        taken = [k + s for s in INTERVAL_KEYS if k + s in out] if isinstance(v, list) else []
        if taken:
            raise TaskError(f"the task's evaluate() returned the key {taken[0]!r} beside the per-item scores of {k!r}: "
                            f"the trainer writes {k}_lo, {k}_hi and {k}_n itself (the interval and the item count)")
    return out


def _items(name: str, values) -> list:
    """A metric's per-item scores as floats, checked: at least one item, each a finite number."""
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise TaskError(f"the task's evaluate() returned {name!r} as an array of shape {values.shape}: per-item "
                        f"scores are one number per item (a list or a 1-D array)")
    if len(values) == 0:
        raise TaskError(f"the task's evaluate() returned {{{name!r}: {_short(values)}}}: per-item scores need at least "
                        f"one item")
    out = []
    for i, v in enumerate(values):
        try:
            out.append(_number(v, sys.float_info.max))
        except NotANumber:
            raise TaskError(f"the task's evaluate() returned {_short(v)} as item {i} of {name!r}: each per-item "
                            f"score must be a finite number") from None
    if intervals.overflows(out, sides=2):   # the mean, its interval, compare_runs.py's differences
        raise TaskError(f"the task's evaluate() returned items of {name!r} as large as "
                        f"{max(map(abs, out)):g}: sums of {len(out)} of them overflow a float (the "
                        f"mean would be inf); scale the scores down")
    return out


def summarise_metrics(checked: dict) -> tuple:
    """(the eval record's metrics, the per-item scores by name) of check_metrics()'s dict: a plain number stays as it
    is; per-item scores become their mean NAME (summed in item order: the number a task that averaged them itself
    would give) with the 95% interval NAME_lo, NAME_hi (Wilson for a rate, every item 0 or 1; else a bootstrap over
    the items: harness/intervals.py) and the item count NAME_n."""
    record, items = {}, {}
    for k, v in checked.items():
        if isinstance(v, list):
            s = intervals.summarise(v)
            record.update({k: s["value"], f"{k}_lo": s["lo"], f"{k}_hi": s["hi"], f"{k}_n": s["n"]})
            items[k] = v
        else:
            record[k] = v
    return record, items


@dataclasses.dataclass
class SampledEvalOptions:
    """Options of a task whose evaluate() can also sample (inherit them: class MyOptions(SampledEvalOptions)).
    Off by default: it decodes N completions per held-out prompt where the greedy evaluation decodes one."""
    eval_k: int = opt(0, "the held-out evaluation also samples: pass@K and mean@N of N completions per prompt, "
                      "beside the greedy metrics (0: greedy only)", resume_free=True)   # evaluation only
    eval_n: int = opt(0, "completions sampled per held-out prompt with --eval-k, at least K (0: K); more than K "
                      "gives a pass@K of lower variance", resume_free=True)
    eval_temperature: float = opt(1.0, "sampling temperature of --eval-k's completions", resume_free=True)

    def __post_init__(self):
        if self.eval_k < 0:
            raise ValueError(f"--eval-k {self.eval_k} must be >= 0 (0: greedy evaluation only)")
        if self.eval_n and not self.eval_k:
            raise ValueError(f"--eval-n {self.eval_n} samples for pass@K: give --eval-k too")
        if self.eval_temperature != type(self).eval_temperature and not self.eval_k:   # not the default: given
            raise ValueError(f"--eval-temperature {self.eval_temperature} is the temperature of --eval-k's samples, "
                             f"and --eval-k 0 samples none: give --eval-k too")
        if self.eval_n and self.eval_n < self.eval_k:
            raise ValueError(f"--eval-n {self.eval_n} must be at least --eval-k {self.eval_k}: pass@K needs K "
                             f"samples (0: N = K)")
        if not 0 < self.eval_temperature < math.inf:
            raise ValueError(f"--eval-temperature {self.eval_temperature} must be > 0 (greedy is the evaluation's "
                             f"default; --eval-k 0 for it alone)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code"): the chance that k of the n, drawn without replacement, hold a correct one,
    1 - C(n-c, k) / C(n, k), computed as prod over i in (n-c, n] of (1 - k/i): no huge binomials."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, not n={n}, c={c}, k={k}")
    if n - c < k:   # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def sampled_metrics(complete, prompts: list, correct, k: int, n: int = None, temperature: float = 1.0,
                    name: str = "") -> dict:
    """n (default k) completions of each prompt sampled with complete(prompts, n=n, temperature=temperature) and
    judged by correct(prompt, completion) -> bool, per prompt: {"<name>_pass@k": pass_at_k of each prompt,
    "<name>_mean@n": the share of each prompt's samples that are correct (the unbiased pass@1)}. Returned by
    evaluate(), the trainer averages each list over the prompts and gives it its interval (a bootstrap over them)."""
    n = n or k
    if not 1 <= k <= n:
        raise ValueError(f"sampled_metrics needs 1 <= k <= n, not k={k}, n={n}")
    hits = [sum(bool(correct(p, c)) for c in group) for p, group in zip(prompts, complete(prompts, n=n,
                                                                                      temperature=temperature))]
    prefix = f"{name}_" if name else ""
    return {f"{prefix}pass@{k}": [pass_at_k(n, c, k) for c in hits], f"{prefix}mean@{n}": [c / n for c in hits]}


def eval_completions(model, tokenizer, prompts: list, n: int = None, temperature: float = None, *, prepend_bos: bool,
                     max_new_tokens: int, batch: int, seed: int = 0, device=None, autocast=None,
                     progress=None) -> list:
    """Completions for evaluation (a task's evaluate(complete)), not training, `batch` rows at a time.

    Without n: the greedy completion of each prompt (list[str]). With n: n completions of each prompt sampled at
    temperature (default 1.0; no top-k/top-p), as one list of n per prompt. Each batch's sampling is seeded by seed
    and its first row (the same at every evaluation of a run: two evaluations differ only by the weights) inside a
    fork of torch's RNG, so training draws afterwards exactly what it would have drawn without the evaluation.
    progress, when given, is called after each batch with the count of prompts whose completions are
    all done."""
    if n is None and temperature is not None:
        raise TaskError(f"complete(prompts, temperature={temperature}) samples only with n, the completions per "
                        f"prompt: complete(prompts, n=8, temperature={temperature})")
    if n is not None and not (isinstance(n, int) and n >= 1 and (temperature is None or temperature > 0)):
        raise TaskError(f"complete(prompts, n={n!r}, temperature={temperature!r}): n must be an int >= 1 and the "
                        f"temperature > 0 (greedy: complete(prompts))")
    bad = next((i for i, p in enumerate(prompts) if prompt_problem(p)), None)
    if bad is not None:
        raise TaskError(f"complete() was given {_short(prompts[bad])} as prompt {bad}: "
                        f"{prompt_problem(prompts[bad])}")
    sample_at = 0.0 if n is None else 1.0 if temperature is None else temperature
    ends = end_ids(model, tokenizer)   # EOS, and an instruct model's end of turn
    try:
        ids = encode_prompts(tokenizer, prompts, prepend_bos, max_new_tokens, context_length(model.config))
    except ValueError as e:   # the task's held-out prompt does not fit the model
        raise TaskError(str(e)) from None
    rows = [row for row in ids for _ in range(n or 1)]
    kind = torch.device(device or "cpu").type
    texts = []
    with torch.random.fork_rng(devices=[] if kind == "cpu" else [device], device_type=kind):
        for s in range(0, len(rows), batch):
            torch.manual_seed(stream_seed(seed, s))
            row_ids, mask = left_pad(rows[s:s + batch], ends[0], device)
            out = generate(model, row_ids, mask, end_ids=ends, max_new_tokens=max_new_tokens,
                           temperature=sample_at, autocast=autocast)
            texts += decode_completions(tokenizer, out.ids, out.mask, ends)
            if progress is not None:
                progress(len(texts) // (n or 1))
    return texts if n is None else [texts[i:i + n] for i in range(0, len(texts), n)]


def _listed(complete, prompts, *args, **kwargs):
    """complete(prompts, ...) as the task calls it: prompts a list (or tuple) of them, else a
    TaskError (a str was decoded as prompts of one character each, a generator broke the count)."""
    if not isinstance(prompts, (list, tuple)):
        raise TaskError(f"complete() takes a list of prompts, and the task's evaluate() gave it a "
                        f"{type(prompts).__name__}, {_short(prompts)}: pass a list ([prompt] for "
                        f"one)")
    return complete(list(prompts), *args, **kwargs)


def takes(function, name: str) -> bool:
    """Whether function takes the keyword `name` (by name, or as **kwargs): a task's evaluate()
    `full`, a complete() `progress`."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):   # a builtin or C callable without a signature: the one-argument form
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def evaluate(task, complete, step: int, metrics_file=None, reporter=None, items_path: str = None,
             full: bool = True) -> dict:
    """The task's held-out evaluation: evaluate(complete), where complete(prompts) -> list[str] is greedy
    decoding of the policy (the same prompt encoding, BOS and --max-new-tokens as training) and
    complete(prompts, n=..., temperature=...) samples n per prompt (eval_completions). What the
    task returns (checked: names to finite numbers or to per-item scores) is printed as a table and logged as a
    record with "kind": "eval" (to the JSONL file and the --report-to reporter); a per-item metric is logged as its
    mean with its interval and item count (summarise_metrics), and its scores as a line of items_path
    (harness/log.py items_path: what compare_runs.py pairs), with a hash of the prompts the evaluation asked for,
    which says whether two evaluations scored the same items, and the task's identity
    (identity). full (the run's first and last evaluation, --eval-only) is passed on to a task whose
    evaluate() takes it (takes). Returns (the record, the per-item line or None). Rank 0 alone
    calls it: nothing here waits on another rank."""
    t0 = time.perf_counter()
    said = log.EvalProgress(complete, f"eval at step {step}", batched=takes(complete, "progress"))
    with contextlib.closing(said) as counted:   # said, not silent
        given = {"full": full} if takes(task.evaluate, "full") else {}
        asked = task.evaluate(functools.partial(_listed, counted), **given)
        result, items = summarise_metrics(check_metrics(asked))
    record = {"kind": "eval", "step": step, **result, "eval_time_s": time.perf_counter() - t0}
    print(eval_table(record, items), flush=True)
    if metrics_file is not None:
        log.write(metrics_file, record)
    entry = {"step": step, "prompts": counted.asked, "prompts_sha256": counted.digest(),
             "task": identity(task), "items": items} if items else None
    if items_path is not None and entry:
        with log.open_jsonl(items_path, append=True) as f:
            log.write(f, entry)
    if reporter is not None:
        reporter.log(record, step)
    return record, entry


def eval_table(record: dict, items: dict = ()) -> str:
    """The console table, a metric a line; a per-item one with its interval and item count: 0.10 [0.06, 0.17] n=100."""
    keys = [k for k in record if k not in EVAL_RECORD_KEYS and not any(
        k.endswith(s) and k[:-len(s)] in items for s in INTERVAL_KEYS)]
    width = max(map(len, keys), default=0)
    lines = [f"eval at step {record['step']} ({record['eval_time_s']:.1f} s)"]
    for k in keys:
        v = record[k]
        text = (intervals.shown(v, record[f"{k}_lo"], record[f"{k}_hi"], record[f"{k}_n"]) if k in items
                else f"{v:.4f}" if isinstance(v, float) else f"{v}")
        lines.append(f"  {k:<{width}}  {text}")
    return "\n".join(lines)
