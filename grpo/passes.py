"""The forwards of the step besides sampling: the logprobs of the completion tokens, with gradient
(the update's) or without (the reference's, and what a variant needs before the micro-batches:
grpo/variants.py). A pass without gradient runs under guard.fit (retried with fewer rows after an
out-of-memory), so holds no collective; a gather after it is marked `# every rank`.
"""
import functools
from contextlib import nullcontext

import torch

from grpo.model import adapters_off, completion_logprobs, is_lora, logprob_temperature


def token_logprobs(model, batch, rows, cfg, autocast, with_entropy: bool = False,
                   entropy_grad: bool = False):
    """The logprobs of the completion tokens of batch's `rows` under model, at the sampling
    temperature [rows, T]; with_entropy also the entropy of each position's distribution, with a
    gradient when entropy_grad (a loss term reads it: else a logged statistic)."""
    return completion_logprobs(model, batch.input_ids[rows], batch.attention[rows],
                               batch.completion_len, logprob_temperature(cfg.temperature),
                               cfg.logprob_chunk_size, autocast, with_entropy=with_entropy,
                               entropy_grad=entropy_grad)


def no_grad_pass(model, batch, guard, cfg, autocast, rows=None, entropy: bool = False):
    """The logprobs (entropy: entropies) of the completion tokens of batch's `rows` (None: every
    row) under model, without gradient, retried with fewer rows after an out-of-memory; a gather
    over ranks that follows stays outside the retry."""
    return guard.fit(functools.partial(  # every rank
        _no_grad_pass, model, batch, cfg=cfg, autocast=autocast, rows=rows, entropy=entropy))


def _no_grad_pass(model, batch, micro, cfg, autocast, rows=None,
                  entropy: bool = False) -> torch.Tensor:
    """Without gradient, a micro-batch per forward (micro.split): the logprobs of the completion
    tokens of batch's `rows` (None: every row), or with entropy each position's entropy. guard.fit
    runs it, retried with fewer rows after an out-of-memory: so no collective call in it (a rank
    out of memory would leave the others waiting in it)."""
    parts = micro.split(batch, rows)
    with torch.no_grad():
        out = [token_logprobs(model, batch, part, cfg, autocast, with_entropy=entropy)
               for part in parts]
    return torch.cat([o[1] for o in out] if entropy else out)


def reference_logprobs(reference, batch, cfg, autocast, guard) -> torch.Tensor:
    """The reference's logprobs of every completion token, micro rows at a time. reference: a frozen
    copy, or with LoRA the PeftModel (its adapters switched off for the pass)."""
    with adapters_off(reference) if is_lora(reference) else nullcontext(reference) as model:
        return no_grad_pass(model, batch, guard, cfg, autocast)  # every rank


def loss_mask(batch, cfg) -> torch.Tensor:
    """The completion tokens that carry loss: all of them, or with --mask-truncated none of a cut-off row's."""
    if not cfg.mask_truncated:
        return batch.completion_mask
    return batch.completion_mask * ~batch.truncated[:, None]
