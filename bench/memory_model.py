"""A memory model of one GRPO step: its peak, part by part, from the model's shape, the batch and
the dtype. A prediction, not a measurement: compare it with a run's rss_peak_mb (CPU) or
cuda_peak_mb (GPU), as BENCHMARKS.md does.

    python bench/memory_model.py --model gpt2-124m --batch-size 8 --max-new-tokens 8 --device cpu
    python bench/memory_model.py --model qwen2.5-0.5b --dtype bf16 --device cuda      # 64 x 144
    python bench/memory_model.py --model qwen2.5-1.5b --dtype bf16 --device cuda --largest 22
    python bench/memory_model.py --model gpt2-124m --micro-batch-tokens 4096

--model: a bench/common.py shape (gpt2-124m, qwen2.5-0.5b, qwen2.5-1.5b; no weights are built) or
a model folder. P: parameters (a tied head once). A step (the second on: every state exists) holds

  weights 4P (fp32 master weights, also under --dtype bf16), reference 4P (--kl-coef > 0: a frozen
  fp32 copy), AdamW's moments 8P, gradients 4P (set to None only when the next update starts, so
  held through sampling and the reference pass),

and at its peak one of these phases on top:

  sampler    the decoder's K/V buffers 2 L rows kv (W + T) b (b: 4 on a CPU, the cache's dtype on
             a GPU), the prefill cache, a decode step's [rows, V] logits and sampling temporaries;
             under bf16 the matmul weights' bf16 copies, 2 x the weights a token passes through
  reference  no gradient, a micro-batch at a time: its K/V cache over every layer and a head chunk
             (2.2 [chunk, V] fp32 at once, 2.5 under bf16, measured on this CPU)
  update     per micro-batch: the tensors autograd saves in the layers (counted, not guessed: a 1-
             and a 2-layer copy of the model run the trainer's own completion_logprobs under
             saved_tensors_hooks, at the micro-batch's shape, on this CPU; the layers' part is
             their difference), the bf16 weight casts autocast keeps for backward, the head's
             backward (5 [chunk, V] fp32: 4.6 measured for one chunk of 2,048 rows, 4.9-5.0
             chunked and recomputed) and gradient; or, at backward's end, a new
             gradient of every weight (4P) and a tied head's two contributions beside their sum
             (8 V E, measured); with accumulation (micro < mini) the gradients held already.
             With --micro-batch-tokens N a micro-batch is N real tokens (a group's prompt
             once): the probe's saved tensors per token times N, the head at N's completion
             tokens (T G / (T G + W) of them) at most
  optimizer  AdamW's temporaries (a GPU's foreach: one fp32 copy of every weight, 4P; a CPU's per
             tensor: two of the largest), and with --guard copies 12P more: the weights and the
             optimizer's state that Guard.step copied before each update until d04604d

A CPU process also holds its runtime (python, torch, transformers, the task: --runtime-mb, measured
here as the RSS before the model loads). A GPU's CUDA context and allocator slack are not in the
model: a 24 GB card's budget is taken as 22 GiB of tensors.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

MiB = 2 ** 20
# the RSS of train_lean.py before its model loads (python, torch, transformers, the chess task),
# this machine, 2026-11-27: 1,355 MB at the 124M run's start less its two fp32 copies (950 MB)
RUNTIME_MB = 405


def config_of(model: str):
    """The model's config: a bench/common.py shape, built in memory, or a folder's config.json."""
    from bench.common import MODELS
    if model not in MODELS:
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(model)
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from make_tiny_model import tiny_config
    shape = dict(MODELS[model])
    vocab, tie = shape.pop("vocab_size", 320), shape.pop("tie", None)
    arch = shape.pop("arch", "gpt2")
    config = tiny_config(arch, vocab, 0, **{"dropout": 0.0, **shape})
    if tie is not None:
        config.tie_word_embeddings = tie
    return config


def sizes(config) -> dict:
    """Parameter counts (a meta-device model: no memory): all (tied once), those a token's matmuls
    read (autocast's bf16 copies), the head's, the largest tensor's; layers, width, K/V width."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())
    matmul = [m.weight for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]
    head = model.get_output_embeddings().weight
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    width = getattr(config, "hidden_size", None) or config.n_embd
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {"P": sum(p.numel() for p in params),
            "matmul": sum(w.numel() for w in {id(w): w for w in matmul}.values()),
            "head": head.numel(), "tied": head is model.get_input_embeddings().weight,
            "largest": max(p.numel() for p in params),
            "layers": config.num_hidden_layers, "width": width, "vocab": config.vocab_size,
            "kv": kv_heads * (width // heads)}


_SAVED = {}


def saved_bytes(config, layers: int, rows: int, group: int, prompt: int, new: int, dtype: str,
                checkpointing: bool) -> int:
    """Bytes autograd saves for backward in one forward of `rows` completions (prompt + new tokens,
    `group` rows a prompt) through a `layers`-layer copy of config; weights, their casts and the
    head's [rows, vocabulary] logits left out."""
    key = (id(config), layers, rows, group, prompt, new, dtype, checkpointing)
    if key not in _SAVED:
        _SAVED[key] = _saved_bytes(config, layers, rows, group, prompt, new, dtype, checkpointing)
    return _SAVED[key]


def _saved_bytes(config, layers, rows, group, prompt, new, dtype, checkpointing) -> int:
    import copy

    import torch
    from transformers import AutoModelForCausalLM
    from grpo.model import checkpoint_layers, completion_logprobs
    from harness.guards import saved_bytes as count   # what --micro-batch-tokens auto counts
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if hasattr(config, "n_layer"):
        config.n_layer = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if checkpointing:
        checkpoint_layers(model)
    prompts = max(1, rows // group)
    ids = torch.randint(3, 300, (prompts, prompt + new)).repeat_interleave(rows // prompts, 0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    return count(model, lambda: completion_logprobs(   # as the default step
        model, ids, torch.ones_like(ids), new, 1.0, 2 ** 40, autocast, with_entropy=True,
        entropy_grad=False))


def predict(s: dict, a) -> dict:
    """The parts (bytes) and the phases' peaks of one step; s: sizes(), a: the arguments."""
    P, L, V, kv = s["P"], s["layers"], s["vocab"], s["kv"]
    W, T, B, G = a.prompt_tokens, a.max_new_tokens, a.batch_size, a.group_size
    micro, bf16, gpu = min(a.micro_batch_size or B, B), a.dtype == "bf16", a.device == "cuda"
    ref_bytes = {"fp32": 4, "bf16": 2, "none": 0}[a.reference]
    kv_b = 2 if gpu and bf16 else 4
    casts = 2 * s["matmul"] if bf16 else 0
    part = {"runtime": 0 if gpu else a.runtime_mb * MiB, "weights": 4 * P,
            "reference": ref_bytes * P if a.kl_coef > 0 else 0,
            "optimizer state": 8 * P, "gradients": 4 * P}
    # the sampler: decoder K/V (prompt columns padded to 16) and prefill cache, a step's logits
    gen = a.generation_batch or B
    pad = -(-W // 16) * 16
    sampler = {"K/V buffers": 2 * L * kv * kv_b * (gen * T + (gen // G) * pad),
               "prefill cache": 2 * L * kv * kv_b * (gen // G) * W,
               "decode logits": gen * V * 24, "bf16 weight copies": casts}
    # the reference pass: one micro-batch's K/V over every layer, one head chunk
    # --micro-batch-tokens: a micro-batch of that many real tokens (a group's prompt once), at most
    # the mini-batch's; the probe's saved tensors scaled per token
    mini = a.mini_batch_size or B
    tokens = min(a.micro_batch_tokens, mini * T + mini // G * W) if a.micro_batch_tokens else None
    # the head runs at completion tokens: a budget's share of them (a group's prompt once)
    scored = tokens * T * G // (T * G + W) if tokens else micro * T
    rows_ref = min(a.logprob_chunk_size, scored)
    reference = {"K/V cache": 2 * L * kv * kv_b * (tokens or micro * (W + T)),
                 "head chunk": rows_ref * V * 4 * (2.5 if bf16 else 2.2),
                 "head cast": 2 * s["head"] if bf16 else 0} if part["reference"] else {}
    # the update: saved tensors of the layers (counted on 1- and 2-layer copies), head, casts
    probe_rows = min(micro, G)
    one = saved_bytes(a.config, 1, probe_rows, G, W, T, a.dtype, a.gradient_checkpointing)
    two = saved_bytes(a.config, 2, probe_rows, G, W, T, a.dtype, a.gradient_checkpointing)
    scale = micro / probe_rows
    if tokens:
        scale = tokens / (probe_rows * T + max(1, probe_rows // G) * W)
    layer = (two - one) * scale
    rows = scored
    update = {"layers' saved tensors": layer * L,
              "other saved tensors": (one - (two - one)) * scale,
              "bf16 weight casts": casts,
              "head backward": min(rows, a.logprob_chunk_size) * V * 4 * 5,
              "head gradient": 4 * s["head"]}
    if a.gradient_checkpointing:   # a layer recomputed in backward: whole rows (no shared prompt)
        full = [saved_bytes(a.config, n, probe_rows, G, W, T, a.dtype, False) for n in (1, 2)]
        tokens = (W + T) * probe_rows / (T * probe_rows + W * max(1, probe_rows // G))
        update["recomputed layer"] = (full[1] - full[0]) * scale * tokens
    optim = {"AdamW temporaries": 4 * P if gpu else 2 * 4 * s["largest"],
             "guard copies": 12 * P if a.guard == "copies" else 0}
    base = sum(part.values())
    without_grads = base - part["gradients"]
    acc = tokens < mini * T + mini // G * W if tokens else micro < mini
    held = sum(update.values()) - update["head gradient"]
    # backward's start (every saved tensor, the head's gradient) or its end: a new gradient of
    # every weight (4P), and a tied head's two contributions beside their sum (measured on this
    # CPU: 2- and 6-layer Qwen2.5-0.5B shapes, within 5%); with accumulation (micro < mini) the
    # gradients of the micro-batches before are held beside them
    update["or, at backward's end"] = end = 4 * P + (8 * s["head"] if s["tied"] else 0)
    train = (base if acc else without_grads) + max(held + update["head gradient"], end)
    peaks = {"sampler": base + sum(sampler.values()),
             "reference": base + sum(reference.values()), "update": train,
             "optimizer": base + sum(optim.values())}
    return {"resident": part, "sampler": sampler, "reference": reference, "update": update,
            "optimizer": optim, "peaks": peaks, "peak": max(peaks.values())}


def micro_text(a) -> str:
    if a.micro_batch_tokens:
        return f"{a.micro_batch_tokens:,} tokens"
    return str(min(a.micro_batch_size or a.batch_size, a.batch_size))


def report(s, a, out) -> str:
    lines = [f"{a.model}: {s['P'] / 1e6:,.1f}M parameters, {s['layers']} layers, vocabulary "
             f"{s['vocab']:,}; batch {a.batch_size} ({a.group_size} a prompt), micro-batch "
             f"{micro_text(a)}, {a.prompt_tokens} prompt + "
             f"{a.max_new_tokens} new tokens, {a.dtype} on {a.device}, guard {a.guard}",
             "prediction (MiB):"]
    for name in ("resident", "sampler", "reference", "update", "optimizer"):
        parts = out[name]
        if parts:
            lines.append(f"  {name}: " + ", ".join(f"{k} {v / MiB:,.0f}" for k, v in parts.items()))
    lines.append("  phase peaks: " + ", ".join(f"{k} {v / MiB:,.0f}" for k, v in
                                               out["peaks"].items()))
    top = max(out["peaks"], key=out["peaks"].get)
    lines.append(f"  predicted peak: {out['peak'] / MiB:,.0f} MiB ({top})")
    return "\n".join(lines)


def largest(s, a, budget_gib: float) -> int | None:
    """The largest batch (a multiple of the group size, micro-batch = batch unless set) whose
    predicted peak is within budget_gib."""
    best, batch = None, a.group_size
    while batch <= 4096:
        b = argparse.Namespace(**{**vars(a), "batch_size": batch, "generation_batch": None})
        if predict(s, b)["peak"] > budget_gib * 2 ** 30:
            break
        best, batch = batch, batch + a.group_size
    return best


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=None)
    ap.add_argument("--mini-batch-size", type=int, default=None)
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="micro-batches of this many real tokens (the trainer's flag)")
    ap.add_argument("--generation-batch", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=144)
    ap.add_argument("--prompt-tokens", type=int, default=120,
                    help="the longest prompt of a batch (chess-env with the bench's tokenizer: "
                         "111-122)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--kl-coef", type=float, default=0.02)
    ap.add_argument("--reference", choices=["fp32", "bf16", "none"], default="fp32",
                    help="the reference's weights (bf16: what a bf16 reference would save)")
    ap.add_argument("--logprob-chunk-size", type=int, default=2048)
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="checkpointed layers (caution: its probe ran out of this machine's memory "
                         "at the 1.5B shape, 14-21 GB, not understood yet; 0.5B ran)")
    ap.add_argument("--guard", choices=["none", "copies"], default="none",
                    help="none: Guard.step as it is; copies: as it was until d04604d (the rows "
                         "BENCHMARKS.md measured on that trainer)")
    ap.add_argument("--runtime-mb", type=float, default=RUNTIME_MB)
    ap.add_argument("--largest", type=float, metavar="GIB",
                    help="also the largest batch whose predicted peak fits in GIB")
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    a.config = config_of(a.model)
    s = sizes(a.config)
    out = predict(s, a)
    print(report(s, a, out))
    if a.largest:
        print(f"  largest batch within {a.largest:g} GiB: {largest(s, a, a.largest)}")
    return out


if __name__ == "__main__":
    main()
