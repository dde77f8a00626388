"""The default step's math (train_lean.py) and grpo/variants.py, each piece against its formula: group advantages, DAPO's choice of groups that are not flat, the
overlong penalty and truncated rows, every loss knob on small hand-made tensors (expected values written out or
looped naively), and the loss on a real tiny model's completions (accumulation, the first on-policy update)."""
import math

import pytest
import torch

from grpo.optim import learning_rate
from grpo.rollout import flat_groups
from grpo.variants import covariance_band, highest_covariance, kl_reward_penalty as _kl_reward_penalty, overlong_penalty, top_entropy_threshold
from train_lean import KL_ESTIMATORS, TABLES, RATIOS as RATIO_CHOICES, group_advantages, grpo_loss, k3 as k3_kl, loss_denominator


def kl_estimate(logp, ref_logp, estimator="k3"):
    return KL_ESTIMATORS[estimator](logp, ref_logp)


def importance_ratio(logp, old_logp, mask, level="token"):
    return RATIO_CHOICES[level](logp, old_logp, mask)


def kl_reward_penalty(logp, ref_logp, mask, kl_coef, estimator="k1"):
    return _kl_reward_penalty(logp, ref_logp, mask, kl_coef, KL_ESTIMATORS[estimator])
from grpo.settings import Settings as Config
from grpo.model import completion_logprobs, frozen_copy, load_policy, load_tokenizer, position_ids_from_mask
from grpo.rollout import encode_prompts, left_pad, truncated_rows
from helpers import loss_config


def test_group_advantages_are_standardised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    adv, frac = group_advantages(rewards, 4, "group", eps=0.0)
    g1, g2 = adv[:4], adv[4:]
    assert torch.allclose(g1, (rewards[:4] - 0.5) / rewards[:4].std())
    assert torch.allclose(g2, (rewards[4:] - 5.0) / rewards[4:].std())
    # scaling the rewards of one group does not change its advantages
    assert torch.allclose(group_advantages(rewards * 10, 4, "group", eps=0.0)[0], adv)
    assert frac == 0.0


def test_equal_rewards_give_exactly_zero_advantage_and_are_counted():
    rewards = torch.tensor([0.1] * 8 + [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    adv, frac = group_advantages(rewards, 8, "group")
    assert torch.equal(adv[:8], torch.zeros(8))  # 0.1 * 8 / 8 is not exactly 0.1 in float
    assert frac == 0.5
    assert (adv[8:] != 0).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_sum_to_zero_per_group(scale):
    torch.manual_seed(0)
    rewards = torch.rand(32)
    adv, _ = group_advantages(rewards, 8, scale)
    assert torch.allclose(adv.view(4, 8).sum(1), torch.zeros(4), atol=1e-5)


def test_batch_and_none_scaling():
    rewards = torch.tensor([0.0, 2.0, 10.0, 30.0])
    none, _ = group_advantages(rewards, 2, "none")
    assert torch.allclose(none, torch.tensor([-1.0, 1.0, -10.0, 10.0]))
    batch, _ = group_advantages(rewards, 2, "batch", eps=0.0)
    assert torch.allclose(batch, none / rewards.std())


def test_unknown_scaling_is_an_error():
    # a name no variant could take (not "rank": that one may well become a variant some day)
    with pytest.raises(ValueError, match="--advantage 'no such advantage' is not one of group, "):
        group_advantages(torch.zeros(4), 2, "no such advantage")


def test_rloo_baseline_leaves_each_completion_out():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 9.0])
    adv, frac = group_advantages(rewards, 4, "rloo")
    for i in range(8):   # the direct formula: r_i minus the mean of the other rewards of its group
        group = rewards[i // 4 * 4:i // 4 * 4 + 4].tolist()
        others = group[:i % 4] + group[i % 4 + 1:]
        assert adv[i].item() == pytest.approx(rewards[i].item() - sum(others) / len(others))
    # G / (G - 1) times the mean-centred advantage, and an equal group still carries nothing
    assert torch.allclose(adv, group_advantages(rewards, 4, "none")[0] * 4 / 3)
    assert group_advantages(torch.tensor([3.0, 3.0, 1.0, 2.0]), 2, "rloo")[0].tolist() == [0.0, 0.0, -1.0, 1.0]
    assert frac == 0.0


def test_flat_groups_are_those_whose_advantages_are_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 0.5, 0.5000001])
    assert flat_groups(rewards, 2).tolist() == [True, False, True, False]
    adv, frac_zero_std = group_advantages(rewards, 2)
    assert ((adv.view(-1, 2) == 0).all(1) == flat_groups(rewards, 2)).all() and frac_zero_std == 0.5


def test_truncated_rows_by_hand():
    eos = 0
    ids = torch.tensor([[5, 6, 0, 0],    # EOS at position 2: finished
                        [5, 6, 7, 8],    # no EOS within max_new_tokens 4: truncated
                        [5, 6, 7, 0],    # EOS as the last allowed token: finished
                        [0, 0, 0, 0]])   # EOS first: finished
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert truncated_rows(ids, mask, eos).tolist() == [False, True, False, False]


def test_truncated_rows_are_the_real_rollouts_without_eos(rollout64, tiny_model_dir):
    _, inputs, _, cmask, _, _ = rollout64
    eos = load_tokenizer(tiny_model_dir)("a", add_special_tokens=False)["input_ids"][0]  # the fixture's EOS
    completions = inputs[:, -cmask.shape[1]:]
    truncated = truncated_rows(completions, cmask, eos)
    assert torch.equal(truncated, ~(completions == eos).any(1))
    assert truncated.any() and not truncated.all()
    assert (cmask.sum(1)[truncated] == 24).all()  # the fixture's max_new_tokens


def test_masked_truncated_rows_carry_no_loss():
    ids = torch.tensor([[5, 0, 0], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss_mask = mask * ~truncated_rows(ids, mask, 0)[:, None]
    logp = torch.tensor([[0.1, 0.05, 0.0], [0.1, 0.05, 0.0]], requires_grad=True)
    assert loss_denominator(loss_mask, loss_config(loss_agg="token-mean", max_new_tokens=3)) == 2
    assert loss_denominator(loss_mask, loss_config(loss_agg="seq-mean", max_new_tokens=3)) == 1
    # dr-grpo: the constant keeps every row
    assert loss_denominator(loss_mask, loss_config(loss_agg="dr-grpo", max_new_tokens=3)) == 6
    loss, stats = grpo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), loss_mask, 2.0, loss_config())
    loss.backward()
    assert torch.equal(logp.grad[1], torch.zeros(3)) and (logp.grad[0, :2] != 0).all()
    assert stats["ratio_mean"] == pytest.approx(math.exp(0.1) + math.exp(0.05))  # the kept row's tokens only


def test_overlong_penalty_ramps_linearly_over_the_buffer():
    lengths = torch.tensor([1, 12, 13, 14, 15, 16])
    # max_new_tokens 16, buffer 4: 0 up to 12 tokens, then 0.5 more per token of the 4, to 2 at 16 (taken off)
    ramp = loss_config(max_new_tokens=16, overlong_buffer=4, overlong_penalty=2.0)
    assert overlong_penalty(lengths, ramp).tolist() == [0.0, 0.0, 0.5, 1.0, 1.5, 2.0]
    whole = loss_config(max_new_tokens=16, overlong_buffer=16, overlong_penalty=1.0)
    assert overlong_penalty(lengths, whole).tolist() == pytest.approx([1 / 16, 12 / 16, 13 / 16, 14 / 16,
                                                                       15 / 16, 1.0])


# two sequences of 3 and 2 tokens (the last position of the second is padding)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.zeros(2, 3)
LOGP = torch.tensor([[0.1, -0.1, 0.3], [0.2, 0.0, 9.0]])  # 9.0 sits under the mask: it must not count
ADV = torch.tensor([1.0, -2.0])


def leaf(t):
    return t.clone().requires_grad_(True)


