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
    rows = dict(re.fullmatch(r"(\S+) +(\d+)", line).groups() for line in out[1:-1])
    # the step itself, its decoder and its passes are on the path
    assert {"train_lean.py", "grpo/decoders.py", "grpo/passes.py"} <= rows.keys()
    total, without = map(int, re.fullmatch(r"the algorithm +(\d+) +\(train_lean.py and grpo/; (\d+) "
                                           r"without grpo/decoders.py\)", out[-1]).groups())
    ours = {path: int(n) for path, n in rows.items() if path == "train_lean.py" or path.startswith("grpo")}
    assert total == sum(ours.values()) and without == total - ours["grpo/decoders.py"]
    # every function of train_lean.py the step calls, not the file: main() is outside the step
    with open(os.path.join(REPO, "train_lean.py"), encoding="utf-8") as f:
        assert ours["train_lean.py"] < sum(1 for line in f if line.strip())


def test_an_unknown_argument_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "count_step.py"), "--trace"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "count_step.py: unknown arguments --trace (usage: count_step.py [--traced])\n"
