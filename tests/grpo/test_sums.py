"""grpo/sums.py: a micro-batch's statistics summed over the loss tokens, a Peak kept as the largest
through Counter.update, and read off the device once."""
from collections import Counter

import torch

from grpo.sums import Largest, Peak, Statistics, read_sums


def test_a_largest_stays_the_largest_where_counter_update_adds():
    totals = Counter()
    for peak, tokens in ((0.5, 3), (2.0, 4), (1.0, 5)):
        totals.update({"gap_max": Largest(peak), "tokens": tokens})
    assert totals == {"gap_max": 2.0, "tokens": 12} and type(totals["gap_max"]) is Largest
    assert 0 + Largest(0.25) == 0.25   # the first update adds to Counter's missing 0


def test_statistics_are_sums_over_the_mask_and_a_peak_its_largest():
    torch.manual_seed(0)
    values, gap = torch.rand(3, 5), torch.randn(3, 5)
    mask = (torch.rand(3, 5) > 0.4).float()
    stats = Statistics({"v": values, "gap_max": Peak(gap.abs())}, mask)
    assert list(stats) == ["v", "gap_max"] and len(stats) == 2
    assert stats["v"] == (values * mask).sum().item()
    assert stats["gap_max"] == (gap.abs() * mask).max().item()
    assert type(stats["gap_max"]) is Largest and type(stats["v"]) is float


def test_read_sums_equals_reading_each_micro_batch_in_order():
    torch.manual_seed(1)
    parts, direct = [], Counter()
    for _ in range(3):
        v, mask, loss = torch.rand(2, 4), (torch.rand(2, 4) > 0.3).float(), torch.rand(())
        stats = Statistics({"v": v, "top": Peak(v)}, mask)
        parts.append((stats, loss, mask.sum()))
        direct.update({"v": stats["v"], "top": stats["top"]}, loss=loss.item(),
                      tokens=int(mask.sum().item()))
    sums = read_sums(parts)
    assert sums == direct and type(sums["top"]) is Largest and type(sums["tokens"]) is int
