import pytest
import torch

from grpo.algorithm import group_advantages, informative_groups, merge_rounds, missing_groups


def test_informative_groups_are_those_with_nonzero_advantages():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.5, 0.5000001])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, True]
    adv, _ = group_advantages(rewards, 2)
    assert ((adv.view(-1, 2) != 0).any(1) == informative_groups(rewards, 2)).all()


def test_merge_rounds_takes_informative_groups_in_draw_order():
    # group size 2; round 0: [equal, differ], round 1: [differ, equal, differ]
    rounds = [torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0.0, 2.0, 3.0, 3.0, 1.0, 0.0])]
    assert missing_groups(rounds[:1], 2, 2) == 1
    assert missing_groups(rounds, 2, 2) == 0
    rows, counts = merge_rounds(rounds, 2, 2)
    # concatenated rows: round 0 is rows 0-3, round 1 rows 4-9; kept: round 0 group 1, round 1 group 0
    assert rows.tolist() == [2, 3, 4, 5]
    assert counts == {"groups_drawn": 5, "groups_dropped": 3, "groups_uninformative": 0}
    rows, counts = merge_rounds(rounds, 2, 3)
    assert rows.tolist() == [2, 3, 4, 5, 8, 9]
    assert counts == {"groups_drawn": 5, "groups_dropped": 2, "groups_uninformative": 0}
    # whatever is picked, every picked group is informative when enough were drawn
    all_rewards = torch.cat(rounds)
    assert informative_groups(all_rewards[rows], 2).all()


def test_merge_rounds_fills_with_the_earliest_uninformative_groups_when_rounds_run_out():
    rounds = [torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([2.0, 2.0, 5.0, 5.0])]
    assert missing_groups(rounds, 2, 3) == 2
    rows, counts = merge_rounds(rounds, 2, 3)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5]  # the informative group, then uninformative ones by draw order
    assert counts == {"groups_drawn": 4, "groups_dropped": 1, "groups_uninformative": 2}
    with pytest.raises(ValueError, match="fewer than the batch"):
        merge_rounds(rounds, 2, 5)
