"""The README's promises that code can check: its task example runs as printed, and it stays short."""
import os
import re

import train_lean
from helpers import REPO, SMALL, read_jsonl

README = os.path.join(REPO, "README.md")


def section(title: str) -> str:
    text = open(README, encoding="utf-8").read()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_task_example_trains_and_evaluates_as_printed(tiny_model_dir, tmp_path, capsys, clean_env):
    code = re.search(r"```python\n(.*?)```", section("Your own task"), re.S).group(1)
    assert 10 <= len(code.strip().splitlines()) <= 20   # "a complete example of about 15 lines"
    (tmp_path / "add.py").write_text(code)
    train_lean.main(["--model", tiny_model_dir, "--task", f"{tmp_path / 'add.py'}:Add", *SMALL, "--steps", "2",
                     "--eval-interval", "2", "--out-dir", str(tmp_path / "run")])
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all(0 <= r["accuracy"] <= 1 for r in evals)
    assert [r["step"] for r in records if "kind" not in r] == [1, 2]
    from grpo.task import build, resolve   # the reward is right about right and wrong answers
    add = build(resolve(f"{tmp_path / 'add.py'}:Add", {}))
    assert add.reward("3+4=", "7") == 1.0 and add.reward("3+4=", " 7 and more") == 1.0
    assert add.reward("3+4=", "8") == 0.0 and add.reward("3+4=", "") == 0.0


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) <= 200
    first_block = open(README, encoding="utf-8").read().split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "train"], ["make", "test"]]
