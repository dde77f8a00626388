"""Operations per decode token: the host work that a GPU would launch one by one, counted on any device.

    python bench/decode_ops.py                       # a 12-layer GPT-2 (the 124M shape's layer count), eager
    python bench/decode_ops.py --arch llama --compile

Counts the top-level aten ops (an op called inside another op is part of it) that generate() runs per
decode token, sampling and the stop bookkeeping included: the profile of a generate() of --long new tokens
minus one of --short, over the difference. On CUDA it also counts the GPU kernels per token the same way.
The model is narrow (the count does not depend on the width) and random; 8 prompts x 8 completions.
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from grpo.decoders import generate  # noqa: E402


def top_level_ops(prof) -> int:
    def nested(e):
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                return True
            p = p.cpu_parent
        return False
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and not nested(e))


def kernels(prof) -> int:
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def graph_calls(prof) -> dict:
    """The CUDA runtime's graph calls in a profile: recorded (captures begun, graphs instantiated)
    against replayed (graph launches). A replayed decode launches one a token."""
    names = {"captures": ("cudaStreamBeginCapture",),
             "instantiations": ("cudaGraphInstantiate", "cudaGraphInstantiateWithFlags"),
             "launches": ("cudaGraphLaunch",)}
    return {k: sum(1 for e in prof.events() if e.name in v) for k, v in names.items()}


def profile_generate(model, ids, mask, eos, new_tokens, compile, graph=None):
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
    kwargs = dict(end_ids=eos, max_new_tokens=new_tokens, min_new_tokens=new_tokens, compile=compile,
                  graph=graph)
    generate(model, ids, mask, **kwargs)  # warm: compilation, capture and allocations are not per token
    with profile(activities=activities) as prof:
        generate(model, ids, mask, **kwargs)
        if ids.is_cuda:
            torch.cuda.synchronize()
    return top_level_ops(prof), kernels(prof)


def per_token(model, device, *, short=8, long=24, compile=False, prompts=8, group=8, width=20,
              graph=None):
    """(top-level aten ops, CUDA kernels) per decode token of generate() on `model` (graph: a
    replayed graph's kernels are counted as the ones it launches)."""
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (prompts, width), device=device).repeat_interleave(group, 0)
    mask = torch.ones_like(ids)
    eos = model.config.eos_token_id if model.config.eos_token_id is not None else 0
    a = profile_generate(model, ids, mask, eos, short, compile, graph)
    b = profile_generate(model, ids, mask, eos, long, compile, graph)
    return tuple((y - x) / (long - short) for x, y in zip(a, b))


def build_model(arch: str, n_layer: int, device):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from make_tiny_model import tiny_config
    from transformers import AutoModelForCausalLM
    from grpo.model import fuse_tanh_gelu
    torch.manual_seed(0)
    config = tiny_config(arch, vocab_size=320, eos=0, n_layer=n_layer, n_embd=96,
                         n_head=12 if arch == "gpt2" else None, dropout=0.0)
    model = AutoModelForCausalLM.from_config(config).to(device).eval()
    fuse_tanh_gelu(model)  # as load_policy does
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="gpt2", choices=["gpt2", "llama", "qwen2"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    model = build_model(args.arch, args.layers, torch.device(args.device))
    ops, launched = per_token(model, torch.device(args.device), compile=args.compile)
    print(f"{args.arch}, {args.layers} layers, {'compiled' if args.compile else 'eager'}, {args.device}: "
          f"{ops:.0f} top-level aten ops per decode token" + (f", {launched:.0f} CUDA kernels" if launched else ""))


if __name__ == "__main__":
    main()
