"""The GRPO math, top to bottom: rewards -> advantages -> the loss of a micro-batch and its statistics.

Plain functions on tensors: no model, no processes, no files. The choices a flag offers are the dicts
here (name -> what it does); harness/config.py reads them, so a new choice is one entry and its branch.
The update loop that calls the loss (mini-batches, micro-batches, devices) is grpo/update.py.

Exactness under gradient accumulation and data parallelism: a micro-batch's loss is divided by its
whole mini-batch's denominator summed over devices (loss_denominator), and a top-entropy threshold is
taken over the whole mini-batch of every device, so summed micro-batch gradients are exactly the
gradient of one large batch.
"""
import math

import torch

# ---- the learning rate of each step (the optimizer's, beside the loss's math) -------------------------------

LR_SCHEDULES = {  # --lr-scheduler
    "constant": "--learning-rate throughout",
    "linear": "down in a straight line towards --min-lr-ratio x --learning-rate",
    "cosine": "down along half a cosine towards --min-lr-ratio x --learning-rate",
}


def learning_rate(step: int, cfg) -> float:
    """The learning rate of training step `step` (1, 2, ... cfg.steps): a function of the step alone, so a
    resumed run continues the schedule exactly.

    Warmup W steps (--lr-warmup-steps, or --lr-warmup-ratio x --steps rounded): step s <= W trains at
    s / W x the rate, the last of them at the full rate. Then the schedule runs over the remaining steps
    with progress p = (s - W - 1) / (steps - W): the first step after the warmup trains at the full rate,
    and the last one still above the floor (min_lr_ratio x the rate), none at zero.
    """
    base = cfg.learning_rate
    warmup = cfg.lr_warmup_steps or round(cfg.lr_warmup_ratio * cfg.steps)
    if step <= warmup:
        return base * step / warmup
    progress = (step - warmup - 1) / max(1, cfg.steps - warmup)
    floor = cfg.min_lr_ratio * base
    if cfg.lr_scheduler == "linear":
        return floor + (base - floor) * (1 - progress)
    if cfg.lr_scheduler == "cosine":
        return floor + (base - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return base


# ---- advantages: each completion judged against the other completions of its prompt ------------------

ADVANTAGES = {  # --scale-rewards
    "group": "(r - the group's mean) / (the group's std + eps)",
    "batch": "(r - the group's mean) / (the whole batch's std + eps), every device's rows",
    "none": "r - the group's mean (Dr. GRPO)",
    "rloo": "r - the mean of the group's other rewards (RLOO's leave-one-out baseline), not divided",
    "reinforce++": "(r - the whole batch's mean) / (the batch's std + eps), every device's rows (REINFORCE++): a global "
                   "baseline, so a group whose rewards are all equal still gets advantages",
    "reinforce++-baseline": "(r - the group's mean) / (the batch's std of those differences + eps) (REINFORCE++-baseline)",
    "maxrl": "(r - the group's mean) / (the group's mean + eps) (MaxRL): for rewards in {0, 1}, a rare success weighs "
             "more; a negative mean flips the sign",
    "gdpo": "each --reward-weights part normalised in its group as 'group' does, weighted and summed, then divided by "
            "the batch's std of the sums + eps (GDPO)",
}


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: whether a group's rewards are not all equal (only such a group has advantages).

    Rows of one group are contiguous. Exact equality, not a tolerance: a group is uninformative
    exactly when group_advantages sets its advantages to 0.
    """
    r = rewards.float().view(-1, group_size)
    return r.max(1).values != r.min(1).values


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4, parts=None,
                     weights=None):
    """Each reward against its group, as ADVANTAGES[scale] says. Rows of one group are contiguous.

    A group whose rewards are all equal carries no signal: its advantages are exactly 0 (set, not
    computed, so float rounding in the mean cannot leak a tiny gradient); not with "reinforce++", whose
    baseline is the batch's, nor "gdpo", where each part's equal groups get 0 and a group whose weighted sum
    ties may still differ part by part. parts [N, K] and weights (K numbers): the reward's parts, for "gdpo".
    Returns (advantages, fraction of groups with zero std).
    """
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(1, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / (rewards.float().std() + eps)
    elif scale == "rloo":  # each completion's baseline leaves it out: the mean of the other G - 1
        adv = r - (r.sum(1, keepdim=True) - r) / (group_size - 1)
    elif scale == "reinforce++":
        adv = (r - r.mean()) / (r.std() + eps)
    elif scale == "reinforce++-baseline":
        adv = adv / (adv.std() + eps)
    elif scale == "maxrl":
        adv = adv / (r.mean(1, keepdim=True) + eps)
    elif scale == "gdpo":  # normalised apart, a part of small spread is not drowned by one of large spread
        adv = sum(w * group_advantages(parts[:, k], group_size, "group", eps)[0] for k, w in enumerate(weights))
        adv = (adv / (adv.std() + eps)).view(-1, group_size)   # the sum's batch mean is 0 already
    elif scale != "none":
        raise ValueError(f"scale_rewards {scale!r} is not one of {', '.join(ADVANTAGES)}")
    zero = ~informative_groups(rewards, group_size)[:, None]
    if scale not in ("reinforce++", "gdpo"):
        adv = adv.masked_fill(zero, 0.0)
    return adv.reshape(-1), zero.float().mean().item()


# ---- reward shaping: DAPO's overlong penalty, and the KL penalty taken out of the reward ---------------

def overlong_penalty(lengths: torch.Tensor, cfg) -> torch.Tensor:
    """[B] rewards to take off (>= 0): 0 up to max_new_tokens - overlong_buffer tokens, then linear up to
    overlong_penalty at max_new_tokens.

    DAPO's soft overlong punishment, so the policy learns to finish before the limit. lengths are
    completion tokens, the EOS included (completion_mask.sum(1)); 0 < buffer <= max_new_tokens
    (harness/config.py checks it). Taken off the task reward before the advantages.
    """
    buffer = cfg.overlong_buffer
    over = (lengths.float() - (cfg.max_new_tokens - buffer)).clamp(0, buffer)
    return cfg.overlong_penalty * over / buffer


# KL(policy || reference) per token. Each estimator is a function of d = ref_logp - logp at a token the
# policy sampled:
#     k1 = -d                 unbiased for the KL, high variance, negative on some tokens
#     k2 = d^2 / 2            biased for the KL, low variance, >= 0
#     k3 = exp(d) - d - 1     unbiased for the KL, low variance, >= 0
# What matters for training is the gradient the penalty gives, and that depends on where it is placed:
# - k1 in the reward (--kl-in reward, kl_reward_penalty): the sequence's summed k1, detached, is
#   subtracted from its reward before the advantages, so it reaches the policy through the score
#   function like the reward does. E[grad log pi(y) * log(pi(y) / ref(y))] is exactly the gradient of
#   the sequence-level KL(pi || ref): an unbiased gradient of the regularised objective (as PPO-style
#   RLHF does it). Group baselines and std scaling then act on it as on the task reward.
# - k2 in the loss: its gradient is (logp - ref_logp) * grad logp, whose expectation under the policy
#   is the gradient of KL(pi || ref) at each position given its prefix. On-policy this matches k1 in
#   the reward token by token, except that it ignores how a token changes the KL of the tokens after it.
# - k3 in the loss (GRPO's choice, the default): its gradient is (1 - ref/pi) * grad logp, whose
#   expectation is the gradient of the *forward* KL(ref || pi), not of KL(pi || ref). It agrees with
#   the reverse KL's gradient only to first order (while pi is close to ref): a biased gradient for
#   the stated objective, though a well-behaved penalty.
# - k1 in the loss gives no regularisation in expectation: E[grad logp] = 0.
# All of these are on-policy statements. After the first update on a batch (mini-batches, ppo_epochs
# > 1) the tokens were sampled by the old policy, and a penalty in the loss is not importance-weighted.
KL_ESTIMATORS = {  # --kl-estimator
    "k1": "the log-ratio logp - ref_logp (belongs in the reward)",
    "k2": "half its square",
    "k3": "exp(d) - d - 1 with d = ref_logp - logp",
}
KL_PLACES = {  # --kl-in
    "loss": "per token in the loss",
    "reward": "per sequence, subtracted from the reward before the advantages",
}


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - policy. >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) at the sampled tokens: k1, k2 or k3 (above)."""
    if estimator == "k3":
        return k3_kl(logp, ref_logp)
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator == "k1":
        return logp - ref_logp
    raise ValueError(f"kl estimator {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


def adaptive_kl_coef(coef: float, kl: float, completions: int, cfg) -> float:
    """The next step's KL coefficient under --kl-target, from this step's KL (Ziegler et al.'s controller, as verl
    and OpenRLHF have it): coef x (1 + clip(kl / target - 1, -0.2, 0.2) x completions / --kl-horizon). The error
    is clipped so that one odd step cannot move it far; the horizon sets how fast it follows."""
    error = min(max(kl / cfg.kl_target - 1, -0.2), 0.2)
    return coef * (1 + error * completions / cfg.kl_horizon)


def kl_reward_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kl_coef: float,
                      estimator: str = "k1") -> torch.Tensor:
    """[B] kl_coef x each sequence's summed per-token KL estimate (detached), taken off its reward with --kl-in reward.

    logp are the policy's logprobs of the sampled tokens when they were sampled (the rollout's
    old_logp), ref_logp the reference's, mask the completion mask: the penalty is a fixed part of
    the reward, computed once per rollout. k1 gives the unbiased gradient (above). Take it off
    before group_advantages, so the group baseline and scaling see the penalised reward. With
    scale_rewards "group", a group whose task rewards are all equal has advantages made of its KL
    penalties divided by their own spread: of unit size, however small kl_coef, once that spread is
    well above group_advantages' eps.
    """
    kl = kl_estimate(logp.detach().float(), ref_logp.detach().float(), estimator)
    return kl_coef * (kl * mask.float()).sum(1)


# ---- the loss ---------------------------------------------------------------------------------------------

LOSS_AGGS = {  # --loss-agg
    "token-mean": "over the mini-batch's loss tokens",
    "seq-mean": "each sequence's token mean, then over the sequences",
    "dr-grpo": "over max-new-tokens x sequences",
}
IMPORTANCE_LEVELS = {  # --importance-level
    "token": "pi / pi_old per token (PPO, GRPO)",
    "sequence": "per sequence (GSPO): the exp of the mean log-ratio, clipped per sequence; use clip ranges of "
                "a few 1e-4, such as 3e-4 low and 4e-4 high",
}


POLICY_LOSSES = {  # --policy-loss
    "ppo": "the clipped surrogate -min(r A, clip(r, 1 - clip-range, 1 + clip-range-high) A) (PPO, GRPO)",
    "cispo": "-sg(min(r, 1 + clip-range-high)) A logp (CISPO, MiniMax-M1): the weight is capped, not the update, so "
             "every token keeps a gradient; no lower bound, as in its paper",
    "sapo": "-(4 / tau) sigmoid(tau (r - 1)) A (SAPO): a soft gate instead of the clip, tau --sapo-tau-pos where "
            "A > 0 and --sapo-tau-neg where A < 0",
    "gmpo": "-A exp(the sequence's mean log-ratio, each token's clipped on A's side to -clip-range or clip-range-high) "
            "(GMPO: the geometric mean of the ratios; its paper clips at 0.4 both sides)",
    "clip-cov": "ppo, with --cov-ratio of the mini-batch's tokens, drawn among those whose (A - mean)(logp - mean) lies "
                "in (--clip-cov-lb, --clip-cov-ub) and the clip left alone, detached (Clip-Cov)",
    "kl-cov": "-r A, plus --kl-cov-coef x |logp - logp_old| on the --cov-ratio of the mini-batch's tokens of highest "
              "(A - mean)(logp - mean) (KL-Cov)",
}


def loss_denominator(mask: torch.Tensor, cfg) -> float:
    """This device's part of a mini-batch's loss denominator, from the mini-batch rows' loss mask [B, T].

    token-mean: the tokens that carry loss; seq-mean: the sequences that carry loss (at least one
    token); dr-grpo: every sequence x max_new_tokens, a constant for a given batch size, so no
    sequence's tokens weigh more for it being short (Dr. GRPO). The caller sums it over devices and
    passes the total to grpo_loss for every micro-batch of the mini-batch.
    """
    if cfg.loss_agg == "token-mean":
        return float(mask.sum().item())
    if cfg.loss_agg == "seq-mean":
        return float((mask.sum(1) > 0).sum().item())
    if cfg.loss_agg == "dr-grpo":
        return float(mask.shape[0] * cfg.max_new_tokens)
    raise ValueError(f"loss aggregation {cfg.loss_agg!r} is not one of {', '.join(LOSS_AGGS)}")


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


# The sampler and the trainer compute the same policy's logprobs apart (compiled or bf16 decoding, and --top-k,
# --top-p, --min-new-tokens, which sample from a truncated, renormalised distribution): the tokens come from
# pi_sampler, the gradient is taken for pi_trainer. w = pi_trainer / pi_sampler per token (the trainer's logprobs
# at the weights that sampled) corrects it; each choice weighs the policy-gradient term by it, detached.
MISMATCH_CORRECTIONS = {  # --mismatch-correction
    "none": "none (the gap is measured in every record: mismatch_kl, mismatch_abs, mismatch_max)",
    "tis": "x min(w, --mismatch-cap), w = pi_trainer / pi_sampler (truncated importance sampling)",
    "token-mask": "x w inside [--mismatch-low, --mismatch-cap], 0 outside: the token is dropped (IcePop)",
    "sequence-mask": "x the sequence's w (its tokens' geometric mean) inside the band, 0 outside: the sequence dropped",
}


def mismatch_weight(train_logp, sampler_logp, mask, cfg):
    """The detached weight of each token's policy-gradient term [B, T] ([B, 1] sequence-mask), or None ("none")."""
    if cfg.mismatch_correction == "none":
        return None
    level = "sequence" if cfg.mismatch_correction == "sequence-mask" else "token"
    w = importance_ratio(train_logp.detach(), sampler_logp, mask, level)
    if cfg.mismatch_correction == "tis":
        return w.clamp(max=cfg.mismatch_cap)
    if cfg.mismatch_correction in ("token-mask", "sequence-mask"):
        return w * ((w >= cfg.mismatch_low) & (w <= cfg.mismatch_cap))
    raise ValueError(f"mismatch correction {cfg.mismatch_correction!r} is not one of {', '.join(MISMATCH_CORRECTIONS)}")


def top_entropy_threshold(entropies: torch.Tensor, quantile: float) -> float:
    """The entropy at or above which a token is among the top `quantile` share of a mini-batch's tokens.

    entropies: 1-D, the entropy of every loss-carrying token of the whole mini-batch, every device's
    (gathered before the micro-batches run). ceil(quantile x n) tokens are kept, at least one, and
    every token tied with the last of them. pg_mask = entropy >= threshold, for grpo_loss.
    """
    n = entropies.numel()
    if n == 0:
        return math.inf
    keep = max(1, math.ceil(quantile * n - 1e-9))  # the 1e-9: 0.1 * 30 is 3.0000000000000004 in floats
    return torch.kthvalue(entropies.detach().float().cpu(), n - keep + 1).values.item()


def covariance_tokens(logp, old_logp, advantages, cfg) -> torch.Tensor:
    """[N] bool: the tokens Clip-Cov or KL-Cov act on, of a mini-batch's loss tokens (1-D: each token's logp, sampling
    logp and its sequence's advantage), every device's, gathered before the micro-batches run.

    The covariance term of a token is (A - mean A)(logp - mean logp), the means over these N tokens; k = cov_ratio x N
    (at least 1). kl-cov: the k largest. clip-cov: k drawn among the tokens inside (lb, ub) that the PPO clip leaves
    alone, ordered by their term and drawn with a generator seeded by --seed, so the draw depends on the set of tokens
    only: the same on every device, for any micro-batch size or device count.
    """
    n = logp.numel()
    chosen, k = torch.zeros(n, dtype=torch.bool), max(1, int(cfg.cov_ratio * n))
    cov = (advantages - advantages.mean()) * (logp - logp.mean())
    if n == 0:
        return chosen
    if cfg.policy_loss == "kl-cov":
        chosen[torch.topk(cov, min(k, n)).indices] = True
        return chosen
    ratio, high = torch.exp(logp - old_logp), cfg.clip_range_high if cfg.clip_range_high is not None else cfg.clip_range
    clipped = ((advantages > 0) & (ratio > 1 + high)) | ((advantages < 0) & (ratio < 1 - cfg.clip_range))
    band = torch.nonzero((cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub) & ~clipped).squeeze(1)
    band = band[torch.argsort(cov[band])]
    chosen[band[torch.randperm(band.numel(), generator=torch.Generator().manual_seed(cfg.seed))[:k]]] = True
    return chosen


def ptx_loss(logp: torch.Tensor, target: torch.Tensor, denominator: float, coef: float):
    """The pretraining-mix term of one micro-batch (PPO-ptx): coef x the next-token loss of its target tokens
    (logp [N, L], target [N, L] 0/1), divided by the update's target tokens over every device, as grpo_loss is by
    its denominator: micro-batches and devices sum to coef x the mean loss per target token of the update's texts.
    Returns (loss, the summed negative log-likelihood, detached)."""
    nll = -(logp * target).sum()
    return coef * nll / denominator, nll.detach()


def grpo_loss(logp, old_logp, advantages, mask, denominator: float, cfg, *, ref_logp=None, entropy=None,
              pg_mask=None, cov_mask=None, sampler_logp=None, train_logp=None):
    """Loss of one micro-batch, already divided by the whole mini-batch's `denominator` (loss_denominator).

    Passing the mini-batch total (not this micro-batch's) is what makes gradient accumulation give
    exactly the gradient of one large batch. Per token, the policy-gradient term is the clipped PPO
    surrogate -min(r A, clip(r, 1 - clip_range, 1 + clip_range_high) A), plus kl_coef x the KL
    estimate (with --kl-in loss) and minus entropy_coef x the entropy; cfg.loss_agg sums it.

    cfg: the run's Config (or anything with its fields). importance_level "sequence" is GSPO: r is
    the sequence's ratio (importance_ratio), clipped per sequence, every token carrying its sequence's
    term. dual_clip C > 1 (dual-clip PPO): for A < 0 the term is at most -C A, so a token whose ratio
    has grown far past 1 cannot push the loss without bound. entropy: the per-token entropies [B, T]
    (needed for entropy_coef and the "entropy" statistic). pg_mask [B, T] (bool): the tokens that
    carry the policy-gradient term (the top-entropy tokens); the KL and entropy terms stay on every token.
    cfg.policy_loss picks another policy-gradient term (POLICY_LOSSES); cov_mask [B, T] (bool): the tokens Clip-Cov
    or KL-Cov act on (covariance_tokens).
    sampler_logp [B, T]: the sampler's logprobs (Rollout.sampler_logp, else old_logp): the mismatch statistics and
    --mismatch-correction's weight, against train_logp, the trainer's at the weights that sampled (default: logp,
    right until the first optimizer step on the batch). mismatch_max is a maximum, not a sum.

    Returns (loss, stats): each statistic is a sum over this micro-batch's loss tokens, and the step's
    record shows it divided by the step's loss tokens (grpo/update.py), under the same name. A new
    statistic is one line in the dict below.
    """
    clip_low = cfg.clip_range
    clip_high = cfg.clip_range_high if cfg.clip_range_high is not None else cfg.clip_range
    kl_coef = cfg.kl_coef if cfg.kl_in == "loss" else 0.0
    mask = mask.to(logp.dtype)
    ratio = importance_ratio(logp, old_logp, mask, cfg.importance_level)
    adv = advantages[:, None].to(logp.dtype)
    kind = cfg.policy_loss
    if kind == "cispo":   # a constant weight: the gradient is w A grad logp, w never 0
        surrogate = -torch.clamp(ratio, max=1 + clip_high).detach() * adv * logp
    elif kind == "sapo":  # the gate's slope is 1 at r = 1 (as the clip's), fading smoothly away from it
        tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        surrogate = -4 / tau * torch.sigmoid(tau * (ratio - 1)) * adv
    elif kind == "gmpo":  # the pessimistic side only, as PPO's clip: the upper bound for A > 0, the lower for A < 0
        log_ratio, sign = logp - old_logp, torch.sign(adv)
        log_ratio = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-clip_low, clip_high))
        surrogate = -adv * torch.exp((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1))
    elif kind == "kl-cov":
        surrogate = -ratio * adv + cfg.kl_cov_coef * (logp - old_logp).abs() * cov_mask
    else:  # ppo and clip-cov
        surrogate = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv)
    if cfg.dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.minimum(surrogate, -cfg.dual_clip * adv), surrogate)
    if kind == "clip-cov":
        surrogate = torch.where(cov_mask, surrogate.detach(), surrogate)
    per_token = surrogate.expand_as(logp)  # a sequence-level term is every token's
    if pg_mask is not None:
        per_token = per_token * pg_mask
    if sampler_logp is not None:
        train_logp = logp.detach() if train_logp is None else train_logp
        weight = mismatch_weight(train_logp, sampler_logp, mask, cfg)
        per_token = per_token if weight is None else per_token * weight
    if ref_logp is not None and kl_coef > 0:
        per_token = per_token + kl_coef * kl_estimate(logp, ref_logp, cfg.kl_estimator)
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    if cfg.loss_agg == "seq-mean":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).sum() / denominator
    else:  # token-mean and dr-grpo differ only in the denominator
        loss = (per_token * mask).sum() / denominator

    with torch.no_grad():
        ratio = ratio.expand_as(logp)
        counted = mask if pg_mask is None else mask * pg_mask   # the clip counts: tokens with a policy gradient
        lo, hi = (math.exp(-clip_low), math.exp(clip_high)) if kind == "gmpo" else (1 - clip_low, 1 + clip_high)
        low = (ratio < lo) & (adv < 0)     # the clamp decides the minimum: no gradient
        high = (ratio > hi) & (adv > 0)
        dual = (adv < 0) & (ratio > cfg.dual_clip) if cfg.dual_clip is not None else torch.zeros_like(low)
        stats = {
            # always the k3 estimate, a low-variance measure of the divergence, whichever estimator the loss uses
            "kl": k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp),
            "clip_frac": (low | high) * counted,
            "clip_low_frac": low * counted,
            "clip_high_frac": high * counted,
            "clip_dual_frac": dual * counted,        # the dual clip bounds the term
            "ratio_mean": ratio,
            "approx_kl": (ratio - 1) - torch.log(ratio),   # KL(old || new) from the ratio (as cleanrl logs it)
            "entropy": entropy if entropy is not None else torch.zeros_like(logp),
        }
        if cov_mask is not None:
            stats["cov_frac"] = cov_mask * counted   # the tokens Clip-Cov or KL-Cov acted on
        if sampler_logp is not None:   # KL(sampler || trainer) by k3 on the sampler's tokens (expm1: gaps near float
            gap = train_logp - sampler_logp   # rounding would cancel to below 0), the gap, the weight
            stats.update(mismatch_kl=torch.expm1(gap) - gap, mismatch_abs=gap.abs(), mismatch_max=gap.abs())
            if weight is not None:
                stats.update(mismatch_weight=weight.expand_as(logp), mismatch_zero_frac=(weight == 0).expand_as(logp))
        sums = [(v * mask).max() if k == "mismatch_max" else (v * mask).sum() for k, v in stats.items()]
        stats = dict(zip(stats, torch.stack(sums).tolist()))   # one device sync, not one each
    return loss, stats
