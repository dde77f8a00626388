"""The policy update of one step: reference logprobs, then clipped-surrogate updates over mini-batches,
each accumulated over micro-batches and summed over devices before the optimizer steps.

The math is grpo/algorithm.py; this is the loop around it. Every cross-device call of the update is
here, marked `# every rank`, and every rank makes them in the same order: the mini-batch's loss
denominator, top-entropy threshold and covariance tokens (before its micro-batches run), the gradient sum and
the statistics' sum. `guard` (harness/guards.py Guard) keeps the run alive: guard.micro is the micro-batch size,
guard.fit(run) calls run(micro) and retries it with a smaller one after an out-of-memory (every rank agrees),
and guard.step(optimizer, params, loss, grad_norm) steps the optimizer unless the update is not
finite.
"""
import functools
import math
from collections import Counter

import torch

from grpo import distributed
from grpo.algorithm import covariance_tokens, grpo_loss, loss_denominator, ptx_loss, top_entropy_threshold
from grpo.model import completion_logprobs, logprob_temperature, reference_weights, trainable_parameters


def token_logprobs(model, batch, rows, cfg, autocast, with_entropy: bool = False):
    """The logprobs of the completion tokens of batch's `rows` under model, at the sampling temperature [rows, T];
    with_entropy also the entropy of each position's distribution."""
    return completion_logprobs(model, batch.input_ids[rows], batch.attention[rows], batch.completion_len,
                               logprob_temperature(cfg.temperature), cfg.logprob_chunk_size, autocast,
                               with_entropy=with_entropy)


def _no_grad_pass(model, batch, micro: int, cfg, autocast, rows=None,
                  entropy: bool = False) -> torch.Tensor:
    """Without gradient, micro rows per forward: the logprobs of the completion tokens of batch's
    `rows` (None: every row), or with entropy each position's entropy. guard.fit runs it, retried
    with fewer rows after an out-of-memory: so no collective call in it (a rank out of memory would
    leave the others waiting in it)."""
    parts = rows.split(micro) if rows is not None else \
        [slice(s, s + micro) for s in range(0, batch.input_ids.shape[0], micro)]
    with torch.no_grad():
        out = [token_logprobs(model, batch, part, cfg, autocast, with_entropy=entropy)
               for part in parts]
    return torch.cat([o[1] for o in out] if entropy else out)


def reference_logprobs(reference, batch, cfg, autocast, guard) -> torch.Tensor:
    """The reference's logprobs of every completion token, micro rows at a time. reference: a frozen copy, or
    with LoRA the PeftModel (its adapters switched off)."""
    with reference_weights(reference) as model:  # with LoRA: the policy, adapters off
        return guard.fit(  # every rank
            functools.partial(_no_grad_pass, model, batch, cfg=cfg, autocast=autocast))


def sampler_logprobs(batch) -> torch.Tensor:
    """The sampler's logprobs of the batch: under the truncated distribution it drew from, or its own old_logp."""
    return batch.old_logp if batch.sampler_logp is None else batch.sampler_logp


def loss_mask(batch, cfg) -> torch.Tensor:
    """The completion tokens that carry loss: all of them, or with --mask-truncated none of a cut-off row's."""
    if not cfg.mask_truncated:
        return batch.completion_mask
    return batch.completion_mask * ~batch.truncated[:, None]


def _mini_batch_pass(policy, batch, rows, guard, cfg, autocast, entropy: bool) -> torch.Tensor:
    """The mini-batch's logprobs (entropy: entropies) [rows, T] before its micro-batches run,
    retried with fewer rows after an out-of-memory; the gather over ranks that follows stays
    outside the retry."""
    return guard.fit(functools.partial(  # every rank
        _no_grad_pass, policy, batch, cfg=cfg, autocast=autocast, rows=rows, entropy=entropy))


