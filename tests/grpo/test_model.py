import subprocess
import sys

import pytest
import torch

import grpo.model
from grpo.model import (ModelLoadError, context_length, frozen_copy, load_config, load_policy, load_tokenizer,
                        sync_reference)
from helpers import env, small_vocab_model, without_tokenizer


def test_tokenizer_pads_left_with_eos_when_it_has_no_pad(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    assert tok.padding_side == "left"
    assert tok.pad_token_id == tok.eos_token_id


def test_policy_loads_in_eval_mode_with_fp32_weights(any_model_dir):
    model = load_policy(any_model_dir, "cpu")
    assert not model.training
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())


def test_reference_is_a_frozen_equal_copy(tiny_model_dir):
    policy = load_policy(tiny_model_dir, "cpu")
    ref = frozen_copy(policy)
    assert not any(p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)  # training the policy must not move the reference
    assert not torch.equal(next(policy.parameters()), next(ref.parameters()))


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_policy(str(tmp_path / "nowhere"), "cpu")
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_unreachable_hub_id_says_the_machine_may_be_offline(monkeypatch):
    import huggingface_hub.constants
    # offline mode answers at once, as a machine without network does after its retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="may be offline"):
        load_tokenizer("no-such-org/no-such-model-lean-grpo")


def test_a_hub_that_cannot_be_reached_is_said_at_once(monkeypatch):
    # not offline mode: the hub's host does not answer (nothing listens there), as on a machine
    # without network, where the hub's client retried for 52 s before the same error
    import socket
    import time
    import huggingface_hub.constants
    from grpo import model
    for scheme in ("https", "http", "all"):
        for proxy in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY"):
            monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as closed:   # a port just freed: refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    model.hub_reachable.cache_clear()
    try:
        start = time.perf_counter()
        with pytest.raises(ModelLoadError, match="may be offline"):
            load_tokenizer("no-such-org/no-such-model-lean-grpo")
        assert time.perf_counter() - start < 10 and not model.hub_reachable()
        with socket.create_server(("127.0.0.1", 0)) as listening:   # a host that answers
            monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT",
                                f"http://127.0.0.1:{listening.getsockname()[1]}")
            model.hub_reachable.cache_clear()
            assert model.hub_reachable()
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")   # behind a proxy: not probed
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"https://127.0.0.1:{port}")
        model.hub_reachable.cache_clear()
        assert model.hub_reachable()
    finally:
        model.hub_reachable.cache_clear()


def test_folder_without_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load --model"):
        load_policy(str(tmp_path), "cpu")


def test_a_folder_without_tokenizer_files_fails_at_load(tiny_model_dir, tmp_path):
    # transformers builds an empty GPT-2 tokenizer from the config: every prompt would encode to nothing
    with pytest.raises(ModelLoadError, match=r"its tokenizer has no vocabulary \(1 special token\(s\) only\): the "
                                             r"folder lacks the tokenizer's files"):
        load_tokenizer(without_tokenizer(tiny_model_dir, tmp_path / "bare"))


def test_a_llama_folder_without_tokenizer_files_says_so_in_one_whole_line(tiny_rotary_dir, tmp_path):
    # transformers fails on it with a message of five lines, of which the first alone was shown, cut mid-list
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer(without_tokenizer(tiny_rotary_dir, tmp_path / "bare"))
    assert str(e.value) == (f"--model {tmp_path / 'bare'}: it has no tokenizer: the folder lacks the tokenizer's "
                            f"files (tokenizer.json, tokenizer.model, or vocab.json and merges.txt): copy them from "
                            f"where the model came from")


def test_a_tokenizer_larger_than_the_models_vocabulary_fails_at_load(tiny_model_dir, tmp_path):
    path = small_vocab_model(tiny_model_dir, tmp_path / "small-vocab")
    with pytest.raises(ModelLoadError, match="its tokenizer has token ids up to 319, but the model's vocab_size is "
                                             "300: ids from 300 on are outside its embeddings"):
        load_tokenizer(path)


def test_context_length_reads_the_config(tiny_model_dir, tiny_rotary_dir):
    assert context_length(load_config(tiny_model_dir)) == 512        # GPT-2: n_positions
    assert context_length(load_config(tiny_rotary_dir)) == 512       # Llama: max_position_embeddings
    assert context_length(object()) is None


def test_sync_reference_mixes_the_policy_in_at_alpha(tiny_model_dir):
    policy = load_policy(tiny_model_dir, "cpu")
    reference = frozen_copy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    before = [r.clone() for r in reference.parameters()]
    sync_reference(reference, policy, 0.3)
    for r, old, p in zip(reference.parameters(), before, policy.parameters()):
        assert torch.allclose(r, 0.3 * p + 0.7 * old, atol=1e-6) and not r.requires_grad
    sync_reference(reference, policy, 1.0)   # alpha 1: the policy's weights exactly
    assert all(torch.equal(r, p) for r, p in zip(reference.parameters(), policy.parameters()))


