"""The sampler/trainer mismatch: its statistics in every record and --mismatch-correction's weights (grpo/variants.py
mismatch_weight), each against its formula written out element by element, gradients included; the sampler's
logprobs under a truncated distribution (grpo/decoders.py sample_token). The settings the harness refuses
are in tests/harness/test_config.py."""
import math

import pytest
import torch

from train_lean import grpo_loss
from grpo.decoders import sample_token
from helpers import loss_config

LOGP = torch.tensor([[-1.0, -0.5, -2.0, -0.3], [-0.7, -1.2, -0.1, -3.0]])
SAMPLER = torch.tensor([[-1.1, -0.5, -1.0, -0.9], [-0.6, -1.25, -0.4, -1.0]])   # w = exp(LOGP - SAMPLER)
OLD = LOGP + torch.tensor([[0.05, -0.1, 0.0, 0.1], [0.0, 0.1, -0.05, 0.0]])      # ratios inside the 0.2 clip
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
ADV = torch.tensor([1.0, -2.0])


def cells():
    return [(i, t) for i in range(2) for t in range(4) if MASK[i, t]]


def by_hand(weight):
    """The loss (token-mean over 7 tokens) and d loss / d logp of each token, for a weight w(i, t) taken as a constant:
    the unclipped surrogate -w r A has the gradient -w r A (d r / d logp = r)."""
    loss, grad = 0.0, torch.zeros(2, 4)
    for i, t in cells():
        r = math.exp(LOGP[i, t] - OLD[i, t])
        loss += -weight(i, t) * r * ADV[i].item() / 7
        grad[i, t] = -weight(i, t) * r * ADV[i].item() / 7
    return loss, grad


def run(**knobs):
    logp = LOGP.clone().requires_grad_(True)
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, 7.0, loss_config(**knobs), sampler_logp=SAMPLER)
    loss.backward()
    return loss.item(), logp.grad, stats


def w(i, t):
    return math.exp(LOGP[i, t] - SAMPLER[i, t])


def test_the_mismatch_statistics_by_formula():
    _, _, stats = run()
    gaps = [(LOGP[i, t] - SAMPLER[i, t]).item() for i, t in cells()]
    assert stats["mismatch_kl"] == pytest.approx(sum(math.exp(d) - d - 1 for d in gaps), rel=1e-6)
    assert stats["mismatch_abs"] == pytest.approx(sum(abs(d) for d in gaps), rel=1e-6)
    assert stats["mismatch_max"] == pytest.approx(max(abs(d) for d in gaps), rel=1e-6)   # not the masked 2.0
    assert "mismatch_weight" not in stats


def test_no_policy_gradient_term_runs_by_default():
    # train_lean.py's "none by default", kept true: the default step's first update has the
    # sampler's logprobs (measured), and no term of grpo/variants.py acts on its loss
    from grpo import variants
    from train_lean import TABLES
    assert variants.on(loss_config(), TABLES).pg == []


def test_no_correction_leaves_the_loss_and_gradient_as_they_were():
    loss, grad, _ = run()
    logp = LOGP.clone().requires_grad_(True)
    plain, _ = grpo_loss(logp, OLD, ADV, MASK, 7.0, loss_config())
    plain.backward()
    assert loss == plain.item() and torch.equal(grad, logp.grad)
    assert loss == pytest.approx(by_hand(lambda i, t: 1.0)[0], rel=1e-6)


def test_tis_weighs_each_token_by_its_capped_detached_ratio():
    loss, grad, stats = run(mismatch_correction="tis", mismatch_cap=1.5)
    weight = lambda i, t: min(w(i, t), 1.5)   # noqa: E731 - the formula, beside its use
    expected, expected_grad = by_hand(weight)
    assert any(w(i, t) > 1.5 for i, t in cells()) and any(w(i, t) < 1 for i, t in cells())   # both sides bind
    assert loss == pytest.approx(expected, rel=1e-6)
    assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)   # no gradient through the weight
    assert stats["mismatch_weight"] == pytest.approx(sum(weight(i, t) for i, t in cells()), rel=1e-6)
    assert stats["mismatch_zero_frac"] == 0


def test_token_mask_drops_the_tokens_outside_the_band():
    loss, grad, stats = run(mismatch_correction="token-mask", mismatch_low=0.8, mismatch_cap=1.5)
    weight = lambda i, t: w(i, t) if 0.8 <= w(i, t) <= 1.5 else 0.0   # noqa: E731
    expected, expected_grad = by_hand(weight)
    dropped = [(i, t) for i, t in cells() if weight(i, t) == 0]
    assert dropped == [(0, 2), (0, 3)]   # w = e^-1 below the band, e^0.6 above
    assert loss == pytest.approx(expected, rel=1e-6)
    assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert all(grad[i, t] == 0 for i, t in dropped)
    assert stats["mismatch_zero_frac"] == 2


