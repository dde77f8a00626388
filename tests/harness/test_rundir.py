"""A run owns its --out-dir: locked while it runs (a killed run leaves no stale lock), never overwritten after
(--resume continues it, --overwrite starts over on purpose), and a disk too small for it is refused at start-up."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import forked

import tasks
import train_lean
from harness import cli, config, rundir
from helpers import (EVALUATED_TASK, PROCESS_DEADLINE_S, SMALL, TRAIN, env, line_starting,
                     one_line_error, read_jsonl, train, usage_error)
from train_lean import TABLES

pytestmark = pytest.mark.slow   # concurrent and repeated real runs in one folder


def toy(model):
    return ["--model", model, *SMALL, "--task", "toy"]


def snapshot(folder) -> dict:
    """Every file under folder with its bytes (what an earlier run left must stay as it was)."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            if name != ".lock":
                with open(os.path.join(root, name), "rb") as f:
                    out[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return out


def test_a_second_run_in_a_running_runs_folder_exits_2_naming_its_pid(tiny_model_dir, tmp_path,
                                                                      capsys, clean_env):
    out = tmp_path / "out"
    first = forked.start([TRAIN, *toy(tiny_model_dir), "--steps", "1000", "--out-dir", str(out)], env(),
                         stdout=False)
    try:
        deadline = time.time() + PROCESS_DEADLINE_S   # from its start: only a hung run stops it
        while not (out / "metrics.jsonl").exists() or not read_jsonl(out / "metrics.jsonl"):
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.time() < deadline, "the first run wrote no record"
            time.sleep(0.05)
        # a second run, fresh or resuming, must not train into the folder while the first one does
        for extra in ([], ["--overwrite"], ["--resume"]):
            line = usage_error([*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(out),
                                *extra], capsys)
            assert f"--out-dir {out} is in use by another run (pid {first.pid})" in line, line
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # the kernel released the killed run's lock: the folder is free again (and still holds its records)
    refused = usage_error([*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(out)], capsys)
    assert "earlier run's records" in refused and "in use" not in refused
    again = train(*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(out), "--overwrite")
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]


def test_a_finished_runs_folder_is_refused_and_overwrite_starts_over(tiny_model_dir, tmp_path,
                                                                     capsys, clean_env):
    out = tmp_path / "out"
    first = train(*toy(tiny_model_dir), "--steps", "2", "--save-interval", "1", "--out-dir", str(out),
                  "--log-completions", str(out / "completions.jsonl"))
    assert first.returncode == 0, first.stderr
    before = snapshot(out)
    assert {"metrics.jsonl", "completions.jsonl", "model/model.safetensors",
            "checkpoints/step_000002/trainer_state.pt"} <= before.keys()
    # the default --save-interval 0 and the default log paths: the case the default out/ makes normal
    line = usage_error([*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(out)], capsys)
    assert f"--out-dir {out} holds an earlier run's records" in line
    assert "metrics.jsonl" in line and "model" in line and "--resume" in line and "--overwrite" in line
    line = usage_error([*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(tmp_path / "other"),
                        "--log-completions", str(out / "completions.jsonl")], capsys)
    assert "completions.jsonl" in line   # another folder, but the same completions log
    (tmp_path / "nockpt").mkdir()   # a finished run that kept no checkpoint: --resume could not continue it
    (tmp_path / "nockpt" / "metrics.jsonl").write_text('{"step": 1}\n')
    line = usage_error([*toy(tiny_model_dir), "--steps", "1", "--out-dir",
                        str(tmp_path / "nockpt")], capsys)
    assert "pass --resume" not in line and "kept no checkpoint" in line and "--overwrite" in line
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    line = usage_error([*toy(tiny_model_dir), "--steps", "3", "--out-dir", str(tmp_path / "used"),
                        "--resume", str(out / "checkpoints" / "step_000002")], capsys)
    assert "holds an earlier run's records" in line and "resumes a checkpoint from elsewhere" in line
    assert snapshot(out) == before   # not a byte of the earlier run changed

    fresh = train(*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(out), "--overwrite",
                  "--log-completions", str(out / "completions.jsonl"))
    assert fresh.returncode == 0, fresh.stderr
    assert "--overwrite: deleted the earlier run's" in fresh.stderr
    # nothing of the earlier run is left to mix with this one: no record, no checkpoint a --resume could pick
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]
    assert {r["step"] for r in read_jsonl(out / "completions.jsonl")} == {1}
    assert os.listdir(out / "checkpoints") == ["step_000001"]   # the new run's last step


