"""scripts/chaos.py, short: a checkpointed run SIGKILLed three times (one aimed at each of mid-step,
mid-save and mid-evaluation) and resumed, engines killed under it, must equal the uninterrupted run."""
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, env
from tasks.rookworld.engine import find_stockfish

pytestmark = pytest.mark.slow   # kill -9 chaos on real runs

CHAOS = os.path.join(REPO, "scripts", "chaos.py")


def test_a_run_killed_and_resumed_three_times_equals_the_uninterrupted_one(tmp_path):
    summary = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, CHAOS, "--steps", "4", "--kills", "3", "--engine-kills", "2",
                        "--eval-interval", "2", "--teach-steps", "60", "--work-dir", str(tmp_path / "work"),
                        "--summary", str(summary)], env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["kills"] == 3 and s["equal"] and "EQUAL" in r.stdout
    assert s["first_differing_record"] is None and s["records_compared"] >= 4 and s["steps_compared"] == 4
    assert s["weight_bytes_differing"] == 0 and s["tensors_equal"] == s["tensors"]
    assert s["tensors_moved"] > 0   # training changed the weights: their equality means something
    assert s["resumes"] >= 1 and s["resumes_seen"] == s["resumes"]   # continued, not restarted
    assert s["engines_left_running"] == []
    if find_stockfish():
        assert s["task"] == "chess" and s["engine_kills"] >= 1


def test_a_summary_inside_a_runs_checkpoints_is_refused(tmp_path):
    """Issue 72 finding 1: every tool's outputs follow the one rule (harness/places.py)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").write_text("")
    inside = tmp_path / "run" / "checkpoints" / "step_000002" / "s.json"
    r = subprocess.run([sys.executable, CHAOS, "--summary", str(inside)], env=env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stderr.strip().endswith(
        f"chaos.py: error: --summary {inside} lies inside {tmp_path / 'run' / 'checkpoints'}, "
        f"which "
        f"the run in {tmp_path / 'run'} keeps (and prunes) its checkpoints in: pass another "
        f"--summary"), r.stderr
