"""Shared fixtures: tiny real models written to folders and loaded through from_pretrained."""
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init 2-layer GPT-2 with a byte-level BPE tokenizer (pad == EOS, dropout 0.1 in its config)."""
    from grpo.model import build_tiny_model
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-gpt2")), seed=0)


@pytest.fixture(scope="session")
def tiny_rotary_dir(tmp_path_factory, tiny_model_dir):
    """A random-init 2-layer Llama (rotary positions) sharing the tiny GPT-2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, bos_token_id=tok.eos_token_id,
                                         eos_token_id=tok.eos_token_id, attention_dropout=0.1))
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(params=["gpt2", "llama"])
def any_model_dir(request, tiny_model_dir, tiny_rotary_dir):
    return tiny_model_dir if request.param == "gpt2" else tiny_rotary_dir