# ---- aggregation -------------------------------------------------------------------------------------------

def test_denominators():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # the third row carries no loss
    assert loss_denominator(mask, loss_config(loss_agg="token-mean", max_new_tokens=10)) == 4
    assert loss_denominator(mask, loss_config(loss_agg="seq-mean", max_new_tokens=10)) == 2
    assert loss_denominator(mask, loss_config(loss_agg="dr-grpo", max_new_tokens=10)) == 30
    with pytest.raises(ValueError, match="'grpo' is not one of token-mean, seq-mean, dr-grpo"):   # TRL's names: cli.py
        loss_denominator(mask, loss_config(loss_agg="grpo", max_new_tokens=10))


def _per_token_surrogate(logp, adv, mask, eps_low=0.2, eps_high=0.2):
    """Naive loop: -min(r A, clip(r) A) per masked token, as a list of (row, col, value)."""
    out = []
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r = math.exp(float(logp[i, t]))
                c = min(max(r, 1 - eps_low), 1 + eps_high)
                out.append((i, t, -min(r * float(adv[i]), c * float(adv[i]))))
    return out


def test_three_aggregations_against_a_loop():
    terms = _per_token_surrogate(LOGP, ADV, MASK)
    token_sum = sum(v for _, _, v in terms)
    rows = [[v for i, _, v in terms if i == row] for row in range(2)]
    loss, _ = grpo_loss(LOGP, OLD, ADV, MASK, 5.0, loss_config())
    assert loss.item() == pytest.approx(token_sum / 5, rel=1e-6)
    loss, _ = grpo_loss(LOGP, OLD, ADV, MASK, 2.0, loss_config(loss_agg="seq-mean"))
    assert loss.item() == pytest.approx((sum(rows[0]) / 3 + sum(rows[1]) / 2) / 2, rel=1e-6)
    loss, _ = grpo_loss(LOGP, OLD, ADV, MASK, 2 * 4.0,
                        loss_config(loss_agg="dr-grpo"))  # 2 sequences x max_new_tokens 4
    assert loss.item() == pytest.approx(token_sum / 8, rel=1e-6)


def test_defaults_are_the_token_mean_k3_loss():
    ref = torch.tensor([[0.0, 0.2, -0.1], [0.5, 0.1, 0.0]])
    loss, stats = grpo_loss(LOGP, OLD, ADV, MASK, 5.0, loss_config(kl_coef=0.1), ref_logp=ref)
    expected = 0.0
    for i, t, v in _per_token_surrogate(LOGP, ADV, MASK):
        d = float(ref[i, t] - LOGP[i, t])
        expected += v + 0.1 * (math.exp(d) - d - 1)
    assert loss.item() == pytest.approx(expected / 5, rel=1e-6)
    assert set(stats) >= {"kl", "clip_frac", "ratio_mean", "clip_low_frac", "clip_high_frac", "clip_dual_frac",
                          "entropy"}


# ---- clipping statistics -----------------------------------------------------------------------------------

def test_clip_low_and_high_are_counted_apart():
    # ratios e^.5 (above 1.2), e^-.5 (below 0.8), 1, and under the mask e^.5
    logp = torch.tensor([[0.5, -0.5, 0.0], [0.5, -0.5, 0.5]])
    adv = torch.tensor([1.0, -1.0])
    _, stats = grpo_loss(logp, torch.zeros(2, 3), adv, torch.tensor([[1, 1, 1], [1, 1, 0]]), 1.0, loss_config())
    # row 0 (A > 0): the high ratio is clipped, the low one not; row 1 (A < 0): the low one is clipped
    assert stats["clip_high_frac"] == 1 and stats["clip_low_frac"] == 1 and stats["clip_frac"] == 2
    assert stats["ratio_mean"] == pytest.approx(2 * math.exp(0.5) + 2 * math.exp(-0.5) + 1, rel=1e-6)


def test_the_clip_region_is_where_the_clip_set_the_ratio_back_on_the_side_of_a():
    """variants.clip_region, from the clamped ratio the loss uses, against the direct comparison
    with the edges: every float32 ratio within 50 steps of either edge, both signs of A."""
    from grpo.variants import clip_edges, clip_region
    for knobs in ({}, {"clip_high": 0.28}, {"clip_low": 3e-4, "clip_high": 4e-4},
                  {"policy_loss": "gmpo", "clip_low": 0.4, "clip_high": 0.3}):
        lo, hi = clip_edges(loss_config(**knobs))
        near = []
        for edge in (lo, hi):
            up = down = torch.tensor(edge, dtype=torch.float32)
            for _ in range(50):
                up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(0.0))
                near += [up, down]
        ratio = torch.stack(near + [torch.tensor(lo), torch.tensor(hi)])
        for a in (1.0, -1.0):
            adv = torch.full_like(ratio, a)
            low, high = clip_region(ratio, torch.clamp(ratio, lo, hi), adv)
            assert torch.equal(low, (ratio < lo) & (adv < 0)) and torch.equal(high, (ratio > hi) & (adv > 0))
            assert (low if a < 0 else high).any() and not (low & high).any()


def test_the_clip_statistics_count_the_tokens_with_a_policy_gradient_alone():
    # with --top-entropy-quantile a token outside pg_mask has no policy gradient: no clip of it counts
    logp = torch.tensor([[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]])   # e^.5 above 1.2, e^-.5 below 0.8
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    _, every = grpo_loss(logp, torch.zeros(2, 3), adv, mask, 1.0, loss_config())
    assert (every["clip_high_frac"], every["clip_low_frac"], every["clip_frac"]) == (3, 2, 5)
    pg_mask = torch.tensor([[True, False, False], [False, True, True]])
    _, chosen = grpo_loss(logp, torch.zeros(2, 3), adv, mask, 1.0, loss_config(top_entropy_quantile=0.5),
                          pg_mask=pg_mask)
    assert (chosen["clip_high_frac"], chosen["clip_low_frac"], chosen["clip_frac"]) == (1, 1, 2)


def test_a_term_reads_the_tokens_by_name_and_cannot_write_them():
    """The per-token record a term gets (train_lean.py Tokens) is made once per micro-batch: its
    fields, and the variants' inputs by name (t.inputs), read; writing a field raises."""
    import dataclasses
    from grpo import variants
    seen = []

    def read(pg, t, cfg):
        seen.append((t.inputs["mine"], "other" in t.inputs, t.adv.shape))
        return pg

    def write(pg, t, cfg):
        t.adv = -t.adv
    on = variants.on(loss_config(), TABLES)
    on.pg = variants.Fold([read])
    mine = torch.ones(2, 3)
    grpo_loss(LOGP, OLD, ADV, MASK, 5.0, loss_config(), on=on, mine=mine)
    assert seen == [(mine, False, (2, 1))]
    on.pg = variants.Fold([write])
    with pytest.raises(dataclasses.FrozenInstanceError):
        grpo_loss(LOGP, OLD, ADV, MASK, 5.0, loss_config(), on=on)


# ---- GSPO ----------------------------------------------------------------------------------------------------

def test_sequence_ratio_is_the_exp_of_the_mean_token_log_ratio():
    ratio = importance_ratio(LOGP, OLD, MASK, "sequence")
    assert ratio.shape == (2, 1)
    assert ratio[0, 0].item() == pytest.approx(math.exp((0.1 - 0.1 + 0.3) / 3), rel=1e-6)
    assert ratio[1, 0].item() == pytest.approx(math.exp((0.2 + 0.0) / 2), rel=1e-6)
    with pytest.raises(ValueError):
        importance_ratio(LOGP, OLD, MASK, "group")


def test_approx_kl_is_the_sum_of_each_tokens_ratio_minus_one_minus_its_log():
    logp = torch.tensor([[0.5, -0.5, 0.0], [0.5, -0.5, 0.5]])   # the last token is masked out
    _, stats = grpo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), MASK, 1.0, loss_config())
    expected = sum(math.exp(d) - 1 - d for d in (0.5, -0.5, 0.0, 0.5, -0.5))
    assert stats["approx_kl"] == pytest.approx(expected, rel=1e-6)


