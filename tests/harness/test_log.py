"""The step's statistics over every device's rows, and the JSONL logs on --resume: a torn last line (a kill or a
full disk mid-write) is dropped with a note; a damaged line before it is dropped loudly, the file as it was kept
beside it. --report-to: the missing-package errors for real; the real writers only where their package is installed."""
import importlib.util
import re
import sys

import pytest
import torch

from harness.config import Config, ConfigError, batch_layout
from harness.log import ReportError, batch_stats, open_reporter, scalars, whole_step
from helpers import SMALL, read_jsonl


def part(rewards, lengths, truncated, part_means, errors, reports, penalties=None):
    """One device's log.device_part(), as the gather hands it to whole_step()."""
    return {"rewards": torch.tensor(rewards), "penalties": penalties or {}, "lengths": torch.tensor(lengths),
            "truncated": torch.tensor(truncated), "part_means": part_means, "errors": errors,
            "scored": len(rewards), "reports": reports}


def test_the_step_over_two_devices():
    step_rows = whole_step([part([0.0, 2.0], [3, 24], [False, True], {"format": 1.0}, {"ValueError": 1},
                              {"ValueError": "rank 0's"}),
                        part([1.0, 1.0, 0.0, 4.0], [10, 24, 5, 5], [False, True, False, False], {"format": 0.5},
                              {"ValueError": 2, "returned None": 1},
                              {"ValueError": "rank 1's", "returned None": "r1"})])
    stats = batch_stats(step_rows, 2)
    assert (stats["completion_len_min"], stats["completion_len_max"]) == (3.0, 24.0)
    assert stats["truncated_frac"] == pytest.approx(2 / 6)
    assert stats["completion_len_mean"] == pytest.approx(71 / 6)
    # groups of 2: std of (0, 2) = sqrt(2); (1, 1) = 0; (0, 4) = sqrt(8): the mean of the groups' unbiased std
    assert stats["reward_std_group"] == pytest.approx((2 ** 0.5 + 0 + 8 ** 0.5) / 3)
    assert stats["reward_mean"] == pytest.approx(8 / 6)
    assert stats["reward_format"] == 0.75                  # each device's mean, averaged over the devices
    assert stats["reward_errors"] == {"ValueError": 3, "returned None": 1}
    assert "kl_reward_penalty" not in stats                # no KL penalty was taken out of the rewards
    assert step_rows["scored"] == 6 and step_rows["reports"] == {"ValueError": "rank 0's", "returned None": "r1"}
    assert step_rows["penalties"] == {}


def test_each_penalty_taken_off_the_reward_is_its_own_statistic_and_the_reward_is_the_tasks():
    step_rows = whole_step([part([1.0, 0.0], [2, 2], [False, False], {}, {}, {},
                                 {"kl_reward_penalty": torch.tensor([0.5, 0.5]), "overlong_penalty": torch.tensor([0.0, 1.0])}),
                            part([2.0, 1.0], [2, 2], [False, False], {}, {}, {},
                                 {"kl_reward_penalty": torch.tensor([1.5, 0.5]), "overlong_penalty": torch.tensor([0.0, 0.0])})])
    stats = batch_stats(step_rows, 2)
    assert stats["kl_reward_penalty"] == pytest.approx(0.75) and stats["overlong_penalty"] == pytest.approx(0.25)
    assert stats["reward_mean"] == pytest.approx(1.0)   # the task's, before the penalties


