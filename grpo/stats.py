"""Per-step statistics of a batch of completions, over the global batch (rows of every rank)."""
import torch


def length_stats(lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """Completion lengths (tokens, EOS included) min / mean / max, and the share cut off at max_new_tokens."""
    lengths = lengths.float()
    return {"completion_len_min": lengths.min().item(), "completion_len_mean": lengths.mean().item(),
            "completion_len_max": lengths.max().item(), "truncated_frac": truncated.float().mean().item()}


def group_reward_std(rewards: torch.Tensor, group_size: int) -> float:
    """The mean over groups of the std of a group's rewards (the spread the advantages are made of).

    The unbiased std, as group_advantages divides by. Rows of one group are contiguous.
    """
    return rewards.float().view(-1, group_size).std(1).mean().item()
