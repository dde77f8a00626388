import functools
import io
import json
import random
import re
import shutil
import sys
from fractions import Fraction
from math import comb
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import train_lean
from helpers import (CHAT_TASK, EVALUATED_TASK, SMALL, means, read_jsonl, records, train,
                     usage_error, weights)

from grpo.decoders import generate
from grpo.model import load_policy, load_tokenizer
from grpo.rollout import decode_completions, encode_prompts, left_pad
from harness.task import (CheckedTask, RewardError, Scorer, TaskError, build, check_metrics,
                          complete_with_system, draw_prompts, eval_completions, evaluate, pass_at_k,
                          resolve, sampled_metrics, score, takes)
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
    assert errors == {"KeyError": 2, "returned nan": 1}


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


def test_reward_weights_sum_the_parts_and_keep_each_rows():
    rows = []
    rewards, _, _ = score(Parts(), ["p"] * 3, ["ab", "abcd", None], weights={"length": 0.5, "format": 2.0}, rows=rows)
    # 0.5 x length + 2 x format; the third completion's reward fails (len(None)): the task declares
    # no min_reward, so it gets 1 below the lowest valid reward, each part 1 below the lowest
    assert np.allclose(rewards, [3.0, 4.0, 2.0]) and rows == [[2.0, 1.0], [4.0, 1.0], [1.0, 0.0]]
    rows = []
    assert np.allclose(score(Parts(), ["p"], ["ab"], weights={"missing": 1.0, "length": 1.0}, rows=rows)[0], [2.0])
    assert rows == [[0.0, 2.0]]   # a part a completion does not report counts 0 (a mixture's other kind)


def test_a_weighted_part_no_completion_reported_stops_the_first_step():
    scorer = Scorer(Parts(), tolerate=False, weights={"lenght": 1.0})
    step_rows = {"errors": {}, "scored": 2, "reports": {}, "part_means": {"format": 1.0, "length": 3.0}}
    with pytest.raises(RewardError, match="--reward-weights names lenght: no completion of step 1 reported such a "
                                          "part .the task's reward_breakdown gave format, length."):
        scorer.after_step(1, step_rows, 0.0)
    Scorer(Parts(), tolerate=False, weights={"length": 1.0, "reward": 1.0}).after_step(1, step_rows, 0.0)


class DeclaredParts(Parts):
    reward_parts = ("reward", "format", "length")


def test_declared_parts_stand_for_the_first_steps_and_every_part_given_must_be_declared():
    step_rows = {"errors": {}, "scored": 2, "reports": {}, "part_means": {"format": 1.0}}
    # a declared part no completion of this step gave (another kind of a mixture): checked at start-up instead
    Scorer(DeclaredParts(), tolerate=False, weights={"length": 1.0}).after_step(1, step_rows, 0.0)
    step_rows["part_means"]["lenght"] = 2.0   # a breakdown that outgrew its declaration
    with pytest.raises(RewardError, match="step 3: the task's reward_breakdown gave lenght, which its reward_parts "
                                          ".reward, format, length. do not name: declare every part"):
        Scorer(DeclaredParts(), tolerate=False, weights={"length": 1.0}).after_step(3, step_rows, 0.0)