def high_entropy_tokens(policy, batch, rows, mask, guard, cfg, autocast) -> torch.Tensor:
    """[B, T] bool: the tokens of the mini-batch `rows` among its top --top-entropy-quantile by entropy, the
    threshold taken over the mini-batch of every device before any micro-batch runs."""
    entropy = _mini_batch_pass(policy, batch, rows, guard, cfg, autocast, True)  # every rank
    carried = mask[rows].bool()
    every = distributed.gather_objects(entropy[carried].cpu())  # every rank
    threshold = top_entropy_threshold(torch.cat(every), cfg.top_entropy_quantile)
    chosen = torch.zeros_like(mask, dtype=torch.bool)
    chosen[rows] = entropy >= threshold
    return chosen


def high_covariance_tokens(policy, batch, rows, mask, guard, cfg, autocast) -> torch.Tensor:
    """[B, T] bool: the tokens of the mini-batch `rows` that --policy-loss clip-cov or kl-cov acts on, chosen over the
    mini-batch of every device (covariance_tokens) before any micro-batch runs."""
    logp = _mini_batch_pass(policy, batch, rows, guard, cfg, autocast, False)  # every rank
    carried = mask[rows].bool()
    adv = batch.advantages[rows][:, None].expand_as(logp)
    tokens = torch.stack([logp[carried], batch.old_logp[rows][carried], adv[carried]]).cpu()
    every = distributed.gather_objects(tokens)  # every rank
    start = sum(t.shape[1] for t in every[:distributed.rank()])
    chosen, mine = torch.zeros_like(mask, dtype=torch.bool), torch.zeros_like(carried)
    mine[carried] = covariance_tokens(*torch.cat(every, 1), cfg)[start:start + int(carried.sum())].to(mine.device)
    chosen[rows] = mine
    return chosen


def accumulate(policy, optimizer, batch, rows, micro: int, mask, pg_mask, denominator: float, cfg,
               autocast, mix=None, cov_mask=None, sampler=None, behaviour=None) -> Counter:
    """Forward and backward of one mini-batch (rows), micro rows at a time, then of this device's share of the
    update's pretraining-mix texts (mix, a PtxBatch, with --ptx-coef); returns the summed statistics
    (grpo_loss's, "loss" and "tokens", and with mix "ptx_nll" and "ptx_tokens"). sampler: the sampler's
    logprobs [B, T] (sampler_logprobs), to measure and correct the mismatch against behaviour, the trainer's at
    the weights that sampled (None: each forward's own); None: not measured ("mismatch_tokens" 0)."""
    optimizer.zero_grad(set_to_none=True)
    sums = Counter()
    for part in rows.split(micro):
        logp, entropy = token_logprobs(policy, batch, part, cfg, autocast, with_entropy=True)
        loss, stats = grpo_loss(logp, batch.old_logp[part], batch.advantages[part], mask[part], denominator, cfg,
                                ref_logp=None if batch.ref_logp is None else batch.ref_logp[part], entropy=entropy,
                                pg_mask=None if pg_mask is None else pg_mask[part],
                                cov_mask=None if cov_mask is None else cov_mask[part],
                                sampler_logp=None if sampler is None else sampler[part],
                                train_logp=None if behaviour is None else behaviour[part])
        loss.backward()
        peak, tokens = stats.pop("mismatch_max", 0.0), mask[part].sum().item()
        sums.update(stats, loss=loss.item(), tokens=tokens, mismatch_tokens=tokens if sampler is not None else 0)
        sums["mismatch_max"] = max(sums["mismatch_max"], peak)
    if mix is not None:   # every device reports the same statistics, a share of no texts too
        sums.update(ptx_nll=0.0, ptx_tokens=0)
    for s in range(0, 0 if mix is None else mix.input_ids.shape[0], micro):
        part = slice(s, s + micro)
        logp = completion_logprobs(policy, mix.input_ids[part], mix.attention[part], mix.target.shape[1], 1.0,
                                   cfg.logprob_chunk_size, autocast, share_prompts=False)
        loss, nll = ptx_loss(logp, mix.target[part], mix.tokens, cfg.ptx_coef)
        loss.backward()
        sums.update(loss=loss.item(), ptx_nll=nll.item(), ptx_tokens=mix.target[part].sum().item())
    return sums


