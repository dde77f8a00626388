"""The README's promises that code can check: its task example runs as printed, it stays short, and
the size of the algorithm it quotes is measured."""
import os
import random
import re
import shlex
import subprocess
import sys

import pytest

import train_lean
from helpers import REPO, SMALL, read_jsonl, train
from train_lean import TABLES

README = os.path.join(REPO, "README.md")


def section(title: str) -> str:
    text = open(README, encoding="utf-8").read()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def example(tmp_path):
    """The task example of the README written to tmp_path/add.py, and its command line's arguments."""
    code = re.search(r"```python\n(.*?)```", section("Your own task"), re.S).group(1)
    assert 10 <= len(code.strip().splitlines()) <= 20   # "a complete example of about 15 lines"
    (tmp_path / "add.py").write_text(code)
    lines = re.search(r"```bash\n(.*?)```", section("Your own task"), re.S).group(1).splitlines()
    command = next(shlex.split(line) for line in lines if "train_lean.py" in line)
    assert command[:2] == [".venv/bin/python", "train_lean.py"]
    return command[2:]


def test_the_task_example_trains_and_evaluates_as_printed(tiny_model_dir, tmp_path, capsys, clean_env):
    example(tmp_path)
    train_lean.main(["--model", tiny_model_dir, "--task", f"{tmp_path / 'add.py'}:Add", *SMALL, "--steps", "2",
                     "--eval-interval", "2", "--out-dir", str(tmp_path / "run")])
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all(0 <= r["accuracy"] <= 1 for r in evals)
    assert all(r["accuracy_n"] == 100 and r["accuracy_lo"] <= r["accuracy"] <= r["accuracy_hi"] for r in evals)
    assert [r["step"] for r in records if "kind" not in r] == [1, 2]
    from harness.task import build, resolve   # the reward is right about right and wrong answers
    add = build(resolve(f"{tmp_path / 'add.py'}:Add", {}))
    assert add.reward("3+4=", "7") == 1.0 and add.reward("3+4=", " 7 and more") == 1.0
    assert add.reward("3+4=", "8") == add.reward("3+4=", "6") == 0.9 and add.reward("3+4=", "17") == 0.0
    assert add.reward("3+4=", "") == add.reward("3+4=", "seven") == 0.0


@pytest.mark.slow   # 50 steps: the README's claim that it learns, in the tier with the long runs
def test_the_task_example_learns_on_the_model_the_readme_makes(tiny_model_dir, tmp_path):
    """The README's command on the tiny model of scripts/make_tiny_model.py (the fixture's, seed 0): the
    reward rises within a few dozen steps (it stays 0 with a reward of 1 or 0 only, where no group differs)."""
    args = example(tmp_path)
    args[args.index("add.py:Add")] = f"{tmp_path / 'add.py'}:Add"
    args[args.index("out/tiny")] = tiny_model_dir
    proc = train(*args, "--steps", "50", "--eval-interval", "0", "--out-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rewards = [r["reward_mean"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    early, late = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert late > 0.15 and late > early + 0.1, (early, late)   # a margin --seed 1 clears as well


CHAT = os.path.join(REPO, "docs", "chat.md")


def chat_example(tmp_path) -> list:
    """docs/chat.md's task written to tmp_path/chat_add.py; its command lines, each split."""
    text = open(CHAT, encoding="utf-8").read()
    (tmp_path / "chat_add.py").write_text(re.search(r"```python\n(.*?)```", text, re.S).group(1))
    return [shlex.split(line) for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.splitlines()]


@pytest.mark.slow   # 20 steps of 64 completions and three evaluations of 100: about a minute
def test_the_chat_example_trains_and_evaluates_as_printed(tiny_chat_model_dir, tmp_path, clean_env):
    """The issue's "tried as a new user would" for docs/chat.md, the README's pointer for instruct
    models: its tiny chat model is the fixture's, its task trains and evaluates with intervals as
    printed, and its other commands are the trainer's flags."""
    from harness import cli
    from harness.task import build, resolve
    make, tiny, qwen, digits = chat_example(tmp_path)
    assert make[1:] == ["scripts/make_tiny_model.py", "out/tiny-chat", "--arch", "qwen2", "--chat"]
    task = f"{tmp_path / 'chat_add.py'}:ChatAdd"

    def here(command, out):
        args = command[command.index("train_lean.py") + 1:]
        swap = {"chat_add.py:ChatAdd": task, "out/tiny-chat": tiny_chat_model_dir}
        args = [swap.get(a, a) for a in args]
        args[args.index("--out-dir") + 1] = str(tmp_path / out)
        return args
    assert qwen[qwen.index("--model") + 1] == "Qwen/Qwen2.5-0.5B-Instruct"
    for command in (qwen, digits):   # not run: flags the trainer takes
        cli.load(here(command, "unused"), {}, {}, tables=TABLES)
    train_lean.main(here(tiny, "run"))
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert all(r["accuracy_n"] == 100 and r["accuracy_lo"] <= r["accuracy"] <= r["accuracy_hi"]
               for r in evals)
    assert [r["step"] for r in records if "kind" not in r] == list(range(1, 21))
    add = build(resolve(task, {}))   # its reward reads the question and the answer
    drawn = add.prompts(4, random.Random(0))
    assert all([m["role"] for m in c] == ["system", "user"] for c in drawn)
    asked = [*drawn[0][:1], {"role": "user", "content": "What is 3+4?"}]
    assert add.reward(asked, "7") == add.reward(asked, " 7.") == 1.0
    assert add.reward(asked, "8") == 0.9 and add.reward(asked, "seven") == 0.0


def test_the_readme_is_short_and_starts_with_the_three_commands():
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) <= 220
    first_block = open(README, encoding="utf-8").read().split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [
        ["make", "demo"], ["make", "train"], ["make", "test"]]


