"""The chess tasks: chess-env (A:), chess-policy (P:) and chess (a mixture of both).

Rewards lie in [0, 1]; the exact expected answer (A:) or the engine's best move with the engine's
own analysis (P:) gets 1.0. Weights, and why:

A: (computed with python-chess alone)
    format      0.1   four '+'-separated fields: a FEN, one of the four reward values, two 0/1 flags
    new FEN     0.5   1 if exact; else, if it is a valid position, 0.8 x character similarity
                      (difflib ratio): a near miss earns something, never as much as the exact
                      FEN; a FEN that is no valid position earns nothing here (with the similarity
                      credit, an unreadable FEN lost only 0.02 against a valid one, and RL traded
                      valid FENs for similar-looking broken ones: BENCHMARKS.md, default model)
    reward      0.2   the reward field, as a string (so "1" for "1.0" does not count)
    terminated  0.1
    truncated   0.1
    The next FEN carries most of the weight because it is the hard part; any single wrong
    character lowers at least one component, so only the exact completion scores 1.0.

P: (scored against Stockfish: fixed depth, multi-PV 5)
    best move   0.5   rank among the engine's top 5: 1.0, 0.8, 0.65, 0.55, 0.45; another legal
                      move 0.25; an illegal or missing move 0
    format      0.1   M:/E:/B: in order, 1-5 distinct UCI candidates, one number per candidate,
                      one UCI best move, and the data's exact column layout (each a fifth)
    candidates  0.2   share of the engine's top moves among the (first 5) M: candidates
    evaluations 0.2   mean over candidates in the engine's top of 1 / (1 + |error in pawns|),
                      each E: value paired with its own M: move
    An answer whose B: move is illegal or missing gets its format credit only (at most 0.1),
    which is less than the least any legal move gets (0.5 x 0.25 = 0.125): illegal moves never
    outscore legal ones, however good the rest of the answer looks.
"""
import difflib
import functools
import json
import os
import random
from collections import OrderedDict

from grpo.task import TaskError
from tasks.rookworld.data import read_rookworld
from tasks.rookworld.engine import INSTALL_HINT, EnginePool, find_stockfish
from tasks.rookworld.format import (
    REWARD_DRAW, REWARD_ILLEGAL, REWARD_MATE, REWARD_MOVE, env_prompt, expected_env_completion,
    legal_move, parse_board, parse_env_prompt, parse_policy_completion, policy_format_checks, policy_prompt,
    prompt_fen)
from tasks.rookworld.positions import history, random_board, random_transition

ENV_WEIGHTS = {"format": 0.1, "fen": 0.5, "reward": 0.2, "terminated": 0.1, "truncated": 0.1}
FEN_SIMILARITY_SHARE = 0.8
POLICY_WEIGHTS = {"best": 0.5, "format": 0.1, "candidates": 0.2, "evals": 0.2}
RANK_CREDIT = (1.0, 0.8, 0.65, 0.55, 0.45)
LEGAL_CREDIT = 0.25
assert POLICY_WEIGHTS["format"] < POLICY_WEIGHTS["best"] * LEGAL_CREDIT, "illegal must score below legal"

MAX_COMPLETION_CHARS = 2000   # longer completions are judged on their start (keeps scoring O(1))
DEFAULT_TASK_MIX = 0.75       # share of P: prompts in --task chess (README: why)
EVAL_SET = os.path.join(os.path.dirname(__file__), "eval_set.jsonl")


def position_key(fen: str) -> str:
    """A position's identity without its move clocks (and en-passant notation style)."""
    board = parse_board(fen)
    return " ".join(board.fen().split()[:4]) if board else fen


def held_out_positions(path: str = EVAL_SET) -> set[str]:
    """Positions of the committed evaluation set; generated training prompts avoid them."""
    if not os.path.exists(path):
        return set()
    with open(path, encoding="utf-8") as f:
        return {position_key(json.loads(line)["fen"]) for line in f if line.strip()}


@functools.lru_cache(maxsize=None)
def _read_data(path: str):
    """Read a --data file once per process, logging its counts (the mixture's two tasks share it)."""
    if not os.path.isfile(path):
        raise TaskError(f"--data {path}: file not found")
    data = read_rookworld(path)
    kept = len(data.policy) + len(data.env)
    if data.skipped > kept:  # most lines unusable: the wrong file, not a few bad lines
        raise TaskError(f"--data {path}: {data.skipped} of {data.skipped + kept} lines are not RookWorld "
                        f"P:/A: samples: pass a RookWorld-format text file (see README, Chess)")
    print(data.summary(path), flush=True)
    return data


