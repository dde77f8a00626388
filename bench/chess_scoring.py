"""Chess scoring throughput: completions scored per second, cold and warm engine cache.

    .venv/bin/python bench/chess_scoring.py                  # 32 positions x 8 completions, depth 10
    .venv/bin/python bench/chess_scoring.py --engines 2 --depth 8

cold: a fresh engine pool; the batch's positions are submitted to the pool at once (as prompts()
      does) and the clock runs from there to the last score, so no analysis overlaps generation
      here as it does in training (the worst case). warm: the same batch again, all from the cache. A: scoring needs no engine. Completions are a realistic
      mix: engine-like answers with a random best move, truncated answers, and junk.
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from harness.task import score  # noqa: E402
from tasks.rookworld.engine import EnginePool, find_stockfish  # noqa: E402
from tasks.rookworld.format import policy_completion, prompt_fen  # noqa: E402
from tasks.rookworld.task import ChessEnvTask, ChessPolicyTask  # noqa: E402


def policy_answers(prompts, group, rng):
    """`group` plausible answers per prompt, built from a separate analysis (not the task's cache)."""
    helper = EnginePool(find_stockfish(), depth=4)
    rows = []
    for prompt in prompts:
        analysis = helper.analyse(prompt_fen(prompt)).result()
        for _ in range(group):
            moves = list(analysis.moves)
            rng.shuffle(moves)
            text = policy_completion(moves, [rng.uniform(-3, 3) for _ in moves], rng.choice(moves))
            rows.append((prompt, [text, text[:rng.randrange(len(text))], "B: a1a1 junk"][rng.randrange(3)]))
    helper.close()
    return rows


def timed(task, rows, prefetch=None):
    t0 = time.perf_counter()
    for prompt in prefetch or []:
        task.pool.analyse(prompt_fen(prompt))
    rewards, _, errors = score(task, [p for p, _ in rows], [c for _, c in rows])
    assert not errors, errors
    return len(rows) / (time.perf_counter() - t0)


def main():
    parser = argparse.ArgumentParser(description="chess scoring throughput")
    parser.add_argument("--positions", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--engines", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(0)

    env = ChessEnvTask()
    prompts = env.prompts(args.positions, random.Random(1))
    rows = [(p, c) for p in prompts for c in
            [env.expected(p)] * (args.group // 2) + ["8/8/8 w - - 0 1+0.001+0+0"] * (args.group - args.group // 2)]
    print(f"A: {len(rows)} completions: {timed(env, rows):,.0f} completions/s (python-chess only)")

    if find_stockfish() is None:
        print("P: skipped, no Stockfish found")
        return
    policy = ChessPolicyTask(stockfish_depth=args.depth, engines=args.engines)
    prompts = policy.prompts(args.positions, random.Random(2))
    policy.close()
    rows = policy_answers(prompts, args.group, rng)
    policy = ChessPolicyTask(stockfish_depth=args.depth, engines=args.engines)   # empty cache
    cold = timed(policy, rows, prefetch=prompts)
    warm = timed(policy, rows)
    policy.close()
    print(f"P: {args.positions} positions x {args.group} completions, depth {args.depth}, multi-PV 5, "
          f"{args.engines} engine(s): cold {cold:,.1f} completions/s "
          f"({cold / args.group:.1f} positions/s), warm {warm:,.0f} completions/s")


if __name__ == "__main__":
    main()
