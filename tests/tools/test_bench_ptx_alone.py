"""bench/ptx_alone.py: the ablation row learns exactly the texts a train_lean.py run with the same flags learns."""
import os

import pytest

import train_lean
from bench import ptx_alone
from helpers import read_jsonl


def test_the_text_alone_run_learns_the_runs_texts_and_evaluates_at_its_steps(tiny_model_dir,
                                                                             tmp_path, clean_env):
    # both in this process, as their command lines run them (main(argv))
    text = tmp_path / "text.txt"
    text.write_text("Repeat a: aaaaaaaaaa\nRepeat b: bbbbbbbbbb\nRepeat c: cccccccccc\n")
    flags = ["--model", tiny_model_dir, "--task", "toy", "--batch-size", "8", "--group-size", "2", "--max-new-tokens", "8", "--learning-rate", "1e-2", "--ptx-coef", "1", "--ptx-file", str(text),
             "--ptx-batch-size", "4", "--steps", "4", "--eval-interval", "2"]
    ptx_alone.main([*flags, "--out-dir", str(tmp_path / "alone")])
    train_lean.main([*flags, "--out-dir", str(tmp_path / "run")])
    recs = read_jsonl(tmp_path / "alone" / "metrics.jsonl")
    assert [r["step"] for r in recs if r.get("kind") == "eval"] == [0, 2, 4]
    losses = [r["ptx_loss"] for r in recs if "ptx_loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]   # it learns them
    # step 1 (one update) starts from the same weights on the same texts: the GRPO run's loss on them, exactly
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1]   # after the step-0 evaluation
    assert first["step"] == 1 and first["ptx_loss"] == pytest.approx(losses[0], rel=1e-5)
    assert os.path.exists(tmp_path / "alone" / "model" / "config.json")