def _load_prompts(path: str | None, kind: str, required: bool = True) -> list[str] | None:
    """The file's prompts of one kind, or None to generate them (no file, or none and not required)."""
    if path is None:
        return None
    data = _read_data(path)
    prompts = data.policy if kind == "P" else data.env
    if prompts:
        return prompts
    if required:
        raise TaskError(f"--data {path}: no usable {kind}: lines")
    print(f"chess data {path}: no {kind}: lines, so {kind}: prompts are generated", flush=True)
    return None


class ChessEnvTask:
    """A: predict the result of a move. Exact answers come from python-chess."""
    name = "chess-env"
    min_reward = 0.0

    def __init__(self, data: str | None = None, data_required: bool = True, expected_cache: int = 200_000):
        self.data = _load_prompts(data, "A", data_required)
        self.held_out = held_out_positions()
        # Expected completions of generated prompts, computed from the full game (fivefold
        # repetition needs more history than a prompt shows). Other prompts are judged from the
        # prompt alone.
        self._expected: OrderedDict[str, str] = OrderedDict()
        self._expected_cache = expected_cache

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        if self.data is not None:
            return [rng.choice(self.data) for _ in range(n)]
        out = []
        while len(out) < n:
            board, move = random_transition(rng)
            if position_key(board.fen()) not in self.held_out:
                out.append(self.prompt_for(board, move))
        return out

    def prompt_for(self, board, move) -> str:
        """The A: prompt for playing `move` in `board`; its answer is remembered with the game."""
        prompt = env_prompt(board.fen(), move.uci(), history(board, move))
        self._expected[prompt] = expected_env_completion(board, move.uci())
        self._expected.move_to_end(prompt)
        if len(self._expected) > self._expected_cache:
            self._expected.popitem(last=False)
        return prompt

    def expected(self, prompt: str) -> str | None:
        """The exact completion for an A: prompt, or None when the prompt holds no valid position."""
        if prompt in self._expected:
            return self._expected[prompt]
        fields = parse_env_prompt(prompt)
        board = parse_board(fields.fen) if fields else None
        return expected_env_completion(board, fields.move) if board else None

    def reward_breakdown(self, prompt: str, completion: str) -> dict[str, float]:
        expected = self.expected(prompt)
        parts = env_components(expected, completion) if expected else dict.fromkeys(ENV_WEIGHTS, 0.0)
        out = {f"env_{k}": v for k, v in parts.items()}
        out["env_exact"] = float(expected is not None and completion.rstrip() == expected)
        out["reward"] = sum(ENV_WEIGHTS[k] * parts[k] for k in ENV_WEIGHTS)
        return out

    def reward(self, prompt: str, completion: str) -> float:
        return self.reward_breakdown(prompt, completion)["reward"]

    def close(self) -> None:
        pass


def env_components(expected: str, completion: str) -> dict[str, float]:
    """Credits in [0, 1] for an A: completion against the exact one (trailing whitespace ignored)."""
    fields = completion[:MAX_COMPLETION_CHARS].rstrip().split("+")
    want = expected.split("+")
    got = fields + [""] * (4 - len(fields))
    fen, reward, terminated, truncated = got[:4]
    well_formed = [len(fields) == 4, parse_board(fen) is not None,
                   reward in (REWARD_MOVE, REWARD_MATE, REWARD_DRAW, REWARD_ILLEGAL),
                   terminated in ("0", "1"), truncated in ("0", "1")]
    if fen == want[0]:
        fen_credit = 1.0
    elif not well_formed[1]:
        fen_credit = 0.0
    else:
        fen_credit = FEN_SIMILARITY_SHARE * difflib.SequenceMatcher(None, fen[:200], want[0], autojunk=False).ratio()
    return {"format": sum(well_formed) / len(well_formed), "fen": fen_credit,
            "reward": float(reward == want[1]), "terminated": float(terminated == want[2]),
            "truncated": float(truncated == want[3])}


