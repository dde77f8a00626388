"""Model loading: policy, frozen reference, tokenizer with left padding, and a tiny offline model.

Nothing here is GPT-2-specific: any AutoModelForCausalLM whose forward takes position_ids
(GPT-2's learned absolute positions, Llama's rotary ones, ...) works with the trainer.
"""
import copy
import os

import torch


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded (reported as a usage error)."""


def _from_pretrained(cls, name_or_path: str, **kwargs):
    """cls.from_pretrained, with a one-line ModelLoadError saying why it failed."""
    looks_local = name_or_path.startswith((".", "/", "~")) or os.path.exists(name_or_path)
    if looks_local and not os.path.isdir(name_or_path):
        raise ModelLoadError(f"--model {name_or_path}: no such folder (make one with "
                             f"`python -m grpo.model {name_or_path}` or give a hub id)")
    try:
        return cls.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        where = "" if looks_local else (" (a hub id needs network access; this machine may be offline: "
                                        "pass a local folder instead)")
        raise ModelLoadError(f"cannot load --model {name_or_path}: {first}{where}") from None


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer
    tok = _from_pretrained(AutoTokenizer, name_or_path)
    # Left padding: every prompt then ends at the same column, so all rows of a batch start
    # generating at the same index and a completion is simply "everything after the prompt".
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        # GPT-2 has no pad token. pad == EOS is then unavoidable, which is why completion masks
        # are built from the first generated EOS and never from `token == pad`.
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ModelLoadError(f"tokenizer of {name_or_path} has no EOS token: completions could never end")
    return tok


def load_policy(name_or_path: str, device: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar says nothing useful here
    model = _from_pretrained(AutoModelForCausalLM, name_or_path, dtype=torch.float32)
    # fp32 master weights always: bf16 is used through autocast, never as the stored weights,
    # because AdamW updates on bf16 weights round away most of a 1e-5 learning rate.
    _fuse_tanh_gelu(model)
    model.to(device)
    # eval() for the whole run: dropout off, so that a training forward gives exactly the logprobs
    # the sampler saw and the first update of a step is on-policy (ratio == 1).
    model.eval()
    return model


def _fuse_tanh_gelu(model) -> None:
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


def frozen_copy(model):
    """A frozen reference on the same device as the policy (no second GPU, no second load)."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens: 0 at each row's first real token.

    With left padding a row's first real token sits at column `pad_len`; without explicit
    position_ids an absolute-position model (GPT-2) would score it at position `pad_len`.
    Pad columns get position 0 (they are masked out of attention anyway).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


TINY_CORPUS = (
    "Repeat a: aaaaaaaaaa Repeat b: bbbbbbbbbb Repeat c: cccccccccc Repeat d: dddddddddd "
    "Repeat e: eeeeeeeeee 0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ "
    "P: rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1 M: e7e5 c7c5 E: 0.3 0.4 B: e7e5 "
    "A: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+e2e4+e2e4+"
    "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0 "
)


def build_tiny_model(path: str, seed: int = 0, n_layer: int = 2, n_head: int = 2, n_embd: int = 64,
                     vocab_size: int = 320, n_positions: int = 512, dropout: float = 0.1,
                     corpus: str = TINY_CORPUS) -> str:
    """Write a random-init GPT-2 and a byte-level BPE tokenizer to `path`; return the path.

    Like GPT-2's, the tokenizer has <|endoftext|> and no pad token, so the tiny model exercises
    the pad == EOS path. Dropout is left on in the config on purpose: the trainer must switch it off.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([corpus], trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    eos = tok.eos_token_id
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tok), n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=eos, eos_token_id=eos)
    model = GPT2LMHeadModel(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Write a tiny random-init GPT-2 with a tokenizer to a folder.")
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    args = parser.parse_args()
    print(build_tiny_model(args.path, seed=args.seed, n_layer=args.n_layer, n_embd=args.n_embd))
