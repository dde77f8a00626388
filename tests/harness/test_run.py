"""harness/run.py: what the run says around the algorithm's steps, in-process on the tiny model."""

import re

import pytest

import train_lean
from grpo.rollout import stream_seed
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


@pytest.mark.slow   # a process of its own (or a traced run): seconds
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


def test_a_seed_whose_nested_streams_passed_2_to_the_64_trains(tiny_model_dir, tmp_path, clean_env):
    """Issue 54 case 9: --seed 20260101 (a date; any above about 1.8e7) crashed at step 1 once the
    model had loaded ("Overflow when unpacking long long": a step's row seed passed 2**64). Every
    seed that trained before draws the same streams (stream_seed changes no number below 2**64)."""
    for seed in (20260101, 2**32 - 1):
        train_lean.main(["--model", tiny_model_dir, "--task", "toy", *SMALL, "--steps", "1",
                         "--seed", str(seed), "--out-dir", str(tmp_path / str(seed))])
        assert [r["step"] for r in records(tmp_path / str(seed) / "metrics.jsonl")] == [1]
    below = 18_000_000   # its row seeds stay below 2**64: the same as before
    assert stream_seed(stream_seed(below, 7), 3) == (below * 1_000_003 + 7) * 1_000_003 + 3


# evaluate() as a user may write it: $COMPLETE_WITH is what it passes complete()
MISTAKEN_TASK = """
import os
from tasks.toy import ToyTask

class Mistaken(ToyTask):
    def evaluate(self, complete):
        given = {"str": "1+2=", "generator": (p for p in ["Repeat a: "])}
        prompts = given[os.environ["COMPLETE_WITH"]]
        return {"n": len(complete(prompts))}
"""


def test_complete_given_no_list_names_the_tasks_mistake(tiny_model_dir, tmp_path, capsys,
                                                        monkeypatch, clean_env):
    """Issue 54 cases 7 and 10: a str was decoded as four one-character prompts in silence; a
    generator was a TypeError from the progress count (harness/log.py), exit 1."""
    (tmp_path / "mistaken.py").write_text(MISTAKEN_TASK)
    for given, shown in (("str", "'1+2='"), ("generator", "<generator object")):
        monkeypatch.setenv("COMPLETE_WITH", given)
        with pytest.raises(SystemExit) as exit_:
            train_lean.main(["--model", tiny_model_dir, "--task",
                             f"{tmp_path / 'mistaken.py'}:Mistaken", *SMALL[:-4], "--eval-only"])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and "\n" not in err, err
        assert err.startswith(f"train_lean.py: error: the task's evaluation at step 0: complete() "
                              f"takes a list of prompts, and the task's evaluate() gave it a "
                              f"{given}, {shown}"), err


# close() as a user may write it: it raises; $FAIL_REWARD makes every reward fail first
CLOSING_TASK = """
import os
from tasks.toy import ToyTask

class Closing(ToyTask):
    def reward(self, prompt, completion):
        if os.environ.get("FAIL_REWARD"):
            raise KeyError("the real cause")
        return super().reward(prompt, completion)

    def close(self):
        raise OSError("the engine was gone already")
"""


@pytest.mark.slow   # a process of its own (or a traced run): seconds
def test_a_close_that_raises_is_one_line_and_the_runs_outcome_stands(tiny_model_dir, tmp_path):
    """Issue 54 case 11: a traceback and exit 1 after a fully saved run; after a failed one the
    close() error came last, burying the cause."""
    (tmp_path / "closing.py").write_text(CLOSING_TASK)
    argv = ["--model", tiny_model_dir, "--task", f"{tmp_path / 'closing.py'}:Closing", *SMALL,
            "--steps", "1"]
    said = ("train_lean.py: the task's close() raised OSError: the engine was gone already (" +
            str(tmp_path / "closing.py") + " line 12); what it holds may not be released")
    good = train(*argv, "--out-dir", str(tmp_path / "good"))
    assert good.returncode == 0 and "Traceback" not in good.stderr, good.stderr
    assert said in good.stderr.splitlines() and (tmp_path / "good" / "model").is_dir()
    failed = train(*argv, "--out-dir", str(tmp_path / "failed"), extra_env={"FAIL_REWARD": "1"})
    assert failed.returncode == 1 and said in failed.stderr.splitlines(), failed.stderr
    assert failed.stderr.index(said) < failed.stderr.index("Traceback")
    assert "KeyError: 'the real cause'" in failed.stderr.strip().splitlines()[-1]
