"""Fixtures of the algorithm tests: a real batch of sampled completions from the tiny GPT-2."""
import pytest
import torch

from grpo.model import load_policy, load_tokenizer
from grpo.decoders import generate
from grpo.rollout import encode_prompts, left_pad


@pytest.fixture(scope="session")
def rollout64(tiny_model_dir):
    """64 real sampled completions (8 prompts x 8) of varying length, with their sampling logprobs."""
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    prompts = [f"Repeat {c}: " + "x" * i for i, c in enumerate("abcdeabc")]
    ids, mask = left_pad(encode_prompts(tok, prompts, True), tok.eos_token_id)
    ids, mask = ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)
    torch.manual_seed(0)
    # a frequent token as EOS, so completion lengths vary a lot (what makes normalisation matter)
    eos = tok("a", add_special_tokens=False)["input_ids"][0]
    out = generate(model, ids, mask, end_ids=eos, max_new_tokens=24, temperature=1.5)
    assert len(set(out.mask.sum(1).tolist())) > 4
    torch.manual_seed(1)
    adv = torch.randn(64)
    return (model, torch.cat([ids, out.ids], 1), torch.cat([mask, out.mask], 1), out.mask, out.logp,
            adv)
