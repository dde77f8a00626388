"""The policy update of one step: reference logprobs, then clipped-surrogate updates over mini-batches,
each accumulated over micro-batches and summed over devices before the optimizer steps.

The loss of a micro-batch is divided by its whole mini-batch's global count (tokens or sequences), so
accumulating micro-batches and summing over devices gives exactly the gradient of one large batch.
"""
import functools
from collections import Counter

import torch

from grpo import distributed, guards
from grpo.loss import completion_logprobs, grpo_loss
from grpo.rollout import logprob_temperature


def reference_logprobs(reference, rollout, micro: int, cfg, autocast) -> torch.Tensor:
    """The frozen reference's logprobs of every completion token, micro rows at a time."""
    T, temperature = rollout.completion_len, logprob_temperature(cfg.temperature)
    with torch.no_grad():
        return torch.cat([completion_logprobs(reference, rollout.input_ids[s:s + micro], rollout.attention[s:s + micro],
                                              T, temperature, cfg.logprob_chunk_size, autocast)
                          for s in range(0, rollout.input_ids.shape[0], micro)])


def accumulate(policy, optimizer, rollout, advantages, ref_logp, rows, micro: int, denominator: float, cfg,
               autocast) -> list:
    """Forward and backward of one mini-batch (rows), micro rows at a time; returns its summed statistics."""
    optimizer.zero_grad(set_to_none=True)
    clip_high = cfg.clip_range_high if cfg.clip_range_high is not None else cfg.clip_range
    temperature = logprob_temperature(cfg.temperature)
    sums = Counter()
    for part in rows.split(micro):
        logp = completion_logprobs(policy, rollout.input_ids[part], rollout.attention[part], rollout.completion_len,
                                   temperature, cfg.logprob_chunk_size, autocast)
        loss, stats = grpo_loss(logp, rollout.old_logp[part], advantages[part], rollout.completion_mask[part],
                                denominator, ref_logp=None if ref_logp is None else ref_logp[part],
                                kl_coef=cfg.kl_coef, clip_low=cfg.clip_range, clip_high=clip_high,
                                loss_agg=cfg.loss_agg)
        loss.backward()
        sums.update(loss=loss.item(), **stats)
    return [sums[k] for k in ("loss", "kl", "clip", "ratio", "tokens")]


def update(policy, optimizer, rollout, advantages, ref_logp, *, layout, micro: int, cfg, autocast, on_oom,
           nonfinite_streak: int):
    """--ppo-epochs passes over the rollout in shuffled mini-batches, one optimizer step each.

    An update whose loss or gradient norm is not finite is skipped (the weights and AdamW's moments stay
    as they were). Returns (summed statistics, micro-batch size now, non-finite streak)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    B, mini = rollout.input_ids.shape[0], layout.mini_batch_per_device
    lengths = rollout.attention.sum(1).cpu()  # sorted on the host: no device round trip per mini-batch
    totals = Counter()
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B) if mini < B else torch.arange(B)
        for rows in order.split(mini):
            # micro-batches of similar length waste less compute on padding
            rows = rows[torch.argsort(lengths[rows], stable=True)].to(rollout.input_ids.device)
            # the denominator is global, so summing gradients over ranks gives the one-process gradient
            local = rollout.completion_mask[rows].sum().item() if cfg.loss_agg == "token-mean" else len(rows)
            denominator = max(distributed.all_sum([local])[0], 1)
            run = functools.partial(accumulate, policy, optimizer, rollout, advantages, ref_logp, rows,
                                    denominator=denominator, cfg=cfg, autocast=autocast)
            sums, micro = guards.shrinking(run, micro, mini, on_oom)
            distributed.sum_gradients(params)
            loss, kl, clip, ratio, tokens = distributed.all_sum(sums)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
            if guards.finite(loss, grad_norm):
                optimizer.step()
                nonfinite_streak = 0
            else:  # one bad batch must not poison the weights or AdamW's moments
                optimizer.zero_grad(set_to_none=True)
                totals["skipped"] += 1
                nonfinite_streak += 1
            totals.update(loss=loss, kl=kl, clip=clip, ratio=ratio, tokens=tokens, grad_norm=grad_norm, updates=1)
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
