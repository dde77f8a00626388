import numpy as np
import torch

from tasks.toy import ToyTask


class LeakyToy(ToyTask):
    """The toy task, with a reward that keeps a copy of every completion's data."""
    name = "leaky_toy"

    def __init__(self, **options):   # the toy task's (--eval-k, ...)
        super().__init__(**options)
        self.seen = []

    def reward(self, prompt, completion):
        self.seen.append(np.full(2**14, len(completion), dtype=np.float64))
        self.seen.append(torch.full((128, 128), float(len(completion))))
        return super().reward(prompt, completion)