def test_the_readme_says_how_many_steps_make_train_runs_and_how_long():
    """It gave no duration for `make train`; the step count it quotes is the default --steps that
    `make train` runs, and the duration a measured one (BENCHMARKS-style: minutes on 2 vCPUs)."""
    from grpo.settings import Settings
    text = " ".join(open(README, encoding="utf-8").read().split())
    assert f"(`python train_lean.py`, {Settings.steps} steps;" in text
    assert re.search(r"took \d+ min on 2 vCPUs", text)


def training_commands() -> list:
    """The README's shell commands that train, in order, as (the command, its --out-dir, whether it continues or
    only evaluates the run there, the logs it names). `make train` is train_lean.py with the defaults."""
    text = open(README, encoding="utf-8").read()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["make", "train"]:
                words = ["train_lean.py"]
            if "train_lean.py" not in words or "..." in words:   # torchrun's line is a pattern, not a command
                continue
            args = words[words.index("train_lean.py") + 1:]
            value = lambda flag, default=None: args[args.index(flag) + 1] if flag in args else default  # noqa: E731
            found.append((line, value("--out-dir", "out"), "--resume" in args or "--eval-only" in args,
                          [v for v in (value("--log-file"), value("--log-completions")) if v], value("--model")))
    return found


def made_models() -> list:
    """The folders the README's commands make with scripts/make_tiny_model.py, in order, as (line number, folder)."""
    text = open(README, encoding="utf-8").read()
    return [(text[:m.start()].count("\n"), m.group(1)) for m in re.finditer(r"make_tiny_model\.py (\S+)", text)]


def test_the_readmes_training_commands_run_in_order_without_colliding():
    # each command that starts a run needs a folder (and logs) no earlier command wrote: run in the README's
    # order, a shared one stops the later command at start-up (exit 2: the folder holds an earlier run's records)
    commands, used = training_commands(), {}
    assert len(commands) >= 5   # make train, the task example, the tiny model's run, the long run and its resume
    text = open(README, encoding="utf-8").read()
    for line, out_dir, continues, logs, model in commands:
        if model and not model.startswith("models/"):   # a folder an earlier command made (not a hub id here)
            at = text.index(line)
            assert any(n < text[:at].count("\n") and folder == model for n, folder in made_models()), \
                f"{line!r} trains {model}, which no earlier command makes"
        if continues:
            assert out_dir in used, f"{line!r} continues a run no earlier command started in {out_dir}"
            continue
        for path in (out_dir, *logs):
            assert path not in used, f"{line!r} writes {path}, as {used.get(path)!r} did before it"
            used[path] = line


def test_the_readme_promises_same_bits_on_one_thread_count_only():
    """It promised "bit-identical on every thread count"; OMP_NUM_THREADS 1 and 2 gave other
    weights: sampling uses every thread (test_guards.py: the update's passes alone keep their bits
    on any count; test_train.py, test_checkpoint.py: same-seed and resumed runs on one count are
    equal)."""
    text = " ".join(open(README, encoding="utf-8").read().split())
    assert "on every thread count" not in text
    said = "end bit-identical on one thread count (sampling's last bits follow `OMP_NUM_THREADS`"
    assert said in text


def test_the_readme_names_the_script_that_counts_the_algorithm_and_it_runs():
    """No count in the README for every change to move (issue 60): the README names
    scripts/count_step.py, which prints the files the README lists and their total."""
    script = os.path.join(REPO, "scripts", "count_step.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True).stdout
    assert re.fullmatch(r"(\d+) files +(\d+) +(\d+)", out.splitlines()[-1])
    said = " ".join(section("Where things are").split())
    assert "(`python scripts/count_step.py` counts their lines)" in said
    assert not re.search(r"\d+ lines, \d+ not blank", said)
    counted = [line.split()[0] for line in out.splitlines()[1:-1]]
    assert len(counted) > 5 and all(os.path.basename(f) in said for f in counted)
