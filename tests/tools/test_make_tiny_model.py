"""scripts/make_tiny_model.py: a tiny GPT-2, Llama or Qwen2 with a byte-level tokenizer, offline, that
from_pretrained loads, that gets its fast decoder, and that trains; with --chat, an instruct model's
files (a ChatML template, <|im_end|> declared as Qwen2.5-Instruct declares it)."""
import json
import os
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


# A system and a user message, and their ChatML with the generation prompt, written out by hand
MESSAGES = [{"role": "system", "content": "Answer with the letter only."},
            {"role": "user", "content": "Repeat a: "}]
CHATML = ("<|im_start|>system\nAnswer with the letter only.<|im_end|>\n"
          "<|im_start|>user\nRepeat a: <|im_end|>\n"
          "<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_chat_makes_an_instruct_models_files(arch, tmp_path, monkeypatch, capsys, clean_env):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = str(tmp_path / f"tiny-chat-{arch}")
    monkeypatch.setattr(sys, "argv", [SCRIPT, path, "--chat", "--arch", arch])
    runpy.run_path(SCRIPT, run_name="__main__")
    assert capsys.readouterr().out.strip() == path
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    assert len(tok) == model.config.vocab_size
    # the template renders the messages and nothing else: no default system message
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == CHATML
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    start, end, text_end = tok.convert_tokens_to_ids(
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    assert ids == tok(CHATML, add_special_tokens=False)["input_ids"]
    assert [i for i in ids if i in (start, end)] == [start, end, start, end, start]   # one id each
    assert tok.convert_ids_to_tokens(ids[:2]) == ["<|im_start|>", "system"]
    # the end of a turn, where Qwen2.5-Instruct declares it: tokenizer_config.json's eos_token, and
    # first of generation_config.json's eos_token_id list (then <|endoftext|>)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    assert tokenizer_config["eos_token"] == "<|im_end|>" and "chat_template" in tokenizer_config
    assert tok.eos_token_id == end and tok.bos_token is None
    assert model.generation_config.eos_token_id == [end, text_end]
    assert (model.config.eos_token_id, model.config.bos_token_id) == (end, text_end)
    # no pad token: pad == EOS, except that transformers loads a qwen2 folder's tokenizer as its
    # Qwen2Tokenizer, whose pad token is <|endoftext|> unless told (as Qwen2.5-Instruct's is)
    assert load_tokenizer(path).pad_token == {"gpt2": "<|im_end|>", "qwen2": "<|endoftext|>"}[arch]
    # a task of strings trains on it as on a base model
    train_lean.main(["--model", path, "--task", "toy", *SMALL, "--steps", "1",
                     "--out-dir", str(tmp_path / "run")])
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_without_chat_the_files_are_a_base_models(tmp_path):
    from transformers import AutoTokenizer
    path = build_tiny_model(str(tmp_path / "tiny"))
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json"]
    assert sorted(os.listdir(path)) == files   # as before --chat: no template anywhere
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template is None and not {"<|im_start|>", "<|im_end|>"} & set(tok.get_vocab())
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == tok.eos_token_id == 0
