"""Completions that reach max_new_tokens: which ones were cut off, and DAPO's soft length penalty.

A completion cut off at max_new_tokens has no EOS, so its reward judges an unfinished answer.
Two remedies, both off by default: drop such completions from the loss (truncated_rows gives the
rows; multiply the loss mask by ~truncated), or shape the reward of every completion near the limit
(overlong_penalty), so the policy learns to finish before it.
"""
import torch


def truncated_rows(completion_ids: torch.Tensor, completion_mask: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B] bool: the completions that end without an EOS, i.e. were stopped by max_new_tokens.

    completion_mask runs up to and including a row's first EOS (grpo/rollout.py), so a row is
    truncated exactly when its last masked token is not EOS.
    """
    lengths = completion_mask.sum(1)
    last = completion_ids.gather(1, (lengths - 1).clamp_min(0)[:, None]).squeeze(1)
    return (lengths > 0) & (last != eos_id)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """[B] rewards to add (<= 0): 0 up to max_new_tokens - buffer tokens, then linear down to -penalty at the limit.

    DAPO's soft overlong punishment. lengths are completion tokens, the EOS included
    (completion_mask.sum(1)). Added to the task reward before the advantages.
    """
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer {buffer} must be in [1, max_new_tokens {max_new_tokens}]")
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(0, buffer)
    return -penalty * over / buffer
