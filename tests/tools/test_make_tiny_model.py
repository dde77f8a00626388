"""scripts/make_tiny_model.py: a tiny GPT-2, Llama or Qwen2 with a byte-level tokenizer, offline, that
from_pretrained loads, that gets its fast decoder, and that trains."""
import runpy
import sys

import pytest
import torch

import train_lean
from grpo import decoders
from grpo.model import load_policy, load_tokenizer
from helpers import REPO, SMALL, build_tiny_model, read_jsonl

SCRIPT = f"{REPO}/scripts/make_tiny_model.py"


@pytest.mark.parametrize("arch, model_class, decoder", [
    ("gpt2", "GPT2LMHeadModel", decoders.GPT2Decoder),
    ("llama", "LlamaForCausalLM", decoders.LlamaDecoder),
    ("qwen2", "Qwen2ForCausalLM", decoders.LlamaDecoder),   # Qwen2 without a sliding window: the Llama-family path
])
def test_each_arch_loads_and_trains_a_step(arch, model_class, decoder, tmp_path, monkeypatch, capsys, clean_env):
    from transformers import AutoModelForCausalLM
    path = str(tmp_path / f"tiny-{arch}")
    monkeypatch.setattr(sys, "argv", [SCRIPT, path, "--arch", arch])   # the command line, as a user runs it
    runpy.run_path(SCRIPT, run_name="__main__")
    assert capsys.readouterr().out.strip() == path
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == model_class and model.config.num_hidden_layers == 2
    if arch != "gpt2":   # grouped-query attention: 4 query heads on 2 K/V heads
        assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
        assert (model.model.layers[0].self_attn.q_proj.bias is not None) == (arch == "qwen2")
    tok = load_tokenizer(path)
    assert tok.eos_token == "<|endoftext|>" and len(tok) == model.config.vocab_size
    assert tok.decode(tok("Repeat a: aaa")["input_ids"]) == "Repeat a: aaa"
    assert decoders.decoder_class(load_policy(path, "cpu")) is decoder
    train_lean.main(["--model", path, "--task", "toy", *SMALL, "--steps", "1", "--out-dir", str(tmp_path / "run")])
    assert f"decoder      {decoder.__name__}" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), model.parameters()))   # it learned


def test_the_same_seed_makes_the_same_model(tmp_path):
    from safetensors.torch import load_file
    a, b = (load_file(build_tiny_model(str(tmp_path / n), seed=3, arch="qwen2") + "/model.safetensors") for n in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