class ChessPolicyTask:
    """P: play a good move, with candidates and evaluations, scored against Stockfish."""
    name = "chess-policy"
    min_reward = 0.0

    def __init__(self, data: str | None = None, stockfish_path: str | None = None,
                 stockfish_depth: int = 10, engines: int | None = None, data_required: bool = True):
        path = find_stockfish(stockfish_path)
        if path is None:
            where = f"no executable Stockfish at {stockfish_path}" if stockfish_path else "no Stockfish found"
            raise TaskError(f"{where}: {INSTALL_HINT}")
        self.data = _load_prompts(data, "P", data_required)
        self.held_out = held_out_positions()
        # One engine per 4 cores, at most 4: enough to keep up with generation without starving it.
        size = engines or min(4, max(1, (os.cpu_count() or 1) // 4))
        self.pool = EnginePool(path, depth=stockfish_depth, size=size)

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        if self.data is not None:
            out = [rng.choice(self.data) for _ in range(n)]
        else:
            out = []
            while len(out) < n:
                board = random_board(rng)
                if position_key(board.fen()) not in self.held_out:
                    # The data writes the en-passant square after every double push.
                    out.append(policy_prompt(board.fen(en_passant="fen")))
        for prompt in out:   # the engine works while the model generates
            self.pool.analyse(prompt_fen(prompt))
        return out

    def reward_breakdown(self, prompt: str, completion: str) -> dict[str, float]:
        fen = prompt_fen(prompt)
        board = parse_board(fen)
        if board is None or not any(board.legal_moves):
            parts = dict.fromkeys(POLICY_WEIGHTS, 0.0)
            legal = False
        else:
            future = self.pool.analyse(fen)
            try:
                analysis = future.result()
            except Exception:
                self.pool.forget(fen)   # a later call re-analyses instead of re-raising forever
                raise
            parts, legal = policy_components(board, analysis, completion)
        out = {f"policy_{k}": v for k, v in parts.items()}
        out["policy_legal"] = float(legal)
        if legal:
            out["reward"] = sum(POLICY_WEIGHTS[k] * parts[k] for k in POLICY_WEIGHTS)
        else:
            out["reward"] = POLICY_WEIGHTS["format"] * parts["format"]
        return out

    def reward(self, prompt: str, completion: str) -> float:
        return self.reward_breakdown(prompt, completion)["reward"]

    def close(self) -> None:
        self.pool.close()


def policy_components(board, analysis, completion: str) -> tuple[dict[str, float], bool]:
    """Credits in [0, 1] for a P: completion, and whether its B: move is legal."""
    answer = parse_policy_completion(completion[:MAX_COMPLETION_CHARS])
    moves = answer.moves or []
    evals = answer.evals or []
    checks = policy_format_checks(answer)
    top = list(analysis.moves)
    best = legal_move(board, answer.best)
    if best is None:
        best_credit = 0.0
    elif best.uci() in top:
        best_credit = RANK_CREDIT[top.index(best.uci())]
    else:
        best_credit = LEGAL_CREDIT
    candidates = list(dict.fromkeys(moves))[:5]
    hits = [m for m in candidates if m in top]
    closeness = []
    for i, move in enumerate(moves[:5]):
        if move in top and moves.index(move) == i:
            value = evals[i] if i < len(evals) else None
            error = abs(value - analysis.evals[top.index(move)]) if value is not None else float("inf")
            closeness.append(1.0 / (1.0 + error))
    parts = {"best": best_credit, "format": sum(map(bool, checks)) / len(checks),
             "candidates": len(hits) / len(top) if top else 0.0,
             "evals": sum(closeness) / len(closeness) if closeness else 0.0}
    return parts, best is not None


class ChessMixTask:
    """chess: P: and A: prompts mixed, `task_mix` the share of P:."""
    name = "chess"
    min_reward = 0.0

    def __init__(self, task_mix: float = DEFAULT_TASK_MIX, data: str | None = None,
                 stockfish_path: str | None = None, stockfish_depth: int = 10):
        if not 0.0 <= task_mix <= 1.0:
            raise TaskError(f"--task-mix {task_mix}: must lie in [0, 1] (the share of P: prompts)")
        self.task_mix = task_mix
        # With --data, a kind the file lacks is generated instead of refused.
        self.policy = ChessPolicyTask(data, stockfish_path, stockfish_depth, data_required=False) \
            if task_mix > 0 else None
        self.env = ChessEnvTask(data, data_required=False) if task_mix < 1 else None

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        # Stochastic rounding keeps the expected share exact for any n.
        exact = n * self.task_mix
        n_policy = int(exact) + (rng.random() < exact - int(exact))
        out = (self.policy.prompts(n_policy, rng) if n_policy else []) + \
              (self.env.prompts(n - n_policy, rng) if n > n_policy else [])
        rng.shuffle(out)
        return out

    def _task(self, prompt: str):
        task = self.policy if prompt.startswith("P: ") else self.env
        if task is None:
            raise TaskError(f"--task-mix {self.task_mix} leaves no task for the prompt {prompt[:20]!r}")
        return task

    def reward_breakdown(self, prompt: str, completion: str) -> dict[str, float]:
        return self._task(prompt).reward_breakdown(prompt, completion)

    def reward(self, prompt: str, completion: str) -> float:
        return self.reward_breakdown(prompt, completion)["reward"]

    def close(self) -> None:
        for task in (self.policy, self.env):
            if task is not None:
                task.close()


# The config fields each chess task takes (train_lean.py passes these to get_task).
OPTIONS = {"chess": ("task_mix", "data", "stockfish_path", "stockfish_depth"),
           "chess-policy": ("data", "stockfish_path", "stockfish_depth"),
           "chess-env": ("data",)}
