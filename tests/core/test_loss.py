import pytest
import torch

from helpers import loss_config
from grpo.algorithm import grpo_loss, k3_kl
from grpo.model import completion_logprobs
from grpo.model import frozen_copy, load_policy, load_tokenizer
from grpo.rollout import encode_prompts, left_pad


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
        loss, _ = grpo_loss(logp, old[sl], adv[sl], cmask[sl], denom, loss_config(kl_coef=0.02, loss_agg=loss_agg), ref_logp=ref_logp - 0.1)
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
