"""Regenerate the committed held-out chess set: tasks/rookworld/eval_set.jsonl.

    .venv/bin/python tasks/rookworld/make_eval_set.py            # 100 P: + 100 A: items, seed 20261122

P: items: generated positions with Stockfish's top 5 (multi-PV 5, fixed depth, cleared hash per
position, one thread: the same output on any machine with the same Stockfish). A: items: generated
transitions with their exact completion from python-chess. The seed is disjoint from training in
effect: the trainer's generated prompts skip every position in this file.
"""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tasks.rookworld.engine import EnginePool, find_stockfish  # noqa: E402
from tasks.rookworld.format import env_prompt, expected_env_completion, policy_prompt  # noqa: E402
from tasks.rookworld.positions import history, random_board, random_transition  # noqa: E402
from tasks.rookworld.evaluate import EVAL_SET  # noqa: E402
from tasks.rookworld.format import position_key  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.normpath(EVAL_SET))
    parser.add_argument("--n", type=int, default=100, help="items per kind")
    parser.add_argument("--seed", type=int, default=20261122)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--stockfish-path", default=None)
    args = parser.parse_args()
    path = find_stockfish(args.stockfish_path)
    if path is None:
        sys.exit("no Stockfish found: the P: items need its analysis")
    rng = random.Random(args.seed)
    seen, boards = set(), []
    while len(boards) < args.n:   # distinct positions: a repeated one would count twice
        board = random_board(rng)
        if position_key(board.fen()) not in seen:
            seen.add(position_key(board.fen()))
            boards.append(board)
    transitions = []
    while len(transitions) < args.n:
        board, move = random_transition(rng)
        if position_key(board.fen()) not in seen:
            seen.add(position_key(board.fen()))
            transitions.append((board, move))
    pool = EnginePool(path, depth=args.depth, size=max(1, (os.cpu_count() or 1) // 2))
    fens = [board.fen(en_passant="fen") for board in boards]
    analyses = [pool.analyse(fen) for fen in fens]
    with open(args.out, "w", encoding="utf-8") as f:
        for fen, future in zip(fens, analyses):
            analysis = future.result()
            f.write(json.dumps({"kind": "P", "fen": fen, "prompt": policy_prompt(fen),
                                "moves": list(analysis.moves), "evals": list(analysis.evals),
                                "depth": args.depth}) + "\n")
        for board, move in transitions:
            f.write(json.dumps({"kind": "A", "fen": board.fen(),
                                "prompt": env_prompt(board.fen(), move.uci(), history(board, move)),
                                "expected": expected_env_completion(board, move.uci())}) + "\n")
    pool.close()
    print(f"wrote {args.out}: {args.n} P: + {args.n} A: items (seed {args.seed}, depth {args.depth})")


if __name__ == "__main__":
    main()
