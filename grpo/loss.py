"""Per-token logprobs and entropies, and the GRPO loss: a clipped PPO surrogate plus a KL penalty.

A mini-batch's loss is computed a micro-batch at a time, on each rank. Whatever normalises it or
selects its tokens (the denominator, the top-entropy threshold) is computed from the whole mini-batch
on all ranks before the micro-batches run, so accumulated and rank-summed gradients are exactly the
gradient of one large batch.
"""
import contextlib
import math

import torch
from torch.utils.checkpoint import checkpoint

from grpo.kl import k3_kl, kl_estimate
from grpo.model import position_ids_from_mask

LOSS_AGGS = ("token-mean", "seq-mean", "dr-grpo")
# TRL's loss_type names for the same aggregations (normalise_loss_agg says where they differ)
TRL_LOSS_TYPES = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean", "dr_grpo": "dr-grpo"}
IMPORTANCE_LEVELS = ("token", "sequence")


def _chosen_logprobs(hidden, targets, weight, bias, temperature, with_entropy=False):
    """(logprob of each row's target,) or with_entropy (logprob, entropy of the row's distribution)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return (logp,)
    # H = -sum p log p = logsumexp(z) - sum p z, from the chunk's logits already in memory
    return logp, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)


@contextlib.contextmanager
def _checkpointed_layers(model, on: bool):
    """Recompute each layer in backward when the model has gradient checkpointing enabled.

    Hugging Face checkpoints a layer only while that layer is in training mode, and the policy stays
    in eval mode (dropout off). So only the layer modules themselves are switched, for this forward:
    their submodules, dropout included, stay in eval mode. Yields whether any layer checkpoints.
    """
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True] if on else []
    for m in layers:
        m.training = True
    try:
        yield bool(layers)
    finally:
        for m in layers:
            m.training = False


def _completion_hidden(model, input_ids, attention_mask, n_completion: int, share_prompts: bool):
    """The last hidden states whose logits predict the completion tokens: [B, n_completion, width].

    The rows of a group share one prompt. With share_prompts, each distinct prompt runs through the
    model once and every completion attends to its prompt's keys and values (a KV cache that carries
    gradients back to the shared prompt forward): the same function, without recomputing a prompt
    for every completion of its group (8x less prompt work at group size 8).
    """
    positions = position_ids_from_mask(attention_mask)
    split = input_ids.shape[1] - n_completion
    if share_prompts and split > 0:
        prompts, inverse = torch.unique(torch.cat([input_ids[:, :split], attention_mask[:, :split]], 1),
                                        dim=0, return_inverse=True)
        share_prompts = prompts.shape[0] < input_ids.shape[0]
    if not share_prompts or split == 0:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=positions).last_hidden_state
        return hidden[:, split - 1:-1]  # the logits at position t predict token t + 1
    prompt_ids, prompt_mask = prompts[:, :split], prompts[:, split:]
    head = model.base_model(input_ids=prompt_ids, attention_mask=prompt_mask,
                            position_ids=position_ids_from_mask(prompt_mask), use_cache=True)
    cache = head.past_key_values
    cache.batch_select_indices(inverse)  # each row gets its prompt's keys and values
    tail = model.base_model(input_ids=input_ids[:, split:], attention_mask=attention_mask,
                            position_ids=positions[:, split:], past_key_values=cache, use_cache=True)
    return torch.cat([head.last_hidden_state[inverse, -1:], tail.last_hidden_state[:, :-1]], 1)


def completion_logprobs(model, input_ids, attention_mask, n_completion: int, temperature: float,
                        chunk_rows: int, autocast=None, share_prompts: bool = True, with_entropy: bool = False):
    """Logprob of each of the last n_completion tokens of input_ids under `model`: [B, n_completion].

    position_ids come from the attention mask, so a left-padded prompt is scored at the positions it
    was sampled at. Rows with the same (padded) prompt share one prompt forward (_completion_hidden).
    Only completion positions go through the output head, and never as a whole [B, T, vocab] fp32
    tensor: the chosen logit minus a logsumexp, chunk_rows token rows at a time (recomputed in
    backward when chunking), which bounds the logits' memory.

    with_entropy: returns (logprobs, entropies), the entropy of the temperature-scaled distribution
    the token was sampled from at each position, computed from the same chunks of logits (with
    gradients, for an entropy bonus).
    """
    autocast = autocast or torch.autocast(input_ids.device.type, enabled=False)
    with autocast, _checkpointed_layers(model, torch.is_grad_enabled()) as checkpointing:
        # a checkpointed layer drops its KV cache (Hugging Face), so prompts are not shared then
        hidden = _completion_hidden(model, input_ids, attention_mask, n_completion,
                                    share_prompts and not checkpointing)
        batch = hidden.shape[0]
        hidden = hidden.reshape(batch * n_completion, -1)
        targets = input_ids[:, -n_completion:].reshape(-1)
        head = model.get_output_embeddings()
        recompute = torch.is_grad_enabled() and hidden.shape[0] > chunk_rows
        parts = []
        for s in range(0, hidden.shape[0], chunk_rows):
            args = (hidden[s:s + chunk_rows], targets[s:s + chunk_rows], head.weight, head.bias, temperature,
                    with_entropy)
            parts.append(checkpoint(_chosen_logprobs, *args, use_reentrant=False) if recompute
                         else _chosen_logprobs(*args))
        out = [torch.cat(p).view(batch, n_completion) for p in zip(*parts)]
    return tuple(out) if with_entropy else out[0]


def normalise_loss_agg(name: str) -> str:
    """Our name for a loss aggregation: token-mean, seq-mean or dr-grpo, also given as TRL's loss_type.

    token-mean: sum over the mini-batch's completion tokens / their count. TRL's "dapo" is exactly
    this (the count is over the whole accumulated batch on all processes). TRL's "bnpo" aims at the
    same mean but divides each micro-batch by its own, per-process token count, so it equals this
    only with one micro-batch on one device: here it is taken to mean token-mean.
    seq-mean: each sequence's token mean, averaged over the sequences; TRL's "grpo".
    dr-grpo: sum over tokens / (max_new_tokens x sequences), a constant for a given batch size, so
    no sequence's tokens weigh more for it being short (Dr. GRPO); TRL's "dr_grpo" (TRL divides per
    micro-batch and averages, the same when micro-batches are of equal size, as here).
    """
    if name in LOSS_AGGS:
        return name
    if name in TRL_LOSS_TYPES:
        return TRL_LOSS_TYPES[name]
    raise ValueError(f"loss aggregation {name!r} is not one of {', '.join(LOSS_AGGS + tuple(TRL_LOSS_TYPES))}")


def loss_denominator(mask: torch.Tensor, loss_agg: str, max_new_tokens: int) -> float:
    """This rank's part of a mini-batch's loss denominator, from the mini-batch rows' loss mask [B, T].

    token-mean: the tokens that carry loss; seq-mean: the sequences that carry loss (at least one
    token); dr-grpo: every sequence x max_new_tokens. The caller sums it over ranks (all_sum) and
    passes the total to grpo_loss for every micro-batch of the mini-batch.
    """
    loss_agg = normalise_loss_agg(loss_agg)
    if loss_agg == "token-mean":
        return float(mask.sum().item())
    if loss_agg == "seq-mean":
        return float((mask.sum(1) > 0).sum().item())
    return float(mask.shape[0] * max_new_tokens)


def importance_ratio(logp, old_logp, mask, importance_level: str = "token") -> torch.Tensor:
    """pi / pi_old of each token [B, T], or with "sequence" (GSPO) of each sequence [B, 1].

    The sequence ratio is exp of the mean over the sequence's tokens of logp - old_logp: the
    length-normalised likelihood ratio. Its gradient flows through the mean to every token.
    """
    log_ratio = logp - old_logp
    if importance_level == "token":
        return torch.exp(log_ratio)
    if importance_level == "sequence":
        mask = mask.to(log_ratio.dtype)
        return torch.exp((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1))
    raise ValueError(f"importance level {importance_level!r} is not one of {', '.join(IMPORTANCE_LEVELS)}")


def top_entropy_threshold(entropies: torch.Tensor, quantile: float) -> float:
    """The entropy at or above which a token is among the top `quantile` share of a mini-batch's tokens.

    entropies: 1-D, the entropy of every loss-carrying token of the whole mini-batch, every rank's
    (gathered before the micro-batches run). ceil(quantile x n) tokens are kept, at least one, and
    every token tied with the last of them. pg_mask = entropy >= threshold, for grpo_loss.
    """
    if not 0 <= quantile <= 1:
        raise ValueError(f"top-entropy quantile {quantile} must be in [0, 1]")
    n = entropies.numel()
    if n == 0:
        return math.inf
    keep = max(1, math.ceil(quantile * n - 1e-9))  # the 1e-9: 0.1 * 30 is 3.0000000000000004 in floats
    return torch.kthvalue(entropies.detach().float().cpu(), n - keep + 1).values.item()


def grpo_loss(logp, old_logp, advantages, mask, denominator: float, *, ref_logp=None, kl_coef: float = 0.0,
              clip_low: float = 0.2, clip_high: float = 0.2, loss_agg: str = "token-mean",
              importance_level: str = "token", dual_clip: float = None, kl_estimator: str = "k3",
              entropy=None, entropy_coef: float = 0.0, pg_mask=None):
    """Loss of one micro-batch, already divided by the whole mini-batch's `denominator` (loss_denominator).

    Passing the mini-batch total (not this micro-batch's) is what makes gradient accumulation give
    exactly the gradient of one large batch. Per token, the policy-gradient term is the clipped PPO
    surrogate -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), plus kl_coef x the KL estimate
    (grpo/kl.py) and minus entropy_coef x the entropy; loss_agg (normalise_loss_agg) sums it.

    importance_level "sequence" is GSPO: r is the sequence's ratio (importance_ratio), clipped per
    sequence, every token carrying its sequence's term. It takes clip ranges of a few 1e-4 (GSPO's
    3e-4 low, 4e-4 high), not 0.2: a length-normalised ratio moves far less than a token's.
    dual_clip C > 1 (dual-clip PPO): for A < 0 the term is at most -C A, so a token whose ratio has
    grown far past 1 cannot push the loss without bound.
    entropy: the per-token entropies [B, T] of completion_logprobs(with_entropy=True), needed for
    entropy_coef and for the "entropy" statistic. pg_mask [B, T] (bool): the tokens that carry the
    policy-gradient term (the top-entropy tokens, top_entropy_threshold); the KL and entropy terms
    stay on every token.

    Returns (loss, sums over this micro-batch's loss tokens): "tokens"; "ratio" (r); "kl" (always the
    k3 estimate, a low-variance measure of the divergence, whichever estimator the loss uses);
    "clip_low" (r < 1 - clip_low with A < 0), "clip_high" (r > 1 + clip_high with A > 0) and "clip"
    (either: the clamp decides the minimum, no gradient), counted over pg_mask's tokens; "clip_dual"
    (the dual clip bounds the term); "entropy" (0 without entropies).
    """
    loss_agg = normalise_loss_agg(loss_agg)
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip {dual_clip} must be > 1")
    if entropy_coef and entropy is None:
        raise ValueError("entropy_coef needs the entropies: completion_logprobs(..., with_entropy=True)")
    mask = mask.to(logp.dtype)
    ratio = importance_ratio(logp, old_logp, mask, importance_level)
    adv = advantages[:, None].to(logp.dtype)
    surrogate = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv)
    if dual_clip is not None:
        bounded = torch.minimum(surrogate, -dual_clip * adv)
        surrogate = torch.where(adv < 0, bounded, surrogate)
    per_token = surrogate.expand_as(logp)  # a sequence-level term is every token's
    if pg_mask is not None:
        per_token = per_token * pg_mask
    if ref_logp is not None and kl_coef > 0:
        per_token = per_token + kl_coef * kl_estimate(logp, ref_logp, kl_estimator)
    if entropy_coef:
        per_token = per_token - entropy_coef * entropy
    if loss_agg == "seq-mean":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).sum() / denominator
    else:  # token-mean and dr-grpo differ only in the denominator
        loss = (per_token * mask).sum() / denominator
    with torch.no_grad():
        ratio = ratio.expand_as(logp)
        counted = mask if pg_mask is None else mask * pg_mask
        low = (ratio < 1 - clip_low) & (adv < 0)
        high = (ratio > 1 + clip_high) & (adv > 0)
        dual = (adv < 0) & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(low)
        kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
        stats = {"kl": (kl * mask).sum().item(), "clip": ((low | high) * counted).sum().item(),
                 "clip_low": (low * counted).sum().item(), "clip_high": (high * counted).sum().item(),
                 "clip_dual": (dual * counted).sum().item(), "ratio": (ratio * mask).sum().item(),
                 "tokens": mask.sum().item(),
                 "entropy": (entropy * mask).sum().item() if entropy is not None else 0.0}
    return loss, stats
