"""Seconds per training step of the default-model build (tasks/rookworld/build_model.py), by attention
kernel, activation and compute dtype: what chose plain attention and the fused GELU for CPU builds.

    .venv/bin/python bench/build_step.py                          # the shipped shape, 64 rows of 56 tokens
    .venv/bin/python bench/build_step.py --n-layer 8 --steps 20

A step is the build's own: forward with the completion-only loss, backward, gradient clipping, AdamW, on
random tokens of a fixed shape (the mean sample is 45 P: / 61 A: tokens), after 3 warm-up steps.
"""
import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks.rookworld.build_model import model_config  # noqa: E402   the build's own model shape


def step_seconds(attention: str, activation: str, dtype: str, args) -> float:
    from transformers import GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(model_config(2048, 0, 256, args.n_embd, args.n_layer, activation))
    model.set_attn_implementation(attention)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 2048, (args.batch_size, args.length), generator=generator)
    labels = input_ids.clone()
    labels[:, :args.length // 2] = -100   # the prompt half is context, not target
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step():
        with autocast:
            loss = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    return (time.perf_counter() - t0) / args.steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--length", type=int, default=56)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"GPT-2 {args.n_layer} x {args.n_embd}, {args.batch_size} rows x {args.length} tokens, "
          f"{args.threads} threads, torch {torch.__version__}")
    print("attention  activation         dtype  s/step  tokens/s")
    for dtype, attention, activation in itertools.product(("bf16", "fp32"), ("sdpa", "eager"),
                                                          ("gelu_new", "gelu_pytorch_tanh")):
        seconds = step_seconds(attention, activation, dtype, args)
        print(f"{attention:<10} {activation:<18} {dtype:<6} {seconds:6.3f}  {args.batch_size * args.length / seconds:8.0f}",
              flush=True)


if __name__ == "__main__":
    main()
