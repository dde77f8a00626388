"""P: held-out metrics on real RookWorld positions: the 400 validation lines in ../shared/data.

    .venv/bin/python bench/real_positions.py models/rook-tiny out/run/model     # one row per model

The committed held-out set (tasks/rookworld/eval_set.jsonl) is drawn from the task's own generator; these
are positions from real games. Each position gets Stockfish's top 5 (depth 12, multi-PV 5: the committed
set's analysis), cached under --cache-dir; each model decodes the data's own prompts greedily, as
--eval-only does, and is scored by the same metrics (best move, top 5, legal, format). Without the data
file it says so and exits 0.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from grpo.model import load_policy, load_tokenizer, model_autocast  # noqa: E402
from harness.task import check_metrics, eval_completions, summarise_metrics  # noqa: E402
from tasks.rookworld.engine import EnginePool, find_stockfish  # noqa: E402
from tasks.rookworld.evaluate import policy_metrics  # noqa: E402
from tasks.rookworld.data import read_rookworld  # noqa: E402
from tasks.rookworld.format import prompt_fen  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOK_VAL = os.path.join(REPO, "..", "shared", "data", "rook_val_400.txt")
CACHE_DIR = os.path.join(REPO, "out", "bench")


def analyses(fens: list[str], depth: int, cache_dir: str, stockfish: str, engines: int = 1) -> list[dict]:
    """Multi-PV 5 analysis at `depth` of each FEN, read from and added to `cache_dir`/analysis_d<depth>.jsonl.
    With one engine, positions go one at a time and `ms` is one analysis's wall time; with more, `ms` is None."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"analysis_d{depth}.jsonl")
    cached = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            cached = {row["fen"]: row for row in map(json.loads, f)}
    missing = [fen for fen in dict.fromkeys(fens) if fen not in cached]
    if missing:
        pool = EnginePool(stockfish, depth=depth, size=engines, timeout=3600)
        try:
            with open(path, "a", encoding="utf-8") as f:
                futures = [] if engines == 1 else [pool.analyse(fen) for fen in missing]
                for i, fen in enumerate(missing):
                    t0 = time.perf_counter()
                    analysis = (futures[i] if futures else pool.analyse(fen)).result()
                    row = {"fen": fen, "moves": list(analysis.moves), "evals": list(analysis.evals),
                           "ms": 1000 * (time.perf_counter() - t0) if engines == 1 else None}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    cached[fen] = row
                    print(f"\rdepth {depth}: {i + 1}/{len(missing)} analysed", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr)
        finally:
            pool.close()
    return [cached[fen] for fen in fens]


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """The flags both real-line scripts take: the data file, how much of it, where analyses are cached."""
    parser.add_argument("--data", default=ROOK_VAL)
    parser.add_argument("--limit", type=int, default=None, help="the first N positions only")
    parser.add_argument("--cache-dir", default=CACHE_DIR)


def real_prompts(args, script: str) -> tuple[list[str], str]:
    """The data's P: prompts (its own bytes, padding included) and the Stockfish binary. Without the data
    file the script says so and exits 0 (the folder is not everywhere); without Stockfish it fails."""
    if not os.path.exists(args.data):
        print(f"{script}: {args.data} not found: skipped")
        sys.exit(0)
    stockfish = find_stockfish()
    if stockfish is None:
        sys.exit(f"{script}: no Stockfish found (make stockfish)")
    return read_rookworld(args.data).policy[:args.limit], stockfish


def model_metrics(model: str, items: list[dict], batch: int) -> dict:
    """Greedy P: metrics of a model folder on the items, decoded as the trainer's evaluation decodes."""
    tokenizer = load_tokenizer(model)
    policy = load_policy(model, "cpu")
    prepend_bos = tokenizer.bos_token_id == tokenizer.eos_token_id   # --prompt-bos auto
    texts = eval_completions(policy, tokenizer, [item["prompt"] for item in items], prepend_bos=prepend_bos,
                             max_new_tokens=144, batch=batch, device=torch.device("cpu"),
                             autocast=model_autocast(torch.device("cpu"), "fp32"))
    return summarise_metrics(check_metrics(policy_metrics(items, texts)))[0]   # each rate, its interval beside


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model folders (or hub ids)")
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    add_data_args(parser)
    args = parser.parse_args()
    prompts, stockfish = real_prompts(args, "real_positions")
    rows = analyses([prompt_fen(p) for p in prompts], args.depth, args.cache_dir, stockfish)
    items = [{"kind": "P", "prompt": p, "fen": row["fen"], "moves": row["moves"], "evals": row["evals"]}
             for p, row in zip(prompts, rows)]
    print(f"{len(items)} real P: positions from {args.data}, Stockfish depth {args.depth} multi-PV 5")
    print("| model | best move | top 5 | legal | format |\n|---|---|---|---|---|")
    for model in args.models:
        m = model_metrics(model, items, args.batch)
        print(f"| {model} | {m['p_best_move_acc']:.1%} | {m['p_top5_acc']:.1%} | {m['p_legal_rate']:.1%} "
              f"| {m['p_format_rate']:.1%} |", flush=True)


if __name__ == "__main__":
    main()
