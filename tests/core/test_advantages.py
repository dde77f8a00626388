import pytest
import torch

from grpo.algorithm import group_advantages


def test_group_advantages_are_standardised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    adv, frac = group_advantages(rewards, 4, "group", eps=0.0)
    g1, g2 = adv[:4], adv[4:]
    assert torch.allclose(g1, (rewards[:4] - 0.5) / rewards[:4].std())
    assert torch.allclose(g2, (rewards[4:] - 5.0) / rewards[4:].std())
    # scaling the rewards of one group does not change its advantages
    assert torch.allclose(group_advantages(rewards * 10, 4, "group", eps=0.0)[0], adv)
    assert frac == 0.0


def test_equal_rewards_give_exactly_zero_advantage_and_are_counted():
    rewards = torch.tensor([0.1] * 8 + [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    adv, frac = group_advantages(rewards, 8, "group")
    assert torch.equal(adv[:8], torch.zeros(8))  # 0.1 * 8 / 8 is not exactly 0.1 in float
    assert frac == 0.5
    assert (adv[8:] != 0).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_sum_to_zero_per_group(scale):
    torch.manual_seed(0)
    rewards = torch.rand(32)
    adv, _ = group_advantages(rewards, 8, scale)
    assert torch.allclose(adv.view(4, 8).sum(1), torch.zeros(4), atol=1e-5)


def test_batch_and_none_scaling():
    rewards = torch.tensor([0.0, 2.0, 10.0, 30.0])
    none, _ = group_advantages(rewards, 2, "none")
    assert torch.allclose(none, torch.tensor([-1.0, 1.0, -10.0, 10.0]))
    batch, _ = group_advantages(rewards, 2, "batch", eps=0.0)
    assert torch.allclose(batch, none / rewards.std())


def test_unknown_scaling_is_an_error():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), 2, "rank")