def test_a_padded_head_gives_the_logprobs_entropies_and_gradients_of_the_plain_one(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """head_multiple 64 (a GPU's default) on the CPU, fp32, a vocabulary of 300 (not a multiple of 64): the same
    logprobs and entropies within float rounding, and the head's own weight gets the same gradient."""
    from grpo.model import completion_logprobs
    model = load_policy(small_vocab_model(tiny_model_dir, tmp_path / "m300"), "cpu")
    torch.manual_seed(0)
    ids = torch.randint(1, 300, (6, 14))
    mask = torch.ones_like(ids)
    mask[:2, :3] = 0   # left padding
    results = []
    for rows in (1, 64):
        model.zero_grad()
        monkeypatch.setattr(grpo.model, "head_multiple", lambda device, rows=rows: rows)
        logp, entropy = completion_logprobs(model, ids, mask, 8, 0.7, chunk_rows=16, with_entropy=True)
        (logp.sum() + entropy.sum()).backward()
        results.append((logp.detach(), entropy.detach(), model.get_output_embeddings().weight.grad.clone()))
    (logp, entropy, grad), (logp64, entropy64, grad64) = results
    assert torch.allclose(logp, logp64, atol=1e-5, rtol=0) and torch.allclose(entropy, entropy64, atol=1e-5, rtol=0)
    assert grad64.shape == grad.shape and torch.allclose(grad, grad64, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_rows", [64, 16])   # the whole head at once, and chunks recomputed
def test_a_logged_entropy_keeps_no_graph_and_changes_no_number(tiny_model_dir, chunk_rows):
    """entropy_grad False (the default step: the entropy is a statistic unless --entropy-coef):
    the same logprobs, entropies and gradients bit for bit, and autograd saves no [rows, vocab]
    tensor but the logits, where a graph adds the softmax's output."""
    from grpo.model import completion_logprobs
    model = load_policy(tiny_model_dir, "cpu")
    vocab = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(0)
    ids = torch.randint(1, 300, (4, 20))
    mask = torch.ones_like(ids)
    mask[:2, :5] = 0   # left padding
    results = []
    for grad in (True, False):
        model.zero_grad()
        saved = []

        def pack(t):
            if t.dim() == 2 and t.shape == (48, vocab):
                saved.append(t.untyped_storage().data_ptr())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, entropy = completion_logprobs(model, ids, mask, 12, 0.7, chunk_rows=chunk_rows,
                                                with_entropy=True, entropy_grad=grad)
        assert entropy.requires_grad is grad
        logp.sum().backward()
        results.append((logp.detach(), entropy.detach(),
                        [p.grad.clone() for p in model.parameters()], saved))
    (logp, entropy, grads, saved), (logp2, entropy2, grads2, saved2) = results
    assert torch.equal(logp, logp2) and torch.equal(entropy, entropy2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    if chunk_rows == 64:   # recomputed chunks save in backward, under checkpoint's own hooks
        # the logits (logsumexp's input) and, with a graph, softmax's output: distinct storages
        assert len(set(saved2)) == 1 and len(set(saved)) == 2


# one rank of a 2-process gloo group (as under torchrun, after the trainer joins it) asking for
# bf16 on a CPU taken to have no native bf16, whatever this machine's
BF16_RANK = """
import sys
import torch

import grpo.model
from grpo import distributed
from grpo.model import model_autocast
torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[1],
                                     rank=int(sys.argv[2]), world_size=2)
torch.ops.mkldnn._is_mkldnn_bf16_supported = lambda: False
model_autocast(torch.device("cpu"), "bf16")
distributed.close()
"""


@pytest.mark.slow
def test_the_emulated_bf16_warning_is_printed_by_rank_0_alone(tmp_path):
    """Every rank printed it: under torchrun, once per process."""
    rendezvous = str(tmp_path / "rendezvous")
    ranks = [subprocess.Popen([sys.executable, "-c", BF16_RANK, rendezvous, str(rank)], env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    errs = []
    for p in ranks:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        errs.append(err)
    said = "warning: this CPU has no native bf16"
    assert [err.count(said) for err in errs] == [1, 0]


def broken_model(tiny_model_dir, tmp_path, case: str) -> str:
    """A copy of the tiny model broken as `case` says: a model folder transformers fails on, or
    loads with weights it makes up."""
    import json
    import shutil
    folder = tmp_path / case
    if case == "bert":   # an encoder: transformers loads it as BertLMHeadModel
        from transformers import BertConfig, BertLMHeadModel
        bert = BertLMHeadModel(BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64))
        bert.save_pretrained(folder)
        return str(folder)
    shutil.copytree(tiny_model_dir, folder)
    conf = json.loads((folder / "config.json").read_text())
    if case == "truncated":
        with open(folder / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    conf.update({"sizes": {"n_embd": 96}, "typed": {"n_layer": "two"}, "layers": {"n_layer": 4},
                 "untied": {"tie_word_embeddings": False}}.get(case, {}))
    (folder / "config.json").write_text(json.dumps(conf))
    return str(folder)


@pytest.mark.parametrize("case,said", [
    ("truncated", "cannot load --model {}: Error while deserializing header"),
    ("sizes", "--model {}: its config.json does not fit its weights: 28 tensor(s) would start from "
              "random values (transformer.h.0.attn.c_attn.bias (saved (192,), configured (288,))"),
    ("typed", "cannot load --model {}: Validation error for field 'n_layer'"),
    ("layers", "--model {}: its config.json does not fit its weights: 24 tensor(s) would start"),
    ("untied", "--model {}: its config.json does not fit its weights: 1 tensor(s) would start from "
               "random values (lm_head.weight)"),
    ("bert", "--model {}: a bert model that returns no key/value cache is no causal LM")])
def test_a_model_transformers_fails_on_or_makes_up_is_one_line(tiny_model_dir, tmp_path, case,
                                                               said):
    """Issue 72 finding 14: a truncated safetensors file, a config that does not fit the weights
    or has a wrong-typed field were tracebacks; more layers than weights or an untied head trained
    from random weights, said only in transformers' report; a BERT loaded, then failed in the
    decoder."""
    folder = broken_model(tiny_model_dir, tmp_path, case)
    with pytest.raises(ModelLoadError) as e:
        load_policy(folder, "cpu")
    assert str(e.value).startswith(said.format(folder)) and "\n" not in str(e.value), str(e.value)
