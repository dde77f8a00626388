"""--report-to: the missing-package errors for real; the real writers only where their package is installed."""
import importlib.util
import sys

import pytest

from grpo.log import ReportError, open_reporter, scalars

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