def test_sequence_mask_weighs_a_sequence_by_its_geometric_mean_ratio_or_drops_it():
    seq = [math.exp(sum(LOGP[i, t] - SAMPLER[i, t] for t in range(4) if MASK[i, t]) / MASK[i].sum().item())
           for i in range(2)]   # row 0: exp(-0.3 / 4) = 0.93, row 1: exp(0.25 / 3) = 1.09
    loss, grad, stats = run(mismatch_correction="sequence-mask", mismatch_low=0.95, mismatch_cap=1.2)
    expected, expected_grad = by_hand(lambda i, t: seq[i] if 0.95 <= seq[i] <= 1.2 else 0.0)
    assert seq[0] < 0.95 and 0.95 <= seq[1] <= 1.2
    assert loss == pytest.approx(expected, rel=1e-6)
    assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(grad[0], torch.zeros(4)) and stats["mismatch_zero_frac"] == 4


def test_the_trainers_logprobs_at_the_sampling_weights_are_used_when_given():
    """After the first optimizer step the forward's logp is not the sampling weights' any more: the update passes the
    trainer's logprobs computed before it (train_logp), and the weight is theirs."""
    behaviour = SAMPLER + 0.1
    logp = LOGP.clone().requires_grad_(True)
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, 7.0, loss_config(mismatch_correction="tis"), sampler_logp=SAMPLER,
                            train_logp=behaviour)
    assert loss.item() == pytest.approx(by_hand(lambda i, t: math.exp(0.1))[0], rel=1e-6)
    assert stats["mismatch_abs"] == pytest.approx(0.1 * 7, rel=1e-5)


def test_the_sampler_logprob_is_the_truncated_renormalised_distributions():
    torch.manual_seed(0)
    logits = torch.randn(64, 10)
    for top_k, top_p in ((3, 1.0), (0, 0.7), (4, 0.8)):
        token, logprob, sampled = sample_token(logits, 1.0, top_k, top_p, with_sampler=True)
        for row in range(64):
            p = torch.softmax(logits[row], -1)
            order = torch.argsort(p, descending=True).tolist()
            kept = order[:top_k] if top_k else order
            k_mass = sum(p[j].item() for j in kept)
            mass, nucleus = 0.0, []
            for j in kept:   # top-p on the top-k renormalised: kept while the ones above hold less than top_p
                if mass >= top_p:
                    break
                nucleus.append(j)
                mass += p[j].item() / k_mass
            assert token[row].item() in nucleus
            assert logprob[row].item() == pytest.approx(math.log(p[token[row]].item()), abs=1e-5)
            z = sum(p[j].item() for j in nucleus)
            assert sampled[row].item() == pytest.approx(math.log(p[token[row]].item() / z), abs=1e-5)
    # nothing truncated: the sampler's logprob is the policy's; EOS banned: renormalised without it
    token, logprob, sampled = sample_token(logits, 1.0, 0, 1.0, with_sampler=True)
    assert torch.equal(sampled, logprob)
    token, logprob, sampled = sample_token(logits, 1.0, 0, 1.0, banned=2, with_sampler=True)
    p = torch.softmax(logits, -1)
    assert torch.allclose(sampled, logprob - torch.log(1 - p[:, 2]), atol=1e-5)


def test_sampler_logprobs_are_kept_apart_only_when_something_truncates(rollout64, tiny_model_dir):
    from grpo.model import load_tokenizer
    from grpo.rollout import Sampler
    model, tok = rollout64[0], load_tokenizer(tiny_model_dir)
    kw = dict(group_size=4, prepend_bos=True, generation_batch=8, max_new_tokens=10,
              temperature=1.0, top_k=0, min_new_tokens=0, autocast=None, device="cpu")
    plain = Sampler(model, tok, top_p=1.0, **kw).sample(["ab", "cd"], seed=1, first_row=0)
    assert plain.sampler_logp is plain.old_logp   # nothing truncated: the policy's own, no second tensor
    nucleus = Sampler(model, tok, top_p=0.9, **kw).sample(["ab", "cd"], seed=1, first_row=0)
    m = nucleus.completion_mask.bool()
    gap = (nucleus.old_logp - nucleus.sampler_logp)[m]   # log of the kept mass: <= 0, and < 0 where it cut
    assert (gap <= 1e-6).all() and (gap < -1e-3).any()
