"""Model loading (policy, LoRA adapters, frozen reference, tokenizer with left padding) and the
logprobs of completions.

Nothing here is GPT-2-specific: any AutoModelForCausalLM whose forward takes position_ids
(GPT-2's learned absolute positions, Llama's rotary ones, ...) works with the trainer.
"""
import contextlib
import copy
import functools
import os
import socket
import sys
import threading
import urllib.parse
import urllib.request

import torch
from torch.utils.checkpoint import checkpoint

from grpo import distributed, packing


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded (reported as a usage error)."""


def _from_pretrained(cls, name_or_path: str, **kwargs):
    """cls.from_pretrained, with a one-line ModelLoadError saying why it failed."""
    looks_local = name_or_path.startswith((".", "/", "~")) or os.path.exists(name_or_path)
    if looks_local and not os.path.isdir(name_or_path):
        raise ModelLoadError(f"--model {name_or_path}: no such folder (make a tiny one with "
                             f"`python scripts/make_tiny_model.py {name_or_path}` "
                             f"or give a hub id)")
    if not looks_local and not hub_reachable():   # the cache alone, at once: no minute of retries
        kwargs["local_files_only"] = True
    try:
        return cls.from_pretrained(name_or_path, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever transformers or safetensors raises on a folder
        # transformers' messages run over several lines: all of it, on one (its first line alone
        # can stop mid-list)
        text = " ".join(str(e).split()) or type(e).__name__
        text = text if len(text) <= 400 else text[:397] + "..."
        where = "" if looks_local else (" (a hub id needs network access; this machine may be "
                                        "offline: pass a local folder instead)")
        raise ModelLoadError(f"cannot load --model {name_or_path}: {text}{where}") from None


HUB_PROBE_S = 5.0   # how long the hub's host has to answer one connection


@functools.cache
def hub_reachable() -> bool:
    """Whether the hub (HF_ENDPOINT) takes a connection within HUB_PROBE_S, asked once a process;
    True behind a proxy (not probed), False with HF_HUB_OFFLINE. A hub id on a machine without
    network is then looked up in the local cache alone, and said at once, where the hub's client
    retries for most of a minute first."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return False
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    if url.scheme in urllib.request.getproxies():
        return True
    answered, done = [], threading.Event()

    def connect():   # a thread: name resolution takes no timeout
        try:
            socket.create_connection((url.hostname, url.port or {"http": 80}.get(url.scheme, 443)),
                                     timeout=HUB_PROBE_S).close()
            answered.append(True)
        except OSError:
            pass
        done.set()
    threading.Thread(target=connect, daemon=True).start()
    done.wait(HUB_PROBE_S)
    return bool(answered)


def load_config(name_or_path: str):
    """The model's config (config.json) alone: what can be checked before the weights load."""
    from transformers import AutoConfig
    return _from_pretrained(AutoConfig, name_or_path)


def context_length(config) -> int | None:
    """The most positions the model takes (GPT-2's n_positions, Llama's max_position_embeddings),
    or None where its config names none."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# the files a tokenizer loads from: a fast tokenizer's, a sentencepiece model (Llama, T5), a BPE or
# WordPiece vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def load_tokenizer(name_or_path: str):
    """The model's tokenizer, checked against it: a vocabulary beyond the special tokens (a folder
    without tokenizer files loads as an empty one that encodes every prompt to nothing), and no
    token id past the model's vocab_size (its embeddings)."""
    from transformers import AutoTokenizer
    missing = ("the folder lacks the tokenizer's files (tokenizer.json, tokenizer.model, or "
               "vocab.json and merges.txt): copy them from where the model came from")
    try:
        tok = _from_pretrained(AutoTokenizer, name_or_path)
    # a Llama-style model folder without them fails in transformers, which does not say so
    except ModelLoadError:
        files = set(os.listdir(name_or_path)) if os.path.isdir(name_or_path) else set()
        if "config.json" in files and not files & set(TOKENIZER_FILES):
            raise ModelLoadError(
                f"--model {name_or_path}: it has no tokenizer: {missing}") from None
        raise
    vocab = tok.get_vocab()
    if len(vocab) <= len(set(tok.all_special_ids)):
        raise ModelLoadError(f"--model {name_or_path}: its tokenizer has no vocabulary "
                             f"({len(vocab)} special token(s) only): {missing}")
    top, size = max(vocab.values()), getattr(load_config(name_or_path), "vocab_size", None)
    if isinstance(size, int) and top >= size:
        raise ModelLoadError(
            f"--model {name_or_path}: its tokenizer has token ids up to {top}, but the model's "
            f"vocab_size is {size}: ids from {size} on are outside its embeddings; use the "
            f"tokenizer the model was trained with")
    # Left padding: every prompt then ends at the same column, so all rows of a batch start
    # generating at the same index and a completion is simply "everything after the prompt".
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        # GPT-2 has no pad token. pad == EOS is then unavoidable, which is why completion masks
        # are built from the first generated EOS and never from `token == pad`.
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ModelLoadError(
            f"tokenizer of {name_or_path} has no EOS token: completions could never end")
    return tok