def test_gspo_loss_and_gradient_by_hand():
    """Both rows have the sequence ratio s = e^0.1 (mean token log-ratio 0.1); A = 1 and -2.

    Inside the clip range, token-mean over 5 tokens: loss = (3 (-s) + 2 (2 s)) / 5, and a row-0 token's
    gradient is 3 x (-1) x (d s / d logp = s / 3) / 5 = -s / 5; a row-1 token's 2 x 2 x (s / 2) / 5.
    """
    s = math.exp(0.1)
    logp = leaf(torch.tensor([[0.1, 0.1, 0.1], [0.0, 0.2, 5.0]]))
    loss, stats = grpo_loss(logp, OLD, torch.tensor([1.0, -2.0]), MASK, 5.0,
                            loss_config(importance_level="sequence", clip_low=0.05, clip_high=0.2))
    assert loss.item() == pytest.approx((3 * -s + 2 * 2 * s) / 5, rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad[0], torch.full((3,), -s / 5))
    assert torch.allclose(logp.grad[1, :2], torch.full((2,), 2 * s / 5))
    assert logp.grad[1, 2] == 0
    # a high range of 0.05 clips row 0 (A > 0, s > 1.05) as a whole; row 1 (A < 0) keeps -s A, the larger
    logp.grad = None
    loss, stats = grpo_loss(logp, OLD, torch.tensor([1.0, -2.0]), MASK, 5.0,
                            loss_config(importance_level="sequence", clip_low=0.05, clip_high=0.05))
    assert loss.item() == pytest.approx((3 * -1.05 + 2 * 2 * s) / 5, rel=1e-6)
    loss.backward()
    assert torch.equal(logp.grad[0], torch.zeros(3))
    assert stats["clip_high_frac"] == 3 and stats["clip_frac"] == 3  # every token of the clipped sequence


# ---- dual clip -----------------------------------------------------------------------------------------------

def test_dual_clip_bounds_negative_advantages():
    # ratios 4, 2, 0.5 with A = -1 and C = 3; a fourth token with A = +1 and ratio 4
    logp = leaf(torch.log(torch.tensor([[4.0, 2.0, 0.5], [4.0, 1.0, 1.0]])))
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, stats = grpo_loss(logp, torch.zeros(2, 3), adv, mask, 1.0, loss_config(dual_clip=3.0))
    # A = -1: min(max(r, clip(r)), C): r=4 -> max(4, 1.2) = 4, bounded to 3; r=2 -> 2; r=0.5 -> max(0.5, 0.8)
    # = 0.8 (clipped low). A = +1, r=4: -min(4, 1.2) = -1.2 (clipped high)
    assert loss.item() == pytest.approx(3 + 2 + 0.8 - 1.2, rel=1e-6)
    loss.backward()
    # the bounded token and the clipped ones get no gradient; r=2 gets d(r)/d logp = r = 2
    assert logp.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0])
    assert logp.grad[1, 0] == 0
    assert stats["clip_dual_frac"] == 1 and stats["clip_low_frac"] == 1 and stats["clip_high_frac"] == 1
    # without it, the r=4 token costs 4 and carries gradient
    loss, _ = grpo_loss(logp, torch.zeros(2, 3), adv, mask, 1.0, loss_config())
    assert loss.item() == pytest.approx(4 + 2 + 0.8 - 1.2, rel=1e-6)


# ---- KL ------------------------------------------------------------------------------------------------------

def test_kl_estimators_by_formula():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = [-0.5, 1.0, 0.0]  # ref - logp
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0, 0.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5, 0.0])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(x) - x - 1 for x in d])
    assert torch.equal(kl_estimate(logp, ref, "k3"), k3_kl(logp, ref))
    with pytest.raises(ValueError, match="'k4' is not one of k3, k1, k2"):
        kl_estimate(logp, ref, "k4")


def test_kl_estimator_in_the_loss():
    ref = torch.tensor([[0.0, 0.2, -0.1], [0.5, 0.1, 0.0]])
    zero_adv = torch.zeros(2)
    for estimator, f in (("k1", lambda lp, r: lp - r), ("k2", lambda lp, r: 0.5 * (lp - r) ** 2)):
        loss, stats = grpo_loss(LOGP, OLD, zero_adv, MASK, 5.0,
                                loss_config(kl_coef=0.1, kl_estimator=estimator), ref_logp=ref)
        expected = sum(0.1 * f(float(LOGP[i, t]), float(ref[i, t])) for i in range(2) for t in range(3) if MASK[i, t])
        assert loss.item() == pytest.approx(expected / 5, rel=1e-6), estimator
        # the logged kl stays the k3 estimate
        k3 = sum(math.exp(float(ref[i, t] - LOGP[i, t])) - float(ref[i, t] - LOGP[i, t]) - 1
                 for i in range(2) for t in range(3) if MASK[i, t])
        assert stats["kl"] == pytest.approx(k3, rel=1e-6)


def test_kl_in_the_reward_is_subtracted_per_sequence_and_detached():
    rewards = torch.tensor([1.0, 0.5])
    logp = leaf(torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]]))
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -0.5, 0.0]])
    out = rewards - kl_reward_penalty(logp, ref, MASK, 0.1)
    # k1 sums: row 0: 0.5 - 1 + 0 = -0.5; row 1: 0.5 + 0 (the third token is masked)
    assert out.tolist() == pytest.approx([1.0 + 0.05, 0.5 - 0.05])
    assert not out.requires_grad
    k3 = rewards - kl_reward_penalty(logp, ref, MASK, 0.1, "k3")
    sums = [math.exp(-0.5) + 0.5 - 1 + math.exp(1) - 2, math.exp(-0.5) + 0.5 - 1]
    assert k3.tolist() == pytest.approx([1.0 - 0.1 * sums[0], 0.5 - 0.1 * sums[1]])


def _exact_gradients(n=5, seed=0):
    """A one-token policy over n tokens: the exact expected gradient of each KL placement, and the KL gradients."""
    torch.manual_seed(seed)
    theta = torch.randn(n, requires_grad=True)
    ref = torch.log_softmax(torch.randn(n), 0)

    def grad(f):
        (g,) = torch.autograd.grad(f(), theta)
        return g

    def expect_loss(estimator):  # E_{y ~ pi}[grad estimator(y)], the sample weights not differentiated
        def f():
            logp = torch.log_softmax(theta, 0)
            return (logp.exp().detach() * kl_estimate(logp, ref, estimator)).sum()
        return f

    def k1_in_reward():  # E_{y ~ pi}[-reward_penalty(y) * grad log pi(y)] with the penalty detached
        logp = torch.log_softmax(theta, 0)
        return (logp.exp().detach() * kl_estimate(logp, ref, "k1").detach() * logp).sum()

    def reverse_kl():
        logp = torch.log_softmax(theta, 0)
        return (logp.exp() * (logp - ref)).sum()

    def forward_kl():
        logp = torch.log_softmax(theta, 0)
        return (ref.exp() * (ref - logp)).sum()

    return {"k1 reward": grad(k1_in_reward), "k1 loss": grad(expect_loss("k1")), "k2 loss": grad(expect_loss("k2")),
            "k3 loss": grad(expect_loss("k3")), "reverse": grad(reverse_kl), "forward": grad(forward_kl)}


def test_which_kl_placement_gives_which_gradient():
    """The claims of docs/algorithm.md's KL section, exactly, on a small categorical policy."""
    g = _exact_gradients()
    assert torch.allclose(g["k1 reward"], g["reverse"], atol=1e-6)   # unbiased for KL(pi || ref)
    assert torch.allclose(g["k2 loss"], g["reverse"], atol=1e-6)     # per position, on-policy
    assert torch.allclose(g["k3 loss"], g["forward"], atol=1e-6)     # the gradient of KL(ref || pi)
    assert not torch.allclose(g["k3 loss"], g["reverse"], atol=1e-3)
    assert torch.allclose(g["k1 loss"], torch.zeros(5), atol=1e-6)  # no regularisation in expectation


