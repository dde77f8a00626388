"""One run's paths: no write lands on, inside or around what the run reads, another of its writes,
what a running run writes or a folder a finished run replaces; each refused with one line (exit 2)
before anything is created or deleted."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

import tasks
from harness import cli, config, paths
from helpers import (EVALUATED_TASK, SMALL, TRAIN, env, one_line_error, read_jsonl, train,
                     usage_error)


def toy(model, *extra):
    return ["--model", model, *SMALL, "--task", "toy", "--steps", "1", *extra]


def snapshot(folder) -> dict:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return out


def load(*argv):
    return cli.load(["--task", "toy", *argv], environ={}, builtin=tasks.BUILTIN).cfg


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_log_on_a_file_of_the_model_is_refused_and_nothing_deleted(tiny_model_dir, tmp_path,
                                                                     name, capsys, clean_env):
    # issue 46 case 2: --overwrite deleted the model's file, then the run failed to load it
    model = tmp_path / "tC"
    shutil.copytree(tiny_model_dir, model)
    before = snapshot(model)
    line = usage_error(toy(str(model), "--out-dir", str(tmp_path / "out"), "--log-file",
                           str(model / name), "--overwrite"), capsys)
    assert f"--log-file {model / name} lies inside {model}, which --model reads: pass another " \
           f"--log-file" in line
    assert snapshot(model) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--log-file", "--log-completions"])
def test_a_log_inside_the_folder_the_final_model_replaces_is_refused(tiny_model_dir, tmp_path,
                                                                     flag, capsys, clean_env):
    # issue 46 case 3: the log vanished when the final model replaced OUT/model (exit 0)
    out, log = tmp_path / "A1", tmp_path / "A1" / "model" / "x.jsonl"
    line = usage_error(toy(tiny_model_dir, "--out-dir", str(out), flag, str(log)), capsys)
    assert f"{flag} {log} lies inside {out / 'model'}, which the run replaces with its trained " \
           f"model at its end: pass another {flag}" in line


def test_paths_are_resolved_and_every_pair_is_checked(tmp_path):
    # a symlink, `..` and a trailing slash name the same place; two logs on one file; the task file
    real, link, out = tmp_path / "real", tmp_path / "link", tmp_path / "o"
    real.mkdir()
    os.symlink(real, link)
    (real / "task.py").write_text("from tasks.toy import ToyTask as T\n")
    cases = [(["--log-file", str(real / "m.jsonl"), "--log-completions",
               str(link / ".." / "link" / "m.jsonl")], "lands on"),
             (["--out-dir", f"{out}/", "--log-completions",
               str(out / "model" / ".." / "checkpoints" / "c.jsonl")], "lies inside"),
             (["--log-completions", str(out / "metrics.items.jsonl")],
              "^--log-completions .* lands on"),
             (["--task", f"{link / 'task.py'}:T", "--log-completions", str(real / "task.py")],
              "which --task reads")]
    for argv, said in cases:
        with pytest.raises(config.ConfigError, match=said):
            paths.check(load("--out-dir", str(out), *argv), None)
    assert not out.exists()   # checked before anything is created


def test_a_run_in_or_around_a_folder_another_run_replaces_is_refused(tmp_path):
    # issue 46 case 5: a run inside A/model was deleted when A resumed and saved its model
    a = tmp_path / "A"
    (a / "model").mkdir(parents=True)
    (a / ".lock").write_text("")   # what every run leaves in its folder
    inner = a / "model" / "b"
    with pytest.raises(config.ConfigError,
                       match=f"lies inside {a / 'model'}, which the run in {a} replaces"):
        paths.check(load("--out-dir", str(inner)), None)
    inner.mkdir()
    (inner / ".lock").write_text("")   # such a run made before the rule: A may not replace it
    with pytest.raises(config.ConfigError, match=f"lies around {inner}, which is another run's"):
        paths.check(load("--out-dir", str(a), "--resume"), None)


def test_a_running_run_locks_every_path_it_writes(tmp_path):
    # issue 46 case 4 in-process: two entries of the registry (the first stands for a live run)
    log = str(tmp_path / "L" / "m.jsonl")
    first = load("--out-dir", str(tmp_path / "a"), "--log-file", log)
    second = load("--out-dir", str(tmp_path / "b"), "--log-file", log)
    with contextlib.ExitStack() as held:
        paths.register(paths.check(first, None), held)
        with pytest.raises(config.ConfigError,
                           match=f"which another run \\(pid {os.getpid()}\\) writes: wait"):
            paths.register(paths.check(second, None), contextlib.ExitStack())
        with contextlib.ExitStack() as apart:
            paths.register(paths.check(load("--out-dir", str(tmp_path / "c")), None), apart)
    with contextlib.ExitStack() as after:   # the first ended: its paths are free
        paths.register(paths.check(second, None), after)


def test_a_temp_folder_that_cannot_be_written_leaves_the_paths_unlocked_and_says_so(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "file" / "tmp"))
    with contextlib.ExitStack() as held:
        paths.register(paths.check(load("--out-dir", str(tmp_path / "a")), None), held)
    assert "cannot lock the paths this run writes" in capsys.readouterr().err


@pytest.mark.slow
def test_two_runs_and_an_evaluation_on_one_log_file(tiny_model_dir, tmp_path):
    # issue 46 case 4: two runs on one --log-file kept 3 of 6 records; --eval-only --overwrite
    # wiped a running run's log
    (tmp_path / "evaluated.py").write_text(EVALUATED_TASK)
    task = ["--model", tiny_model_dir, *SMALL, "--task", f"{tmp_path / 'evaluated.py'}:Evaluated"]
    log = tmp_path / "L" / "metrics.jsonl"
    first = subprocess.Popen([sys.executable, TRAIN, *task, "--steps", "1000", "--out-dir",
                              str(tmp_path / "a"), "--log-file", str(log)], env=env(),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in first.stdout:   # its first record is written
            if line.startswith("step 1/"):
                break
        for extra in (["--steps", "3", "--out-dir", str(tmp_path / "b")],
                      ["--eval-only", "--overwrite"]):
            line = one_line_error(train(*task, "--log-file", str(log), *extra))
            assert f"--log-file {log} lands on {log}, which another run (pid {first.pid}) " \
                   f"writes" in line
        assert read_jsonl(log)[0]["step"] == 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
