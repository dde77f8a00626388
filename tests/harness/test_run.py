"""harness/run.py: what the run says around the algorithm's steps, in-process on the tiny model."""

import re
import signal

import pytest

import forked
import train_lean
from grpo.rollout import stream_seed
from harness.task import TaskEnded
from helpers import PARTED_TASK, PROCESS_DEADLINE_S, SMALL, TRAIN, env, line_starting, records, train


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


def test_a_weight_no_completion_reports_is_one_line_and_exit_2(tiny_model_dir, tmp_path, capsys,
                                                                clean_env):
    """A --reward-weights typo is found once the first step's rewards are in: one line naming it,
    exit 2, no traceback, as a bad flag at start-up (it was a RewardError's traceback, exit 1)."""
    (tmp_path / "parted.py").write_text(PARTED_TASK)
    with pytest.raises(SystemExit) as exit_:
        train_lean.main(["--model", tiny_model_dir, "--task", f"{tmp_path / 'parted.py'}:Parted",
                         *SMALL, "--reward-weights", "letter=1,shrot=0.5", "--steps", "2",
                         "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "train_lean.py: error: --reward-weights names shrot: no completion of step 1 reported such a "
        "part (the task's reward_breakdown gave letter, short)")


HOSTILE_TASK = """
import os, sys, time
from tasks.toy import ToyTask

class Hostile(ToyTask):
    calls = 0

    def __init__(self, **options):
        super().__init__(**options)
        if os.environ.get("MODE") == "slow-init":
            print("building", flush=True)
            time.sleep(600)
        while os.environ.get("MODE") == "swallow-init":
            try:   # a slow call wrapped in a bare except (the signal comes once "building" is read)
                print("building", flush=True)
                time.sleep(60)
            except:  # noqa: E722
                pass

    def reward(self, prompt, completion):
        Hostile.calls += 1
        mode, step_2 = os.environ.get("MODE"), Hostile.calls == 9   # 8 rewards a step
        if mode == "exit" and step_2:
            sys.exit(0)
        if mode == "interrupt" and step_2:
            raise KeyboardInterrupt
        if mode == "fork" and Hostile.calls in (1, 9):   # a helper that exits, one that returns
            child = os.fork()
            if child == 0 and Hostile.calls == 1:
                sys.exit()
            if child:
                os.waitpid(child, 0)
        if mode == "swallow" and step_2:
            print("hung", flush=True)
            while True:
                try:   # a slow call wrapped in a bare except
                    time.sleep(60)
                except:  # noqa: E722
                    pass
        return super().reward(prompt, completion)

    def evaluate(self, complete):
        print("evaluating", flush=True)
        time.sleep(600)
"""


def hostile(tmp_path, model: str, *more) -> list:
    """The arguments of a 3-step run of HOSTILE_TASK (its MODE from the environment)."""
    (tmp_path / "hostile.py").write_text(HOSTILE_TASK)
    return ["--model", model, *SMALL, "--task", f"{tmp_path / 'hostile.py'}:Hostile", "--steps",
            "3", "--save-interval", "0", "--out-dir", str(tmp_path / "out"), *more]


@pytest.mark.parametrize("mode,raised", [("exit", "SystemExit (0)"),
                                         ("interrupt", "KeyboardInterrupt")])
def test_a_task_that_exits_fails_the_run_saving_what_it_trained(tiny_model_dir, tmp_path, capsys,
                                                                monkeypatch, clean_env, mode,
                                                                raised):
    """Issue 72 finding 5: sys.exit(0) in a reward ended the run with exit 0, unsaid and unsaved; a
    KeyboardInterrupt of its own was a traceback with the steps since the last checkpoint lost."""
    monkeypatch.setenv("MODE", mode)
    with pytest.raises(TaskEnded, match=f"the task's reward\\(\\) raised {re.escape(raised)}: "):
        train_lean.main(hostile(tmp_path, tiny_model_dir))
    saved = tmp_path / "out" / "checkpoints" / "step_000001"
    assert f"the run failed after step 1: saved it to {saved}" in capsys.readouterr().err


@pytest.mark.slow   # processes of their own: seconds
def test_a_task_that_forks_cannot_end_or_unlock_the_run(tiny_model_dir, tmp_path):
    """Issue 72 finding 2: a forked helper ending with sys.exit() ran the trainer's clean-up in the
    child: the run's locks went, another run overwrote its files, and it ended in a traceback."""
    args = hostile(tmp_path, tiny_model_dir, "--log-completions", str(tmp_path / "c.jsonl"))
    done = train(*args, extra_env={"MODE": "fork"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert [r["step"] for r in records(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3]
    assert len((tmp_path / "c.jsonl").read_text().splitlines()) == 24
    assert done.stdout.count("saved the trained model") == 1   # by the run, not a child too


@pytest.mark.slow
@pytest.mark.parametrize("mode,said", [
    ("swallow", ["stopped (SIGTERM) in step 2: saved step 1 to {out}/checkpoints/step_000001; "
                 "continue with --resume (the task's code swallowed the stop)"]),
    ("swallow-init", ["stopped (SIGTERM) before the first step: nothing was trained, nothing to "
                      "save", "stopped (SIGTERM) while the task's code swallowed the stop"])],
    ids=["reward", "build"])
def test_a_stop_the_task_swallows_ends_the_run_said(tiny_model_dir, tmp_path, mode, said):
    """Issue 72 finding 4: a reward's bare `except:` swallowed the stop; every SIGTERM was ignored
    for as long as it ran, and a kill -9 then lost the steps trained. A task's `__init__` doing the
    same held the run before its first step."""
    proc = forked.start([TRAIN, *hostile(tmp_path, tiny_model_dir, "--stop-grace", "1")],
                        env(MODE=mode))
    line_starting(proc, "hung" if mode == "swallow" else "building", PROCESS_DEADLINE_S)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    lines = [f"train_lean.py: {line.format(out=tmp_path / 'out')}" for line in said]
    assert err.strip().splitlines()[-len(lines):] == lines, err


@pytest.mark.slow
def test_a_timeout_the_task_swallows_saves_the_last_step_and_exits(tiny_model_dir, tmp_path):
    """Issue 72 finding 6: the timeout's exception, swallowed, became a valid score of 0.0, and
    the spent timer left the other rewards unbounded."""
    done = train(*hostile(tmp_path, tiny_model_dir, "--reward-timeout", "1"),
                 extra_env={"MODE": "swallow"})
    assert done.returncode == 1, done.stderr
    saved = tmp_path / "out" / "checkpoints" / "step_000001"
    assert (f"stopped (--reward-timeout 1 s) in step 2: saved step 1 to {saved}; continue with "
            f"--resume (the task's code swallowed the timeout)") in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode,extra", [("slow-init", []), (None, ["--eval-interval", "5"]),
                                        (None, ["--eval-only"])],
                         ids=["build", "eval", "eval-only"])
def test_ctrl_c_before_the_first_step_is_one_line(tiny_model_dir, tmp_path, mode, extra):
    """Issue 72 finding 13: Ctrl-C in a task's slow __init__ (or the model's load, the packing
    probe) was a KeyboardInterrupt traceback, where SIGTERM at the same moment said one line."""
    args = hostile(tmp_path, tiny_model_dir, *extra)
    proc = forked.start([TRAIN, *args], env(**({"MODE": mode} if mode else {})))
    line_starting(proc, "building" if mode else "evaluating", PROCESS_DEADLINE_S)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == ("train_lean.py: stopped (SIGINT) before the first step: nothing was "
                           "trained, nothing to save")


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