# ---- entropy -------------------------------------------------------------------------------------------------

def test_entropies_are_those_of_the_full_softmax(rollout64):
    model, inputs, attention, cmask, _, _ = rollout64
    T = cmask.shape[1]
    rows = slice(0, 16)
    with torch.no_grad():
        logits = model(input_ids=inputs[rows], attention_mask=attention[rows],
                       position_ids=position_ids_from_mask(attention[rows])).logits[:, -T - 1:-1].float() / 1.5
    p = torch.softmax(logits, -1)
    direct = -(p * torch.log(p)).sum(-1)
    results = []
    for chunk in (10**6, 37):  # one chunk, and many (checkpointed) chunks
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs(model, inputs[rows], attention[rows], T, 1.5, chunk, with_entropy=True)
        assert torch.allclose(entropy, direct * cmask[rows], atol=1e-4)   # 0 on padding
        (entropy * cmask[rows]).sum().backward()
        results.append((logp.detach(), model.get_output_embeddings().weight.grad.clone()))
        assert torch.equal(logp.detach(), completion_logprobs(model, inputs[rows], attention[rows], T, 1.5,
                                                              chunk).detach())
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert ((results[0][1] - results[1][1]).norm() / results[0][1].norm()).item() <= 1e-5


def test_entropy_bonus_is_subtracted_under_the_aggregation():
    entropy = leaf(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]]))
    zero = torch.zeros(2)
    loss, stats = grpo_loss(LOGP, OLD, zero, MASK, 5.0, loss_config(entropy_coef=0.1), entropy=entropy)
    assert loss.item() == pytest.approx(-0.1 * 15 / 5)
    assert stats["entropy"] == 15
    loss.backward()
    assert torch.allclose(entropy.grad, torch.tensor([[-0.02] * 3, [-0.02, -0.02, 0.0]]))
    loss, _ = grpo_loss(LOGP, OLD, zero, MASK, 2.0, loss_config(entropy_coef=0.1, loss_agg="seq-mean"), entropy=entropy)
    assert loss.item() == pytest.approx(-0.1 * (6 / 3 + 9 / 2) / 2)


def test_top_entropy_threshold_keeps_the_top_share():
    values = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 1.0, 0.4, 0.8, 0.6])
    assert top_entropy_threshold(values, 0.2) == pytest.approx(0.9)   # keeps 1.0 and 0.9
    assert top_entropy_threshold(values, 0.25) == pytest.approx(0.8)  # ceil(2.5) = 3 tokens
    assert top_entropy_threshold(values, 1.0) == pytest.approx(0.1)   # every token
    assert top_entropy_threshold(values, 0.0) == pytest.approx(1.0)   # the highest one only
    assert top_entropy_threshold(torch.arange(30.0), 0.1) == 27.0     # 0.1 x 30 is 3 tokens, not 4
    assert top_entropy_threshold(torch.tensor([2.0, 2.0, 1.0]), 0.1) == 2.0  # one asked for, both ties kept


def test_top_entropy_mask_keeps_kl_and_entropy_on_every_token():
    logp = leaf(LOGP)
    ref = torch.tensor([[0.0, 0.2, -0.1], [0.5, 0.1, 0.0]])
    pg_mask = torch.tensor([[True, False, False], [False, True, False]])
    cfg = loss_config(kl_coef=0.1, top_entropy_quantile=0.5)   # the mask's own setting
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, 5.0, cfg, ref_logp=ref, pg_mask=pg_mask)
    expected = 0.0
    for i, t, v in _per_token_surrogate(LOGP, ADV, MASK):
        d = float(ref[i, t] - LOGP[i, t])
        expected += v * bool(pg_mask[i, t]) + 0.1 * (math.exp(d) - d - 1)
    assert loss.item() == pytest.approx(expected / 5, rel=1e-6)
    loss.backward()
    # a masked-out token's gradient is its KL term's alone: 0.1 (1 - e^d) / 5
    d = float(ref[0, 1] - LOGP[0, 1])
    assert logp.grad[0, 1].item() == pytest.approx(0.1 * (1 - math.exp(d)) / 5, rel=1e-5)