def declared_end_ids(model, tokenizer) -> tuple:
    """The tokenizer's EOS (the pad), then the other ids the model's generation config ends at (an
    instruct model's end of turn: Qwen's <|im_end|>, Llama 3's <|eot_id|>), as transformers does."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    declared = [declared] if isinstance(declared, int) else list(declared or ())
    return tuple(dict.fromkeys([tokenizer.eos_token_id, *declared]))


def turn_end(tokenizer) -> int | None:
    """The special token the chat template closes an assistant's turn with, or None (no template,
    or plain text there): found by rendering a turn around a marker and reading what follows it."""
    marker = "\u2063end\u2063"   # invisible separators: text no template adds or strips
    try:
        turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
        text = tokenizer.apply_chat_template(turn, tokenize=False)
    except Exception:   # no template, or one that refuses this turn: nothing to learn from it
        return None
    after = text.split(marker, 1)[1] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    added = tokenizer.added_tokens_decoder.get(ids[0]) if ids else None
    return ids[0] if added is not None and added.special else None


def end_ids(model, tokenizer) -> tuple:
    """The ids that end a completion: declared_end_ids, and the chat template's turn_end (a model
    whose files forget to declare it would otherwise talk on past its turn)."""
    turn = turn_end(tokenizer)
    ends = [*declared_end_ids(model, tokenizer), *([] if turn is None else [turn])]
    return tuple(dict.fromkeys(ends))


def fuse_tanh_gelu(model) -> None:
    """Swap GPT-2's gelu_new (the tanh GELU written as eight elementwise ops) for PyTorch's fused
    kernel of the same function (equal to float rounding, ~2e-7): about half the activation's time
    in forward and backward. The config says so too, so a saved checkpoint describes the model."""
    from transformers.activations import ACT2FN, NewGELUActivation
    swapped = False
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, ACT2FN["gelu_pytorch_tanh"])
                swapped = True
    if swapped and getattr(model.config, "activation_function", None) == "gelu_new":
        model.config.activation_function = "gelu_pytorch_tanh"


def load_policy(name_or_path: str, device: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar says nothing useful here
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its load report: what matters is said below, in a line
    try:
        model, info = _from_pretrained(AutoModelForCausalLM, name_or_path, dtype=torch.float32,
                                       output_loading_info=True, ignore_mismatched_sizes=True)
    finally:
        hf_logging.set_verbosity(before)
    # weights transformers would start at random values: a config that does not fit its weights
    wrong = [*info["missing_keys"], *(f"{k} (saved {tuple(a)}, configured {tuple(b)})"
                                      for k, a, b in info["mismatched_keys"])]
    if wrong:
        raise ModelLoadError(f"--model {name_or_path}: its config.json does not fit its weights: "
                             f"{len(wrong)} tensor(s) would start from random values "
                             f"({', '.join(sorted(wrong)[:2])}{', ...' if len(wrong) > 2 else ''})")
    with torch.no_grad():   # what the sampler needs: a decoder that returns its key/value cache
        cache = model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True).past_key_values
    if cache is None:
        raise ModelLoadError(f"--model {name_or_path}: a {model.config.model_type} model that "
                             f"returns no key/value cache is no causal LM this trainer samples "
                             f"from (a decoder: GPT-2, Llama, Qwen2, ...)")
    # fp32 master weights always: bf16 is used through autocast, never as the stored weights,
    # because AdamW updates on bf16 weights round away most of a 1e-5 learning rate.
    fuse_tanh_gelu(model)
    model.to(device)
    # eval() for the whole run: dropout off, so that a training forward gives exactly the logprobs
    # the sampler saw and the first update of a step is on-policy (ratio == 1).
    model.eval()
    return model


def model_autocast(device: torch.device, dtype: str):
    """The autocast the run computes under: bf16 matmuls over fp32 weights (--dtype bf16), or none.

    Warns where bf16 is emulated: a CPU without AVX512-BF16 or AMX runs bf16 matmuls many times
    slower; rank 0 alone, as it alone prints (under torchrun every process would say it)."""
    if dtype == "bf16" and device.type == "cpu" and distributed.is_main() and \
            not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        print("train_lean.py: warning: this CPU has no native bf16 (AVX512-BF16 or AMX): bf16 "
              "matmuls are emulated, many times slower than fp32; prefer --dtype fp32",
              file=sys.stderr, flush=True)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def frozen_copy(model):
    """A frozen reference on the same device as the policy (no second GPU, no second load)."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def is_lora(model) -> bool:
    """Whether model is a peft PeftModel (--lora-rank), without importing peft when it is not."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def add_lora(model, rank: int, alpha: float, target_modules: str | None = None,
             adapter: str | None = None):
    """LoRA adapters injected in place into model's layers (peft): returns the PeftModel, whose
    get_base_model() is `model` itself, now with its adapters, which alone require gradients.
    target_modules: comma-separated module names (None: peft's default for the architecture);
    adapter: a saved adapter's folder (a checkpoint) to load instead of fresh ones, which start with
    B = 0 (the policy starts as the model). No adapter dropout, and the model stays in eval mode: a
    training forward gives the sampler's logprobs (a step's first update is on-policy, ratio 1)."""
    import warnings
    from peft import LoraConfig, PeftModel, get_peft_model
    targets = ([t.strip() for t in target_modules.split(",") if t.strip()] if target_modules
               else None)
    try:
        with warnings.catch_warnings():  # GPT-2's Conv1D: peft says it sets fan_in_fan_out itself
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            if adapter:
                lora = PeftModel.from_pretrained(model, adapter, is_trainable=True)
            else:
                lora = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                        target_modules=targets))
    except ValueError as e:
        first = str(e).strip().splitlines()[0][:200]
        raise ModelLoadError(f"--lora-rank {rank} --lora-target-modules "
                             f"{target_modules or '(peft default)'} on {model.config.model_type}: "
                             f"{first} (name its modules with --lora-target-modules)") from None
    lora.eval()  # peft's new layers are created in training mode
    return lora


def load_trainable(cfg, device, resume_from: str | None = None):
    """(the model the run trains and decodes with, its PeftModel or None). --lora-rank 0: the whole
    model, from the checkpoint when resuming. Above 0: LoRA adapters on --model, which never changes
    (a checkpoint holds the adapters alone, loaded onto it again). Training and decoding use the
    underlying Hugging Face model, whose layers peft changed in place: the PeftModel serves to
    switch the adapters off and to save them."""
    if not cfg.lora_rank:
        return load_policy(resume_from or cfg.model, device), None
    lora = add_lora(load_policy(cfg.model, device), cfg.lora_rank, cfg.lora_alpha,
                    cfg.lora_target_modules, resume_from)
    return lora.get_base_model(), lora


def lora_summary(lora, with_reference: bool) -> str:
    """The start-up line of a LoRA run: where the adapters are, the trainable share, and what the
    reference (the adapters switched off) saves: a frozen copy of the model's weights."""
    c = lora.peft_config[lora.active_adapter]
    params = list(lora.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    frozen_mib = sum(p.numel() * p.element_size() for p in params if not p.requires_grad) / 2 ** 20
    line = (f"LoRA rank {c.r}, alpha {c.lora_alpha:g} on {','.join(sorted(c.target_modules))}: "
            f"{trainable:,} of {total:,} parameters train ({100 * trainable / total:.3g}%)")
    if with_reference:
        line += (f"; the KL reference is the same weights with the adapters off, no copy of the "
                 f"model ({frozen_mib:,.1f} MiB saved)")
    return line


@contextlib.contextmanager
def adapters_off(lora):
    """With LoRA, the model that gives the reference's logprobs: the policy itself (lora, the
    PeftModel's base model) with its adapters switched off for the while."""
    with lora.disable_adapter():
        yield lora.get_base_model()


def sync_reference(reference, policy, alpha: float) -> None:
    """Move the reference toward the policy (TR-DPO): each weight becomes alpha x the policy's +
    (1 - alpha) x its own; alpha 1 copies the policy. In place, no gradients."""
    with torch.no_grad():
        for r, p in zip(reference.parameters(), policy.parameters()):
            r.copy_(p) if alpha == 1 else r.lerp_(p, alpha)


def logprob_temperature(temperature: float) -> float:
    """The temperature trained at: the sampler's, so a step's first update is on-policy (ratio 1);
    1 for greedy decoding, which has no distribution of its own."""
    return temperature if temperature > 0 else 1.0


def trainable_parameters(model) -> list:
    """The parameters the optimizer steps: every weight, or with LoRA the adapters alone."""
    return [p for p in model.parameters() if p.requires_grad]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of the real tokens alone, 0 at a row's first: under left padding GPT-2 would
    otherwise place it at its row's pad count (pad columns: 0, masked out anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def padded_head(head, multiple: int):
    """(weight, bias) of the output head with zero rows up to a multiple of `multiple`, their logits
    sliced off (a GPU picks a slow kernel for 50257 rows): a differentiable copy, so gradients reach
    the head's weight; multiple 1: the head's own tensors."""
    pad = -head.weight.shape[0] % multiple
    if not pad:
        return head.weight, head.bias
    bias = None if head.bias is None else torch.nn.functional.pad(head.bias, (0, pad))
    return torch.nn.functional.pad(head.weight, (0, 0, 0, pad)), bias


def head_multiple(device) -> int:
    """The vocabulary rows the head is padded to a multiple of: 64 on a GPU; 1 (none) elsewhere."""
    return 64 if torch.device(device).type == "cuda" else 1


def _chosen_logprobs(hidden, targets, weight, bias, temperature, with_entropy, vocab, entropy_grad):
    """(logprob of each row's target,), with_entropy also the entropy of the row's distribution;
    vocab: the head's real rows. entropy_grad False: the entropy without a graph (docs/algorithm.md:
    a logged statistic would keep its [rows, vocab] softmax to the micro-batch's end)."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if logits.shape[-1] != vocab:   # a padded head's alone: a slice's backward zero-fills
        logits = logits[:, :vocab]
    logits = logits.float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return (logp,)
    # H = -sum p log p = logsumexp(z) - sum p z, from the chunk's logits already in memory
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        return logp, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def checkpoint_layers(model) -> None:
    """--gradient-checkpointing: each layer recomputes its activations in backward.

    Hugging Face checkpoints a layer only while that layer is in training mode, and the policy stays
    in eval mode (dropout off). So a hook switches each layer module alone to training mode for a
    forward with gradients, and back after it: its submodules, dropout included, stay in eval mode.
    """
    model.activation_checkpointing_enable({"use_reentrant": False})
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.register_forward_pre_hook(lambda layer, _: setattr(layer, "training",
                                                                  torch.is_grad_enabled()))
            m.register_forward_hook(lambda layer, *_: setattr(layer, "training", False))


def checkpoints(model) -> bool:
    """Whether this forward recomputes model's layers in backward (checkpoint_layers)."""
    return torch.is_grad_enabled() and getattr(model, "is_activation_checkpointing", False)


def _padded_rows(model, input_ids, attention_mask, n_completion: int, share_prompts: bool):
    """The padded forward: the last hidden states whose logits predict the completion tokens
    [B x n_completion, width], and those tokens [B x n_completion]."""
    targets = input_ids[:, -n_completion:].reshape(-1)
    # a checkpointed layer drops its KV cache (Hugging Face), so prompts are not shared then
    hidden = _completion_hidden(model, input_ids, attention_mask, n_completion,
                                share_prompts and not checkpoints(model))
    return hidden.reshape(input_ids.shape[0] * n_completion, -1), targets


def _completion_hidden(model, input_ids, attention_mask, n_completion: int, share_prompts: bool):
    """The last hidden states whose logits predict the completion tokens: [B, n_completion, width].
    share_prompts: each distinct prompt runs through the model once and its rows attend to its keys
    and values (a KV cache that carries gradients back): the same function, 8x less prompt work at
    group size 8.
    """
    positions = position_ids_from_mask(attention_mask)
    split = input_ids.shape[1] - n_completion
    if share_prompts and split > 0:
        prompts, inverse = torch.unique(
            torch.cat([input_ids[:, :split], attention_mask[:, :split]], 1), dim=0,
            return_inverse=True)
        share_prompts = prompts.shape[0] < input_ids.shape[0]
    if not share_prompts or split == 0:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=positions, use_cache=False).last_hidden_state
        return hidden[:, split - 1:-1]  # the logits at position t predict token t + 1
    prompt_ids, prompt_mask = prompts[:, :split], prompts[:, split:]
    head = model.base_model(input_ids=prompt_ids, attention_mask=prompt_mask,
                            position_ids=position_ids_from_mask(prompt_mask), use_cache=True)
    cache = head.past_key_values
    cache.batch_select_indices(inverse)  # each row gets its prompt's keys and values
    tail = model.base_model(input_ids=input_ids[:, split:], attention_mask=attention_mask,
                            position_ids=positions[:, split:], past_key_values=cache,
                            use_cache=True)
    return torch.cat([head.last_hidden_state[inverse, -1:], tail.last_hidden_state[:, :-1]], 1)


