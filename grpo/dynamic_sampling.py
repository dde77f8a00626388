"""DAPO's dynamic sampling: fill a step's batch with groups whose rewards differ.

A group whose completions all get the same reward has zero advantages: it adds only KL (and
entropy) terms and dilutes the policy gradient of the others. With dynamic sampling the trainer
draws extra rounds of prompts (from the step's seeded prompt stream), generates and scores them,
until it holds enough informative groups or has run its extra rounds; merge_rounds then picks the
batch. Every rank runs the same number of rounds (another round while any rank is short), each
picking its own share of the groups from its own rounds.
"""
from collections import Counter

import torch

from grpo import distributed
from grpo.advantages import informative_groups
from grpo.rollout import select_rows
from grpo.task import draw_prompts


def missing_groups(round_rewards: list, group_size: int, groups: int) -> int:
    """How many informative groups the rounds so far lack for a batch of `groups` (0: enough)."""
    found = sum(int(informative_groups(r, group_size).sum()) for r in round_rewards)
    return max(0, groups - found)


def merge_rounds(round_rewards: list, group_size: int, groups: int):
    """Choose a batch of `groups` groups from generation rounds; return (rows, counts).

    round_rewards: one 1-D reward tensor per round, in draw order, rows of a group contiguous.
    Informative groups are taken first, in draw order; when the rounds hold too few, the earliest
    uninformative groups fill the batch (the rounds ran out: the batch keeps its size, those groups
    add no policy gradient). rows: LongTensor of row indices into the rounds' rows concatenated in
    draw order, whole groups in draw order. counts: groups_drawn, groups_dropped (drawn, not kept)
    and groups_uninformative (kept although uninformative).
    """
    informative = torch.cat([informative_groups(r, group_size) for r in round_rewards])
    drawn = informative.numel()
    if drawn < groups:
        raise ValueError(f"{drawn} groups drawn, fewer than the batch's {groups}")
    order = torch.argsort((~informative).int(), stable=True)  # informative first, each in draw order
    chosen = torch.sort(order[:groups]).values
    rows = (chosen[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    counts = {"groups_drawn": drawn, "groups_dropped": drawn - groups,
              "groups_uninformative": int((~informative[chosen]).sum())}
    return rows, counts


def fill(rollout, rewards, components: dict, errors: dict, *, task, score, rng, sample, seed: int, rank: int,
         world: int, group_size: int, max_rounds: int, pad_id: int):
    """Draw more rounds while any device lacks informative groups, then keep a batch of them.

    rollout, rewards (a [B] tensor), components and errors: this device's first round of the step, scored.
    Each extra round takes the next prompts of the step's stream (rng, seeded by the step), this device's
    share of them, samples them with sample(prompts, seed=, first_row=) at rows past every earlier round's,
    so that no two rounds share sampling seeds, and scores them with score(prompts, completions). Returns the
    batch's rollout and rewards, the reward components (averaged over the rounds) and errors (summed), and
    merge_rounds' counts."""
    rounds, round_rewards, parts, errors = [rollout], [rewards], [components], Counter(errors)
    B = rewards.numel()
    groups = B // group_size
    while len(rounds) <= max_rounds and distributed.any_rank(missing_groups(round_rewards, group_size, groups) > 0):
        prompts = draw_prompts(task, groups * world, rng)[rank * groups:(rank + 1) * groups]
        rounds.append(sample(prompts, seed=seed, first_row=(len(rounds) * world + rank) * B))
        scored, part, errs = score(rounds[-1].prompts, rounds[-1].texts)
        round_rewards.append(torch.from_numpy(scored))
        parts.append(part)
        errors.update(errs)
    rows, counts = merge_rounds(round_rewards, group_size, groups)
    means = {k: sum(p.get(k, 0.0) for p in parts) / len(parts) for k in parts[0]}
    return select_rows(rounds, rows, pad_id), torch.cat(round_rewards)[rows], means, dict(errors), counts
