"""harness/run.py: what the run says around the algorithm's steps, in-process on the tiny model."""

import train_lean
from helpers import SMALL, records


def test_a_step_whose_loss_saw_no_tokens_is_named_once(tiny_model_dir, tmp_path, capsys, clean_env):
    """--mask-truncated when every completion is cut off: loss 0, gradient 0 (it said nothing)."""
    train_lean.main(["--model", tiny_model_dir, "--task", "toy", *SMALL, "--max-new-tokens", "2",
                     "--mask-truncated", "--steps", "2", "--out-dir", str(tmp_path)])
    recs = records(tmp_path / "metrics.jsonl")
    assert [(r["truncated_frac"], r["loss"], r["grad_norm"]) for r in recs] == [(1.0, 0.0, 0.0)] * 2
    err = capsys.readouterr().err
    assert err.count("the policy loss saw no tokens") == 1
    assert ("step 1: the policy loss saw no tokens: every completion reached --max-new-tokens 2 "
            "without ending, and --mask-truncated leaves such completions out of the loss") in err
