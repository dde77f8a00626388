"""train_lean.py on the benchmark's varied workload: each completion ends at its row's length from
bench/common.py row_lengths (EOS impossible before it, the only token at it), the lengths TRL's and
the floor's rows get from length_processor. The sampler is patched here, in the benchmark alone.

    python bench/varied_ours.py TRAIN_LEAN_FLAGS...    # bench/run.py --lengths varied runs it
"""
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import train_lean  # noqa: E402
from bench.common import row_lengths  # noqa: E402
from grpo import decoders  # noqa: E402

_init, _draw = decoders.Draws.__init__, decoders.Draws.draw
_calls = [0]   # generate() calls so far: with --eval-interval 0, one per step and generation batch


def init(self, model, batch, max_new_tokens, *args, **kwargs):
    _init(self, model, batch, max_new_tokens, *args, **kwargs)
    _calls[0] += 1
    self.lengths = torch.tensor(row_lengths(_calls[0], batch, max_new_tokens),
                                device=self.done.device)


def draw(self, logits, column, banned):
    rows = getattr(self, "rows", None)   # the rows the decoder still runs (a commit before: all)
    lengths = self.lengths if rows is None else self.lengths[rows]
    eos, logits = self.end_ids[0], logits.clone()
    logits[:, eos] = logits[:, eos].masked_fill(lengths > column + 1, float("-inf"))
    columns = torch.arange(logits.shape[1], device=logits.device)
    last = torch.where(columns == eos, 0.0, float("-inf"))
    logits = torch.where((lengths == column + 1)[:, None], last, logits)
    _draw(self, logits, column, None)


decoders.Draws.__init__, decoders.Draws.draw = init, draw

if __name__ == "__main__":
    train_lean.main()
