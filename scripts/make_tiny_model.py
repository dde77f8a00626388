"""Write a tiny random-init causal LM (GPT-2, Llama or Qwen2 shape) with its own byte-level BPE tokenizer
to a folder, offline.

    python scripts/make_tiny_model.py out/tiny                   # GPT-2, 2 layers x 64, vocabulary 320, seconds
    python scripts/make_tiny_model.py out/tiny-llama --arch llama   # rotary positions, 4 query heads on 2 K/V heads
    python scripts/make_tiny_model.py out/tiny-qwen2 --arch qwen2   # the same with Qwen2's q/k/v biases
    python train_lean.py --model out/tiny --task toy --steps 20

The test suite's fixtures and the benchmark's models are made with build_tiny_model.
"""
import os

import torch


TINY_CORPUS = (
    "Repeat a: aaaaaaaaaa Repeat b: bbbbbbbbbb Repeat c: cccccccccc Repeat d: dddddddddd "
    "Repeat e: eeeeeeeeee 0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ "
    "P: rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1 M: e7e5 c7c5 E: 0.3 0.4 B: e7e5 "
    "A: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+e2e4+e2e4+"
    "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0 "
)
# --arch: GPT-2 (learned positions, fused q/k/v, LayerNorm, GELU), or a Llama-family shape (rotary positions,
# grouped-query attention, RMSNorm, gated MLP; Qwen2 adds biases to q, k and v). grpo/decoders.py has a fast
# decoding path for each.
ARCHS = ("gpt2", "llama", "qwen2")


def tiny_config(arch: str, vocab_size: int, eos: int, n_layer: int = 2, n_head: int = None, n_kv_head: int = None,
                n_embd: int = 64, intermediate: int = None, n_positions: int = 512, dropout: float = 0.1):
    """The model config of a tiny `arch`. GPT-2 has 2 heads unless told; a Llama-family shape 4 query heads on
    2 K/V heads (grouped-query attention) and a gated MLP 2 x n_embd wide unless told."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                          n_head=n_head or 2, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                          bos_token_id=eos, eos_token_id=eos)
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")
    family = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return family(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=intermediate or 2 * n_embd,
                  num_hidden_layers=n_layer, num_attention_heads=n_head or 4, num_key_value_heads=n_kv_head or 2,
                  max_position_embeddings=n_positions, attention_dropout=dropout, bos_token_id=eos, eos_token_id=eos)


def build_tiny_model(path: str, seed: int = 0, arch: str = "gpt2", vocab_size: int = 320,
                     corpus: str = TINY_CORPUS, **shape) -> str:
    """Write a random-init model of `arch` and a byte-level BPE tokenizer to `path`; return the path.

    Like GPT-2's, the tokenizer has <|endoftext|> and no pad token, so the tiny model exercises
    the pad == EOS path. Dropout is left on in the config on purpose: the trainer must switch it off.
    shape: tiny_config's n_layer, n_head, n_kv_head, n_embd, intermediate, n_positions, dropout.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([corpus], trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    config = tiny_config(arch, len(tok), tok.eos_token_id, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Write a tiny random-init causal LM with a byte-level BPE "
                                     "tokenizer to a folder (offline).")
    parser.add_argument("path")
    parser.add_argument("--arch", choices=ARCHS, default="gpt2", help="the model's shape (default gpt2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    args = parser.parse_args()
    from transformers.utils import logging
    logging.disable_progress_bar()   # one tiny weights file: a "Writing model shards" bar says nothing
    print(build_tiny_model(args.path, seed=args.seed, arch=args.arch, n_layer=args.n_layer, n_embd=args.n_embd))
