"""The forwards of the step besides sampling: the logprobs of the completion tokens, with gradient
(the update's) or without (the reference's, and what a variant needs before the micro-batches:
grpo/variants.py). A pass without gradient runs under guard.fit (retried with fewer rows after an
out-of-memory), so holds no collective; a gather after it is marked `# every rank`.
"""
from contextlib import nullcontext

import torch

from grpo.model import adapters_off, completion_logprobs, is_lora, logprob_temperature


def token_logprobs(model, batch, rows, cfg, autocast, with_entropy=False, entropy_grad=False):
    """The logprobs [rows, T] of batch's completion tokens under model, at the sampling temperature;
    with_entropy also each position's entropy, with a gradient if entropy_grad (a loss reads it)."""
    return completion_logprobs(model, batch.input_ids[rows], batch.attention[rows],
                               batch.completion_len, logprob_temperature(cfg.temperature),
                               cfg.logprob_chunk_size, autocast, with_entropy=with_entropy,
                               entropy_grad=entropy_grad)


def no_grad_pass(model, batch, guard, cfg, autocast, rows=None, entropy: bool = False):
    """The logprobs (entropy: entropies) of batch's `rows` (None: all) under model, no gradient,
    a micro-batch per forward; guard.fit retries it smaller on an out-of-memory: no collective."""
    def run(micro):
        with torch.no_grad():
            out = [token_logprobs(model, batch, part, cfg, autocast, with_entropy=entropy)
                   for part in micro.split(batch, rows)]
        return torch.cat([o[1] for o in out] if entropy else out)
    return guard.fit(run)  # every rank


def reference_logprobs(reference, batch, cfg, autocast, guard) -> torch.Tensor:
    """The reference's logprobs of every completion token, micro rows at a time. reference: a frozen
    copy, or with LoRA the PeftModel (its adapters switched off for the pass)."""
    with adapters_off(reference) if is_lora(reference) else nullcontext(reference) as model:
        return no_grad_pass(model, batch, guard, cfg, autocast)  # every rank


def loss_mask(batch, cfg) -> torch.Tensor:
    """The completion tokens that carry loss: all, or with --mask-truncated no cut-off row's."""
    mask = batch.completion_mask
    return mask * ~batch.truncated[:, None] if cfg.mask_truncated else mask