def test_eval_only_works_on_a_finished_runs_folder_and_overwrites_no_log(tiny_model_dir, tmp_path,
                                                                         capsys, clean_env):
    (tmp_path / "evaluated.py").write_text(EVALUATED_TASK)
    task = ["--model", tiny_model_dir, *SMALL, "--task", f"{tmp_path / 'evaluated.py'}:Evaluated"]
    out = tmp_path / "out"
    first = train(*task, "--steps", "2", "--eval-interval", "2", "--save-interval", "2", "--out-dir", str(out))
    assert first.returncode == 0, first.stderr
    before = snapshot(out)
    for args in (["--model", str(out / "model")], ["--resume"]):   # the trained model, and the checkpoint
        result = train(*task, "--eval-only", "--out-dir", str(out), *args)
        assert result.returncode == 0, result.stderr
        assert "first_letter_rate" in result.stdout and "step 1/" not in result.stdout
    assert snapshot(out) == before
    # asked to log into the run's own metrics: that would overwrite them
    line = usage_error([*task, "--eval-only", "--out-dir", str(out), "--log-file",
                        str(out / "metrics.jsonl")], capsys)
    assert "metrics.jsonl" in line and "--overwrite" in line
    # the log is to blame, not --out-dir, which --eval-only does not write
    log = out / "metrics.jsonl"
    assert line.startswith(f"train_lean.py: error: --log-file {log} holds earlier records (")
    assert "another --log-file" in line and "--out-dir" not in line
    assert snapshot(out) == before


def test_a_disk_too_small_for_a_checkpoint_and_the_model_is_refused_before_loading(
        tiny_model_dir, tmp_path, capsys, clean_env):
    # a model folder whose weights file claims as many bytes as the disk has free (a sparse file: it takes
    # none): one checkpoint and the trained model need about four times that
    big = tmp_path / "big-model"
    shutil.copytree(tiny_model_dir, big)
    os.truncate(big / "model.safetensors", shutil.disk_usage(tmp_path).free)
    line = usage_error(["--model", str(big), *SMALL, "--task", "toy", "--steps", "1",
                        "--out-dir", str(tmp_path / "out")], capsys)
    assert "free on its disk" in line and "pass an --out-dir on another disk" in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_an_earlier_runs_memory_evidence_is_one_of_its_records(tmp_path):
    # a traced run leaves OUT_DIR/memory/trace.json: a new run there would mix its evidence with that one
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "trace.json").write_text("{}")
    cfg = cli.load(["--task", "toy", "--out-dir", str(tmp_path)], environ={}, builtin=tasks.BUILTIN, tables=TABLES).cfg
    assert rundir.earlier_run(cfg) == [str(tmp_path / "memory")]


def test_a_longer_resumed_run_says_that_its_schedule_stretches():
    saved = config.settings(config.Config(lr_scheduler="cosine", steps=4), None)
    notes = rundir.check_resume(saved, config.Config(lr_scheduler="cosine", steps=8), None, "ckpt")
    assert any("--steps 4 -> 8" in n and "8-step schedule" in n for n in notes)
    assert not rundir.check_resume(saved, config.Config(lr_scheduler="cosine", steps=4), None, "ckpt")
    constant = config.settings(config.Config(steps=4), None)   # a constant rate does not depend on --steps
    assert not rundir.check_resume(constant, config.Config(steps=8), None, "ckpt")


