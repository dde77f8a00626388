"""The default loss (PPO clip, k3 KL in the loss, token-mean) term by term: each clip bound, the KL
term and the aggregation, value and gradient against a formula written here, not the code's."""
import torch
from torch.testing import assert_close

from train_lean import grpo_loss
from grpo.settings import Settings as Config

EPS_LOW, EPS_HIGH = 0.2, 0.28   # apart, so a bound that reads the other's range shows
EXACT = {"rtol": 1e-12, "atol": 1e-15}   # float64: the code and the formula differ by rounding only


def default_loss(logp, old_logp, adv, mask, denominator, ref_logp=None,
                 clip_low=EPS_LOW, clip_high=EPS_HIGH, kl_coef=0.0):
    """One micro-batch's loss under Config's defaults but the clip ranges and the KL coefficient.

    The only call of the code under test in this file: where grpo_loss moves, only this changes.
    """
    cfg = Config(clip_range=clip_low, clip_range_high=clip_high, kl_coef=kl_coef)
    loss, _ = grpo_loss(logp, old_logp, adv, mask, denominator, cfg, ref_logp=ref_logp)
    return loss


def tokens(ratios):
    """logp (a leaf) and old logprobs [B, T], float64, whose ratios exp(logp - old) are `ratios`.

    The old logprobs are anything but 0, so a ratio taken against the wrong one shows."""
    r = torch.tensor(ratios, dtype=torch.float64)
    old = -torch.linspace(1.0, 3.0, r.numel(), dtype=torch.float64).view_as(r)
    return (old + r.log()).requires_grad_(True), old


def advantages(*values):
    return torch.tensor(values, dtype=torch.float64)


