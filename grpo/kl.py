"""KL(policy || reference) per token: three estimators, and the KL penalty taken out of the rewards.

Each estimator is a function of d = ref_logp - logp at a token the policy sampled:

    k1 = -d                 unbiased for the KL, high variance, negative on some tokens
    k2 = d^2 / 2            biased for the KL, low variance, >= 0
    k3 = exp(d) - d - 1     unbiased for the KL, low variance, >= 0

What matters for training is not the estimate's value but the gradient the penalty gives, and that
depends on where it is placed:

- k1 in the reward (`kl_in="reward"`, kl_penalised_rewards): the sequence's summed k1, detached, is
  subtracted from its reward before the advantages, so it reaches the policy through the score
  function like the reward does. E[grad log pi(y) * log(pi(y) / ref(y))] is exactly the gradient of
  the sequence-level KL(pi || ref): an unbiased gradient of the regularised objective (as PPO-style
  RLHF does it). Group baselines and std scaling then act on it as on the task reward.
- k2 in the loss: its gradient is (logp - ref_logp) * grad logp, whose expectation under the policy
  is the gradient of KL(pi || ref) at each position given its prefix. On-policy this matches k1 in
  the reward token by token, except that it ignores how a token changes the KL of the tokens after
  it.
- k3 in the loss (GRPO's choice, the default here): its gradient is (1 - ref/pi) * grad logp, whose
  expectation is the gradient of the *forward* KL(ref || pi), not of KL(pi || ref). It agrees with
  the reverse KL's gradient only to first order (while pi is close to ref): a biased gradient for
  the stated objective, though a well-behaved penalty.
- k1 in the loss gives no regularisation in expectation: E[grad logp] = 0.

All of these are on-policy statements. After the first update on a batch (mini-batches, ppo_epochs
> 1) the tokens were sampled by the old policy, and a penalty in the loss is not importance-weighted.
"""
import torch

ESTIMATORS = ("k1", "k2", "k3")


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - policy. >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) at the sampled tokens: k1, k2 or k3 (module doc)."""
    if estimator == "k3":
        return k3_kl(logp, ref_logp)
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator == "k1":
        return logp - ref_logp
    raise ValueError(f"kl estimator {estimator!r} is not one of {', '.join(ESTIMATORS)}")


def kl_penalised_rewards(rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                         kl_coef: float, estimator: str = "k1") -> torch.Tensor:
    """rewards [B] minus kl_coef x each sequence's summed per-token KL estimate (detached), for `kl_in="reward"`.

    logp are the policy's logprobs of the sampled tokens when they were sampled (the rollout's
    old_logp), ref_logp the reference's, mask the completion mask: the penalty is a fixed part of
    the reward, computed once per rollout. k1 gives the unbiased gradient (module doc). Subtract it
    before group_advantages, so the group baseline and scaling see the penalised reward. With
    scale_rewards "group", a group whose task rewards are all equal has advantages made of its KL
    penalties divided by their own spread: of unit size, however small kl_coef, once that spread is
    well above group_advantages' eps.
    """
    kl = kl_estimate(logp.detach().float(), ref_logp.detach().float(), estimator)
    return rewards.float() - kl_coef * (kl * mask.float()).sum(1)