@pytest.mark.slow
def test_torn_and_damaged_lines_are_dropped_on_resume_and_said(tiny_model_dir, tmp_path, capsys,
                                                               clean_env):
    import train_lean   # in this process: three runs' start-ups saved
    out = tmp_path / "out"
    metrics, completions = out / "metrics.jsonl", out / "completions.jsonl"
    args = ["--model", tiny_model_dir, *SMALL, "--task", "toy", "--save-interval", "1", "--out-dir", str(out),
            "--log-completions", str(completions), "--save-final", "false"]
    train_lean.main([*args, "--steps", "2"])
    for path in (metrics, completions):   # a record cut off mid-write: no newline, not JSON
        with open(path, "ab") as f:
            f.write(b'{"step": 3, "reward_mean": 0.2, "comp')

    capsys.readouterr()
    train_lean.main([*args, "--steps", "3", "--resume"])
    err = capsys.readouterr().err
    for path in (metrics, completions):
        assert f"{path}: dropped its torn last line" in err
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3]   # every line parses again
    assert sorted({r["step"] for r in read_jsonl(completions)}) == [1, 2, 3] and len(read_jsonl(completions)) == 24

    # a line that is no record before the last one: not what a kill leaves; said, dropped, the file kept aside
    lines = metrics.read_bytes().splitlines(keepends=True)
    damaged = lines[0] + b"\x00\x00\x00 not a record\n" + b"".join(lines[1:])
    metrics.write_bytes(damaged)
    train_lean.main([*args, "--steps", "4", "--resume"])
    assert f"{metrics}: line(s) 2 of 4 hold no JSON record" in capsys.readouterr().err
    assert (out / "metrics.jsonl.damaged").read_bytes() == damaged
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, 4]


RECORD = {"step": 3, "loss": 0.5, "kl": 1, "skipped_nonfinite": 0, "kind": "eval", "done": True,
          "reward_errors": {"ValueError": 2}}
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def test_scalars_are_the_numbers_of_a_record_flattened():
    assert scalars(RECORD) == {"loss": 0.5, "kl": 1.0, "skipped_nonfinite": 0.0, "reward_errors/ValueError": 2.0}


