"""One run's paths: no write lands on, inside or around what the run reads, another of its writes,
what a running run writes or a folder a finished run replaces; each refused with one line (exit 2)
before anything is created or deleted."""
import contextlib
import os
import shutil
import signal
import tempfile

import pytest

import forked

import tasks
import train_lean
from harness import cli, config, paths
from helpers import (EVALUATED_TASK, SMALL, TRAIN, env, one_line_error, read_jsonl, train,
                     usage_error)
from train_lean import TABLES


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
    return cli.load(["--task", "toy", *argv], environ={}, builtin=tasks.BUILTIN, tables=TABLES).cfg


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


def test_the_lock_holds_under_another_tmpdir_and_through_a_relative_path(tmp_path, monkeypatch):
    # issue 54 case 1: the registry followed TMPDIR, so a run under another one deleted (with
    # --overwrite) the --log-completions of a running run; the same file named from another
    # working directory through a relative path is the same file too
    shared = tmp_path / "S" / "c.jsonl"
    shared.parent.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmpA"))
    with contextlib.ExitStack() as held:
        paths.register(paths.check(load("--out-dir", str(tmp_path / "a"), "--log-completions",
                                        str(shared)), None), held)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmpB"))
        monkeypatch.chdir(tmp_path / "S")
        second = load("--out-dir", str(tmp_path / "b"), "--log-completions", "c.jsonl")
        with pytest.raises(config.ConfigError, match=f"--log-completions c.jsonl lands on "
                                                     f"{shared}, which another run "
                                                     f"\\(pid {os.getpid()}\\)"):
            paths.register(paths.check(second, None), contextlib.ExitStack())


def test_a_registry_that_cannot_be_written_leaves_the_paths_unlocked_and_says_so(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(paths, "REGISTRY", str(tmp_path / "file" / "runs"))
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
    first = forked.start([TRAIN, *task, "--steps", "1000", "--out-dir", str(tmp_path / "a"),
                          "--log-file", str(log)], env(), stderr=False)
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


@pytest.mark.parametrize("name, make, said", [
    ("checkpoints", "file", "is a file, where the run makes a folder, which the run keeps"),
    ("checkpoints", "dangling", "is a dangling link, where the run makes a folder"),
    ("model.tmp", "file", "is a file, where the run makes a folder, which the run writes its "
                          "trained model to first"),
    ("metrics.jsonl", "folder", "is a folder, where the run makes a file, which --out-dir writes "
                                "the run's records to"),
    ("metrics.items.jsonl", "dangling", "is a dangling link, where the run makes a file"),
    ("memory", "file", "is a file, where the run makes a folder"),
])
def test_what_lies_where_the_run_makes_a_path_is_refused_before_the_model_loads(
        tiny_model_dir, tmp_path, capsys, clean_env, name, make, said):
    # issue 54 case 3: a file named checkpoints in a fresh --out-dir: every step trained, then
    # "could not save step 3 ... the steps after the start are lost", exit 1
    out = tmp_path / "out"
    out.mkdir()
    {"file": lambda p: p.write_text("x"), "folder": lambda p: p.mkdir(),
     "dangling": lambda p: p.symlink_to(tmp_path / "gone")}[make](out / name)
    with pytest.raises(SystemExit) as exit_:
        train_lean.main(toy(tiny_model_dir, "--out-dir", str(out)))
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err, err
    assert err.startswith(f"train_lean.py: error: --out-dir {out}: {out / name} {said}"), err
    assert err.endswith(": move it away, or pass another --out-dir")
    assert os.listdir(out) == [name]   # nothing written, nothing loaded


def test_a_reporters_folder_counts_only_when_the_run_reports_there(tmp_path):
    cfg = load("--out-dir", str(tmp_path))
    (tmp_path / "wandb").write_text("the user's notes")   # --report-to none: never made
    paths.check_made(cfg, paths.check(cfg, None))
    with pytest.raises(config.ConfigError, match="wandb is a file, where the run makes a folder"):
        cfg = load("--out-dir", str(tmp_path), "--report-to", "wandb")
        paths.check_made(cfg, paths.check(cfg, None))


@pytest.mark.parametrize("flag,name", [("--out-dir", "a\nb"), ("--log-completions", "c\tx.jsonl"),
                                       ("--log-file", "m\x7f.jsonl")])
def test_a_path_with_a_control_character_is_one_line(flag, name, tiny_model_dir, tmp_path, capsys,
                                                     clean_env):
    """Issue 72 finding 11: a newline in a path: the header printed a space (a path that does not
    exist) and the `saved` lines broke in two."""
    given = str(tmp_path / name)
    args = toy(tiny_model_dir, "--out-dir", str(tmp_path / "out"), flag, given)
    err = usage_error(args, capsys)
    assert f"error: {flag} {given!r}: " in err and "holds a control character" in err, err
    assert os.listdir(tmp_path) == []