def test_a_checkpoint_that_recorded_an_earlier_name_resumes_under_the_new_one():
    # checkpoints made before --advantage recorded scale_rewards: the same value is no change, another one is
    saved = config.settings(config.Config(), None)
    saved["scale_rewards"] = saved.pop("advantage")
    assert not rundir.check_resume(saved, config.Config(), None, "ckpt")
    with pytest.raises(config.ConfigError, match="--advantage group -> rloo"):
        rundir.check_resume(saved, config.Config(advantage="rloo"), None, "ckpt")
    allowed = config.Config(advantage="rloo", resume="latest", resume_allow_change="scale_rewards")
    assert "--advantage group -> rloo" in rundir.check_resume(saved, allowed, None, "ckpt")[0]


def test_overwrite_refuses_to_delete_what_the_run_reads(tiny_model_dir, tmp_path, capsys,
                                                        clean_env):
    # train on from a finished run's model into the same folder: --overwrite would delete that model first
    out = tmp_path / "x"
    first = train(*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(out))
    assert first.returncode == 0, first.stderr
    before = snapshot(out)
    line = usage_error([*toy(str(out / "model")), "--steps", "1", "--out-dir", str(out),
                        "--overwrite"], capsys)
    assert f"--out-dir {out}: {out / 'model'} lands on {out / 'model'}, which --model reads: " \
           f"pass another --out-dir" in line
    # a file inside the doomed records (a path="in" setting): the same
    line = usage_error([*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(out), "--overwrite",
                        "--ptx-coef", "1", "--ptx-file", str(out / "metrics.jsonl")], capsys)
    metrics = out / "metrics.jsonl"
    assert f"{metrics} lands on {metrics}, which --ptx-file reads" in line
    assert snapshot(out) == before   # nothing was deleted


def test_overwrite_sets_the_earlier_run_aside_only_when_the_new_one_can_start(tiny_model_dir,
                                                                              tmp_path, capsys,
                                                                              clean_env):
    # issue 46 case 6: --overwrite deleted the earlier run first, then failed (--device tpu, a
    # typo in --model): nothing replaced it
    (tmp_path / "evaluated.py").write_text(EVALUATED_TASK)
    task = ["--model", tiny_model_dir, *SMALL, "--task", f"{tmp_path / 'evaluated.py'}:Evaluated"]
    out = tmp_path / "out"
    first = train(*task, "--steps", "1", "--out-dir", str(out))
    assert first.returncode == 0, first.stderr
    before = snapshot(out)
    for bad in (["--device", "tpu"], ["--model", str(tmp_path / "typo")]):
        usage_error([*task, "--steps", "1", "--out-dir", str(out), "--overwrite", *bad], capsys)
        assert snapshot(out) == before
    # set aside once the model loaded, the run fails at its evaluation before step 1: put back
    failed = train(*task, "--steps", "1", "--out-dir", str(out), "--overwrite", "--eval-interval",
                   "1", extra_env={"RAISE_AT_EVAL": "1"})
    assert failed.returncode == 1 and "are back as they were" in failed.stderr, failed.stderr
    assert snapshot(out) == before
    # the earlier run goes only once the new one has written its first step
    fresh = train(*task, "--steps", "1", "--out-dir", str(out), "--overwrite")
    assert fresh.returncode == 0 and "--overwrite: deleted the earlier run's" in fresh.stderr
    assert not list(out.glob("*.overwritten"))


def test_a_local_looking_model_that_is_not_there_is_refused_at_once(tmp_path):
    """A typo of a local folder went to the hub: 48 s of retries, then the network was blamed."""
    (tmp_path / "out" / "tiny").mkdir(parents=True)
    line = one_line_error(train("--model", "out/tniy", "--task", "toy", "--out-dir", "run",
                                cwd=tmp_path))
    assert line == ("train_lean.py: error: --model out/tniy: no such folder (did you mean "
                    "out/tiny?): pass a local model folder, or a hub id (NAME or OWNER/NAME)")
    (tmp_path / "weights.bin").write_text("")
    line = one_line_error(train("--model", "./weights.bin", "--task", "toy", "--out-dir", "run",
                                cwd=tmp_path))
    assert "--model ./weights.bin is a file: pass the folder that holds the model's" in line