def _grad(model, inputs, attention, cmask, old, adv, micro, loss_agg="token-mean", per_micro_denominator=False):
    model.zero_grad(set_to_none=True)
    T = cmask.shape[1]
    ref = frozen_copy(model)
    total = cmask.sum().item() if loss_agg == "token-mean" else cmask.shape[0]
    for s in range(0, inputs.shape[0], micro):
        sl = slice(s, s + micro)
        logp = completion_logprobs(model, inputs[sl], attention[sl], T, 1.5, 4096)
        with torch.no_grad():
            ref_logp = completion_logprobs(ref, inputs[sl], attention[sl], T, 1.5, 4096)
        denom = (cmask[sl].sum().item() if loss_agg == "token-mean" else micro) if per_micro_denominator else total
        loss, _ = grpo_loss(logp, old[sl], adv[sl], cmask[sl], denom,
                            loss_config(kl_coef=0.02, loss_agg=loss_agg), ref_logp=ref_logp - 0.1)
        (loss / (inputs.shape[0] // micro) if per_micro_denominator else loss).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean"])
def test_gradient_accumulation_equals_one_big_batch(rollout64, loss_agg):
    model, inputs, attention, cmask, old, adv = rollout64
    whole = _grad(model, inputs, attention, cmask, old, adv, micro=64, loss_agg=loss_agg)
    accumulated = _grad(model, inputs, attention, cmask, old, adv, micro=8, loss_agg=loss_agg)
    assert ((whole - accumulated).norm() / whole.norm()).item() <= 1e-5


def test_per_micro_batch_token_mean_is_a_different_gradient(rollout64):
    """The trap the test above guards against: normalising each micro-batch by its own token count."""
    model, inputs, attention, cmask, old, adv = rollout64
    whole = _grad(model, inputs, attention, cmask, old, adv, micro=64)
    wrong = _grad(model, inputs, attention, cmask, old, adv, micro=8, per_micro_denominator=True)
    assert ((whole - wrong).norm() / whole.norm()).item() > 1e-3


def test_first_on_policy_update_has_ratio_one_and_no_clipping(rollout64):
    model, inputs, attention, cmask, old, adv = rollout64
    logp = completion_logprobs(model, inputs, attention, cmask.shape[1], 1.5, 4096)
    _, stats = grpo_loss(logp, old, adv, cmask, cmask.sum().item(), loss_config())
    ratio = torch.exp(logp - old)[cmask.bool()]
    assert (ratio - 1).abs().max().item() <= 1e-5
    assert stats["clip_frac"] == 0
    assert abs(stats["ratio_mean"] / cmask.sum().item() - 1) <= 1e-6


def test_k3_kl_is_zero_for_the_same_policy_and_positive_otherwise(rollout64):
    model, inputs, attention, cmask, old, adv = rollout64
    T = cmask.shape[1]
    with torch.no_grad():
        logp = completion_logprobs(model, inputs, attention, T, 1.0, 4096)
        ref_logp = completion_logprobs(frozen_copy(model), inputs, attention, T, 1.0, 4096)
    assert k3_kl(logp, ref_logp).abs().max().item() == 0.0
    shifted = k3_kl(logp, ref_logp + 0.3 * torch.randn_like(ref_logp))
    assert (shifted >= 0).all() and shifted.mean() > 0


def test_clipped_tokens_carry_no_gradient():
    old = torch.zeros(1, 4)
    logp = torch.tensor([[0.5, -0.5, 0.05, 0.5]], requires_grad=True)  # ratios e^.5, e^-.5, e^.05, e^.5
    adv = torch.tensor([1.0])
    loss, stats = grpo_loss(logp, old, adv, torch.ones(1, 4), 4, loss_config())
    loss.backward()
    # adv > 0: the ratio above 1 + 0.2 is clipped (no gradient); below 1 - 0.2 it is not clipped
    assert logp.grad[0, 0] == 0 and logp.grad[0, 3] == 0
    assert logp.grad[0, 1] != 0 and logp.grad[0, 2] != 0
    assert stats["clip_frac"] == 2
    # the high side follows clip_high
    loss, stats = grpo_loss(logp, old, adv, torch.ones(1, 4), 4, loss_config(clip_high=0.7))
    assert stats["clip_frac"] == 0


def test_masked_tokens_do_not_count(rollout64):
    old = torch.zeros(2, 3)
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, stats = grpo_loss(logp, old, torch.tensor([1.0, -1.0]), mask, 3, loss_config())
    loss.backward()
    assert stats["ratio_mean"] == 3  # statistics are sums over the 3 unmasked tokens (each ratio 1)
    assert logp.grad[0, 2] == 0 and logp.grad[1, 1] == 0 and logp.grad[1, 2] == 0
    assert torch.allclose(logp.grad[0, :2], torch.tensor([-1 / 3, -1 / 3]))


def test_chunked_logprobs_equal_unchunked_with_gradients(rollout64):
    model, inputs, attention, cmask, _, _ = rollout64
    T = cmask.shape[1]
    grads = []
    for chunk in (10**6, 37):
        model.zero_grad(set_to_none=True)
        logp = completion_logprobs(model, inputs[:16], attention[:16], T, 1.0, chunk)
        (logp * cmask[:16]).sum().backward()
        grads.append((logp.detach(), model.get_output_embeddings().weight.grad.clone()))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5)
    assert ((grads[0][1] - grads[1][1]).norm() / grads[0][1].norm()).item() <= 1e-5


def test_dropout_is_off_in_training_forwards(tiny_model_dir):
    """The tiny model's config has dropout 0.1: two training forwards must still agree exactly."""
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = left_pad(encode_prompts(tok, ["Repeat a: aaaa", "Repeat b: bb"], True), tok.eos_token_id)
    assert model.config.resid_pdrop > 0
    a = completion_logprobs(model, ids, mask, 3, 1.0, 4096)
    b = completion_logprobs(model, ids, mask, 3, 1.0, 4096)
    assert a.requires_grad and torch.equal(a, b)
    model.train()  # the control: with dropout on, the same forward differs
    c = completion_logprobs(model, ids, mask, 3, 1.0, 4096)
    model.eval()
    assert not torch.equal(a, c)


def test_learning_rate_schedules_against_their_formulas():
    constant = Config(learning_rate=2.0, steps=5)
    assert [learning_rate(s, constant) for s in range(1, 6)] == [2.0] * 5
    # 4 warmup steps (s / 4), then linear over the 6 left towards a floor of 0.1: (s - 5) / 6 of the way at s
    linear = Config(learning_rate=1.0, steps=10, lr_scheduler="linear", lr_warmup_steps=4, min_lr_ratio=0.1)
    lrs = [learning_rate(s, linear) for s in range(1, 11)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4:] == pytest.approx([0.1 + 0.9 * (1 - (s - 5) / 6) for s in range(5, 11)])
    assert lrs[4] == 1.0 and lrs[-1] == pytest.approx(0.25)   # no step at the floor itself, none at 0
    # the warmup as a share of --steps: 0.2 x 10 = 2 steps, then half a cosine over the 8 left, down to 0
    cosine = Config(learning_rate=1.0, steps=10, lr_scheduler="cosine", lr_warmup_ratio=0.2)
    assert [learning_rate(s, cosine) for s in range(1, 11)] == pytest.approx(
        [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * (s - 3) / 8)) for s in range(3, 11)])


# ---- REINFORCE++, MaxRL, GDPO: each advantage against its formula, looped by hand --------------------------------

def _std(values):   # the unbiased sample standard deviation, as torch.std
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def test_reinforce_plus_plus_uses_the_batch_mean_and_std():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]   # the second group all equal: it still gets advantages
    adv, frac = group_advantages(torch.tensor(rewards), 4, "reinforce++", eps=1e-4)
    mean, std = sum(rewards) / 8, _std(rewards)
    assert adv.tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in rewards], rel=1e-5)
    assert (adv[4:] > 0).all() and frac == 0.5


def test_reinforce_plus_plus_baseline_divides_the_group_centred_rewards_by_their_batch_std():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 9.0, 3.0, 3.0, 3.0, 3.0]
    centred = [r - sum(rewards[i // 4 * 4:i // 4 * 4 + 4]) / 4 for i, r in enumerate(rewards)]
    adv, _ = group_advantages(torch.tensor(rewards), 4, "reinforce++-baseline", eps=1e-4)
    expected = [c / (_std(centred) + 1e-4) for c in centred]
    assert adv.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert adv[8:].tolist() == [0.0] * 4
    # not --advantage batch, whose std is the raw rewards'
    assert not torch.allclose(adv, group_advantages(torch.tensor(rewards), 4, "batch", eps=1e-4)[0])


def test_maxrl_divides_by_the_group_mean():
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]), 4, "maxrl",
                              eps=0.0)
    # one success in four: (1 - 1/4) / (1/4) = 3, each failure -1; three in four: 1/3 and -1; none: 0
    assert adv.tolist() == pytest.approx([3, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1, 0, 0, 0, 0])
    rewards = [0.2, 0.9, 0.5, 0.4]
    adv, _ = group_advantages(torch.tensor(rewards), 4, "maxrl")
    m = sum(rewards) / 4
    assert adv.tolist() == pytest.approx([(r - m) / (m + 1e-4) for r in rewards], rel=1e-5)


def test_gdpo_normalises_each_part_in_its_group_then_the_weighted_sum_by_the_batch():
    # two parts; group 1 ties on the weighted sum (1 + 0 = 0 + 1) part by part, group 2 differs in part 0 only
    parts = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    weights = [1.0, 0.5]
    summed = [sum(w * p for w, p in zip(weights, row)) for row in parts]
    adv, _ = group_advantages(torch.tensor(summed), 4, "gdpo", eps=1e-4, parts=torch.tensor(parts), weights=weights)
    per_row = [0.0] * 8
    for k, w in enumerate(weights):
        for g in range(2):
            values = [parts[i][k] for i in range(g * 4, g * 4 + 4)]
            m = sum(values) / 4
            for j, v in enumerate(values):   # a part equal across its group gives 0
                per_row[g * 4 + j] += w * (0.0 if max(values) == min(values) else (v - m) / (_std(values) + 1e-4))
    expected = [a / (_std(per_row) + 1e-4) for a in per_row]
    assert adv.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # GRPO on the weighted sum gives (1, 0) and (0, 1) the same advantage; GDPO keeps them apart
    assert adv[0] != adv[1]
    assert adv[5].item() == pytest.approx(expected[5]) and adv[6] == adv[7]


# ---- per-token advantages (--token-advantage): the shaped A against its formula, under any loss ----------------

ENTROPY = torch.tensor([[2.0, 0.1, 1.0], [0.5, 3.0, 7.0]])   # 7.0 sits under the mask


