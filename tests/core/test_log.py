"""The step's statistics over every device's rows, and the JSONL logs on --resume: a torn last line (a kill or a
full disk mid-write) is dropped with a note; a damaged line before it is dropped loudly, the file as it was kept
beside it."""
import pytest
import torch

from grpo.log import batch_stats, combine
from helpers import SMALL, read_jsonl, train


def share(rewards, lengths, truncated, components, errors, reports, train_rewards=None):
    """One device's log.share(), as the gather hands it to combine()."""
    return {"rewards": torch.tensor(rewards), "train_rewards": train_rewards, "lengths": torch.tensor(lengths),
            "truncated": torch.tensor(truncated), "components": components, "errors": errors,
            "scored": len(rewards), "reports": reports}


def test_the_step_over_two_devices():
    everyone = combine([share([0.0, 2.0], [3, 24], [False, True], {"format": 1.0}, {"ValueError": 1},
                              {"ValueError": "rank 0's"}),
                        share([1.0, 1.0, 0.0, 4.0], [10, 24, 5, 5], [False, True, False, False], {"format": 0.5},
                              {"ValueError": 2, "returned None": 1}, {"ValueError": "rank 1's", "returned None": "r1"})])
    stats = batch_stats(everyone, 2)
    assert (stats["completion_len_min"], stats["completion_len_max"]) == (3.0, 24.0)
    assert stats["truncated_frac"] == pytest.approx(2 / 6)
    assert stats["completion_len_mean"] == pytest.approx(71 / 6)
    # groups of 2: std of (0, 2) = sqrt(2); (1, 1) = 0; (0, 4) = sqrt(8): the mean of the groups' unbiased std
    assert stats["reward_std_group"] == pytest.approx((2 ** 0.5 + 0 + 8 ** 0.5) / 3)
    assert stats["reward_mean"] == pytest.approx(8 / 6)
    assert stats["reward_format"] == 0.75                  # each device's mean, averaged over the devices
    assert stats["reward_errors"] == {"ValueError": 3, "returned None": 1}
    assert "kl_reward_penalty" not in stats                # no KL penalty was taken out of the rewards
    assert everyone["scored"] == 6 and everyone["reports"] == {"ValueError": "rank 0's", "returned None": "r1"}
    assert everyone["train_rewards"] is everyone["rewards"]


def test_a_kl_penalty_in_the_reward_is_its_own_statistic():
    everyone = combine([share([1.0, 0.0], [2, 2], [False, False], {}, {}, {}, torch.tensor([0.5, -0.5]))])
    assert batch_stats(everyone, 2)["kl_reward_penalty"] == pytest.approx(0.5)
    assert everyone["train_rewards"].tolist() == [0.5, -0.5]


@pytest.mark.slow
def test_torn_and_damaged_lines_are_dropped_on_resume_and_said(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    metrics, completions = out / "metrics.jsonl", out / "completions.jsonl"
    args = ["--model", tiny_model_dir, *SMALL, "--task", "toy", "--save-interval", "1", "--out-dir", str(out),
            "--log-completions", str(completions)]
    first = train(*args, "--steps", "2")
    assert first.returncode == 0, first.stderr
    for path in (metrics, completions):   # a record cut off mid-write: no newline, not JSON
        with open(path, "ab") as f:
            f.write(b'{"step": 3, "reward_mean": 0.2, "comp')

    resumed = train(*args, "--steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    for path in (metrics, completions):
        assert f"{path}: dropped its torn last line" in resumed.stderr
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3]   # every line parses again
    assert sorted({r["step"] for r in read_jsonl(completions)}) == [1, 2, 3] and len(read_jsonl(completions)) == 24

    # a line that is no record before the last one: not what a kill leaves; said, dropped, the file kept aside
    lines = metrics.read_bytes().splitlines(keepends=True)
    damaged = lines[0] + b"\x00\x00\x00 not a record\n" + b"".join(lines[1:])
    metrics.write_bytes(damaged)
    again = train(*args, "--steps", "4", "--resume")
    assert again.returncode == 0, again.stderr
    assert f"{metrics}: line(s) 2 of 4 hold no JSON record" in again.stderr
    assert (out / "metrics.jsonl.damaged").read_bytes() == damaged
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, 4]