@pytest.mark.parametrize("flag", ["--log-file", "--log-completions"])
def test_a_log_outside_out_dir_that_holds_something_is_named_as_its_flags(
        tiny_model_dir, tmp_path, capsys, clean_env, flag):
    # issue 54 case 13: "--out-dir X holds an earlier run's records (PATH): pass another --out-dir,
    # or --overwrite": another --out-dir could not help
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(SystemExit) as exit_:
        train_lean.main([*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(tmp_path / "out"),
                         flag, str(notes)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err == (
        f"train_lean.py: error: {flag} {notes} holds earlier records ({notes}): the run would "
        f"overwrite them; pass another {flag}, or --overwrite to replace them")
    assert notes.read_text() == "my notes\n"


# a held-out evaluation long enough to stop a run in, before its first step
SLOW_EVAL_TASK = """
import time
from tasks.toy import ToyTask

class SlowEval(ToyTask):
    def evaluate(self, complete):
        time.sleep(300)
        return {"n": 1}
"""


@pytest.mark.slow
def test_sigterm_before_the_first_step_says_what_it_stopped(tiny_model_dir, tmp_path):
    """Issue 59 case 10: SIGTERM in the step-0 evaluation exited 143 without a word (Ctrl-C there
    said it)."""
    (tmp_path / "slow.py").write_text(SLOW_EVAL_TASK)
    argv = [sys.executable, TRAIN, "--model", tiny_model_dir, *SMALL[:-4], "--task",
            f"{tmp_path / 'slow.py'}:SlowEval", "--eval-interval", "5", "--steps", "1",
            "--out-dir", str(tmp_path / "out")]
    proc = forked.start(argv[1:], env())
    line_starting(proc, "eval at step 0: evaluating", 120)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1].endswith(
        "stopped (SIGTERM) before the first step: nothing was trained, nothing to save")


def test_overwrites_set_aside_is_undone_on_sigterm_and_found_after_kill_9(tiny_model_dir, tmp_path):
    # issue 54 case 5: SIGTERM in the step-0 evaluation of an --overwrite run died (143) unsaid,
    # the earlier run left as *.overwritten, which a bare --resume did not find ("no checkpoint")
    # and a later --overwrite left there
    out = tmp_path / "out"
    first = train(*toy(tiny_model_dir), "--steps", "2", "--save-interval", "1", "--out-dir",
                  str(out))
    assert first.returncode == 0, first.stderr
    before = snapshot(out)
    (tmp_path / "slow.py").write_text(SLOW_EVAL_TASK)
    argv = [sys.executable, TRAIN, "--model", tiny_model_dir, *SMALL[:-4], "--task",
            f"{tmp_path / 'slow.py'}:SlowEval", "--eval-interval", "5", "--steps", "1",
            "--out-dir", str(out), "--overwrite"]
    for sent in (signal.SIGTERM, signal.SIGKILL):
        proc = forked.start(argv[1:], env())
        line_starting(proc, "eval at step 0: evaluating", 120)
        proc.send_signal(sent)
        _, err = proc.communicate(timeout=60)
        # SIGTERM: all back as it was, said; kill -9: set aside still, found by the next run
        assert proc.returncode == (128 + sent if sent == signal.SIGTERM else -sent), err
        if sent == signal.SIGTERM:
            assert "stopped (SIGTERM)" in err and "are back as they were" in err, err
            assert snapshot(out) == before
    line = one_line_error(train(*toy(tiny_model_dir), "--steps", "3", "--out-dir", str(out),
                                "--resume"))
    assert f"{out / 'checkpoints.overwritten'} (and " in line
    assert "an --overwrite run set these earlier records aside and was killed" in line
    assert line.endswith("or pass --overwrite to delete them")
    again = train(*toy(tiny_model_dir), "--steps", "1", "--out-dir", str(out), "--overwrite")
    assert again.returncode == 0, again.stderr
    assert not [n for n in os.listdir(out) if ".overwritten" in n]
    assert "checkpoints.overwritten" in again.stderr   # said among what it deleted


CHDIR_TASK = """
import os
from tasks.toy import ToyTask

class Elsewhere(ToyTask):
    def __init__(self, **options):
        super().__init__(**options)
        os.makedirs(os.environ["TASK_CWD"], exist_ok=True)
        os.chdir(os.environ["TASK_CWD"])
"""


def test_a_task_that_changes_the_working_folder_moves_no_path_of_the_run(tiny_model_dir, tmp_path,
                                                                         monkeypatch, capsys, clean_env):
    """Issue 59 case 1: a task whose __init__ calls os.chdir moved a run started with a relative
    --out-dir into another folder (a finished run there lost records and its model). Every path
    is absolute before the task is built."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    (here / "elsewhere.py").write_text(CHDIR_TASK)
    monkeypatch.chdir(here)
    monkeypatch.setenv("TASK_CWD", str(there))
    train_lean.main(["--model", tiny_model_dir, *SMALL, "--task", "elsewhere.py:Elsewhere",
                     "--steps", "2", "--out-dir", "run"])
    assert len(read_jsonl(here / "run" / "metrics.jsonl")) == 2 and (here / "run" / "model").is_dir()
    assert not (there / "run").exists()
    assert f"the task changed the working folder to {there}" in capsys.readouterr().out
    assert str(here / "run") in (here / "run" / "settings.txt").read_text()   # recorded as it is


VANISH_TASK = """
import os, shutil
from tasks.toy import ToyTask

class Vanish(ToyTask):
    calls = 0

    def reward(self, prompt, completion):
        Vanish.calls += 1
        if Vanish.calls == 9:   # the first reward of step 2 (8 a step)
            out = os.environ["VANISH"]
            if os.environ.get("MOVE_TO"):
                os.rename(out, os.environ["MOVE_TO"])
            else:
                shutil.rmtree(out)
        return super().reward(prompt, completion)
"""


@pytest.mark.slow
@pytest.mark.parametrize("move", [False, True])
def test_an_out_dir_deleted_or_moved_while_the_run_trains_stops_it_keeping_a_checkpoint(
        tiny_model_dir, tmp_path, move, clean_env):
    """Issue 59 case 7: rm -rf of the run's folder after step 2 of 5 exited 0 with its records and
    settings gone; mv split the run in two folders, one of them unlocked."""
    (tmp_path / "vanish.py").write_text(VANISH_TASK)
    out, moved = tmp_path / "out", tmp_path / "moved"
    extra = {"VANISH": str(out), **({"MOVE_TO": str(moved)} if move else {})}
    args = [sys.executable, TRAIN, "--model", tiny_model_dir, *SMALL, "--task",
            f"{tmp_path / 'vanish.py'}:Vanish", "--steps", "5", "--save-interval", "0"]
    done = subprocess.run([*args, "--out-dir", str(out)], env={**env(), **extra}, capture_output=True,
                          text=True, timeout=PROCESS_DEADLINE_S)
    assert done.returncode == 1, done.stderr
    home = moved if move else out
    said = (f"--out-dir {out} moved to {moved} while the run trained: stopping after step 2" if move
            else f"--out-dir {out} was deleted while the run trained (its records with it): stopping after step 2")
    assert said in done.stderr
    assert (home / "checkpoints" / "step_000002").is_dir() and not (home / "model").exists()
    assert move != out.exists()   # nothing made again where the folder was, when it moved
    again = subprocess.run([*args, "--out-dir", str(home), "--resume"], env=env(), capture_output=True,
                           text=True, timeout=PROCESS_DEADLINE_S)
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in read_jsonl(home / "metrics.jsonl")][-3:] == [3, 4, 5]
