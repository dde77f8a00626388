"""The policy update of one step: reference logprobs, then clipped-surrogate updates over mini-batches,
each accumulated over micro-batches and summed over devices before the optimizer steps.

The loss of a micro-batch is divided by its whole mini-batch's global denominator (loss_denominator),
and a top-entropy threshold is taken over the whole mini-batch of every device, so accumulating
micro-batches and summing over devices gives exactly the gradient of one large batch.
"""
import functools
from collections import Counter

import torch

from grpo import distributed, guards
from grpo.loss import completion_logprobs, grpo_loss, loss_denominator, top_entropy_threshold
from grpo.rollout import logprob_temperature


def reference_logprobs(reference, rollout, micro: int, cfg, autocast) -> torch.Tensor:
    """The frozen reference's logprobs of every completion token, micro rows at a time."""
    T, temperature = rollout.completion_len, logprob_temperature(cfg.temperature)
    with torch.no_grad():
        return torch.cat([completion_logprobs(reference, rollout.input_ids[s:s + micro], rollout.attention[s:s + micro],
                                              T, temperature, cfg.logprob_chunk_size, autocast)
                          for s in range(0, rollout.input_ids.shape[0], micro)])


STATS = ("loss", "kl", "clip", "clip_low", "clip_high", "clip_dual", "ratio", "tokens", "entropy")


def loss_mask(rollout, cfg) -> torch.Tensor:
    """The completion tokens that carry loss: all of them, or with --mask-truncated none of a cut-off row's."""
    if not cfg.mask_truncated:
        return rollout.completion_mask
    return rollout.completion_mask * ~rollout.truncated[:, None]


def high_entropy_tokens(policy, rollout, rows, mask, micro: int, cfg, autocast) -> torch.Tensor:
    """[B, T] bool: the tokens of the mini-batch `rows` among its top --top-entropy-quantile by entropy, the
    threshold taken over the mini-batch of every device before any micro-batch runs."""
    with torch.no_grad():
        entropy = torch.cat([completion_logprobs(policy, rollout.input_ids[part], rollout.attention[part],
                                                 rollout.completion_len, logprob_temperature(cfg.temperature),
                                                 cfg.logprob_chunk_size, autocast, with_entropy=True)[1]
                             for part in rows.split(micro)])
    carried = mask[rows].bool()
    threshold = top_entropy_threshold(torch.cat(distributed.gather_objects(entropy[carried].cpu())),
                                      cfg.top_entropy_quantile)
    chosen = torch.zeros_like(mask, dtype=torch.bool)
    chosen[rows] = entropy >= threshold
    return chosen


def accumulate(policy, optimizer, rollout, advantages, ref_logp, rows, micro: int, mask, pg_mask,
               denominator: float, cfg, autocast) -> list:
    """Forward and backward of one mini-batch (rows), micro rows at a time; returns its summed statistics."""
    optimizer.zero_grad(set_to_none=True)
    clip_high = cfg.clip_range_high if cfg.clip_range_high is not None else cfg.clip_range
    sums = Counter()
    for part in rows.split(micro):
        logp, entropy = completion_logprobs(policy, rollout.input_ids[part], rollout.attention[part],
                                            rollout.completion_len, logprob_temperature(cfg.temperature),
                                            cfg.logprob_chunk_size, autocast, with_entropy=True)
        loss, stats = grpo_loss(logp, rollout.old_logp[part], advantages[part], mask[part], denominator,
                                ref_logp=None if ref_logp is None else ref_logp[part],
                                kl_coef=cfg.kl_coef if cfg.kl_in == "loss" else 0.0, clip_low=cfg.clip_range,
                                clip_high=clip_high, loss_agg=cfg.loss_agg, importance_level=cfg.importance_level,
                                dual_clip=cfg.dual_clip, kl_estimator=cfg.kl_estimator, entropy=entropy,
                                entropy_coef=cfg.entropy_coef, pg_mask=None if pg_mask is None else pg_mask[part])
        loss.backward()
        sums.update(loss=loss.item(), **stats)
    return [sums[k] for k in STATS]


def update(policy, optimizer, rollout, advantages, ref_logp, *, layout, micro: int, cfg, autocast, on_oom,
           nonfinite_streak: int):
    """--ppo-epochs passes over the rollout in shuffled mini-batches, one optimizer step each.

    An update whose loss or gradient norm is not finite is skipped (the weights and AdamW's moments stay
    as they were). Returns (summed statistics, micro-batch size now, non-finite streak)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    B, mini = rollout.input_ids.shape[0], layout.mini_batch_per_device
    lengths = rollout.attention.sum(1).cpu()  # sorted on the host: no device round trip per mini-batch
    mask = loss_mask(rollout, cfg)
    totals = Counter()
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B) if mini < B else torch.arange(B)
        for rows in order.split(mini):
            # micro-batches of similar length waste less compute on padding
            rows = rows[torch.argsort(lengths[rows], stable=True)].to(rollout.input_ids.device)
            # the denominator is global, so summing gradients over ranks gives the one-process gradient
            local = loss_denominator(mask[rows], cfg.loss_agg, cfg.max_new_tokens)
            denominator = max(distributed.all_sum([local])[0], 1)
            pg_mask = None
            if cfg.top_entropy_quantile < 1:
                pg_mask = high_entropy_tokens(policy, rollout, rows, mask, micro, cfg, autocast)
            run = functools.partial(accumulate, policy, optimizer, rollout, advantages, ref_logp, rows, mask=mask,
                                    pg_mask=pg_mask, denominator=denominator, cfg=cfg, autocast=autocast)
            sums, micro = guards.shrinking(run, micro, mini, on_oom)
            distributed.sum_gradients(params)
            stats = dict(zip(STATS, distributed.all_sum(sums)))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
            if guards.finite(stats["loss"], grad_norm):
                optimizer.step()
                nonfinite_streak = 0
            else:  # one bad batch must not poison the weights or AdamW's moments
                optimizer.zero_grad(set_to_none=True)
                totals["skipped"] += 1
                nonfinite_streak += 1
            totals.update(stats, grad_norm=grad_norm, updates=1)
    return totals, micro, nonfinite_streak


def _fit_test(policy, optimizer, moments: int, longest: int, eos: int, micro: int, cfg, autocast):
    """One forward and backward of micro rows of the longest sequence, with AdamW's moments' memory held."""
    stand_in = torch.empty(moments, device=next(policy.parameters()).device)
    ids = torch.full((micro, longest), eos, device=stand_in.device)
    logp = completion_logprobs(policy, ids, torch.ones_like(ids), cfg.max_new_tokens,
                               logprob_temperature(cfg.temperature), cfg.logprob_chunk_size, autocast)
    logp.sum().backward()
    optimizer.zero_grad(set_to_none=True)
    del stand_in


def probe_micro_batch(policy, optimizer, longest: int, eos: int, layout, cfg, autocast, on_oom) -> int:
    """The largest micro-batch (a divisor of the per-device mini-batch) whose forward and backward fit at
    the longest sequence; AdamW's two moments do not exist before the first update, so a stand-in holds
    their place."""
    moments = 0 if optimizer.state else sum(2 * p.numel() for p in policy.parameters() if p.requires_grad)
    run = functools.partial(_fit_test, policy, optimizer, moments, longest, eos, cfg=cfg, autocast=autocast)
    return guards.shrinking(run, layout.micro_batch, layout.mini_batch_per_device, on_oom)[1]