def test_entropy_shaping_adds_a_capped_entropy_term_to_each_tokens_advantage():
    """Cheng et al. 2025: A + min(alpha H, |A| / kappa) per token, H without a gradient; combined
    with PPO's clipped loss and with CISPO's, each reading the shaped A at its token."""
    entropy = leaf(ENTROPY)
    for loss_name in ("ppo", "cispo"):
        logp = leaf(torch.log(RATIOS))
        cfg = loss_config(policy_loss=loss_name, token_advantage="entropy", shaping_alpha=0.4,
                          shaping_kappa=2.0, clip_high=0.28)
        loss, stats = grpo_loss(logp, OLD, ADV, MASK, 5.0, cfg, entropy=entropy)
        expected, shaped = 0.0, []
        for i in range(2):
            for t in range(3):
                if MASK[i, t]:
                    a, r = ADV[i].item(), RATIOS[i, t].item()
                    a = a + min(0.4 * ENTROPY[i, t].item(), abs(a) / 2)
                    shaped.append(a)
                    if loss_name == "ppo":
                        expected += -min(r * a, min(max(r, 0.8), 1.28) * a)
                    else:
                        expected += -min(r, 1.28) * a * math.log(r)
        assert loss.item() == pytest.approx(expected / 5, rel=1e-5)
        loss.backward()
        assert entropy.grad is None   # the shaping is a weight, not an entropy bonus
        # the record: the shaped advantage's mean over loss tokens (sums here) and its square
        assert stats["token_adv"] == pytest.approx(sum(shaped), rel=1e-5)
        assert stats["token_adv_sq"] == pytest.approx(sum(a * a for a in shaped), rel=1e-5)
    # the sign of A is kept: the term never exceeds |A| / kappa
    assert all(x < 0 for x in shaped[3:]) and all(x > 0 for x in shaped[:3])


def test_the_sequence_advantage_records_no_shaping():
    _, stats = grpo_loss(leaf(torch.log(RATIOS)), OLD, ADV, MASK, 5.0, loss_config(),
                         entropy=ENTROPY)
    assert "token_adv" not in stats


# ---- the policy-loss variants: value and gradient against their formulas -------------------------------------

RATIOS = torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 2.0]])   # the last token is masked (MASK)


def test_cispo_caps_a_stop_gradient_weight_and_keeps_every_tokens_gradient():
    logp = leaf(torch.log(RATIOS))
    loss, _ = grpo_loss(logp, OLD, ADV, MASK, 5.0, loss_config(policy_loss="cispo", clip_high=0.28))
    expected, grads = 0.0, torch.zeros(2, 3)
    for i in range(2):
        for t in range(3):
            if MASK[i, t]:
                w = min(RATIOS[i, t].item(), 1.28)   # no lower bound: 0.5 stays 0.5
                expected += -w * ADV[i].item() * math.log(RATIOS[i, t].item())
                grads[i, t] = -w * ADV[i].item() / 5   # the weight is a constant: d/dlogp of -w A logp
    assert loss.item() == pytest.approx(expected / 5, rel=1e-5)
    loss.backward()
    assert torch.allclose(logp.grad, grads)
    assert logp.grad[0, 0] != 0   # ratio 1.5 > 1.28 with A > 0: PPO's clip would leave it no gradient


def test_sapo_is_a_soft_gate_with_a_temperature_per_sign():
    logp = leaf(torch.log(RATIOS))
    cfg = loss_config(policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=3.0)
    loss, _ = grpo_loss(logp, OLD, ADV, MASK, 5.0, cfg)
    expected, grads = 0.0, torch.zeros(2, 3)
    for i in range(2):
        a = ADV[i].item()
        tau = 1.0 if a > 0 else 3.0
        for t in range(3):
            if MASK[i, t]:
                r = RATIOS[i, t].item()
                s = 1 / (1 + math.exp(-tau * (r - 1)))
                expected += -4 / tau * s * a
                grads[i, t] = -4 * s * (1 - s) * r * a / 5   # d/dlogp: the gate's slope x dr/dlogp (= r)
    assert loss.item() == pytest.approx(expected / 5, rel=1e-5)
    loss.backward()
    assert torch.allclose(logp.grad, grads, rtol=1e-5)
    # on-policy (r = 1) the gradient is exactly PPO's: -A per token
    logp = leaf(torch.zeros(2, 3))
    grpo_loss(logp, OLD, ADV, MASK, 5.0, cfg)[0].backward()
    assert torch.allclose(logp.grad, -ADV[:, None] * MASK / 5)


def test_gmpo_is_the_geometric_mean_of_the_ratios_clipped_in_log_space():
    logp = leaf(torch.log(RATIOS))
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, 2.0, loss_config(policy_loss="gmpo", clip_low=0.4, clip_high=0.3,
                                                                    loss_agg="seq-mean"))
    expected, grads = 0.0, torch.zeros(2, 3)
    for i in range(2):
        a, n = ADV[i].item(), int(MASK[i].sum())
        logs, free = [], []
        for t in range(n):
            x = math.log(RATIOS[i, t].item())
            clipped = min(x, 0.3) if a > 0 else max(x, -0.4)   # A's side only
            logs.append(clipped)
            free.append(clipped == x)
        geo = math.exp(sum(logs) / n)
        expected += -a * geo
        for t in range(n):   # d/dlogp_t of -A exp(mean): -A geo / n where the token is not clipped
            grads[i, t] = -a * geo / n / 2 if free[t] else 0.0
    assert loss.item() == pytest.approx(expected / 2, rel=1e-5)
    loss.backward()
    assert torch.allclose(logp.grad, grads, rtol=1e-5)
    assert logp.grad[0, 0] == 0 and stats["clip_high_frac"] == 1   # log 1.5 = 0.405 > 0.3 with A > 0


def _covariances(logp, adv):
    n = len(logp)
    ml, ma = sum(logp) / n, sum(adv) / n
    return [(a - ma) * (lp - ml) for lp, a in zip(logp, adv)]


def test_kl_cov_chooses_the_highest_covariance_tokens():
    torch.manual_seed(0)
    logp, adv = -torch.rand(200), torch.randn(200)
    cov = _covariances(logp.tolist(), adv.tolist())
    chosen = highest_covariance(logp, logp, adv, loss_config(policy_loss="kl-cov", cov_ratio=0.03))
    assert set(torch.nonzero(chosen).squeeze(1).tolist()) == set(sorted(range(200), key=lambda i: -cov[i])[:6])
    # at least one token, however small the share
    assert highest_covariance(logp, logp, adv, loss_config(policy_loss="kl-cov", cov_ratio=1e-6)).sum() == 1


def test_clip_cov_draws_in_the_band_outside_the_clip_the_same_for_any_order():
    torch.manual_seed(1)
    logp, adv = -3 * torch.rand(300), 2 * torch.randn(300)
    old = logp - 0.3 * torch.randn(300)   # some ratios outside the clip range
    cfg = loss_config(policy_loss="clip-cov", cov_ratio=0.02, clip_cov_lb=0.5, clip_cov_ub=2.0)
    cov = _covariances(logp.tolist(), adv.tolist())
    ratio = torch.exp(logp - old).tolist()
    band = {i for i in range(300) if 0.5 < cov[i] < 2.0
            and not (adv[i] > 0 and ratio[i] > 1.2) and not (adv[i] < 0 and ratio[i] < 0.8)}
    chosen = covariance_band(logp, old, adv, cfg)
    picked = set(torch.nonzero(chosen).squeeze(1).tolist())
    assert len(band) > 6 and len(picked) == 6 and picked <= band
    # a function of the set of tokens: shuffled (another device split, another order), the same tokens
    perm = torch.randperm(300)
    again = covariance_band(logp[perm], old[perm], adv[perm], cfg)
    assert set(perm[again].tolist()) == picked
    # a share above the band's size takes the whole band
    wide = covariance_band(logp, old, adv, loss_config(policy_loss="clip-cov", cov_ratio=0.9, clip_cov_lb=0.5,
                                                       clip_cov_ub=2.0))
    assert set(torch.nonzero(wide).squeeze(1).tolist()) == band


