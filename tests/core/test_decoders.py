"""The speed paths compute the same thing as the plain ones: decode loop, shared prompts, sampling, checkpointing."""
import pytest
import torch

import grpo.decoders as decoders
from grpo.loss import completion_logprobs
from grpo.model import load_policy, load_tokenizer
from grpo.rollout import encode_prompts, generate, left_pad, sample_token


def _group_batch(tok, group=4):
    prompts = encode_prompts(tok, ["Repeat a: ", "Repeat d: and a longer prompt"], prepend_bos=True)
    ids, mask = left_pad(prompts, tok.eos_token_id)
    return ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)


@pytest.mark.parametrize("order", ["groups", "interleaved"])
def test_gpt2_decoder_matches_the_models_own_forward(tiny_model_dir, monkeypatch, order):
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    assert decoders.GPT2Decoder.fits(model)
    ids, mask = _group_batch(tok)
    if order == "interleaved":  # rows of a group not contiguous: the decoder keeps one prompt copy per row
        ids, mask = ids[[0, 4, 1, 5, 2, 6, 3, 7]], mask[[0, 4, 1, 5, 2, 6, 3, 7]]
    kw = dict(eos_id=tok.eos_token_id, max_new_tokens=16, temperature=0.0)
    fast = generate(model, ids, mask, **kw)
    monkeypatch.setattr(decoders.GPT2Decoder, "fits", staticmethod(lambda m: False))
    plain = generate(model, ids, mask, **kw)
    assert torch.equal(fast[0], plain[0])
    assert (fast[2] - plain[2]).abs().max().item() <= 1e-5


def test_min_new_tokens_masks_eos_but_keeps_its_probability(tiny_model_dir):
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = _group_batch(tok)
    # pretend the greedy first token is EOS: with min_new_tokens it cannot be drawn
    first = int(generate(model, ids, mask, eos_id=-1, max_new_tokens=1, temperature=0.0)[0][0, 0])
    comp, cmask, logp = generate(model, ids, mask, eos_id=first, max_new_tokens=6, min_new_tokens=3, temperature=0.0)
    assert (comp[:, :3] != first).all() and comp.shape[1] >= 3
    scored = completion_logprobs(model, torch.cat([ids, comp], 1), torch.cat([mask, cmask], 1), comp.shape[1], 1.0, 4096)
    assert ((scored - logp).abs() * cmask).max().item() <= 1e-5


def _sampled_inputs(tok, model):
    """completion_logprobs' arguments for 12 sampled tokens per row of a group batch, and the mask."""
    ids, mask = _group_batch(tok)
    torch.manual_seed(0)
    comp, cmask, _ = generate(model, ids, mask, eos_id=tok.eos_token_id, max_new_tokens=12)
    return (torch.cat([ids, comp], 1), torch.cat([mask, cmask], 1), comp.shape[1], 1.0, 4096), cmask


def test_shared_prompt_forward_equals_the_plain_one_with_gradients(any_model_dir):
    tok, model = load_tokenizer(any_model_dir), load_policy(any_model_dir, "cpu")
    inputs, cmask = _sampled_inputs(tok, model)
    results = []
    for share in (False, True):
        model.zero_grad()
        logp = completion_logprobs(model, *inputs, share_prompts=share)
        (logp * cmask).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    assert ((results[0][0] - results[1][0]).abs() * cmask).max().item() <= 1e-5
    # per tensor, relative to its norm: float32 summation order differs between the two paths (and between
    # CPUs: AMX kernels), which an element-wise rtol trips on entries that cancel to near zero; measured
    # ~4e-7 here, where a wrong attention pattern gives errors of order 1e-1
    for a, b in zip(results[0][1], results[1][1]):
        assert (a - b).norm() <= 1e-5 * a.norm()


def test_gradient_checkpointing_gives_the_same_gradients_with_dropout_off(tiny_model_dir):
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    inputs, cmask = _sampled_inputs(tok, model)
    grads = []
    for on in (False, True):
        if on:
            model.activation_checkpointing_enable({"use_reentrant": False})
        model.zero_grad()
        (completion_logprobs(model, *inputs) * cmask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert not any(m.training for m in model.modules())  # switched back: dropout never ran
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_inverse_cdf_sampling_never_draws_a_zero_probability_token():
    torch.manual_seed(0)
    logits = torch.randn(2000, 7)
    logits[:, [0, 3, 6]] = float("-inf")  # first, middle and last index impossible
    tokens, _ = sample_token(logits, 1.0, 0, 1.0)
    assert not set(tokens.tolist()) & {0, 3, 6}
    banned, _ = sample_token(torch.zeros(500, 4), 1.0, 0, 1.0, banned=2)
    assert 2 not in banned.tolist() and set(banned.tolist()) == {0, 1, 3}
