"""Write a tiny random-init causal LM (GPT-2, Llama or Qwen2 shape) with its own byte-level BPE tokenizer
to a folder, offline.

    python scripts/make_tiny_model.py out/tiny                   # GPT-2, 2 layers x 64, vocabulary 320, seconds
    python scripts/make_tiny_model.py out/tiny-llama --arch llama   # rotary positions, 4 query heads on 2 K/V heads
    python scripts/make_tiny_model.py out/tiny-qwen2 --arch qwen2   # the same with Qwen2's q/k/v biases
    python scripts/make_tiny_model.py out/tiny-chat --chat          # an instruct model (ChatML)
    python train_lean.py --model out/tiny --task toy --steps 20

--chat declares its end-of-turn token as Qwen2.5-Instruct does (see build_tiny_model); without it
the files are those of a base model, byte for byte as before --chat existed.

The test suite's fixtures and the benchmark's models are made with build_tiny_model.
"""
import os
import re

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

# --chat: Qwen2.5-Instruct's ChatML, `<|im_start|>role\ncontent<|im_end|>\n` per message and
# `<|im_start|>assistant\n` as the generation prompt. Unlike Qwen's template it adds no default
# system message: a test then renders exactly the messages it wrote.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# The chat tokenizer's corpus: the base one plus ChatML turns, so that the roles, the newlines
# around them and the toy task's answers get merges of their own.
CHAT_CORPUS = TINY_CORPUS + (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nRepeat a: <|im_end|>\n<|im_start|>assistant\naaaaaaaaaa<|im_end|>\n"
    "<|im_start|>system\nAnswer with the letter only.<|im_end|>\n"
    "<|im_start|>user\nRepeat b: <|im_end|>\n<|im_start|>assistant\nbbbbbbbbbb<|im_end|>\n"
    "<|im_start|>system\nRepeat the letter ten times.<|im_end|>\n"
    "<|im_start|>user\nRepeat c: <|im_end|>\n<|im_start|>assistant\ncccccccccc<|im_end|>\n"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
)


def tiny_config(arch: str, vocab_size: int, eos: int, n_layer: int = 2, n_head: int = None, n_kv_head: int = None,
                n_embd: int = 64, intermediate: int = None, n_positions: int = 512,
                dropout: float = 0.1, bos: int = None):
    """The model config of a tiny `arch`. GPT-2 has 2 heads unless told; a Llama-family shape 4 query heads on
    2 K/V heads (grouped-query attention) and a gated MLP 2 x n_embd wide unless told; BOS is EOS
    unless told."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config
    bos = eos if bos is None else bos
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                          n_head=n_head or 2, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                          bos_token_id=bos, eos_token_id=eos)
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")
    family = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return family(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=intermediate or 2 * n_embd,
                  num_hidden_layers=n_layer, num_attention_heads=n_head or 4, num_key_value_heads=n_kv_head or 2,
                  max_position_embeddings=n_positions, attention_dropout=dropout,
                  bos_token_id=bos, eos_token_id=eos)


def build_tiny_model(path: str, seed: int = 0, arch: str = "gpt2", vocab_size: int = 320,
                     corpus: str = None, chat: bool = False, **shape) -> str:
    """Write a random-init model of `arch` and a byte-level BPE tokenizer to `path`; return the path.

    Like GPT-2's, the tokenizer has <|endoftext|> and no pad token, so the tiny model exercises
    the pad == EOS path. Dropout is left on in the config on purpose: the trainer must switch it off.
    corpus: the text the merges are learnt from (TINY_CORPUS, or CHAT_CORPUS with chat).
    shape: tiny_config's n_layer, n_head, n_kv_head, n_embd, intermediate, n_positions, dropout.

    chat: an instruct model, its files laid out as Qwen2.5-Instruct's. <|im_start|> and <|im_end|>
    are added special tokens (one id each) after <|endoftext|>. tokenizer_config.json holds the
    template (CHAT_TEMPLATE: ChatML with no default system message, where Qwen's adds "You are
    Qwen...") and declares the end-of-turn token as its "eos_token": <|im_end|>, so
    tokenizer.eos_token_id is <|im_end|>'s id. generation_config.json's "eos_token_id" lists
    [<|im_end|>, <|endoftext|>], what generate() stops at; config.json has eos_token_id <|im_end|>
    and bos_token_id <|endoftext|>. As in Qwen's there is no BOS token; unlike Qwen's (pad
    <|endoftext|>) no pad token either, so pad == EOS (<|im_end|>) is still exercised, except with
    arch qwen2: transformers then loads the tokenizer as its Qwen2Tokenizer, whose pad (and unk)
    is <|endoftext|> unless the files say otherwise.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    specials = [END_OF_TEXT, IM_START, IM_END] if chat else [END_OF_TEXT]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # The trainer would spend merges on a special token's characters ("<|", ".<|"), which encoding
    # never sees as text: learn from the text between them.
    corpus = corpus or (CHAT_CORPUS if chat else TINY_CORPUS)
    texts = re.split("|".join(map(re.escape, specials)), corpus)
    bpe.train_from_iterator(texts, trainer=trainer)
    if chat:
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=IM_END,
                                      extra_special_tokens=[IM_START, IM_END],
                                      chat_template=CHAT_TEMPLATE)
        end_of_text = tok.convert_tokens_to_ids(END_OF_TEXT)
    else:
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TEXT,
                                      bos_token=END_OF_TEXT, unk_token=END_OF_TEXT)
        end_of_text = None   # tiny_config's BOS is then the EOS
    config = tiny_config(arch, len(tok), tok.eos_token_id, bos=end_of_text, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if chat:   # generate() stops at any id of the list: the end of a turn, or of the text
        model.generation_config = GenerationConfig(bos_token_id=end_of_text,
                                                   eos_token_id=[tok.eos_token_id, end_of_text])
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    # a chat template in tokenizer_config.json, where Qwen2.5-Instruct has it, not in a
    # chat_template.jinja of its own (without one the files are the same either way)
    tok.save_pretrained(path, save_jinja_files=False)
    return path


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Write a tiny random-init causal LM with a byte-level BPE "
                                     "tokenizer to a folder (offline).")
    parser.add_argument("path")
    parser.add_argument("--arch", choices=ARCHS, default="gpt2", help="the model's shape (default gpt2)")
    parser.add_argument("--chat", action="store_true", help="an instruct model's tokenizer: "
                        "a ChatML chat template, <|im_end|> ending a turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    args = parser.parse_args()
    from transformers.utils import logging
    logging.disable_progress_bar()   # one tiny weights file: a "Writing model shards" bar says nothing
    print(build_tiny_model(args.path, seed=args.seed, arch=args.arch, chat=args.chat,
                           n_layer=args.n_layer, n_embd=args.n_embd))
