"""P: held-out metrics on real RookWorld positions: the 400 validation lines in ../shared/data.

    .venv/bin/python bench/real_positions.py models/rook-tiny out/run/model     # one row per model

The committed held-out set (tasks/rookworld/eval_set.jsonl) is drawn from the task's own generator; these
are positions from real games. Each position gets Stockfish's top 5 (depth 12, multi-PV 5: the committed
set's analysis), cached under --cache-dir; each model decodes the data's own prompts greedily, as
--eval-only does, and is scored by the same metrics (best move, top 5, legal, format), each with its 95%
Wilson interval. With two models or more, a second table pairs each later model with the first on the same
positions (the first is "before": the difference, its paired 95% interval and the verdict of
compare_runs.py). Without the data file it says so and exits 0.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from grpo.model import load_policy, load_tokenizer, model_autocast  # noqa: E402
from harness import intervals  # noqa: E402
from harness.task import check_metrics, eval_completions  # noqa: E402
from tasks.rookworld.engine import EnginePool, find_stockfish  # noqa: E402
from tasks.rookworld.evaluate import policy_metrics  # noqa: E402
from tasks.rookworld.data import read_rookworld  # noqa: E402
from tasks.rookworld.format import prompt_fen  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOK_VAL = os.path.join(REPO, "..", "shared", "data", "rook_val_400.txt")
CACHE_DIR = os.path.join(REPO, "out", "bench")
METRICS = {"p_best_move_acc": "best move", "p_top5_acc": "top 5", "p_legal_rate": "legal", "p_format_rate": "format"}


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
    """Greedy P: per-item hits of a model folder on the items (name -> list), decoded as the trainer's evaluation
    decodes."""
    tokenizer = load_tokenizer(model)
    policy = load_policy(model, "cpu")
    prepend_bos = tokenizer.bos_token_id == tokenizer.eos_token_id   # --prompt-bos auto
    texts = eval_completions(policy, tokenizer, [item["prompt"] for item in items], prepend_bos=prepend_bos,
                             max_new_tokens=144, batch=batch, device=torch.device("cpu"),
                             autocast=model_autocast(torch.device("cpu"), "fp32"))
    return {k: v for k, v in check_metrics(policy_metrics(items, texts)).items() if k in METRICS}


def rate_cell(hits: list) -> str:
    s = intervals.summarise(hits)
    return f"{s['value']:.1%} [{100 * s['lo']:.1f}, {100 * s['hi']:.1f}]"


def paired_cell(before: list, after: list) -> str:
    """after - before on the same positions in points, its paired 95% interval and the verdict in words."""
    c = intervals.paired(before, after)
    verdict = {"B higher": "higher", "A higher": "lower"}.get(c["verdict"], c["verdict"])
    return f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}] {verdict}"


def tables(hits: list) -> str:
    """The markdown tables of [(model, its per-item hits)]: each rate with its interval, then each later model
    against the first, paired."""
    head = "| model | " + " | ".join(METRICS.values()) + " |\n|---|" + "---|" * len(METRICS)
    lines = [head] + [f"| {m} | " + " | ".join(rate_cell(h[k]) for k in METRICS) + " |" for m, h in hits]
    (first, before), *later = hits
    if later:
        lines += ["", f"Against {first} on the same positions: the difference in points, its paired 95% interval, "
                      f"the verdict", "", head]
        lines += [f"| {m} | " + " | ".join(paired_cell(before[k], h[k]) for k in METRICS) + " |" for m, h in later]
    return "\n".join(lines)


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
    hits = []
    for i, model in enumerate(args.models, 1):
        print(f"model {i}/{len(args.models)}: {model} ...", file=sys.stderr, flush=True)
        hits.append((model, model_metrics(model, items, args.batch)))
    print(tables(hits))


if __name__ == "__main__":
    main()
