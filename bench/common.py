"""What every system in the benchmark shares: the task, the per-step prompt stream, the models."""
import argparse
import math
import os
import random
import sys


def get_bench_task(name: str):
    """chess-a: the chess task's A: (environment) prompts and reward when it is installed, else the
    bench's own python-chess stand-in; anything else: a task name as train_lean.py --task takes it."""
    if name == "chess-a":
        try:
            from tasks import get_task
            return get_task("chess-env")
        except Exception as e:  # noqa: BLE001 - the chess task is not in this checkout: use the stand-in
            print(f"bench: chess-env task unavailable ({e}); using bench/chess_a.py", file=sys.stderr)
            from bench.chess_a import ChessA
            return ChessA()
    from tasks import get_task
    return get_task(name)


def task_flag(name: str) -> str:
    """The --task value that makes train_lean.py use the same task as get_bench_task(name)."""
    if name != "chess-a":
        return name
    task = get_bench_task(name)
    if type(task).__module__.startswith("tasks."):
        return "chess-env"
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "chess_a.py") + ":ChessA"


def step_prompts(task, n: int, seed: int, step: int) -> list:
    """The prompts train_lean.py draws at `step` (its rng is seeded by (seed, step))."""
    from grpo.rollout import stream_seed   # the trainer's own stream (the TRL venv imports this file too)
    return task.prompts(n, random.Random(stream_seed(seed, step)))


MODELS = {
    # name: build_tiny_model(...) arguments; the tiny one is the core tests' model
    "tiny": {},
    # a Llama of the tiny GPT-2's size (151,872 vs 153,344 parameters): 2 x 64, 4 query heads on 2 K/V heads
    # (grouped-query attention), gated MLP 224 wide, untied head; the same tokenizer
    "tiny-llama": {"arch": "llama", "intermediate": 224, "dropout": 0.0},
    # GPT-2 124M's shape (12 x 768, 12 heads, vocab 50257, context 1024), random weights. The bench's
    # byte-level tokenizer knows 320 of the ids; the others decode to nothing, which changes no cost
    # that matters here (the reward only sees text).
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257},
    # Qwen2.5-0.5B's and 1.5B's configurations (query heads on 2 K/V heads, gated MLP, q/k/v biases,
    # the head tied to the 151,936-token embeddings), random weights: 494M and 1.54B parameters
    "qwen2.5-0.5b": {"arch": "qwen2", "n_layer": 24, "n_embd": 896, "n_head": 14, "n_kv_head": 2,
                     "intermediate": 4864, "n_positions": 1024, "vocab_size": 151936, "tie": True},
    "qwen2.5-1.5b": {"arch": "qwen2", "n_layer": 28, "n_embd": 1536, "n_head": 12, "n_kv_head": 2,
                     "intermediate": 8960, "n_positions": 1024, "vocab_size": 151936, "tie": True},
}


def model_dir(name: str, root: str) -> str:
    """A folder holding the named benchmark model (built once, random weights, seed 0), or `name` itself."""
    if name not in MODELS:
        return name
    path = os.path.join(root, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        build(path, **MODELS[name])
    return path


def build(path: str, vocab_size: int = 320, tie: bool = None, **shape):
    """build_tiny_model's folder; a vocabulary above the tokenizer's 320 or tie (the head
    tied to the embeddings, as Qwen2.5's small models have it) rebuilds its weights."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from make_tiny_model import build_tiny_model
    build_tiny_model(path, seed=0, **shape)
    if vocab_size > 320 or tie is not None:  # the tokenizer stays small, the vocabulary full
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(path)
        torch.manual_seed(0)
        config.vocab_size = vocab_size
        if tie is not None:
            config.tie_word_embeddings = tie
        AutoModelForCausalLM.from_config(config).save_pretrained(path)


def weights_per_token(path: str) -> int:
    """The weights a token passes through: every matmul's weight, the output head's included (the input
    embeddings are a lookup, not counted). GPT-2: 12 L E^2 + V E."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D)))


def row_lengths(step: int, rows: int, cap: int) -> list:
    """The varied workload's completion lengths of a step's rows, the same for every system: a fixed
    long-tailed distribution, 16 x e^X tokens with X exponential of mean 0.8 (median 28), at most cap:
    most rows short, a few to the cap, as a reasoning task's are."""
    rng = random.Random(f"lengths {step}")
    return [min(cap, int(16 * math.exp(rng.expovariate(1 / 0.8)))) for _ in range(rows)]


def length_processor(step: int, cap: int, eos: int):
    """A Hugging Face logits processor that ends each row of a generate() call at its row_lengths(step)
    length: EOS impossible before it, the only token at it (TRL and the floor)."""
    import torch
    from transformers import LogitsProcessor

    class Lengths(LogitsProcessor):
        def __init__(self):
            self.start = None

        def __call__(self, input_ids, scores):
            self.start = input_ids.shape[1] if self.start is None else self.start
            drawn = input_ids.shape[1] - self.start
            lengths = torch.tensor(row_lengths(step, scores.shape[0], cap), device=scores.device)
            scores[lengths > drawn + 1, eos] = float("-inf")
            scores[lengths == drawn + 1] = torch.where(
                torch.arange(scores.shape[1], device=scores.device) == eos, 0.0, float("-inf"))
            return scores
    return Lengths()


def workload_parser() -> argparse.ArgumentParser:
    """The flags every system's runner takes: the same workload for ours, TRL and the floor."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", choices=["fixed", "varied"], default="fixed",
                    help="fixed: every completion --new-tokens long; varied: row_lengths, at most --new-tokens")
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", default="chess-a")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=144)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    return ap