# A user's task with options and a held-out evaluation, as a file: the protocol end to end through the trainer.
USER_TASK = '''
from dataclasses import dataclass

from harness.config import opt


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
    header = capsys.readouterr().out
    assert "--letter b" in header and "--width 3 (env)" in header   # the settings given, in the header
    table = (tmp_path / "run" / "settings.txt").read_text()
    table = table[table.index(f"options of --task {echo}"):table.index("batch layout")]
    assert re.search(r"--letter\s+b\s+cli", table) and re.search(r"--width\s+3\s+env", table)
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["step"] == 1
    with pytest.raises(SystemExit):
        train_lean.main(["--task", echo, "--help"])
    assert "--letter LETTER" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--letter", "bb"], "--letter 'bb' must be one character"),
    (["--width", "x"], "--width 'x' is not a valid int"),
    (["--stockfish-depth", "3"], "--stockfish-depth is not a flag of train_lean.py nor of --task"),
    (["--lettr", "b"], "did you mean --letter?"),   # the task's own flags are suggested too
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


def test_reward_values_that_are_not_numbers_get_the_minimum_counted_by_what_they_were():
    class Odd(Flaky):
        def reward(self, prompt, completion):
            return {"s": "0.5", "none": None, "inf": float("-inf"), "f32": 1e39, "list": [0.5], "ok": 0.25,
                    "np": np.float64(0.75), "true": True, "false": False, "max": 3e38}[completion]
    kinds = ["s", "none", "inf", "f32", "list", "ok", "np", "true", "false", "max"]
    failures = {}
    rewards, _, errors = score(Odd(), ["p"] * len(kinds), kinds, failures)
    # rewards are stored as float32: 1e39 is finite as a Python float and inf there; 3e38 still fits.
    # A bool is a number (True counts 1.0): `return answer == expected` is a common, correct reward.
    assert rewards.tolist() == [-1.0] * 5 + [0.25, 0.75, 1.0, 0.0, np.float32(3e38)]
    assert errors == {"returned str": 1, "returned None": 1, "returned inf": 2, "returned list": 1}
    assert [str(failures[k][0]) for k in ("returned str", "returned None", "returned inf", "returned list")] == [
        "returned a str ('0.5'), not a number", "returned None, not a number", "returned -inf",
        "returned a list ([0.5]), not a number"]
    assert failures["returned inf"][1:] == ("p", "inf")   # the first of the kind, with its prompt and completion


def test_reward_breakdown_components_must_be_numbers_too():
    class Parted(Parts):
        def reward_breakdown(self, prompt, completion):
            return {"reward": 1.0, "format": "yes"}
    rewards, means, errors = score(Parted(), ["p"], ["c"])
    assert rewards.tolist() == [0.0] and errors == {"returned str": 1} and means == {}


@pytest.mark.parametrize("floor", [float("nan"), float("inf"), 1e39, "0", None])
def test_min_reward_must_be_a_finite_number(floor):
    class Floored(Flaky):
        min_reward = floor
    with pytest.raises(TaskError, match=r"--task t: min_reward .* is not a finite number"):
        build(Floored, None, "t")


def test_min_reward_that_is_a_number_builds():
    class Floored(Flaky):
        min_reward = np.float32(-2)
    assert build(Floored, None, "t").min_reward == -2


class Counted(Flaky):
    def __init__(self, result):
        self.result = result

    def prompts(self, n, rng):
        return self.result(n)


@pytest.mark.parametrize("result, message", [
    (lambda n: ["p"] * (n - 1), "returned 3 prompts, not 4: it must return exactly n"),
    (lambda n: ["p"] * (n + 1), "returned 5 prompts, not 4"),
    (lambda n: [], "returned 0 prompts, not 4"),
    (lambda n: "pppp", "returned a str, not a list of 4 prompts"),
    (lambda n: (p for p in "pppp"), "returned a generator, not a list of 4 prompts"),
    (lambda n: ["p", "p", 3, "p"],
     "returned 3 as prompt 2: each prompt must be a non-empty str or a conversation"),
    (lambda n: ["p", "", "p", "p"], "returned '' as prompt 1"),
    (lambda n: ["p", None, "p", "p"], "returned None as prompt 1"),
    # the tokenizer's TypeError was a traceback
    (lambda n: ["p", "a\udc80b", "p", "p"],
     "returned 'a\\udc80b' as prompt 1: it holds '\\udc80', a lone surrogate, which no tokenizer "
     "encodes"),
])
def test_prompts_are_exactly_n_non_empty_strings(result, message):
    with pytest.raises(TaskError, match=re.escape(f"the task's prompts(4, rng) {message}")):
        draw_prompts(Counted(result), 4, random.Random(0))


def test_a_held_out_prompt_with_a_lone_surrogate_is_named():
    said = "complete() was given 'x\\ud800' as prompt 1: it holds '\\ud800', a lone surrogate"
    with pytest.raises(TaskError, match=re.escape(said)):
        eval_completions(None, None, ["fine", "x\ud800"], prepend_bos=True, max_new_tokens=2,
                         batch=1)


def test_prompts_as_a_tuple_are_fine():
    assert draw_prompts(Counted(lambda n: ("a",) * n), 3, random.Random(0)) == ["a", "a", "a"]


# ---- conversations: a prompt for an instruct model (harness/task.py's docstring) ----------------

USER = {"role": "user", "content": "Repeat a: "}
SYSTEM = {"role": "system", "content": "Be brief."}
ASSISTANT = {"role": "assistant", "content": "aaaa"}
TOOL = {"role": "tool", "content": "42"}


def test_a_conversation_is_a_prompt_given_on_as_it_is():
    conversations = [[USER], [SYSTEM, USER], [SYSTEM, USER, ASSISTANT, USER],
                     [USER, ASSISTANT, TOOL], [{"role": "user", "content": ""}]]
    got = draw_prompts(Counted(lambda n: conversations), 5, random.Random(0))
    assert got == conversations and all(a is b for a, b in zip(got, conversations))
    mixed = ["Repeat a: ", [USER]]
    assert draw_prompts(Counted(lambda n: mixed), 2, random.Random(0)) == mixed


# each malformed conversation as prompt 1 of 2, and what the one line says of it
MALFORMED = [
    ([], "each prompt must be a non-empty str or a conversation (a non-empty list of {'role': ..., "
         "'content': ...} dicts): this one holds no message"),
    ([USER, "Repeat a: "], "message 1 is of type str, not a dict with 'role' and 'content'"),
    ([("user", "Repeat a: ")], "message 0 is of type tuple, not a dict"),
    ([{"role": "user"}], "message 0 has no 'content' (a message is {'role': ..., 'content': ...})"),
    ([{"content": "Repeat a: "}], "message 0 has no 'role'"),
    ([{"role": "user", "text": "Repeat a: "}], "message 0 has no 'content'"),
    ([{**USER, "name": "ann"}],
     "message 0 has the key 'name': a message holds 'role' and 'content' only"),
    ([{"role": "User", "content": "Repeat a: "}],
     "message 0's role 'User' is not one of system, user, assistant, tool"),
    ([{"role": None, "content": "Repeat a: "}], "message 0's role None is not one of"),
    ([{"role": "human", "content": "Repeat a: "}], "message 0's role 'human' is not one of"),
    ([{"role": "user", "content": 3}], "message 0's content is of type int, not a str"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}]}],
     "message 0's content is of type list, not a str (content parts such as images are not "
     "supported)"),
    ([USER, SYSTEM, USER], "message 1 is a system message: only the first message may be one"),
    ([{"role": "user", "content": "a\udc80"}],
     "message 0's content holds '\\udc80', a lone surrogate"),
    ([USER, ASSISTANT], "its last message is the assistant's: the generation prompt would open "
                        "a second assistant turn after it, not continue it; end the conversation "
                        "with the user's (or a tool's)"),
    ([SYSTEM], "its last message is the system's: it leaves the assistant nothing to answer"),
    ((USER,), "each prompt must be a non-empty str or a conversation"),   # a conversation is a list
]


@pytest.mark.parametrize("conversation, message", MALFORMED)
def test_a_malformed_conversation_is_named(conversation, message):
    with pytest.raises(TaskError) as e:
        draw_prompts(Counted(lambda n: [[USER], conversation]), 2, random.Random(0))
    said = r"the task's prompts\(2, rng\) returned .+ as prompt 1: " + re.escape(message) + ".*"
    assert re.fullmatch(said, str(e.value)), str(e.value)


def test_a_held_out_conversation_is_checked_as_a_training_one():
    said = ("complete() was given [..., {'role': 'assistant', 'content': 'aaaa'}] (2 messages) as "
            "prompt 1: its last message is the assistant's")
    with pytest.raises(TaskError, match=re.escape(said)):
        eval_completions(None, None, [[USER], [USER, ASSISTANT]], prepend_bos=False,
                         max_new_tokens=2, batch=1)


def test_a_system_prompt_replaces_the_tasks_own_or_comes_first():
    own = [[SYSTEM, USER], [USER], [USER, ASSISTANT, TOOL]]
    task = CheckedTask(Counted(lambda n: own), "Answer in French.", "chat")
    new = {"role": "system", "content": "Answer in French."}
    given = [[new, USER], [new, USER], [new, USER, ASSISTANT, TOOL]]
    assert task.prompts(3, random.Random(0)) == given
    assert own == [[SYSTEM, USER], [USER], [USER, ASSISTANT, TOOL]]   # the task's lists left alone
    assert CheckedTask(Counted(lambda n: own), None, "chat").prompts(3, random.Random(0)) == own
    assert task.name == "flaky"   # every other attribute is the task's own


def test_a_system_prompt_reaches_the_evaluations_conversations_too():
    asked = []

    def complete(prompts, **kw):
        asked.append((prompts, kw))
        return ["aaaa"] * len(prompts)
    with_system = functools.partial(complete_with_system, complete, "Answer in French.", "chat")
    assert with_system([[SYSTEM, USER], [USER]], n=2, temperature=0.5) == ["aaaa", "aaaa"]
    new = {"role": "system", "content": "Answer in French."}
    assert asked == [([[new, USER], [new, USER]], {"n": 2, "temperature": 0.5})]
    said = ("--system-prompt 'Answer in French.': --task chat asks complete() in its evaluation "
            "for str prompts ('Repeat a: '); a system prompt needs conversations")
    with pytest.raises(TaskError, match=re.escape(said)):
        with_system(["Repeat a: "])


def test_a_failed_reward_of_a_conversation_names_its_last_message():
    class Picky(Flaky):
        def reward(self, prompt, completion):
            return {"a": 1.0}[completion]
    scorer = Scorer(Picky(), tolerate=False)
    rewards, _, errors, _ = scorer([[SYSTEM, USER]] * 2, ["a", "b"])
    assert rewards.tolist() == [1.0, -1.0] and errors == {"KeyError": 1}
    report = scorer.to_gather()["reports"]["KeyError"]
    assert report.startswith("raised KeyError: 'b', for the prompt [..., {'role': 'user', "
                             "'content': 'Repeat a: '}] (2 messages) and completion 'b'; such "
                             "completions")


CONVERSATIONS = """
class Base:
    name = "base"
    def prompts(self, n, rng): return [self.ask()] * n
    def ask(self): return [{"role": "user", "content": "Repeat a: "}]
    def reward(self, prompt, completion): return 0.0
class NoContent(Base):
    def ask(self): return [{"role": "user"}]
class Typo(Base):
    def ask(self): return [{"role": "usr", "content": "Repeat a: "}]
class Answered(Base):
    def ask(self): return super().ask() + [{"role": "assistant", "content": "a"}]
class Parts(Base):
    def ask(self): return [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
class Empty(Base):
    def ask(self): return []
"""


@pytest.mark.parametrize("name, message", [
    ("NoContent", "message 0 has no 'content'"), ("Typo", "message 0's role 'usr' is not one of"),
    ("Answered", "its last message is the assistant's"),
    ("Parts", "message 0's content is of type list"), ("Empty", "this one holds no message")])
def test_a_malformed_conversation_exits_2_with_one_line_before_the_model_loads(
        name, message, tiny_model_dir, tmp_path, capsys, clean_env):
    (tmp_path / "conversations.py").write_text(CONVERSATIONS)
    task = f"{tmp_path / 'conversations.py'}:{name}"
    with pytest.raises(SystemExit) as e:   # a model without a chat template: refused before it
        train_lean.main(["--model", tiny_model_dir, "--task", task, *SMALL,
                         "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err, err
    said = "train_lean.py: error: the task's prompts(4, rng) returned ["
    assert err.startswith(said) and message in err, err


def in_process(capsys, *argv):
    """train_lean.main(argv) in this process, as train() runs it in its own: (stdout, stderr)."""
    capsys.readouterr()
    train_lean.main(list(argv))
    return SimpleNamespace(**dict(zip(("stdout", "stderr"), capsys.readouterr())))


@pytest.fixture
def chat_task(tmp_path):
    (tmp_path / "chat_toy.py").write_text(CHAT_TASK)
    return f"{tmp_path / 'chat_toy.py'}:ChatToy"


def test_a_system_prompt_for_a_task_of_str_prompts_exits_2_with_one_line(
        tiny_model_dir, tmp_path, capsys, clean_env):
    with pytest.raises(SystemExit) as e:   # at start-up, on the first step's prompts
        train_lean.main(["--model", tiny_model_dir, "--task", "toy", "--system-prompt", "Be brief.",
                         *SMALL, "--out-dir", str(tmp_path / "run")])
    said = (r"train_lean.py: error: --system-prompt 'Be brief.': --task toy gives str prompts "
            r"\('Repeat [a-e]: '\); a system prompt needs conversations \(docs/chat.md\)")
    assert e.value.code == 2 and re.fullmatch(said, capsys.readouterr().err.strip())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # --eval-only draws no training prompts: an evaluation that asks for str prompts is refused
    (tmp_path / "evaluated.py").write_text(EVALUATED_TASK)
    task = f"{tmp_path / 'evaluated.py'}:Evaluated"
    line = usage_error(["--model", tiny_model_dir, "--task", task, "--eval-only",
                        "--system-prompt", "Be brief."], capsys)
    assert line == (f"train_lean.py: error: the task's evaluation at step 0: --system-prompt "
                    f"'Be brief.': --task {task} asks complete() in its evaluation for str prompts "
                    f"('Repeat a: '); a system prompt needs conversations (docs/chat.md)")


# The three below need the trainer's side of conversations (grpo/rollout.py encode_prompts renders
# them with the chat template, grpo/model.py end_ids ends a completion at <|im_end|> too)

def test_a_conversational_task_trains_and_evaluates_on_an_instruct_model(
        chat_task, tiny_chat_model_dir, tmp_path, capsys, clean_env, monkeypatch):
    """The issue's "tried as a new user would": a conversational task of your own on the tiny chat
    model, with --system-prompt over the task's own system message, trains and evaluates with
    intervals; its reward and the logged completions see the conversation with that system
    message, and the assistant's text alone."""
    system = "Answer with one letter, ten times."
    run = tmp_path / "run"
    monkeypatch.setenv("EXPECT_SYSTEM", system)   # else its reward raises
    train_lean.main(["--model", tiny_chat_model_dir, "--task", chat_task, *SMALL, "--steps", "2",
                     "--eval-interval", "1", "--system-prompt", system, "--log-completions",
                     str(run / "completions.jsonl"), "--out-dir", str(run)])
    assert "reward_errors" not in (run / "metrics.jsonl").read_text()
    recs = read_jsonl(run / "metrics.jsonl")
    evals = [r for r in recs if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert [r["step"] for r in recs if "kind" not in r] == [1, 2]
    assert all(r["acc_n"] == 5 and r["acc_lo"] <= r["acc"] <= r["acc_hi"] for r in evals)
    rows = read_jsonl(run / "completions.jsonl")
    assert len(rows) == 16 and all(len(r["prompt"]) == 2 for r in rows)
    assert all(r["prompt"][0] == {"role": "system", "content": system} for r in rows)
    assert all(re.fullmatch(r"Repeat [a-e]: ", r["prompt"][1]["content"]) for r in rows)
    # the assistant's text: a completion ends at <|im_end|> or <|endoftext|>, neither in its text
    specials = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
    assert not any(t in r["completion"] for r in rows for t in specials)
    items = read_jsonl(run / "metrics.items.jsonl")   # the same held-out items at every evaluation
    assert len({r["prompts_sha256"] for r in items}) == 1
    assert [r["prompts"] for r in items] == [5] * 3


def test_a_conversational_task_on_a_tokenizer_without_a_chat_template_exits_2(
        chat_task, tiny_model_dir, tmp_path, capsys, clean_env):
    line = usage_error(["--model", tiny_model_dir, "--task", chat_task, *SMALL,
                        "--steps", "1", "--out-dir", str(tmp_path / "run")], capsys)
    assert "chat template" in line and "conversations" in line, line


def test_an_end_of_turn_the_models_files_forget_ends_completions_and_is_said(
        chat_task, tiny_chat_model_dir, tmp_path, capsys, clean_env):
    # an instruct model whose tokenizer and generation config name <|endoftext|> alone (as some do)
    model = shutil.copytree(tiny_chat_model_dir, tmp_path / "undeclared")
    for name, key, value in (("generation_config.json", "eos_token_id", 0), ("config.json", "eos_token_id", 0),
                             ("tokenizer_config.json", "eos_token", "<|endoftext|>")):
        settings = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**settings, key: value}))
    done = in_process(capsys, "--model", str(model), "--task", chat_task, *SMALL, "--steps", "1",
                      "--out-dir", str(tmp_path / "run"), "--log-completions",
                      str(tmp_path / "rows.jsonl"))
    assert ("the chat template ends a turn with <|im_end|> (id 2), which neither the tokenizer's EOS nor the "
            "model's generation_config.json eos_token_id declares: completions end there too") in done.stderr
    assert not any("<|im_end|>" in row["completion"] for row in read_jsonl(tmp_path / "rows.jsonl"))
    done = in_process(capsys, "--model", tiny_chat_model_dir, "--task", chat_task, *SMALL,
                      "--steps", "1", "--out-dir", str(tmp_path / "declared"))
    assert "chat template ends a turn" not in done.stderr


def test_the_evaluation_renders_its_conversations_with_the_system_prompt(
        chat_task, tiny_chat_model_dir, tmp_path, capsys, clean_env, monkeypatch):
    """With --eval-only no training prompt is drawn: a system prompt too long for the model is found
    in the evaluation's conversations, in as many tokens as the chat template renders with it."""
    from transformers import AutoTokenizer
    system = "x " * 600
    asked = [{"role": "system", "content": system}, {"role": "user", "content": "Repeat a: "}]
    ids = AutoTokenizer.from_pretrained(tiny_chat_model_dir).apply_chat_template(
        asked, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    monkeypatch.setenv("EXPECT_SYSTEM", system)
    line = usage_error(["--model", tiny_chat_model_dir, "--task", chat_task, "--eval-only",
                        "--system-prompt", system], capsys)
    assert line.startswith("train_lean.py: error: the task's evaluation at step 0: "), line
    assert f"{len(ids)} tokens" in line, line


@pytest.mark.parametrize("result, message", [
    ([("accuracy", 0.5)], "returned a list ([('accuracy', 0.5)]), not a dict"),
    ({"accuracy": float("nan")}, "returned {'accuracy': nan}: 'accuracy' must be a finite number"),
    ({"accuracy": float("inf")}, "returned {'accuracy': inf}: 'accuracy' must be a finite number"),
    ({"accuracy": "0.5"}, "returned {'accuracy': '0.5'}: 'accuracy' must be a finite number"),
    ({"accuracy": None}, "returned {'accuracy': None}"),
    ({"step": 3}, "returned the key 'step'"),   # would overwrite the record's own step
    ({1: 0.5}, "returned the key 1: metric names are str"),
])
def test_what_evaluate_returns_is_checked(result, message):
    with pytest.raises(TaskError, match=re.escape(f"the task's evaluate() {message}")):
        check_metrics(result)


def test_evaluate_numbers_become_plain_json_numbers():
    checked = check_metrics({"a": np.float32(0.5), "n": np.int64(3), "b": 2, "ok": True})
    assert checked == {"a": 0.5, "n": 3, "b": 2, "ok": 1}
    assert [type(v) for v in checked.values()] == [float, int, int, int]


class Slow:
    """A task whose evaluation reads what the console showed while it ran."""

    def __init__(self, capsys):
        self.capsys, self.seen = capsys, None

    def evaluate(self, complete):
        texts = complete(["a", "b", "c"]) + complete(["d", "e"], "passed on")
        self.seen = self.capsys.readouterr()
        return {"n": len(texts)}


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_an_evaluation_is_said_when_it_starts_and_counted_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    task, calls = Slow(capsys), []
    record, _ = evaluate(task, lambda prompts, *rest: calls.append(rest) or [p + "!" for p in prompts], step=7)
    assert task.seen.out == "eval at step 7: evaluating ...\n"   # before the task's evaluate() returned
    assert calls == [(), ("passed on",)] and record["n"] == 5   # complete's arguments and answers pass through
    assert "eval at step 7: 5 prompts" in sys.stderr.getvalue()   # the running count, on a terminal only
    assert capsys.readouterr().out.startswith("eval at step 7 (")   # then the time it took, and the table


def test_an_evaluation_off_a_terminal_is_one_line_before_and_the_time_after(capsys):
    task = Slow(capsys)
    evaluate(task, lambda prompts, *rest: prompts, step=0)
    assert task.seen == ("eval at step 0: evaluating ...\n", "")   # no progress bar into a log file
    assert re.match(r"eval at step 0 \(\d+\.\d s\)\n  n  5\n", capsys.readouterr().out)


def test_evaluate_passes_full_only_to_a_task_that_takes_it(capsys):
    # evaluate(complete, full): the whole held-out set at a run's first and last evaluation, a subset between
    # (tests/tasks/rookworld/test_rookworld_train.py runs it); a one-argument evaluate() is called as before
    class Sized:
        def evaluate(self, complete, full=False):
            return {"n": len(complete(["a", "b", "c"] if full else ["a"]))}

    class Keywords:
        def evaluate(self, complete, **options):
            return {"full": int(options["full"])}

    class Plain:
        def evaluate(self, complete):
            return {"n": len(complete(["a"]))}

    echo = lambda prompts: list(prompts)  # noqa: E731
    record = lambda *args, **kwargs: evaluate(*args, **kwargs)[0]  # noqa: E731
    assert record(Sized(), echo, step=0)["n"] == 3 and record(Sized(), echo, step=5, full=False)["n"] == 1
    assert record(Keywords(), echo, step=5, full=False)["full"] == 0
    assert record(Plain(), echo, step=0)["n"] == 1 and record(Plain(), echo, step=5, full=False)["n"] == 1
    assert takes(Sized().evaluate, "full") and not takes(Plain().evaluate, "full")
    assert not takes(len, "full")
    capsys.readouterr()


# ---- through the trainer: what the user sees ---------------------------------------------------------------

REWARDS = '''
class Base:
    name = "base"
    min_reward = -1.0

    def prompts(self, n, rng):
        return [f"Repeat {rng.choice('ab')}: " for _ in range(n)]


