"""Write a tiny random-init GPT-2 with its own byte-level BPE tokenizer to a folder, offline.

    python scripts/make_tiny_model.py out/tiny            # 2 layers x 64, vocabulary 320, seconds
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
