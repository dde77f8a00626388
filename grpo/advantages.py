"""Group-relative advantages: each completion is judged against the other completions of its prompt."""
import torch


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: whether a group's rewards are not all equal (only such a group has advantages).

    Rows of one group are contiguous. Exact equality, not a tolerance: a group is uninformative
    exactly when group_advantages sets its advantages to 0.
    """
    r = rewards.float().view(-1, group_size)
    return r.max(1).values != r.min(1).values


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4):
    """(r - mean of its group) / (std + eps). Rows of one group are contiguous.

    scale: "group" divides by the group's std, "batch" by the whole batch's, "none" not at all.
    A group whose rewards are all equal carries no signal: its advantages are exactly 0 (set, not
    computed, so float rounding in the mean cannot leak a tiny gradient). Returns (advantages,
    fraction of groups with zero std).
    """
    r = rewards.float().view(-1, group_size)
    mean = r.mean(1, keepdim=True)
    std = r.std(1, keepdim=True)
    adv = r - mean
    if scale == "group":
        adv = adv / (std + eps)
    elif scale == "batch":
        adv = adv / (rewards.float().std() + eps)
    elif scale != "none":
        raise ValueError(f"scale_rewards {scale!r}")
    zero = ~informative_groups(rewards, group_size)[:, None]
    adv = adv.masked_fill(zero, 0.0)
    return adv.reshape(-1), zero.float().mean().item()
