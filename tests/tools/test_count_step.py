"""scripts/count_step.py --traced: the default step's path, counted from a real 2-step toy run."""
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.slow   # a trainer run in its own process
def test_the_traced_count_names_the_step_and_the_decoder_and_adds_them_up():
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "count_step.py"), "--traced"],
                         capture_output=True, text=True, check=True, timeout=300).stdout.splitlines()
    rows = dict(re.fullmatch(r"(\S+) +(\d+)", line).groups() for line in out[1:-2])
    # the step itself, its decoder and its passes are on the path
    assert {"train_lean.py", "grpo/decoders.py", "grpo/passes.py"} <= rows.keys()
    whole, total = re.fullmatch(r"the default path: (\d+) lines \(all (\d+) of train_lean.py, and the traced "
                                r"functions of grpo/\)", out[-2]).group(2, 1)
    without = re.fullmatch(r"the default path without grpo/decoders.py: (\d+) lines", out[-1]).group(1)
    grpo = {path: int(n) for path, n in rows.items() if path.startswith("grpo")}
    with open(os.path.join(REPO, "train_lean.py"), encoding="utf-8") as f:
        assert int(whole) == sum(1 for line in f if line.strip())   # the file whole, main() too
    assert int(total) == int(whole) + sum(grpo.values())
    assert int(without) == int(total) - grpo["grpo/decoders.py"]
    # the traced functions of train_lean.py, listed on their own, are not the file: main() is outside the step
    assert int(rows["train_lean.py"]) < int(whole)


@pytest.mark.slow   # a trainer run in its own process
def test_the_default_path_is_within_its_line_budget():
    # issue 71's budget (docs/history.md): at most 1,000 lines, 650 without grpo/decoders.py
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "count_step.py"), "--traced"],
                         capture_output=True, text=True, check=True, timeout=300).stdout.splitlines()
    total = int(re.fullmatch(r"the default path: (\d+) lines .*", out[-2]).group(1))
    without = int(re.fullmatch(r"the default path without grpo/decoders.py: (\d+) lines", out[-1]).group(1))
    assert total <= 1000 and without <= 650, out[-2:]


def test_an_unknown_argument_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "count_step.py"), "--trace"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "count_step.py: unknown arguments --trace (usage: count_step.py [--traced])\n"
