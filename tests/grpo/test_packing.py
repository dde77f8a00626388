"""The packed forward (real tokens only, grpo/packing.py) against the padded one it replaces."""
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from grpo import packing
from grpo.model import completion_logprobs, load_policy

T = 6   # completion columns


def group_batch(vocab: int, seed: int = 0):
    """Two groups of three rows (one prompt each) and two rows alone, prompts of 3-9 tokens
    left-padded to 9; completions of 0 (all padding), 1, T (at the cap) and between; the mask."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in (9, 4, 3, 7)]
    rows, lengths = [], [T, 1, 3, 2, 0, T, 5, 4]
    for i, n in enumerate(lengths):
        prompt = prompts[min(i // 3, 3) if i < 6 else 2 + (i - 6)]
        rows.append((prompt, torch.randint(1, vocab, (T,), generator=g), n))
    ids = torch.zeros(len(rows), 9 + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (prompt, completion, n) in enumerate(rows):
        ids[r, 9 - len(prompt):9], mask[r, 9 - len(prompt):9] = prompt, 1
        ids[r, 9:], mask[r, 9:9 + n] = completion, 1
    return ids, mask


def both(model, ids, mask, **kwargs):
    """(packed, padded) completion_logprobs with entropies, each with its parameters' gradient of
    sum(logp + entropy) over the real completion tokens."""
    out = []
    for pack in (True, False):
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs(model, ids, mask, T, 0.7, kwargs.pop("chunk", 4096),
                                            with_entropy=True, pack=pack, **kwargs)
        real = mask[:, -T:]
        ((logp + entropy) * real).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        out.append((logp.detach() * real, entropy.detach() * real, grads))
    return out


@pytest.mark.parametrize("chunk", [4096, 5])   # one head chunk; chunks recomputed in backward
def test_packed_equals_padded_logprobs_entropies_and_gradients(any_model_dir, chunk):
    model = load_policy(any_model_dir, "cpu")
    ids, mask = group_batch(model.config.vocab_size)
    assert packing.packs(model)
    (logp, ent, grads), (logp0, ent0, grads0) = both(model, ids, mask, chunk=chunk)
    torch.testing.assert_close(logp, logp0, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent0, atol=2e-5, rtol=1e-5)
    assert len(grads) == len(grads0)
    for g, g0 in zip(grads, grads0):
        torch.testing.assert_close(g, g0, atol=5e-5, rtol=1e-4)


def test_only_real_completion_tokens_are_scored(tiny_model_dir):
    """Padding columns read 0; a row of no completion token is all 0; the values do not depend on
    the other rows (a row scored alone gives the same logprobs)."""
    model = load_policy(tiny_model_dir, "cpu")
    ids, mask = group_batch(model.config.vocab_size)
    with torch.no_grad():
        logp = completion_logprobs(model, ids, mask, T, 1.0, 4096)
        alone = torch.cat([completion_logprobs(model, ids[r:r + 1], mask[r:r + 1], T, 1.0, 4096)
                           for r in range(ids.shape[0])])
    assert (logp[mask[:, -T:] == 0] == 0).all() and (logp[4] == 0).all()
    assert (logp[mask[:, -T:] == 1] < 0).all()
    torch.testing.assert_close(logp, alone, atol=2e-5, rtol=1e-5)


def test_rows_whole_with_chosen_positions_equal_padded(any_model_dir):
    """share_prompts False (the pretraining mix's texts): every row whole, the head only where
    predict says; those positions equal the padded forward's."""
    model = load_policy(any_model_dir, "cpu")
    ids, mask = group_batch(model.config.vocab_size, seed=1)
    predict = mask[:, -T:].clone()
    predict[:, ::2] = 0
    with torch.no_grad():
        packed = completion_logprobs(model, ids, mask, T, 1.0, 4096, share_prompts=False,
                                     predict=predict)
        padded = completion_logprobs(model, ids, mask, T, 1.0, 4096, share_prompts=False,
                                     pack=False)
    assert (packed[predict == 0] == 0).all()
    torch.testing.assert_close(packed, padded * predict, atol=2e-5, rtol=1e-5)


def test_a_model_with_a_sliding_window_stays_padded(tmp_path):
    """Mistral's sliding window is an attention the packed function does not do: the probe says so
    and its logprobs are the padded forward's."""
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    model = load_policy(str(tmp_path), "cpu")
    assert not packing.packs(model)
    assert "padded rows (the model's attention takes sliding_window" in packing.describe(model)
    assert model.config._attn_implementation == "sdpa"   # its own, kept
    ids, mask = group_batch(64)
    with torch.no_grad():
        torch.testing.assert_close(completion_logprobs(model, ids, mask, T, 1.0, 4096),
                                   completion_logprobs(model, ids, mask, T, 1.0, 4096, pack=False))


def test_bucketed_block_widths_give_the_unbucketed_hidden_states_and_gradients(any_model_dir):
    """Attention's blocks padded to bucket() widths (on CUDA by default): the extra columns masked,
    the same hidden states and gradients as the blocks at their own widths, to float round-off
    (in float64: float32's reaches 1e-4 of a gradient's norm, the sums rounded in another order)."""
    model = load_policy(any_model_dir, "cpu").double()
    assert packing.packs(model)
    ids, mask = group_batch(model.config.vocab_size)
    heads, tails = packing.layout(torch.tensor([9, 4]), torch.tensor([6, 5]), torch.tensor([0, 1]),
                                  buckets=True), packing.layout(torch.tensor([9]), buckets=True)
    assert heads.head.shape[1] == heads.tail.shape[1] == tails.head.shape[1] == 16
    out = []
    for buckets in (False, True):
        model.zero_grad(set_to_none=True)
        for split in (9, 0):   # prompts shared, and every row whole
            hidden, kept = packing.packed_hidden(model, ids, mask, split, mask.bool(), buckets)
            hidden.square().sum().backward()
            out.append((hidden.detach(), kept))
        out.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for (a, kept), (b, kept_b) in zip(out[:2], out[3:5]):
        assert torch.equal(kept, kept_b)
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    for a, b in zip(out[2], out[5]):   # relative to each gradient's size (some reach 300)
        assert (a - b).norm() <= 1e-13 * a.norm()
