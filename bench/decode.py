"""Generation throughput: generate()'s tokens/s by decode path, on the benchmark's batch.

    python bench/decode.py                                   # tiny GPT-2 and tiny Llama: eager, compiled, generic
    python bench/decode.py --models gpt2-124m --paths eager,compiled --rounds 2

The batch is the GRPO benchmark's (bench/run.py): 8 chess A: prompts x 8 completions = 64 rows, exactly
144 new tokens (EOS masked), temperature 1. Paths: eager (the model's preallocated decoder, as
train_lean.py runs it), compiled (the same step through torch.compile: generate(compile=True)), generic
(HFDecoder: the model's own forward with a DynamicCache, what any architecture gets). Each path's first
call is reported apart (it pays torch.compile's compilation, and allocator and kernel warm-up for all);
the paths alternate for --rounds rounds, and the table gives the median of the later calls.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import grpo.decoders as decoders  # noqa: E402
import grpo.rollout as rollout  # noqa: E402
from bench.common import get_bench_task, model_dir, step_prompts  # noqa: E402
from grpo.decoders import GPT2Decoder, HFDecoder, LlamaDecoder  # noqa: E402
from grpo.model import load_policy, load_tokenizer  # noqa: E402


@contextlib.contextmanager
def generic_decoder(on: bool):
    """generate() with HFDecoder whatever the model (the path a model without a fast decoder gets)."""
    chosen = decoders.decoder_for
    if on:
        decoders.decoder_for = HFDecoder
    try:
        yield
    finally:
        decoders.decoder_for = chosen


def seconds(model, ids, mask, eos, new_tokens, path):
    with generic_decoder(path == "generic"):
        t = time.perf_counter()
        decoders.generate(model, ids, mask, end_ids=eos, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         compile=path == "compiled")
        return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,tiny-llama", help="comma-separated: bench/common.py names or folders")
    ap.add_argument("--paths", default="eager,compiled,generic")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=144)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--model-root", default=os.path.join(REPO, "out", "bench-models"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    paths = args.paths.split(",")
    rows = args.prompts * args.group_size
    print(f"{rows} rows ({args.prompts} prompts x {args.group_size}), {args.new_tokens} new tokens, {device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| model | parameters | decoder | path | first call s | tokens/s (median) | calls |\n|---|---|---|---|---|---|---|")
    task = get_bench_task("chess-a")
    for name in args.models.split(","):
        path = model_dir(name, args.model_root)
        tok, model = load_tokenizer(path), load_policy(path, device)
        prompts = rollout.encode_prompts(tok, step_prompts(task, args.prompts, 0, 1), True)
        ids, mask = rollout.left_pad(prompts, tok.eos_token_id, device)
        ids, mask = ids.repeat_interleave(args.group_size, 0), mask.repeat_interleave(args.group_size, 0)
        calls = {p: [] for p in paths}
        for _ in range(args.rounds + 1):
            for p in paths:
                torch.manual_seed(0)
                calls[p].append(seconds(model, ids, mask, tok.eos_token_id, args.new_tokens, p))
        kind = next((c.__name__ for c in (GPT2Decoder, LlamaDecoder) if c.fits(model)), "HFDecoder")
        n_params = sum(p.numel() for p in model.parameters())
        for p in paths:
            first, later = calls[p][0], calls[p][1:]
            tps = rows * args.new_tokens / statistics.median(later)
            print(f"| {name} | {n_params:,} | {'HFDecoder' if p == 'generic' else kind} | {p} | {first:.2f} "
                  f"| {tps:.0f} | {len(later)} |", flush=True)


if __name__ == "__main__":
    main()
