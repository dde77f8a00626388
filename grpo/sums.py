"""A micro-batch's statistics as the update sums them: over micro-batches, updates and devices
(Counter.update), read off the device once per mini-batch."""
import dataclasses
from collections import Counter
from collections.abc import Mapping

import torch


@dataclasses.dataclass(frozen=True)
class Peak:
    """A statistic that is the largest of its [B, T] values over the loss tokens, not their sum."""
    values: torch.Tensor


class Largest(float):
    """A Peak read: adding two keeps the larger, so that Counter.update, which sums the other
    statistics, keeps a Peak's largest."""

    def __add__(self, other):
        return Largest(max(self, other))

    __radd__ = __add__


class Statistics(Mapping):
    """A micro-batch's statistics by name: each a sum over the loss tokens, or a Peak's largest.
    Kept on the device as one tensor (values) until read: reading waits for the device, so the
    update reads every micro-batch's at once (floats); stats[name] reads this one's."""

    def __init__(self, stats: dict, mask):
        self.names, self.read = list(stats), None
        self.largest = {k for k, v in stats.items() if isinstance(v, Peak)}
        self.values = torch.stack([(v.values * mask).max() if k in self.largest
                                   else (v * mask).sum() for k, v in stats.items()])

    def floats(self, values) -> dict:
        """The statistics from their values read (a Peak's as a Largest)."""
        return {k: Largest(v) if k in self.largest else v for k, v in zip(self.names, values)}

    def __getitem__(self, name):
        if self.read is None:
            self.read = self.floats(self.values.tolist())
        return self.read[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def read_sums(parts) -> Counter:
    """Each micro-batch's (Statistics, loss, loss tokens), read off the device at once (float64
    holds each float32 value exactly) and summed on the host in micro-batch order."""
    read = iter(torch.cat([torch.cat([s.values.double(), loss.double()[None], n.double()[None]])
                           for s, loss, n in parts]).tolist())
    sums = Counter()
    for stats, _, _ in parts:
        sums.update(stats.floats([next(read) for _ in stats.names]), loss=next(read),
                    tokens=int(next(read)))
    return sums
