"""bench/ptx_alone.py: the ablation row learns exactly the texts a train_lean.py run with the same flags learns."""
import os
import subprocess
import sys

import pytest

from helpers import REPO, env, read_jsonl, train


def test_the_text_alone_run_learns_the_runs_texts_and_evaluates_at_its_steps(tiny_model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("Repeat a: aaaaaaaaaa\nRepeat b: bbbbbbbbbb\nRepeat c: cccccccccc\n")
    flags = ["--model", tiny_model_dir, "--task", "toy", "--batch-size", "8", "--group-size", "2", "--max-new-tokens", "8", "--learning-rate", "1e-2", "--ptx-coef", "1", "--ptx-file", str(text),
             "--ptx-batch-size", "4", "--steps", "4", "--eval-interval", "2"]
    alone = subprocess.run([sys.executable, os.path.join(REPO, "bench", "ptx_alone.py"), *flags, "--out-dir",
                            str(tmp_path / "alone")], capture_output=True, text=True, env=env(), timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    run = train(*flags, "--out-dir", str(tmp_path / "run"), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    recs = read_jsonl(tmp_path / "alone" / "metrics.jsonl")
    assert [r["step"] for r in recs if r.get("kind") == "eval"] == [0, 2, 4]
    losses = [r["ptx_loss"] for r in recs if "ptx_loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]   # it learns them
    # step 1 (one update) starts from the same weights on the same texts: the GRPO run's loss on them, exactly
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1]   # after the step-0 evaluation
    assert first["step"] == 1 and first["ptx_loss"] == pytest.approx(losses[0], rel=1e-5)
    assert os.path.exists(tmp_path / "alone" / "model" / "config.json")
