"""The policy update of one step: reference logprobs, then clipped-surrogate updates over mini-batches,
each accumulated over micro-batches and summed over devices before the optimizer steps.

The math is grpo/algorithm.py; this is the loop around it. Every cross-device call of the update is
here, marked `# every rank`, and every rank makes them in the same order: the mini-batch's loss
denominator and top-entropy threshold (before its micro-batches run), the agreement on an
out-of-memory retry, the gradient sum and the statistics' sum.
"""
import functools
from collections import Counter

import torch

from grpo import distributed
from harness import guards
from grpo.algorithm import grpo_loss, loss_denominator, ptx_loss, top_entropy_threshold
from grpo.model import completion_logprobs, reference_weights
from grpo.rollout import logprob_temperature


def shrinking(run, micro: int, mini: int, note):
    """Return (run(micro), micro), where micro is halved (to a divisor of mini) until run fits in memory.

    `run` must start from a clean slate (zeroed gradients) each call. All ranks agree on each retry,
    so no rank waits in a collective for one that ran out of memory.
    """
    while True:
        try:
            result, oom = run(micro), False
        except Exception as e:  # noqa: BLE001 - anything but an out-of-memory is re-raised
            if not guards.is_oom(e):
                raise
            result, oom = None, True
        if not distributed.any_rank(oom):  # every rank
            return result, micro
        # the exception (and its frames' tensors) is released by now
        result = None
        guards.free_memory()
        smaller = guards.smaller_micro(micro, mini)
        if smaller is None:
            raise torch.OutOfMemoryError("out of memory with a micro-batch of 1: lower --max-new-tokens, "
                                         "use --dtype bf16 or a smaller model")
        note(f"out of memory at micro-batch {micro}: freed memory, retrying with {smaller}")
        micro = smaller


def _reference_logprobs(reference, batch, micro: int, cfg, autocast) -> torch.Tensor:
    T, temperature = batch.completion_len, logprob_temperature(cfg.temperature)
    with torch.no_grad(), reference_weights(reference) as model:  # with LoRA: the policy, adapters off
        return torch.cat([completion_logprobs(model, batch.input_ids[s:s + micro], batch.attention[s:s + micro],
                                              T, temperature, cfg.logprob_chunk_size, autocast)
                          for s in range(0, batch.input_ids.shape[0], micro)])


def reference_logprobs(reference, batch, micro: int, mini: int, cfg, autocast, on_oom):
    """(the reference's logprobs of every completion token, micro-batch size now): micro rows at a time, fewer
    after an out-of-memory. reference: a frozen copy, or with LoRA the PeftModel (its adapters switched off)."""
    return shrinking(functools.partial(_reference_logprobs, reference, batch, cfg=cfg, autocast=autocast),
                     micro, mini, on_oom)


def loss_mask(batch, cfg) -> torch.Tensor:
    """The completion tokens that carry loss: all of them, or with --mask-truncated none of a cut-off row's."""
    if not cfg.mask_truncated:
        return batch.completion_mask
    return batch.completion_mask * ~batch.truncated[:, None]


def high_entropy_tokens(policy, batch, rows, mask, micro: int, cfg, autocast) -> torch.Tensor:
    """[B, T] bool: the tokens of the mini-batch `rows` among its top --top-entropy-quantile by entropy, the
    threshold taken over the mini-batch of every device before any micro-batch runs."""
    with torch.no_grad():
        entropy = torch.cat([completion_logprobs(policy, batch.input_ids[part], batch.attention[part],
                                                 batch.completion_len, logprob_temperature(cfg.temperature),
                                                 cfg.logprob_chunk_size, autocast, with_entropy=True)[1]
                             for part in rows.split(micro)])
    carried = mask[rows].bool()
    every = distributed.gather_objects(entropy[carried].cpu())  # every rank
    threshold = top_entropy_threshold(torch.cat(every), cfg.top_entropy_quantile)
    chosen = torch.zeros_like(mask, dtype=torch.bool)
    chosen[rows] = entropy >= threshold
    return chosen