def test_clip_cov_detaches_its_tokens_and_kl_cov_penalises_them():
    logp = leaf(torch.log(RATIOS))
    chosen = torch.tensor([[False, True, False], [True, False, False]])
    ppo, _ = grpo_loss(logp, OLD, ADV, MASK, 5.0, loss_config())
    ppo.backward()
    ppo_grad, logp.grad = logp.grad.clone(), None
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, 5.0, loss_config(policy_loss="clip-cov"), cov_mask=chosen)
    assert loss.item() == pytest.approx(ppo.item())   # detached, not removed: the loss reads the same
    loss.backward()
    assert torch.equal(logp.grad, torch.where(chosen, 0.0, ppo_grad)) and stats["cov_frac"] == 2
    logp.grad = None
    loss, _ = grpo_loss(logp, OLD, ADV, MASK, 5.0, loss_config(policy_loss="kl-cov", kl_cov_coef=0.5), cov_mask=chosen)
    expected, grads = 0.0, torch.zeros(2, 3)
    for i in range(2):
        for t in range(3):
            if MASK[i, t]:
                r, a, d = RATIOS[i, t].item(), ADV[i].item(), math.log(RATIOS[i, t].item())
                pen = 0.5 if chosen[i, t] else 0.0   # no clip: -r A, plus the penalty on the chosen tokens
                expected += -r * a + pen * abs(d)
                grads[i, t] = (-r * a + pen * math.copysign(1, d)) / 5
    assert loss.item() == pytest.approx(expected / 5, rel=1e-5)
    loss.backward()
    assert torch.allclose(logp.grad, grads, rtol=1e-5)


# ---- every policy loss and advantage has a formula test -------------------------------------

# The tests (in tests/grpo/) that check each --policy-loss and --advantage choice against its
# formula, written out in the test: the value, and for a loss the gradient. A choice added to
# POLICY_LOSSES or ADVANTAGES without an entry fails the test below.
POLICY_LOSS_FORMULA_TESTS = {
    "ppo": ["test_the_low_bound_clips_negative_advantages_below_one_minus_eps_low",
            "test_the_high_bound_clips_positive_advantages_above_one_plus_eps_high",
            "test_inside_both_bounds_every_token_has_the_gradient_minus_a_r"],
    "cispo": ["test_cispo_caps_a_stop_gradient_weight_and_keeps_every_tokens_gradient"],
    "sapo": ["test_sapo_is_a_soft_gate_with_a_temperature_per_sign"],
    "gmpo": ["test_gmpo_is_the_geometric_mean_of_the_ratios_clipped_in_log_space"],
    "clip-cov": ["test_clip_cov_draws_in_the_band_outside_the_clip_the_same_for_any_order",
                 "test_clip_cov_detaches_its_tokens_and_kl_cov_penalises_them"],
    "kl-cov": ["test_kl_cov_chooses_the_highest_covariance_tokens",
               "test_clip_cov_detaches_its_tokens_and_kl_cov_penalises_them"],
}
ADVANTAGE_FORMULA_TESTS = {
    "group": ["test_group_advantages_are_standardised_within_each_group"],
    "batch": ["test_batch_and_none_scaling"],
    "none": ["test_batch_and_none_scaling"],
    "rloo": ["test_rloo_baseline_leaves_each_completion_out"],
    "reinforce++": ["test_reinforce_plus_plus_uses_the_batch_mean_and_std"],
    "reinforce++-baseline": [
        "test_reinforce_plus_plus_baseline_divides_the_group_centred_rewards_by_their_batch_std"],
    "maxrl": ["test_maxrl_divides_by_the_group_mean"],
    "gdpo": ["test_gdpo_normalises_each_part_in_its_group_then_the_weighted_sum_by_the_batch"],
}
TOKEN_ADVANTAGE_FORMULA_TESTS = {
    "sequence": ["test_the_sequence_advantage_records_no_shaping"],
    "entropy": ["test_entropy_shaping_adds_a_capped_entropy_term_to_each_tokens_advantage"],
}


def _test_functions():
    """{name: [(file, its ast node)]} of the test functions in tests/grpo/, read, not imported."""
    import ast
    import glob
    import os
    found, here = {}, os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(here, "test_*.py"))):
        with open(path) as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                    found.setdefault(node.name, []).append((os.path.basename(path), node))
    return found


def test_every_policy_loss_and_advantage_has_a_formula_test():
    """Each listed test exists once and names its choice as a string (or the choice is the default,
    which the default Config runs). That it checks the formula is for a reader to see: this keeps a
    new choice from going without a test."""
    import ast
    from train_lean import ADVANTAGES, POLICY_LOSSES, TOKEN_ADVANTAGES
    tests = _test_functions()
    for field, choices, listed, what in (
            ("policy_loss", POLICY_LOSSES, POLICY_LOSS_FORMULA_TESTS, "value and gradient"),
            ("advantage", ADVANTAGES, ADVANTAGE_FORMULA_TESTS, "values"),
            ("token_advantage", TOKEN_ADVANTAGES, TOKEN_ADVANTAGE_FORMULA_TESTS, "values")):
        flag = "--" + field.replace("_", "-")
        for choice in choices:
            assert listed.get(choice), (
                f"add a formula test for {flag} {choice} in tests/grpo/test_variants.py (its "
                f"{what} against the formula written in the test) and list it in its FORMULA_TESTS")
        assert set(listed) <= set(choices), f"tests listed for {flag} choices that are gone"
        for choice, names in listed.items():
            for name in names:
                assert len(tests.get(name, [])) == 1, f"{name} ({flag} {choice}): not one such test"
                _, node = tests[name][0]
                strings = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
                assert choice in strings or choice == getattr(Config(), field), (name, choice)


@pytest.mark.slow   # a process of its own (or a traced run): seconds
def test_an_entry_added_to_a_table_of_train_lean_is_a_value_of_its_flag(tiny_model_dir, tmp_path):
    # the file that says "hack it here" takes the hack: a scratch copy of the repository whose only
    # change is a new POLICY_LOSSES entry in train_lean.py lists it in --help and runs it
    import os
    import subprocess
    import sys
    from helpers import REPO, SMALL, TRAIN, env, read_jsonl
    scratch = tmp_path / "repo"
    scratch.mkdir()
    for package in ("grpo", "harness", "tasks"):
        os.symlink(os.path.join(REPO, package), scratch / package)
    with open(TRAIN) as f:
        source = f.read()
    entry = "clipped_surrogate, variants.POLICY_LOSSES)"
    changed = source.replace(entry, 'clipped_surrogate, {**variants.POLICY_LOSSES, "mine": '
                             'clipped_surrogate})')
    assert changed != source
    (scratch / "train_lean.py").write_text(changed)
    command = [sys.executable, str(scratch / "train_lean.py"), "--task", "toy"]
    helped = subprocess.run([*command, "--help"], capture_output=True, text=True, env=env(),
                            timeout=120)
    assert "mine: PPO's -min(r A, clip(r" in " ".join(helped.stdout.split()), helped.stderr
    out = tmp_path / "out"
    ran = subprocess.run([*command, "--model", tiny_model_dir, "--policy-loss", "mine", "--steps",
                          "1", *SMALL, "--out-dir", str(out)], capture_output=True, text=True,
                         env=env(), timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]


def test_the_command_line_and_the_checks_read_the_tables_they_are_handed():
    # nothing registers on import: a table handed to the harness is what it takes, lists and checks
    import tasks
    import train_lean
    from grpo import variants
    from harness import cli
    from harness.config import ConfigError, check_variants
    argv = ["--task", "toy", "--policy-loss", "mine", "--dual-clip", "3"]
    with pytest.raises(ConfigError, match="--policy-loss 'mine' is not one of ppo, cispo"):
        cli.load(argv, {}, tasks.BUILTIN, tables=train_lean.TABLES)

    @variants.declares(accepts_dual_clip=True)
    def mine(ratio, t, cfg, **_):
        """a scratch loss"""
    tables = {**train_lean.TABLES, "policy_loss": variants.Table(
        "policy_loss", {**train_lean.POLICY_LOSSES, "mine": mine})}
    cfg = cli.load(argv, {}, tasks.BUILTIN, tables=tables).cfg
    check_variants(cfg, tables)   # its declaration counts
    with pytest.raises(ConfigError, match="--policy-loss 'mine' is not one of"):
        check_variants(cfg, train_lean.TABLES)
    assert "mine: a scratch loss" in cli.build_parser("toy", tables=tables).format_help()