def ppo_term(r, adv, eps_low=EPS_LOW, eps_high=EPS_HIGH):
    """PPO's clipped surrogate per token: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    a = adv[:, None]
    return -torch.minimum(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a)


def k3_term(logp, ref, beta):
    """beta x k3 per token: beta (e^d - d - 1) with d = ref - logp."""
    d = ref - logp
    return beta * (torch.exp(d) - d - 1)


def value_and_grad(logp, *args, **kw):
    loss = default_loss(logp, *args, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def test_the_default_is_the_loss_these_formulas_write():
    cfg = Config()
    assert (cfg.policy_loss, cfg.importance_level, cfg.loss_agg) == ("ppo", "token", "token-mean")
    assert (cfg.kl_in, cfg.kl_estimator) == ("loss", "k3")
    assert (cfg.clip_range, cfg.clip_range_high) == (0.2, None)
    assert (cfg.dual_clip, cfg.entropy_coef, cfg.top_entropy_quantile) == (None, 0.0, 1.0)
    assert cfg.mismatch_correction == "none"


def test_the_low_bound_clips_negative_advantages_below_one_minus_eps_low():
    # A < 0: r < 0.8 is clipped (0.75 lies between 1 - EPS_HIGH and 1 - EPS_LOW); A > 0: never
    logp, old = tokens([[0.5, 0.75, 0.85, 1.1, 1.5], [0.5, 0.75, 0.85, 0.95, 0.6]])
    adv = advantages(-1.5, 0.7)
    clipped = torch.tensor([[True, True, False, False, False], [False] * 5])
    mask, denom = torch.ones(2, 5), 10.0
    loss, grad = value_and_grad(logp, old, adv, mask, denom)
    r = torch.exp(logp.detach() - old)
    assert_close(loss, ppo_term(r, adv).sum() / denom, **EXACT)
    # a clipped token's term is the constant -(1 - eps_low) A; elsewhere d(-r A)/dlogp = -A r
    assert_close(ppo_term(r, adv)[clipped], torch.full((2,), 1.5 * (1 - EPS_LOW), dtype=r.dtype))
    assert_close(grad, torch.where(clipped, 0.0, -adv[:, None] * r / denom), **EXACT)
    assert torch.equal(grad[clipped], torch.zeros(2, dtype=torch.float64))


def test_the_high_bound_clips_positive_advantages_above_one_plus_eps_high():
    # A > 0: r > 1.28 is clipped (1.25 lies between 1 + EPS_LOW and 1 + EPS_HIGH); A < 0: never
    logp, old = tokens([[0.5, 1.1, 1.25, 1.3, 2.0], [1.1, 1.25, 1.3, 2.0, 1.5]])
    adv = advantages(1.2, -0.4)
    clipped = torch.tensor([[False, False, False, True, True], [False] * 5])
    mask, denom = torch.ones(2, 5), 10.0
    loss, grad = value_and_grad(logp, old, adv, mask, denom)
    r = torch.exp(logp.detach() - old)
    assert_close(loss, ppo_term(r, adv).sum() / denom, **EXACT)
    assert_close(ppo_term(r, adv)[clipped], torch.full((2,), -1.2 * (1 + EPS_HIGH), dtype=r.dtype))
    assert_close(grad, torch.where(clipped, 0.0, -adv[:, None] * r / denom), **EXACT)
    assert torch.equal(grad[clipped], torch.zeros(2, dtype=torch.float64))
    # clip_high None is clip_low on both sides: then 1.25 > 1.2 is clipped too
    _, grad = value_and_grad(logp, old, adv, mask, denom, clip_high=None)
    clipped[0, 2] = True
    assert_close(grad, torch.where(clipped, 0.0, -adv[:, None] * r / denom), **EXACT)


def test_inside_both_bounds_every_token_has_the_gradient_minus_a_r():
    logp, old = tokens([[0.81, 0.95, 1.0, 1.1, 1.27], [0.81, 0.95, 1.0, 1.1, 1.27]])
    adv = advantages(2.0, -0.5)
    mask, denom = torch.ones(2, 5), 10.0
    loss, grad = value_and_grad(logp, old, adv, mask, denom)
    r = torch.exp(logp.detach() - old)
    assert_close(loss, (-adv[:, None] * r).sum() / denom, **EXACT)
    assert_close(grad, -adv[:, None] * r / denom, **EXACT)


def test_the_k3_kl_term_and_its_gradient():
    beta, mask, denom = 0.05, torch.ones(2, 4), 8.0
    d = torch.tensor([[-0.5, -0.1, 0.0, 0.2], [1.0, 0.3, -1.2, 0.05]], dtype=torch.float64)
    # A = 0: the KL term alone, beta (e^d - d - 1) with d = ref - logp; d/dlogp: beta (1 - e^d)
    logp, old = tokens([[1.5, 0.5, 1.0, 1.1]] * 2)
    ref = logp.detach() + d
    loss, grad = value_and_grad(logp, old, advantages(0.0, 0.0), mask, denom, ref, kl_coef=beta)
    assert_close(loss, (beta * (torch.exp(d) - d - 1)).sum() / denom, **EXACT)
    assert_close(grad, beta * (1 - torch.exp(d)) / denom, **EXACT)
    # A != 0: added to the clipped term on every token, clipped ones too (theirs is the KL's alone)
    adv = advantages(1.0, -2.0)
    clipped = torch.tensor([[True, False, False, False], [False, True, False, False]])
    loss, grad = value_and_grad(logp, old, adv, mask, denom, ref, kl_coef=beta)
    r = torch.exp(logp.detach() - old)
    terms = ppo_term(r, adv) + k3_term(logp.detach(), ref, beta)
    assert_close(loss, terms.sum() / denom, **EXACT)
    surrogate = torch.where(clipped, 0.0, -adv[:, None] * r)
    assert_close(grad, (surrogate + beta * (1 - torch.exp(d))) / denom, **EXACT)


def test_token_mean_over_the_denominator_passed_in_masked_tokens_count_nothing():
    # 5 loss tokens here, 12 in the mini-batch over every device; the masked ones would be unclipped
    # and carry KL, so leaking them would show in the value and the gradient
    logp, old = tokens([[0.9, 1.1, 1.05, 0.5], [0.95, 1.15, 1.5, 1.6]])
    d = torch.tensor([[0.3, -0.2, 0.1, 0.7], [-0.4, 0.2, 0.9, -0.8]], dtype=torch.float64)
    ref = logp.detach() + d
    adv, beta = advantages(1.0, -1.0), 0.1
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    loss, grad = value_and_grad(logp, old, adv, mask, 12.0, ref, kl_coef=beta)
    r, m = torch.exp(logp.detach() - old), mask.to(torch.float64)
    # the loss tokens lie inside both bounds: -A r + beta k3 each, gradient -A r + beta (1 - e^d)
    terms = -adv[:, None] * r + beta * (torch.exp(d) - d - 1)
    assert_close(loss, (terms * m).sum() / 12.0, **EXACT)
    assert_close(grad, (-adv[:, None] * r + beta * (1 - torch.exp(d))) * m / 12.0, **EXACT)
    assert torch.equal(grad[mask == 0], torch.zeros(3, dtype=torch.float64))


def test_micro_batches_with_the_mini_batch_denominator_sum_to_one_batch():
    logp, old = tokens([[0.5, 1.1, 1.3, 0.9], [0.7, 1.5, 1.0, 1.2],
                        [0.95, 1.05, 2.0, 0.6], [1.4, 0.85, 0.75, 1.01]])
    ref = logp.detach() + torch.linspace(-0.6, 0.6, 16, dtype=torch.float64).view(4, 4)
    adv, beta = advantages(1.0, -0.5, 0.3, -2.0), 0.05
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]])
    denom = float(mask.sum())   # the mini-batch's 10 tokens
    whole, whole_grad = value_and_grad(logp, old, adv, mask, denom, ref, kl_coef=beta)
    r, m = torch.exp(logp.detach() - old), mask.to(torch.float64)
    formula = ((ppo_term(r, adv) + k3_term(logp.detach(), ref, beta)) * m).sum() / denom
    assert_close(whole, formula, **EXACT)
    a, d = adv[:, None], ref - logp.detach()
    clipped = ((a > 0) & (r > 1 + EPS_HIGH)) | ((a < 0) & (r < 1 - EPS_LOW))
    assert clipped[mask.bool()].sum() == 3   # 1.3 and 2.0 high, 0.7 low
    surrogate = torch.where(clipped, 0.0, -a * r)
    assert_close(whole_grad, (surrogate + beta * (1 - torch.exp(d))) * m / denom, **EXACT)
    parts, grads = [], []
    for rows in (slice(0, 1), slice(1, 4)):   # 4 tokens, then 6: neither is the mini-batch's count
        part = logp.detach()[rows].requires_grad_(True)
        loss, grad = value_and_grad(part, old[rows], adv[rows], mask[rows], denom, ref[rows],
                                    kl_coef=beta)
        parts.append(loss)
        grads.append(grad)
    assert_close(sum(parts), whole, **EXACT)
    assert_close(torch.cat(grads), whole_grad, **EXACT)