class Buggy(Base):
    def reward(self, prompt, completion):
        return len(completion) * scale      # scale is never defined


class SomeStr(Base):
    def reward(self, prompt, completion):
        return "0.5" if len(completion) % 2 else 0.5


class Flat(Base):
    def reward(self, prompt, completion):
        return 0.5


class MostlyFlat(Base):
    scored = 0

    def reward(self, prompt, completion):   # 1/0 within each group of step 1 (8 completions), then 0 everywhere
        MostlyFlat.scored += 1
        return float(MostlyFlat.scored % 2) if MostlyFlat.scored <= 8 else 0.0


class Alternating(Base):
    scored = 0

    def reward(self, prompt, completion):   # 1/0 within every group of 2: never flat
        Alternating.scored += 1
        return float(Alternating.scored % 2)


class BreaksAfterStep1(Base):
    scored = 0

    def reward(self, prompt, completion):
        self.scored += 1   # 8 completions a step: an outside service that goes away after step 1
        if self.scored > 8:
            raise ConnectionError("the grader is gone")
        return len(completion) / 10


class Shrinking(Flat):
    calls = 0

    def prompts(self, n, rng):
        self.calls += 1   # the trainer draws step 1 before the model loads and again in the loop
        return ["Repeat a: "] * (n if self.calls <= 2 else n - 1)


