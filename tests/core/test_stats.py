import pytest
import torch

from grpo.stats import group_reward_std, length_stats


def test_length_stats():
    stats = length_stats(torch.tensor([3, 24, 10, 24]), torch.tensor([False, True, False, True]))
    assert stats == {"completion_len_min": 3.0, "completion_len_mean": 15.25, "completion_len_max": 24.0,
                     "truncated_frac": 0.5}


def test_group_reward_std_is_the_mean_of_the_groups_unbiased_std():
    rewards = torch.tensor([0.0, 2.0, 1.0, 1.0, 0.0, 4.0])
    # groups of 2: std of (0, 2) = sqrt(2); (1, 1) = 0; (0, 4) = sqrt(8)
    assert group_reward_std(rewards, 2) == pytest.approx((2 ** 0.5 + 0 + 8 ** 0.5) / 3)
