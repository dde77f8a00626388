"""Per-token logprobs and the GRPO loss: clipped PPO surrogate plus a k3 KL penalty."""
import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from grpo.model import position_ids_from_mask


def _chosen_logprobs(hidden, targets, weight, bias, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


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
                        chunk_rows: int, autocast=None, share_prompts: bool = True):
    """Logprob of each of the last n_completion tokens of input_ids under `model`: [B, n_completion].

    position_ids come from the attention mask, so a left-padded prompt is scored at the positions it
    was sampled at. Rows with the same (padded) prompt share one prompt forward (_completion_hidden).
    Only completion positions go through the output head, and never as a whole [B, T, vocab] fp32
    tensor: the chosen logit minus a logsumexp, chunk_rows token rows at a time (recomputed in
    backward when chunking), which bounds the logits' memory.
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
        if hidden.shape[0] <= chunk_rows:
            out = _chosen_logprobs(hidden, targets, head.weight, head.bias, temperature)
        else:
            parts = []
            for s in range(0, hidden.shape[0], chunk_rows):
                args = (hidden[s:s + chunk_rows], targets[s:s + chunk_rows], head.weight, head.bias, temperature)
                parts.append(checkpoint(_chosen_logprobs, *args, use_reentrant=False)
                             if torch.is_grad_enabled() else _chosen_logprobs(*args))
            out = torch.cat(parts)
    return out.view(batch, n_completion)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - policy. >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def grpo_loss(logp, old_logp, advantages, mask, denominator: float, *, ref_logp=None, kl_coef: float = 0.0,
              clip_low: float = 0.2, clip_high: float = 0.2, loss_agg: str = "token-mean"):
    """Loss of one micro-batch, already divided by the whole mini-batch's `denominator`.

    token-mean: denominator = completion tokens in the mini-batch; seq-mean: = sequences in it. Passing
    the mini-batch total (not this micro-batch's) is what makes gradient accumulation give exactly
    the gradient of one large batch. Returns (loss, sums of per-token statistics for logging).
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    if ref_logp is not None and kl_coef > 0:
        per_token = per_token + kl_coef * kl
    if loss_agg == "token-mean":
        loss = (per_token * mask).sum() / denominator
    elif loss_agg == "seq-mean":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).sum() / denominator
    else:
        raise ValueError(f"loss_agg {loss_agg!r}")
    with torch.no_grad():
        # a token is clipped when the clamp, not the ratio, decides the minimum: no gradient flows
        is_clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
        stats = {"kl": (kl * mask).sum().item(), "clip": (is_clipped * mask).sum().item(),
                 "ratio": (ratio * mask).sum().item(), "tokens": mask.sum().item()}
    return loss, stats