class NanEval(Flat):
    def evaluate(self, complete):
        return {"accuracy": float("nan")}


class LongEval(Flat):
    def evaluate(self, complete):
        complete(["Repeat a: " * 200])
        return {"accuracy": 0.0}
'''


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(open(path), 1) if text in line)


@pytest.mark.slow
def test_a_reward_that_always_raises_stops_the_run_with_the_tasks_traceback(rewards_file, tiny_model_dir, tmp_path):
    proc = train("--model", tiny_model_dir, "--task", f"{rewards_file}:Buggy", *SMALL, "--steps", "3",
                 "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    # the user's file and line, the real exception, then one line saying why and how to opt out
    assert f'File "{rewards_file}", line {line_of(rewards_file, "scale is never")}, in reward' in proc.stderr
    assert "NameError: name 'scale' is not defined" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("harness.task.RewardError: step 1: every reward failed (NameError 8; the first raised "
                           "NameError: name 'scale' is not defined)")
    assert "--reward-errors tolerate" in last
    assert "step 1/3" not in proc.stdout and not (tmp_path / "run" / "model").exists()


@pytest.mark.slow
def test_a_reward_that_fails_everywhere_later_stops_and_keeps_the_steps_done(rewards_file, tiny_model_dir, tmp_path):
    proc = train("--model", tiny_model_dir, "--task", f"{rewards_file}:BreaksAfterStep1", *SMALL, "--steps", "3",
                 "--out-dir", str(tmp_path))
    assert proc.returncode == 1 and "step 1/3" in proc.stdout and "step 2/3" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("harness.task.RewardError: step 2: every reward failed "
                                                           "(ConnectionError 8; the first raised ConnectionError: the "
                                                           "grader is gone)")
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()   # what --resume continues once the grader is back


@pytest.mark.slow
def test_a_reward_that_sometimes_returns_a_str_is_named_once_and_training_goes_on(rewards_file, tiny_model_dir,
                                                                                 tmp_path):
    proc = train("--model", tiny_model_dir, "--task", f"{rewards_file}:SomeStr", *SMALL, "--steps", "3",
                 "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    where = f"(SomeStr.reward, {rewards_file} line {line_of(rewards_file, 'class SomeStr') + 1})"
    said = [line for line in proc.stderr.splitlines() if "the task's reward" in line]
    assert len(said) == 1 and "returned a str ('0.5'), not a number " + where in said[0], proc.stderr
    assert said[0].startswith("train_lean.py: step ") and "min_reward -1" in said[0]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert sum(r.get("reward_errors", {}).get("returned str", 0) for r in records) > 1   # each counted


@pytest.mark.slow
def test_tolerated_reward_errors_train_on_and_show_the_traceback_once(rewards_file, tiny_model_dir, tmp_path):
    proc = train("--model", tiny_model_dir, "--task", f"{rewards_file}:Buggy", *SMALL, "--steps", "3",
                 "--out-dir", str(tmp_path), extra_env={"GRPO_REWARD_ERRORS": "tolerate"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("NameError: name 'scale' is not defined") == 2   # the warning line and the traceback
    assert proc.stderr.count(f'File "{rewards_file}", line') == 1
    assert [r["reward_errors"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [{"NameError": 8}] * 3


def test_a_step_without_signal_is_named_once_with_what_to_try(rewards_file, tiny_model_dir,
                                                              tmp_path, capsys, clean_env):
    proc = in_process(capsys, "--model", tiny_model_dir, "--task", f"{rewards_file}:Flat", *SMALL,
                      "--steps", "3", "--log-level", "warning", "--out-dir", str(tmp_path))
    notes = [line for line in proc.stderr.splitlines() if "frac_zero_std 1.0" in line]   # --log-level keeps it
    assert len(notes) == 1 and notes[0].startswith("train_lean.py: step 1: every group's completions got equal "
                                                   "rewards"), proc.stderr
    for hint in ("--temperature", "--group-size", "partial credit", "model that sometimes solves"):
        assert hint in notes[0]
    assert [r["frac_zero_std"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0] * 3
    assert proc.stderr.strip().splitlines()[-1] == (   # and at the end, after the model is saved
        "train_lean.py: 3 of 3 steps had only flat groups (every advantage 0): the model barely trained. Try a higher "
        "--temperature, a larger --group-size, a reward with partial credit, or a model that sometimes solves the task")


def test_a_run_whose_steps_mostly_learned_nothing_ends_saying_so(rewards_file, tiny_model_dir,
                                                                 tmp_path, capsys, clean_env):
    # it ended with "saved the trained model" and nothing else, the one note at step 1 far above
    runs = {"MostlyFlat": [0.0, 1.0, 1.0], "Alternating": [0.0, 0.0, 0.0]}
    for name, flat in runs.items():
        proc = in_process(capsys, "--model", tiny_model_dir, "--task", f"{rewards_file}:{name}",
                          *SMALL, "--steps", "3", "--out-dir", str(tmp_path / name))
        assert [r["frac_zero_std"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")] == flat
        summary = [line for line in proc.stderr.splitlines() if "had only flat groups" in line]
        assert summary == (["train_lean.py: 2 of 3 steps had only flat groups (every advantage 0): the model barely "
                            "trained. Try a higher --temperature, a larger --group-size, a reward with partial "
                            "credit, or a model that sometimes solves the task"] if name == "MostlyFlat" else []), name
    assert "saved the trained model" in proc.stdout


@pytest.mark.slow
def test_a_step_whose_prompts_come_up_short_stops_with_a_clear_error(rewards_file, tiny_model_dir, tmp_path):
    proc = train("--model", tiny_model_dir, "--task", f"{rewards_file}:Shrinking", *SMALL, "--steps", "3",
                 "--out-dir", str(tmp_path))
    assert proc.returncode == 1 and "step 1/3" in proc.stdout and "step 2/3" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == ("harness.task.TaskError: the task's prompts(4, rng) returned 3 "
                                                     "prompts, not 4: it must return exactly n (the batch is n groups)")


def test_an_evaluation_that_returns_nan_is_a_clear_error(rewards_file, tiny_model_dir, tmp_path, capsys, clean_env):
    # the evaluation before training: one line, exit 2 (nothing is lost yet); a later one raises (exit 1, step saved)
    with pytest.raises(SystemExit) as exit_:
        train_lean.main(["--model", tiny_model_dir, "--task", f"{rewards_file}:NanEval", *SMALL, "--steps", "1",
                         "--eval-interval", "1", "--out-dir", str(tmp_path)])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip() == (
        "train_lean.py: error: the task's evaluation at step 0: the task's evaluate() returned {'accuracy': nan}: "
        "'accuracy' must be a finite number")


def test_an_evaluation_prompt_too_long_for_the_model_is_one_line_before_training(rewards_file, tiny_model_dir,
                                                                                   tmp_path, capsys, clean_env):
    # found by the evaluation before training (step 0, or --eval-only), where nothing is lost yet: it was a traceback
    for args in (["--eval-only"], ["--eval-interval", "1", "--out-dir", str(tmp_path / "run")]):
        with pytest.raises(SystemExit) as exit_:
            train_lean.main(["--model", tiny_model_dir, "--task", f"{rewards_file}:LongEval", *SMALL, "--steps", "1",
                             "--out-dir", str(tmp_path), *args])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and "\n" not in err, err
        assert re.fullmatch(r"train_lean.py: error: the task's evaluation at step 0: a prompt of 60\d tokens "
                            r"\('Repeat a: Repeat a: .*more than the model's 512.*", err), err


# ---- sampled evaluation: pass@k and mean@n -----------------------------------------------------------------

def direct_pass_at_k(n, c, k):
    """1 - C(n-c, k) / C(n, k), in exact fractions."""
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(direct_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)
    # by hand: none correct, all correct, k = n (any correct), one correct in n with k = 1 (c / n)
    assert pass_at_k(16, 0, 4) == 0.0 and pass_at_k(16, 16, 4) == 1.0 and pass_at_k(8, 8, 8) == 1.0
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 1, 1) == 0.125
    assert pass_at_k(16, 1, 4) == pytest.approx(0.25) and pass_at_k(10, 3, 2) == pytest.approx(24 / 45)
    # large n: binomials of hundreds of digits, the product stays exact to float precision
    assert pass_at_k(1000, 3, 100) == pytest.approx(float(direct_pass_at_k(1000, 3, 100)), rel=1e-12)
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


@pytest.fixture(scope="module")
def tiny_complete(tiny_model_dir):
    """The trainer's complete() on the tiny GPT-2: greedy, or seeded samples."""
    return functools.partial(eval_completions, load_policy(tiny_model_dir, "cpu"), load_tokenizer(tiny_model_dir),
                             prepend_bos=True, max_new_tokens=12, batch=32, seed=0)


LETTER_PROMPTS = [f"Repeat {c}: " for c in "abcde"]


def contains_letter(prompt, completion):
    return prompt[len("Repeat ")] in completion


def test_sampled_metrics_of_real_samples_are_the_estimator_over_the_counts(tiny_complete):
    # the tiny random model writes the asked letter somewhere in some of its samples: counts between 0 and n
    samples = tiny_complete(LETTER_PROMPTS, n=16, temperature=1.0)
    counts = [sum(contains_letter(p, c) for c in group) for p, group in zip(LETTER_PROMPTS, samples)]
    assert any(0 < c < 16 for c in counts) and len(set(counts)) > 2, counts
    got = sampled_metrics(tiny_complete, LETTER_PROMPTS, contains_letter, k=4, n=16, name="letter")
    # per prompt: the trainer averages them (and gives each its interval)
    assert got == {"letter_pass@4": pytest.approx([float(direct_pass_at_k(16, c, 4)) for c in counts]),
                   "letter_mean@16": [c / 16 for c in counts]}
    assert means(got)["letter_mean@16"] == pytest.approx(sum(counts) / 80)
    # n defaults to k: pass@k is then "any of the k is correct"
    few = tiny_complete(LETTER_PROMPTS, n=3, temperature=1.0)
    assert sampled_metrics(tiny_complete, LETTER_PROMPTS, contains_letter, k=3) == {
        "pass@3": [float(any(contains_letter(p, c) for c in g)) for p, g in zip(LETTER_PROMPTS, few)],
        "mean@3": pytest.approx([sum(contains_letter(p, c) for c in g) / 3 for p, g in zip(LETTER_PROMPTS, few)])}
    with pytest.raises(ValueError, match="1 <= k <= n"):
        sampled_metrics(tiny_complete, LETTER_PROMPTS, contains_letter, k=4, n=2)


def test_the_toy_task_reports_greedy_and_sampled_metrics(tiny_complete):
    # width 1: a completion is correct when it starts with the letter; the task's answers are known, so its
    # numbers are recomputed here from the same seeded completions
    task = ToyTask(width=1, eval_k=4, eval_n=16)
    greedy, samples = tiny_complete(LETTER_PROMPTS), tiny_complete(LETTER_PROMPTS, n=16, temperature=1.0)
    counts = [sum(c[:1] == p[7] for c in group) for p, group in zip(LETTER_PROMPTS, samples)]
    assert sum(counts) > 0, counts
    assert means(task.evaluate(tiny_complete)) == {
        "acc": sum(c[:1] == p[7] for p, c in zip(LETTER_PROMPTS, greedy)) / 5,
        "reward": sum(c[:1] == p[7] for p, c in zip(LETTER_PROMPTS, greedy)) / 5,
        "pass@4": pytest.approx(float(sum(direct_pass_at_k(16, c, 4) for c in counts) / 5)),
        "mean@16": pytest.approx(sum(counts) / 80)}
    assert set(ToyTask().evaluate(tiny_complete)) == {"acc", "reward"}   # greedy only by default


def test_a_sampled_evaluation_leaves_training_bit_identical(tiny_model_dir, tmp_path, capsys,
                                                            clean_env, user_threads):
    # the evaluation samples from its own seed in a fork of torch's RNG: the steps, the weights and the RNG
    # states a checkpoint keeps are those of a run without it
    args = ["--model", tiny_model_dir, "--task", "toy", *SMALL, "--steps", "2", "--save-interval", "2"]
    train_lean.main([*args, "--out-dir", str(tmp_path / "plain")])
    train_lean.main([*args, "--eval-interval", "1", "--eval-k", "2", "--eval-n", "4", "--eval-temperature", "1.5",
                     "--out-dir", str(tmp_path / "evaluated")])
    assert "pass@2" in capsys.readouterr().out
    plain, evaluated = records(tmp_path / "plain" / "metrics.jsonl"), records(tmp_path / "evaluated" / "metrics.jsonl")
    evals = [r for r in evaluated if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2] and all({"pass@2", "mean@4"} <= set(r) for r in evals)
    assert [r for r in evaluated if "kind" not in r] == plain
    ckpt = "checkpoints/step_000002"
    assert all(torch.equal(a, b) for a, b in zip(weights(tmp_path / "plain" / ckpt).values(),
                                                 weights(tmp_path / "evaluated" / ckpt).values()))
    rng = [torch.load(tmp_path / run / ckpt / "trainer_state.pt", weights_only=False)["rng"][0]
           for run in ("plain", "evaluated")]
    assert torch.equal(rng[0]["torch"], rng[1]["torch"]) and rng[0]["python"] == rng[1]["python"]


@pytest.mark.parametrize("args, message", [
    (["--eval-k", "-1"], "--eval-k -1 must be >= 0"),
    (["--eval-n", "8"], "--eval-n 8 samples for pass@K: give --eval-k too"),
    (["--eval-k", "4", "--eval-n", "2"], "--eval-n 2 must be at least --eval-k 4"),
    (["--eval-k", "4", "--eval-temperature", "0"], "--eval-temperature 0.0 must be > 0"),
])
def test_bad_sampled_evaluation_options_exit_2_with_one_line(args, message, tmp_path, capsys, clean_env):
    with pytest.raises(SystemExit) as exit_:
        train_lean.main(["--model", "unused", "--task", "toy", *args, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().count("\n") == 0 and message in err, err


def test_a_task_without_evaluate_is_not_evaluated_and_cannot_be_asked_to(rewards_file, tiny_model_dir, tmp_path,
                                                                         capsys, clean_env):
    # no --eval-interval: the default interval evaluates only a task that has evaluate()
    train_lean.main(["--model", tiny_model_dir, "--task", f"{rewards_file}:Flat", *SMALL[:-4], "--steps", "1",
                     "--out-dir", str(tmp_path / "run")])
    assert not [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "eval"]
    for ask in (["--eval-interval", "2"], ["--eval-only"]):
        with pytest.raises(SystemExit):
            train_lean.main(["--model", "unused", "--task", f"{rewards_file}:Flat", *ask, "--out-dir", str(tmp_path)])
        assert f"{ask[0]}: --task {rewards_file}:Flat has no evaluate(complete) method" in capsys.readouterr().err


# ---- complete(): the trainer's decoding for evaluate() ------------------------------------------------------

EVAL_PROMPTS = ["Repeat a: ", "P: rnbqkbnr", "A: 8/8/8", "0123456789", "Repeat e: xyz"]


@pytest.fixture(scope="module")
def complete_7_rows(tiny_model_dir):
    """complete() as the trainer builds it (harness/run.py), on the tiny GPT-2, 7 rows a batch."""
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    return lambda prompts, seed=0, **kw: eval_completions(model, tok, prompts, **kw, prepend_bos=True,
                                                          max_new_tokens=12, batch=7, seed=seed)


def test_eval_completions_greedy_is_the_argmax_decoding(tiny_model_dir, complete_7_rows):
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = left_pad(encode_prompts(tok, EVAL_PROMPTS, True), tok.eos_token_id)
    out = generate(model, ids, mask, end_ids=tok.eos_token_id, max_new_tokens=12, temperature=0.0)
    greedy = complete_7_rows(EVAL_PROMPTS)
    assert greedy == decode_completions(tok, out.ids, out.mask, tok.eos_token_id)
    assert len(set(greedy)) == len(EVAL_PROMPTS)   # distinct: the test below can tell the prompts' samples apart


def test_eval_completions_samples_n_per_prompt_in_prompt_order(complete_7_rows):
    samples = complete_7_rows(EVAL_PROMPTS, n=4, temperature=1.0)
    assert [len(group) for group in samples] == [4] * 5 and all(isinstance(t, str) for g in samples for t in g)
    assert all(len(set(group)) > 1 for group in samples)   # n draws, not one repeated
    # at a temperature near 0 every sample is the greedy completion of its own prompt (rows cross batches of 7)
    cold = complete_7_rows(EVAL_PROMPTS, n=3, temperature=1e-4)
    assert cold == [[g] * 3 for g in complete_7_rows(EVAL_PROMPTS)]


def test_eval_completions_are_seeded_and_leave_torchs_rng_alone(complete_7_rows):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = complete_7_rows(EVAL_PROMPTS, n=4, temperature=1.0)
    assert torch.equal(torch.get_rng_state(), before)   # training draws next what it would have drawn
    assert complete_7_rows(EVAL_PROMPTS, n=4, temperature=1.0) == first   # the same at every evaluation
    assert complete_7_rows(EVAL_PROMPTS, seed=1, n=4, temperature=1.0) != first   # another --seed, other samples


def test_eval_completions_say_the_prompts_done_after_each_batch(complete_7_rows):
    # what moves the evaluation's count (harness/log.py EvalProgress) while one call decodes all
    said = []
    assert complete_7_rows(EVAL_PROMPTS, progress=said.append) == complete_7_rows(EVAL_PROMPTS)
    assert said == [5]   # 5 rows: one batch
    said.clear()
    sampled = complete_7_rows(EVAL_PROMPTS, n=3, temperature=1.0, progress=said.append)
    assert sampled == complete_7_rows(EVAL_PROMPTS, n=3, temperature=1.0)
    assert said == [2, 4, 5]   # 15 rows in batches of 7, 7, 1: prompts whose 3 samples are done


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=0.7), "complete(prompts, temperature=0.7) samples only with n"),
    (dict(n=0), "complete(prompts, n=0, temperature=None): n must be an int >= 1"),
    (dict(n=2.0), "n must be an int >= 1"),
    (dict(n=4, temperature=0.0), "n must be an int >= 1 and the temperature > 0"),
])
def test_eval_completions_refuse_a_sampling_they_cannot_do(complete_7_rows, kw, message):
    with pytest.raises(TaskError, match=re.escape(message)):
        complete_7_rows(EVAL_PROMPTS, **kw)


class Crashy:
    """A user's task without min_reward: valid rewards below 0, and a reward that raises on "x"."""
    name = "crashy"

    def prompts(self, n, rng):
        return ["p"] * n

    def reward(self, prompt, completion):
        if completion == "x":
            raise KeyError(completion)
        return -len(completion) / 10


def test_a_failed_reward_ranks_below_every_valid_reward_of_its_group():
    """The default min_reward 0 gave a crash a positive advantage beside rewards below 0."""
    completions = ["ab", "x", "abcd", "x", "x", "x"]
    rewards, _, errors = score(Crashy(), ["p"] * 6, completions, group_size=2)
    assert rewards.tolist() == pytest.approx([-0.2, -1.2, -0.4, -1.4, 0.0, 0.0])
    assert errors == {"KeyError": 4}
    declared = type("Declared", (Crashy,), {"min_reward": -5.0})()   # a declared minimum is kept
    rewards = score(declared, ["p"] * 2, ["ab", "x"], group_size=2)[0]
    assert rewards.tolist() == [pytest.approx(-0.2), -5]
    # with --reward-weights, each part ranks below its group's valid parts the same way
    rows = []
    parts = type("Parted", (Crashy,), {"reward_breakdown": lambda self, p, c: {
        "a": Crashy.reward(self, p, c), "b": 1.0}})()
    rewards, _, _ = score(parts, ["p"] * 2, ["ab", "x"], weights={"a": 1.0, "b": 1.0}, rows=rows,
                          group_size=2)
    assert rows == [pytest.approx([-0.2, 1.0]), pytest.approx([-1.2, 0.0])]
    assert rewards.tolist() == pytest.approx([0.8, -0.2])


def test_a_run_ranks_failures_in_their_groups_and_counts_them_on_the_console(
        tiny_model_dir, tmp_path, capsys, clean_env):
    """The count was only in metrics.jsonl."""
    import train_lean
    (tmp_path / "flaky.py").write_text(   # the toy task's prompts and reward, not its min_reward
        "from tasks.toy import ToyTask\n\nclass Flaky:\n    name = 'flaky'\n"
        "    toy = ToyTask()\n\n"
        "    def prompts(self, n, rng):\n        return self.toy.prompts(n, rng)\n\n"
        "    def reward(self, prompt, completion):\n"
        "        if len(completion) % 2:\n            raise ValueError('odd')\n"
        "        return self.toy.reward(prompt, completion)\n")
    out = tmp_path / "out"
    train_lean.main(["--model", tiny_model_dir, "--task", f"{tmp_path / 'flaky.py'}:Flaky", *SMALL,
                     "--steps", "2", "--out-dir", str(out),
                     "--log-completions", str(out / "c.jsonl")])
    failed = [r["reward_errors"]["ValueError"] for r in read_jsonl(out / "metrics.jsonl")]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[2] for line in lines] == [f"failed {n}" for n in failed]
    rows = read_jsonl(out / "c.jsonl")
    for group in (rows[i:i + 2] for i in range(0, len(rows), 2)):   # --group-size 2
        valid = [r["reward"] for r in group if len(r["completion"]) % 2 == 0]
        for r in group:
            if len(r["completion"]) % 2:
                assert r["reward"] == pytest.approx(min(valid) - 1 if valid else 0.0)


def test_a_task_file_imports_a_module_beside_it(tmp_path):
    """It was "No module named 'rev'" unless PYTHONPATH named the folder."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "rev46.py").write_text("def rev(text):\n    return text[::-1]\n")
    (folder / "leaky.py").write_text("import rev46\n\nclass Leaky:\n    name = 'leaky'\n"
                                     "    flip = staticmethod(rev46.rev)\n")
    assert resolve(f"{folder / 'leaky.py'}:Leaky", {}).flip("ab") == "ba"


def test_a_long_scoring_says_it_is_still_going(monkeypatch, capsys):
    """Issue 59 case 3: a reward that never returned hung the run in silence (evaluations already
    said they were still going)."""
    import time
    from harness.task import Scorer
    monkeypatch.setattr(Scorer, "EVERY_S", 0.1)

    lines = []

    class Slow:   # busy until the ticker spoke twice, however late it runs (a loaded machine)
        def reward(self, prompt, completion):
            deadline = time.monotonic() + 120   # only a ticker that never speaks ends it
            while len(lines) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
                lines.extend(capsys.readouterr().out.splitlines())
            return 1.0
    rewards, *_ = Scorer(Slow(), tolerate=False)(["p"] * 3, ["a", "b", "c"])
    assert rewards.tolist() == [1.0] * 3
    lines.extend(capsys.readouterr().out.splitlines())
    said = (r"rewards: still scoring, \S+ so far, [0-3] of 3 scored \(Ctrl-C or SIGTERM "
            r"gives the step up, saving the last one\)")
    assert len(lines) >= 2 and all(re.fullmatch(said, line) for line in lines), lines
    time.sleep(0.2)
    assert not capsys.readouterr().out   # closed with the scoring


def test_the_fence_passes_failures_and_the_runs_stops_and_ends_the_tasks_own_exits():
    """Issue 72: a task's SystemExit or KeyboardInterrupt is no way out of the run (TaskEnded, a
    failure that saves); its ordinary errors, the run's give-up and the run's exit pass as they
    are."""
    import harness.guards
    from harness.task import TaskEnded, fenced
    for raised, said in ((SystemExit(0), "SystemExit (0)"),
                         (KeyboardInterrupt(), "KeyboardInterrupt")):
        with pytest.raises(TaskEnded, match=re.escape(f"the task's reward() raised {said}: ")):
            with fenced("reward()"):
                raise raised
    for passed in (ValueError("x"), harness.guards.StoppedBySignal(15),
                   harness.guards.Exiting(130)):
        with pytest.raises(type(passed)):
            with fenced("reward()"):
                raise passed
    task = CheckedTask(SimpleNamespace(name="t", reward=lambda p, c: sys.exit(2)))
    with pytest.raises(TaskEnded, match=r"the task's reward\(\) raised SystemExit \(2\)"):
        task.reward("p", "c")