def test_a_variant_built_on_the_default_takes_it_as_an_argument(monkeypatch):
    # gdpo and clip-cov build on the flag's default; it is passed to them, not looked up in
    # train_lean.py's tables (grpo/ does not import it)
    from grpo import variants
    from types import SimpleNamespace
    calls = []

    def default(*args, **_):
        calls.append(args)
        return args[0]
    r, parts = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    variants.gdpo(r, 1e-4, parts=parts, weights=[1.0, 0.5], default=default)
    t = SimpleNamespace(inputs={"cov_mask": torch.tensor([[True, False]])})
    ratio = torch.tensor([[1.5, 0.5]], requires_grad=True)
    variants.clip_cov(ratio, t, loss_config(policy_loss="clip-cov"), default=default)
    assert len(calls) == 3   # each part of gdpo's, then clip-cov's surrogate


def test_an_entry_added_to_a_table_after_it_was_built_is_a_value_of_its_flag(monkeypatch):
    # the notebook way: POLICY_LOSSES["mine"] = f, after train_lean.py built its table
    import tasks
    import train_lean
    from grpo import variants
    from harness import cli
    from harness.config import check_variants
    monkeypatch.setitem(train_lean.POLICY_LOSSES, "mine", train_lean.clipped_surrogate)
    monkeypatch.setitem(variants.MISMATCH_CORRECTIONS, "mine", variants.tis)
    argv = ["--task", "toy", "--policy-loss", "mine", "--mismatch-correction", "mine"]
    tables = train_lean.TABLES
    cfg = cli.load(argv, {}, tasks.BUILTIN, tables=tables).cfg
    assert (cfg.policy_loss, cfg.mismatch_correction) == ("mine", "mine")
    check_variants(cfg, tables)   # and its declarations count: --dual-clip is PPO's, so the copy's too
    check_variants(cli.load([*argv, "--dual-clip", "3"], {}, tasks.BUILTIN, tables=tables).cfg, tables)
    help_text = cli.build_parser("toy", tables=tables).format_help()
    assert "mine: PPO's -min(r A" in " ".join(help_text.split())


def test_no_variant_adds_anything_to_the_default_step():
    # train_lean.py's "none by default": every point of the step calls an empty list, which gives
    # back the value it is handed (a Fold) or nothing ({}, a Merged)
    from grpo import variants
    from harness.config import Config
    from train_lean import TABLES
    on = variants.on(Config(), TABLES)
    assert not on.reads_entropy
    assert {p: getattr(on, p) for p in variants.POINTS} == {p: [] for p in variants.POINTS}
    value = object()
    assert on.pg(value, None, None) is value and on.rounds(value, None, None) is value
    assert on.prepare(1, 2, 3, 4, 5) == {} and on.after_step(1, 2, 3, 4, 5, 6) == {}


def test_a_point_calls_its_additions_in_order():
    # what the step's loops did, written out: a Fold threads the value through each in turn, a
    # Merged gives each the same arguments and merges what they return, later names winning
    from grpo import variants
    fold = variants.Fold([lambda v, k: v * k, lambda v, k: v + k])
    assert fold(2, 3) == (2 * 3) + 3
    seen = []
    merged = variants.Merged([lambda x: seen.append(x) or {"a": 1, "b": x},
                              lambda x: seen.append(-x), lambda x: {"b": 2 * x}])
    assert merged(5) == {"a": 1, "b": 10} and seen == [5, -5]
    on = variants.on(Config(dual_clip=3.0, entropy_coef=0.01, kl_target=0.01, kl_coef=0.1), TABLES)
    assert isinstance(on.pg, variants.Fold) and isinstance(on.loss, variants.Fold)
    assert isinstance(on.after_step, variants.Merged) and len(on.pg) == len(on.after_step) == 1


def test_a_tables_default_is_named_by_its_flags_default():
    # one source: the default's name in a table is the flag's default value in grpo/settings.py
    from grpo import variants
    for flag, table in TABLES.items():
        assert table.default == Config.__dataclass_fields__[flag].default, flag
    mine = variants.table("policy_loss", k3_kl, {"other": grpo_loss})
    assert list(mine) == ["ppo", "other"] and mine["ppo"] is k3_kl and mine.flag == "policy_loss"


def test_each_switch_is_on_when_its_setting_is():
    from grpo import variants
    from harness.config import Config
    from train_lean import TABLES
    settings = {"dynamic-sampling": {"dynamic_sampling": True},
                "overlong-buffer": {"overlong_buffer": 4},
                "pretraining-mix": {"ptx_coef": 0.1}, "dual-clip": {"dual_clip": 3.0},
                "top-entropy": {"top_entropy_quantile": 0.2},
                "entropy-bonus": {"entropy_coef": 0.01}, "kl-target": {"kl_target": 0.01},
                "ref-sync": {"ref_sync_steps": 2}}
    assert set(settings) == set(variants.SWITCHES)
    for name, switch in variants.SWITCHES.items():
        assert switch.on(Config(**settings[name])) and not switch.on(Config()), name
    # a choice's switch adds where it is chosen and its own `on` holds: no reference, no KL to take off
    assert [name for name, _ in variants.on(Config(kl_in="reward", kl_coef=0.1), TABLES).penalty] == [
        "kl_reward_penalty"]
    assert variants.on(Config(kl_in="reward", kl_coef=0.0), TABLES).penalty == []


def test_a_switch_checks_its_settings_before_the_run_whether_it_is_on_or_not(monkeypatch):
    # a switch's own rules stand beside it (Switch.check); the harness asks every switch's
    from grpo import variants
    from harness.config import Config, ConfigError, check_variants
    from train_lean import TABLES
    check_variants(Config(), TABLES)   # the defaults pass every switch's check
    for settings, words in (({"kl_horizon": 50}, "--kl-horizon 50 without --kl-target"),
                            ({"ref_sync_steps": 2, "kl_coef": 0.0}, "--ref-sync-steps 2 moves"),
                            ({"ptx_batch_size": 4}, "--ptx-batch-size 4 with --ptx-coef 0")):
        with pytest.raises(ConfigError, match=words):
            check_variants(Config(**settings), TABLES)
    scratch = variants.Switch(on=lambda cfg: cfg.entropy_coef > 0.5,
                              check=lambda cfg: f"--entropy-coef {cfg.entropy_coef} is too high"
                              if cfg.entropy_coef > 0.5 else None)
    monkeypatch.setitem(variants.SWITCHES, "scratch", scratch)
    with pytest.raises(ConfigError, match="--entropy-coef 0.9 is too high"):
        check_variants(Config(entropy_coef=0.9), TABLES)
    check_variants(Config(entropy_coef=0.1), TABLES)


def test_a_policy_loss_gets_the_token_mask_its_switch_computes(monkeypatch, tiny_model_dir,
                                                               tmp_path, clean_env):
    # a scratch variant in one place: its mask, computed before the micro-batches, reaches its term
    import train_lean
    from grpo import variants
    from helpers import SMALL, read_jsonl
    seen = []

    def positive_tokens(policy, batch, rows, mask, guard, cfg, autocast):
        return {"positive": (batch.advantages[:, None] > 0).expand_as(mask) & mask.bool()}

    @variants.declares(switch=variants.Switch(mini_batch=positive_tokens))
    def positive_only(ratio, t, cfg, default):
        """ppo on the tokens of completions with a positive advantage"""
        seen.append(bool(((t.adv <= 0) & t.inputs["positive"]).any()))
        return default(ratio, t, cfg).expand_as(t.logp) * t.inputs["positive"]
    monkeypatch.setitem(train_lean.POLICY_LOSSES, "positive-only", positive_only)
    out = tmp_path / "run"
    train_lean.main(["--model", tiny_model_dir, "--task", "toy", "--steps", "1", *SMALL,
                     "--policy-loss", "positive-only", "--out-dir", str(out)])
    assert seen and not any(seen)   # called, and never on a token of a completion not above 0
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]