def completion_logprobs(model, input_ids, attention_mask, n_completion: int, temperature: float,
                        chunk_rows: int, autocast=None, share_prompts: bool = True,
                        with_entropy: bool = False, entropy_grad: bool = True, predict=None,
                        pack: bool = True):
    """Logprobs [B, n_completion] of input_ids' last n_completion tokens under `model`, positions
    from the mask; with_entropy also entropies (entropy_grad False: without a graph). pack (where
    the model takes it, grpo/packing.py): real tokens, the head only at predict (default: the mask)
    and 0 elsewhere. share_prompts: a group's prompt runs once. The head: chunk_rows per call."""
    batch, width = input_ids.shape
    pack = pack and packing.packs(model)
    with autocast or torch.autocast(input_ids.device.type, enabled=False):
        if pack:   # the hidden states at the columns before the predicted tokens
            keep = torch.zeros_like(input_ids, dtype=torch.bool)
            keep[:, -n_completion - 1:-1] = (
                attention_mask[:, -n_completion:] if predict is None else predict)
            hidden, kept = packing.packed_hidden(model, input_ids, attention_mask,
                                                 width - n_completion if share_prompts else 0, keep)
            at = (kept + 1).to(input_ids.device, non_blocking=True)   # each predicts the next
            targets = input_ids.reshape(-1)[at]
        else:
            hidden, targets = _padded_rows(model, input_ids, attention_mask, n_completion,
                                           share_prompts)
        head = model.get_output_embeddings()
        weight, bias = padded_head(head, head_multiple(input_ids.device))
        recompute = torch.is_grad_enabled() and hidden.shape[0] > chunk_rows
        parts = []
        for s in range(0, hidden.shape[0] or 1, chunk_rows):   # no row: one empty chunk, a graph
            args = (hidden[s:s + chunk_rows], targets[s:s + chunk_rows], weight, bias, temperature,
                    with_entropy, head.weight.shape[0], entropy_grad)
            parts.append(checkpoint(_chosen_logprobs, *args, use_reentrant=False) if recompute
                         else _chosen_logprobs(*args))
        out = [torch.cat(p) for p in zip(*parts)]
        if pack:   # each at its token's place in [batch, n_completion], 0 elsewhere
            place = at - (at // width + 1) * (width - n_completion)
            out = [o.new_zeros(batch * n_completion).index_copy(0, place, o) for o in out]
    out = [o.view(batch, n_completion) for o in out]
    return tuple(out) if with_entropy else out[0]
