"""Regenerate the committed held-out chess set: tasks/rookworld/eval_set.jsonl.

    .venv/bin/python tasks/rookworld/make_eval_set.py            # 1000 P: + 1000 A: items

P: items: generated positions with Stockfish's top 5 (multi-PV 5, fixed depth, cleared hash per
position, one thread: the same output on any machine with the same Stockfish). A: items: generated
transitions with their exact completion from python-chess.

The set is drawn in two parts from seeds of its own. The first is the original set (seed 20261122, 100 P: + 100 A:),
drawn exactly as it always was, so that --eval-samples 100 scores the items earlier numbers were measured on. The
rest (seed 20261125) skips every position the main job's generators draw in their first --reference-steps steps of
seeds 0 and 1 with no held-out filter (training_positions): the common ones, such as the start position and short
openings, stay training positions. Disjointness itself is the trainer's: the chess tasks' generated prompts and
demonstrations skip every position in this file (docs/chess.md).
"""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from grpo.rollout import stream_seed  # noqa: E402
from tasks.rookworld.engine import EnginePool, find_stockfish  # noqa: E402
from tasks.rookworld.evaluate import EVAL_FULL, EVAL_SET  # noqa: E402
from tasks.rookworld.format import (env_prompt, expected_env_completion, parse_env_prompt, policy_prompt,  # noqa: E402
                                    position_key, prompt_fen)
from tasks.rookworld.positions import history, random_board, random_transition  # noqa: E402

ORIGINAL = (20261122, 100)            # (seed, items per kind) of the original set, kept as its first items
SEED = 20261125                       # the rest
REFERENCE_SEEDS, REFERENCE_STEPS = (0, 1), 700   # the main job's seeds and steps (docs/chess.md)
PROMPTS_PER_STEP, DEMOS_PER_STEP = 8, 16         # python train_lean.py: batch 64 / group 8; --ptx-batch-size 16


class _NoEngine:
    """The P: generator queues an analysis per prompt; enumerating positions needs none."""

    def analyse(self, fen):
        return None

    def close(self):
        pass


def prompt_key(prompt: str) -> str:
    """The position a generated P: or A: prompt asks about (position_key)."""
    return position_key(prompt_fen(prompt) if prompt.startswith("P: ") else parse_env_prompt(prompt).fen)


def training_positions(seeds=REFERENCE_SEEDS, steps: int = REFERENCE_STEPS, first_step: int = 1) -> set[str]:
    """The position keys the main job (--task chess at its defaults, 8 prompts and 16 --ptx-coef demonstrations a step)
    draws at steps first_step..steps of each seed, with the held-out filter off: the prompts' rng and the
    demonstrations' rng seeded as train_lean.py and grpo/ptx.py seed them."""
    from tasks.rookworld.task import ChessMixTask
    task = ChessMixTask(stockfish_path="/nonexistent")
    for part in {id(t): t for t in (task.policy, task.env, task.policy_texts, task.env_texts) if t}.values():
        part.held_out = frozenset()
    task.policy.pool = _NoEngine()
    keys = set()
    for seed in seeds:
        for step in range(first_step, steps + 1):
            keys.update(map(prompt_key, task.prompts(PROMPTS_PER_STEP, random.Random(stream_seed(seed, step)))))
            demos = task.demonstrations(DEMOS_PER_STEP, random.Random(f"ptx {stream_seed(seed, step)}"))
            keys.update(prompt_key(context) for context, _ in demos)
    return keys


def draw(seed: int, n: int, seen: set, avoid=frozenset()):
    """n distinct positions (P:) and n transitions (A:) from random.Random(seed), none in seen (updated) or avoid."""
    rng = random.Random(seed)
    boards, transitions = [], []
    while len(boards) < n:   # distinct positions: a repeated one would count twice
        board = random_board(rng)
        key = position_key(board.fen())
        if key not in seen and key not in avoid:
            seen.add(key)
            boards.append(board)
    while len(transitions) < n:
        board, move = random_transition(rng)
        key = position_key(board.fen())
        if key not in seen and key not in avoid:
            seen.add(key)
            transitions.append((board, move))
    return boards, transitions


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.normpath(EVAL_SET))
    parser.add_argument("--n", type=int, default=EVAL_FULL, help=f"items per kind (at least {ORIGINAL[1]})")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the items after the original ones")
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--reference-steps", type=int, default=REFERENCE_STEPS,
                        help="steps of the main job's stream whose positions the new items avoid")
    parser.add_argument("--stockfish-path", default=None)
    args = parser.parse_args()
    if args.n < ORIGINAL[1]:
        parser.error(f"--n {args.n}: the set starts with the original {ORIGINAL[1]} items per kind")
    path = find_stockfish(args.stockfish_path)
    if path is None:
        sys.exit("no Stockfish found: the P: items need its analysis")
    seen = set()
    boards, transitions = draw(ORIGINAL[0], ORIGINAL[1], seen)
    if args.n > ORIGINAL[1]:
        avoid = training_positions(steps=args.reference_steps)
        print(f"the main job's stream (seeds {REFERENCE_SEEDS}, steps 1-{args.reference_steps}): {len(avoid)} "
              f"distinct positions avoided", flush=True)
        more_boards, more_transitions = draw(args.seed, args.n - ORIGINAL[1], seen, avoid)
        boards, transitions = boards + more_boards, transitions + more_transitions
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
    print(f"wrote {args.out}: {args.n} P: + {args.n} A: items (seeds {ORIGINAL[0]}, {args.seed}; depth {args.depth})")


if __name__ == "__main__":
    main()