def test_none_reports_nothing(tmp_path):
    reporter = open_reporter("none", str(tmp_path), {})
    reporter.log(RECORD, 1)
    reporter.close()
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_kind_is_one_line():
    with pytest.raises(ReportError, match="not one of none, tensorboard, wandb"):
        open_reporter("mlflow", "out", {})


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_missing_package_names_what_to_install(kind, tmp_path, monkeypatch):
    # a None entry in sys.modules makes Python's import of that name fail, as when it is not installed
    monkeypatch.setitem(sys.modules, PACKAGES[kind], None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(ReportError) as e:
        open_reporter(kind, str(tmp_path), {})
    assert str(e.value) == f"--report-to {kind} needs the {PACKAGES[kind]} package: pip install {PACKAGES[kind]}"
    assert not (tmp_path / kind).exists()


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_missing_package_is_refused_at_start_up(kind, monkeypatch):
    """Before anything loads (it was refused once the model had loaded)."""
    monkeypatch.setitem(sys.modules, PACKAGES[kind], None)
    with pytest.raises(ConfigError, match=f"--report-to {kind} needs the {kind} package"):
        batch_layout(Config(report_to=kind))


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_writes_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    reporter = open_reporter("tensorboard", str(tmp_path), {"lr": 1e-4})
    reporter.log(RECORD, 3)
    reporter.log({"step": 4, "loss": 0.25}, 4)
    reporter.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "kl", "skipped_nonfinite", "reward_errors/ValueError"}
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 0.5), (4, 0.25)]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_writes_an_offline_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    reporter = open_reporter("wandb", str(tmp_path), {"learning_rate": 1e-4})
    assert reporter.run.settings.mode == "offline"
    assert reporter.run.config["learning_rate"] == 1e-4
    reporter.log(RECORD, 3)
    reporter.log({"step": 3, "eval_time_s": 7.5}, 3)  # a second record of the same step joins it
    reporter.log({"step": 4, "loss": 0.25}, 4)        # and a later step commits it
    assert reporter.run.summary["loss"] == 0.5 and reporter.run.summary["eval_time_s"] == 7.5
    reporter.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/*.wandb"))
    assert len(runs) == 1
    written = runs[0].read_bytes()  # the run's log holds each history item's name and value as text
    assert b"reward_errors/ValueError" in written and b"0.25" in written


def test_a_long_evaluation_off_a_terminal_says_it_is_still_going(monkeypatch, capsys):
    """Off a terminal, "evaluating ..." was the last line for 7.7 minutes."""
    import time
    from harness import log
    monkeypatch.setattr(log.EvalProgress, "EVERY_S", 0.1)
    lines = []

    def complete(prompts):   # busy until the ticker spoke twice, however late it runs
        deadline = time.monotonic() + 120   # only a ticker that never speaks ends it
        while sum("still" in line for line in lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            lines.extend(capsys.readouterr().out.splitlines())
        return list(prompts)
    progress = log.EvalProgress(complete, "eval at step 0")
    progress(["a", "b"])
    progress.close()
    lines.extend(capsys.readouterr().out.splitlines())
    time.sleep(0.15)   # closed: no line after it
    assert not capsys.readouterr().out
    assert lines[0] == "eval at step 0: evaluating ..." and len(lines) >= 3
    said = r"eval at step 0: still evaluating, \S+ so far, [02] prompts completed"
    assert all(re.fullmatch(said, line) for line in lines[1:]), lines


def test_the_console_line_says_the_share_of_flat_groups_when_half_or_more():
    """A run whose groups were 81-87% flat for 40 steps showed nothing of it on its console line."""
    from harness import log
    rec = {"step": 3, "reward_mean": 0.5, "loss": 0.1, "frac_zero_std": 0.5,
           "reward_errors": {"ValueError": 2}}
    assert log.step_line(rec, 9).startswith("step 3/9 | reward 0.500 | failed 2 | flat 0.50 | loss")
    rec.update(frac_zero_std=0.49, reward_errors={})
    assert log.step_line(rec, 9) == "step 3/9 | reward 0.500 | loss +0.1000"
    assert log.step_line(rec, 9, 75, trend="~0.4 (+0.1 [+0.0, +0.2])") == \
        "step 3/9 | reward 0.500 ~0.4 (+0.1 [+0.0, +0.2]) | loss +0.1000 | eta 1m15s"


def test_the_console_line_says_the_per_token_advantage_when_shaping_is_on():
    """Issue 70: --token-advantage's effect was in the records only."""
    from harness import log
    rec = {"step": 3, "reward_mean": 0.5, "loss": 0.1, "token_adv": -0.0123, "token_adv_std": 0.456}
    assert log.step_line(rec, 9) == \
        "step 3/9 | reward 0.500 | loss +0.1000 | token_adv -0.012 | token_adv_std 0.456"


def test_the_count_moves_as_each_batch_of_a_call_finishes():
    """One complete() call may decode every held-out prompt (4 minutes of chess --eval-only): a
    complete that says its batches (the trainer's) moves the count as each finishes, not at the
    end; one that does not is called as before."""
    from harness import log
    seen = []

    def complete(prompts, progress):
        for done in range(1, len(prompts) + 1):
            progress(done)
            seen.append(counted.done)
        return list(prompts)
    counted = log.EvalProgress(complete, "eval at step 0", batched=True)
    counted(["a", "b", "c"])
    counted(["d"])
    counted.close()
    assert seen == [1, 2, 3, 4] and counted.done == counted.asked == 4
    plain = log.EvalProgress(lambda prompts: list(prompts), "eval at step 0")
    plain(["a", "b"])
    plain.close()
    assert plain.done == 2


def test_an_evaluations_conversations_name_its_items_whatever_the_order_of_their_keys():
    """The digest compare_runs.py pairs evaluations by: the same messages are the same items, other
    ones not; a str prompt hashes as it did before conversations."""
    import hashlib
    from harness import log

    def digest(prompts):
        progress = log.EvalProgress(lambda asked: ["x"] * len(asked), "eval at step 0")
        progress(prompts)
        progress.close()
        return progress.digest()
    ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Repeat a: "}]
    turned = [{"content": m["content"], "role": m["role"]} for m in ask]
    assert digest([ask]) == digest([turned]) != digest([ask[1:]])
    assert digest([ask]) != digest([str(ask)])
    before = hashlib.sha256((10).to_bytes(8, "little") + b"Repeat a: ").hexdigest()
    assert digest(["Repeat a: "]) == before
