"""harness/run.py: what the run says around the algorithm's steps, in-process on the tiny model."""

import re

import train_lean
from helpers import SMALL, records, train


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


INTERRUPTED_TASK = """
from tasks.toy import ToyTask

class Interrupted(ToyTask):
    def evaluate(self, complete):
        complete(["Repeat a: "])
        raise KeyboardInterrupt   # where Ctrl-C lands during a long evaluation
"""


def test_ctrl_c_during_the_evaluation_before_training_is_a_clean_stop(tiny_model_dir, tmp_path):
    """It was a KeyboardInterrupt traceback and exit 130; nothing is trained yet, so the run stops
    at once, with one line."""
    (tmp_path / "interrupted.py").write_text(INTERRUPTED_TASK)
    task = f"{tmp_path / 'interrupted.py'}:Interrupted"
    for extra in ([], ["--eval-only"]):
        proc = train("--model", tiny_model_dir, "--task", task, *SMALL[:-4], "--eval-interval", "5",
                     "--out-dir", str(tmp_path / "out"), "--overwrite", *extra)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == ("train_lean.py: stopped (Ctrl-C) during the evaluation at "
                                       "step 0, before any training: nothing to save")


def test_the_console_says_how_long_the_run_has_left(tiny_model_dir, tmp_path, capsys, clean_env):
    """Nothing said how long a job would take."""
    train_lean.main(["--model", tiny_model_dir, "--task", "toy", *SMALL, "--steps", "3",
                     "--out-dir", str(tmp_path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [re.search(r" \| eta (\d+s|\d+m\d\ds)$", line) is not None for line in lines] == \
        [False, True, False]   # from the second step on, none at the last