def accumulate(policy, optimizer, batch, rows, micro: int, mask, pg_mask, denominator: float, cfg,
               autocast, ptx=None) -> Counter:
    """Forward and backward of one mini-batch (rows), micro rows at a time, then of this device's share of the
    update's pretraining-mix texts (ptx, a PtxBatch, with --ptx-coef); returns the summed statistics
    (grpo_loss's, "loss" and "tokens", and with ptx "ptx_nll" and "ptx_tokens")."""
    optimizer.zero_grad(set_to_none=True)
    sums = Counter()
    for part in rows.split(micro):
        logp, entropy = completion_logprobs(policy, batch.input_ids[part], batch.attention[part],
                                            batch.completion_len, logprob_temperature(cfg.temperature),
                                            cfg.logprob_chunk_size, autocast, with_entropy=True)
        loss, stats = grpo_loss(logp, batch.old_logp[part], batch.advantages[part], mask[part], denominator, cfg,
                                ref_logp=None if batch.ref_logp is None else batch.ref_logp[part], entropy=entropy,
                                pg_mask=None if pg_mask is None else pg_mask[part])
        loss.backward()
        sums.update(stats, loss=loss.item(), tokens=mask[part].sum().item())
    if ptx is not None:   # every device reports the same statistics, a share of no texts too
        sums.update(ptx_nll=0.0, ptx_tokens=0)
    for s in range(0, 0 if ptx is None else ptx.input_ids.shape[0], micro):
        part = slice(s, s + micro)
        logp = completion_logprobs(policy, ptx.input_ids[part], ptx.attention[part], ptx.target.shape[1], 1.0,
                                   cfg.logprob_chunk_size, autocast, share_prompts=False)
        loss, nll = ptx_loss(logp, ptx.target[part], ptx.tokens, cfg.ptx_coef)
        loss.backward()
        sums.update(loss=loss.item(), ptx_nll=nll.item(), ptx_tokens=ptx.target[part].sum().item())
    return sums


def update(policy, optimizer, batch, *, layout, micro: int, cfg, autocast, on_oom, nonfinite_streak: int, ptx=None):
    """--ppo-epochs passes over the batch (a Rollout with its advantages, and ref_logp when the loss has a KL
    term) in shuffled mini-batches, one optimizer step each; ptx: with --ptx-coef, this device's share of each
    update's pretraining-mix texts (a PtxBatch per update, grpo/ptx.py).

    An update whose loss or gradient norm is not finite is skipped (the weights and AdamW's moments stay
    as they were). Returns (the step's record entries, micro-batch size now, non-finite streak): grpo_loss's
    statistics per loss token, and the loss and gradient norm per update, all over every device."""
    params = [p for p in policy.parameters() if p.requires_grad]
    B, mini = batch.input_ids.shape[0], layout.mini_batch_per_device
    lengths = batch.attention.sum(1).cpu()  # sorted on the host: no device round trip per mini-batch
    mask = loss_mask(batch, cfg)
    totals, grad_norms, skipped = Counter(), [], 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B) if mini < B else torch.arange(B)
        for rows in order.split(mini):
            # micro-batches of similar length waste less compute on padding
            rows = rows[torch.argsort(lengths[rows], stable=True)].to(batch.input_ids.device)
            # the denominator is global, so summing gradients over ranks gives the one-process gradient
            denominator = max(distributed.all_sum([loss_denominator(mask[rows], cfg)])[0], 1)  # every rank
            pg_mask = None
            if cfg.top_entropy_quantile < 1:
                pg_mask = high_entropy_tokens(policy, batch, rows, mask, micro, cfg, autocast)
            run = functools.partial(accumulate, policy, optimizer, batch, rows, mask=mask, pg_mask=pg_mask,
                                    denominator=denominator, cfg=cfg, autocast=autocast,
                                    ptx=None if ptx is None else ptx[len(grad_norms)])
            sums, micro = shrinking(run, micro, mini, on_oom)
            distributed.sum_gradients(params)  # every rank
            names = sorted(sums)
            sums = dict(zip(names, distributed.all_sum([sums[k] for k in names])))  # every rank
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
            if guards.finite(sums["loss"], grad_norm):
                optimizer.step()
                nonfinite_streak = 0
            else:  # one bad batch must not poison the weights or AdamW's moments
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                nonfinite_streak += 1
            totals.update(sums)
            grad_norms.append(grad_norm)
    tokens, updates = max(totals.pop("tokens"), 1), len(grad_norms)
    ptx_loss = totals.pop("ptx_nll", 0.0) / max(totals.pop("ptx_tokens", 0), 1)
    record = {"loss": totals.pop("loss") / updates, **{k: v / tokens for k, v in totals.items()},
              "grad_norm": sum(grad_norms) / updates, "skipped_nonfinite": skipped}
    if ptx is not None:   # the pretraining mix's mean loss per learned token (not times --ptx-coef)
        record["ptx_loss"] = ptx_loss
    return record, micro, nonfinite_streak


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
    return shrinking(run, layout.micro_batch, layout.mini_batch_per_device, on_oom)[1]
