"""Bad input: each case exits with code 2 and one line naming the problem and the fix, before heavy
work. train_lean.main runs in this process (helpers.usage_error), as the command line runs it; the
real command line in a process of its own where its start matters (the hub read offline)."""
import dataclasses
import os

import pytest

from helpers import SMALL, one_line_error, train, usage_error
from harness import config, rundir


@pytest.mark.parametrize("args, expected", [
    (["--bogus", "1"], "unrecognized arguments: --bogus"),
    (["--batch-size", "lots"], "--batch-size 'lots' is not a valid int"),
    (["--micro-batch-size", "3"], "--micro-batch-size 3 does not divide the per-device mini-batch 8"),
])
def test_unknown_flag_or_bad_value(tiny_model_dir, tmp_path, args, expected, capsys, clean_env):
    line = usage_error(["--model", tiny_model_dir, *SMALL, "--out-dir", str(tmp_path), *args],
                       capsys)
    assert expected in line


# as a user starts it: no --model (the shipped default), in their own folder
@pytest.mark.parametrize("args, message", [
    (["--batch-size", "60"], "--batch-size 60 is not a multiple of --group-size 8: use 56 or 64"),
    (["--steps", "two"], "--steps 'two' is not a valid int"),
    (["--task", "nope"], "unknown task 'nope'"),
    (["--model", "./no-such-folder"], "no such folder"),
])
def test_user_errors_exit_2_with_one_line(args, message, tmp_path, capsys, clean_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in usage_error([*args, "--out-dir", str(tmp_path)], capsys)


def test_env_values_are_validated_like_flags(tmp_path, capsys, clean_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRPO_BATCH_SIZE", "60")
    assert "--batch-size 60 is not a multiple" in usage_error(["--out-dir", str(tmp_path)], capsys)


def test_a_model_folder_that_does_not_exist(tmp_path, capsys, clean_env):
    line = usage_error(["--model", str(tmp_path / "no-model"), *SMALL, "--out-dir", str(tmp_path)],
                       capsys)
    assert "no-model: no such folder" in line


def test_a_hub_id_that_cannot_be_fetched_says_the_machine_may_be_offline(tmp_path):
    # the real command line, in a process of its own: what a user runs, with the hub offline
    # (HF_HUB_OFFLINE=1: huggingface_hub reads it when it is imported)
    line = one_line_error(train("--model", "no-such-org/no-such-model", *SMALL, "--out-dir", str(tmp_path)))
    assert "cannot load --model no-such-org/no-such-model" in line and "offline" in line


def test_an_output_folder_that_cannot_be_written(tiny_model_dir, tmp_path, capsys, clean_env):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "out"
    line = usage_error(["--model", tiny_model_dir, *SMALL, "--out-dir", str(out)], capsys)
    assert "--out-dir" in line and "cannot write to" in line and "pass a writable folder" in line


def test_resume_without_a_checkpoint(tiny_model_dir, tmp_path, capsys, clean_env):
    args = ["--model", tiny_model_dir, *SMALL, "--out-dir", str(tmp_path), "--resume"]
    line = usage_error(args, capsys)
    assert f"--resume latest: no checkpoint in {tmp_path}" in line and "run without --resume" in line
    assert "nothing-here" in usage_error([*args, str(tmp_path / "nothing-here")], capsys)


def test_an_output_folder_with_an_earlier_runs_checkpoints_needs_resume(tiny_model_dir, tmp_path,
                                                                        capsys, clean_env):
    (tmp_path / "checkpoints" / "step_000003").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000003" / "trainer_state.pt").write_bytes(b"")
    line = usage_error(["--model", tiny_model_dir, *SMALL, "--out-dir", str(tmp_path)], capsys)
    assert "holds an earlier run's records" in line and "checkpoints" in line and "pass --resume" in line


# Input files: no flag on this branch reads a data file yet; a field declared with path="in" (such as a
# task's --data) gets these checks in check_paths, which train_lean.py runs before loading anything.
@dataclasses.dataclass
class WithData(config.Config):
    data: str = config.opt(None, "a data file", path="in")


def test_a_missing_or_unreadable_data_file(tmp_path):
    with pytest.raises(config.ConfigError, match="--data .*missing.txt: no such file"):
        rundir.check_paths(WithData(data=str(tmp_path / "missing.txt"), out_dir=str(tmp_path)))
    with pytest.raises(config.ConfigError, match="no such file"):
        rundir.check_paths(WithData(data=str(tmp_path), out_dir=str(tmp_path)))  # a folder is no data file
    unreadable = tmp_path / "secret.txt"
    unreadable.write_text("x\n")
    os.chmod(unreadable, 0)
    if os.access(unreadable, os.R_OK):
        pytest.skip("running as root: permissions do not stop reading")
    with pytest.raises(config.ConfigError, match="cannot be read"):
        rundir.check_paths(WithData(data=str(unreadable), out_dir=str(tmp_path)))