def update(policy, optimizer, batch, cfg, layout, autocast, guard, mix=None) -> dict:
    """--ppo-epochs passes over the batch (a Rollout with its advantages, and ref_logp when the loss has a KL
    term) in shuffled mini-batches, one optimizer step each; mix: with --ptx-coef, this device's share of each
    update's pretraining-mix texts (a PtxBatch per update, grpo/ptx.py).

    An update whose loss or gradient norm is not finite is skipped (the weights and AdamW's moments stay
    as they were). Returns the step's record entries: grpo_loss's statistics per loss token, and the loss and
    gradient norm per update, all over every device."""
    params = trainable_parameters(policy)
    B, mini = batch.input_ids.shape[0], layout.mini_batch_per_device
    lengths = batch.attention.sum(1).cpu()  # sorted on the host: no device round trip per mini-batch
    mask = loss_mask(batch, cfg)
    totals, grad_norms, skipped, peaks = Counter(), [], 0, []
    # the trainer's logprobs at the weights that sampled: each forward gives them until the first optimizer step; a
    # correction on a step of several updates needs them for every row before it (one more forward, no gradient)
    behaviour = None
    if cfg.mismatch_correction != "none" and layout.updates_per_step > 1:
        behaviour = guard.fit(  # every rank
            functools.partial(_no_grad_pass, policy, batch, cfg=cfg, autocast=autocast))
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B) if mini < B else torch.arange(B)
        for rows in order.split(mini):
            # the mismatch is measured where the trainer's logprobs at the sampling weights are known
            sampler = None if behaviour is None and grad_norms else sampler_logprobs(batch)
            # micro-batches of similar length waste less compute on padding
            rows = rows[torch.argsort(lengths[rows], stable=True)].to(batch.input_ids.device)
            # the denominator is global, so summing gradients over ranks gives the one-process gradient
            denominator = max(distributed.all_sum([loss_denominator(mask[rows], cfg)])[0], 1)  # every rank
            pg_mask = None
            if cfg.top_entropy_quantile < 1:
                pg_mask = high_entropy_tokens(  # every rank
                    policy, batch, rows, mask, guard, cfg, autocast)
            cov_mask = None
            if cfg.policy_loss in ("clip-cov", "kl-cov"):
                cov_mask = high_covariance_tokens(  # every rank
                    policy, batch, rows, mask, guard, cfg, autocast)
            sums = guard.fit(functools.partial(accumulate, policy, optimizer, batch, rows, mask=mask, pg_mask=pg_mask,
                                               denominator=denominator, cfg=cfg, autocast=autocast,
                                               mix=None if mix is None else mix[len(grad_norms)], cov_mask=cov_mask,
                                               sampler=sampler, behaviour=behaviour))  # every rank
            distributed.sum_gradients(params)  # every rank
            peaks.append(max(distributed.gather_objects(sums.pop("mismatch_max"))))  # every rank
            names = sorted(sums)
            sums = dict(zip(names, distributed.all_sum([sums[k] for k in names])))  # every rank
            # --max-grad-norm 0 is no clipping (a bound of 0 would zero every gradient): an
            # infinite bound scales by exactly 1
            bound = cfg.max_grad_norm or math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(params, bound).item()
            if not guard.step(optimizer, params, sums["loss"], grad_norm):   # not finite: skipped
                skipped += 1
            totals.update(sums)
            grad_norms.append(grad_norm)
    tokens, updates = max(totals.pop("tokens"), 1), len(grad_norms)
    ptx_nll, ptx_tokens = totals.pop("ptx_nll", 0.0), max(totals.pop("ptx_tokens", 0), 1)
    measured = max(totals.pop("mismatch_tokens"), 1)
    record = {"loss": totals.pop("loss") / updates, "mismatch_max": max(peaks),
              **{k: v / (measured if k.startswith("mismatch") else tokens) for k, v in totals.items()},
              "grad_norm": sum(grad_norms) / updates, "skipped_nonfinite": skipped}
    if mix is not None:   # the pretraining mix's mean loss per learned token (not times --ptx-coef), its texts cut
        record.update(ptx_loss=ptx_nll / ptx_tokens, ptx_cut=sum(b.cut for b in mix))
    return record
