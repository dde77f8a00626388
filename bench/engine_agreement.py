"""How often the P: reward's Stockfish analysis agrees with a deep one, and what each depth costs.

    .venv/bin/python bench/engine_agreement.py                          # depths 8,10,12,14 vs 16, 400 real lines
    .venv/bin/python bench/engine_agreement.py --depths 10,12 --deep 18 --limit 100 --deep-engines 2

For each position of the real RookWorld validation lines (../shared/data/rook_val_400.txt): the deep
analysis's best move is compared with the shallow analysis the reward would use. "best agrees": both
rank the same move first (the move the reward pays 1.0 is the truly best one); "deep best in top 5": the
truly best move earns rank credit at all; "shallow best in deep top 5": the move paid 1.0 is at least a
good one. Times are one engine (one thread, 16 MB hash, cleared per position) analysing one position at a
time, as the reward's pool does. Analyses are cached under out/bench, so a rerun only adds what is missing.
Without the data file it says so and exits 0.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.real_positions import add_data_args, analyses, real_prompts  # noqa: E402
from tasks.rookworld.format import prompt_fen  # noqa: E402


def agreement(shallow: list[dict], deep: list[dict]) -> dict:
    """Shares of positions where the shallow analysis agrees with the deep one, as defined above."""
    n = len(deep)
    return {"best agrees": sum(s["moves"][0] == d["moves"][0] for s, d in zip(shallow, deep)) / n,
            "deep best in top 5": sum(d["moves"][0] in s["moves"] for s, d in zip(shallow, deep)) / n,
            "shallow best in deep top 5": sum(s["moves"][0] in d["moves"] for s, d in zip(shallow, deep)) / n}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="8,10,12,14", help="comma-separated depths to compare")
    parser.add_argument("--deep", type=int, default=16, help="the reference depth")
    parser.add_argument("--deep-engines", type=int, default=1,
                        help="engines analysing the reference in parallel (its times are not reported)")
    add_data_args(parser)
    args = parser.parse_args()
    prompts, stockfish = real_prompts(args, "engine_agreement")
    fens = [prompt_fen(p) for p in prompts]
    deep = analyses(fens, args.deep, args.cache_dir, stockfish, args.deep_engines)
    print(f"{len(fens)} real positions from {args.data}; reference: depth {args.deep} multi-PV 5")
    print("| depth | best agrees | deep best in top 5 | shallow best in deep top 5 | median ms | mean ms |")
    print("|---|---|---|---|---|---|")
    for depth in map(int, args.depths.split(",")):
        rows = analyses(fens, depth, args.cache_dir, stockfish)
        shares = agreement(rows, deep)
        ms = [r["ms"] for r in rows]
        print(f"| {depth} | " + " | ".join(f"{v:.1%}" for v in shares.values())
              + f" | {statistics.median(ms):.0f} | {statistics.mean(ms):.0f} |", flush=True)


if __name__ == "__main__":
    main()
