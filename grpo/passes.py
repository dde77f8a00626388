"""The forwards without gradient besides the update: the reference's logprobs, and what a variant
needs over a whole mini-batch before its micro-batches (the top-entropy tokens, the tokens a policy
loss chooses, the trainer's logprobs at the sampling weights). Each runs under guard.fit (retried with fewer rows
after an out-of-memory), so holds no collective; the gathers after it are marked `# every rank`.
"""
import functools

import torch

from grpo import distributed
from grpo.variants import declared, entropy_in_loss, top_entropy_threshold
from grpo.model import completion_logprobs, logprob_temperature, reference_weights


def token_logprobs(model, batch, rows, cfg, autocast, with_entropy: bool = False):
    """The logprobs of the completion tokens of batch's `rows` under model, at the sampling
    temperature [rows, T]; with_entropy also the entropy of each position's distribution, with a
    gradient only when the loss reads it (variants.entropy_in_loss; else a logged statistic)."""
    return completion_logprobs(model, batch.input_ids[rows], batch.attention[rows], batch.completion_len,
                               logprob_temperature(cfg.temperature), cfg.logprob_chunk_size, autocast,
                               with_entropy=with_entropy, entropy_grad=entropy_in_loss(cfg))


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
    copy, or with LoRA the PeftModel (its adapters switched off)."""
    with reference_weights(reference) as model:  # with LoRA: the policy, adapters off
        return no_grad_pass(model, batch, guard, cfg, autocast)  # every rank


def loss_mask(batch, cfg) -> torch.Tensor:
    """The completion tokens that carry loss: all of them, or with --mask-truncated none of a cut-off row's."""
    if not cfg.mask_truncated:
        return batch.completion_mask
    return batch.completion_mask * ~batch.truncated[:, None]


def high_entropy_tokens(policy, batch, rows, mask, guard, cfg, autocast) -> torch.Tensor:
    """[B, T] bool: the tokens of the mini-batch `rows` among its top --top-entropy-quantile by
    entropy, the threshold taken over the mini-batch of every device before any micro-batch runs."""
    entropy = no_grad_pass(policy, batch, guard, cfg, autocast, rows, entropy=True)  # every rank
    carried = mask[rows].bool()
    every = distributed.gather_objects(entropy[carried].cpu())  # every rank
    threshold = top_entropy_threshold(torch.cat(every), cfg.top_entropy_quantile)
    chosen = torch.zeros_like(mask, dtype=torch.bool)
    chosen[rows] = entropy >= threshold
    return chosen


def chosen_tokens(choose, policy, batch, rows, mask, guard, cfg, autocast) -> torch.Tensor:
    """[B, T] bool: the tokens of the mini-batch `rows` that a policy loss acts on, chosen by its
    choose(logp, old_logp, adv, cfg) (its chooses_tokens: Clip-Cov's, KL-Cov's) over the
    mini-batch of every device before any micro-batch runs."""
    logp = no_grad_pass(policy, batch, guard, cfg, autocast, rows)  # every rank
    carried = mask[rows].bool()
    adv = batch.advantages[rows][:, None].expand_as(logp)
    tokens = torch.stack([logp[carried], batch.old_logp[rows][carried], adv[carried]]).cpu()
    every = distributed.gather_objects(tokens)  # every rank
    start = sum(t.shape[1] for t in every[:distributed.rank()])
    chosen, mine = torch.zeros_like(mask, dtype=torch.bool), torch.zeros_like(carried)
    picked = choose(*torch.cat(every, 1), cfg)   # among every device's tokens
    mine[carried] = picked[start:start + int(carried.sum())].to(mine.device)
    chosen[rows] = mine
    return chosen


def token_masks(policy, batch, rows, mask, guard, cfg, autocast, loss) -> dict:
    """The tokens of the mini-batch `rows` a variant's term acts on, chosen over every device's rows
    before its micro-batches run: pg_mask (--top-entropy-quantile) and cov_mask (those the policy
    loss `loss` chooses, when it declares chooses_tokens), each None when off."""
    masks = {"pg_mask": None, "cov_mask": None}
    if cfg.top_entropy_quantile < 1:
        masks["pg_mask"] = high_entropy_tokens(  # every rank
            policy, batch, rows, mask, guard, cfg, autocast)
    choose = declared(loss, "chooses_tokens")
    if choose is not None:
        masks["cov_mask"] = chosen_tokens(  # every rank
            choose, policy, batch, rows, mask, guard, cfg, autocast)
    return masks


def trainer_logprobs(policy, batch, cfg, layout, autocast, guard):
    """The trainer's logprobs at the weights that sampled, for --mismatch-correction on a step of
    several updates (each forward gives them itself until the first optimizer step); else None."""
    if cfg.mismatch_correction == "none" or layout.updates_per_step == 1:
        return None
    return no_grad_pass(policy, batch, guard, cfg, autocast)  # every rank
