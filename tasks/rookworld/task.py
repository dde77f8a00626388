"""The chess tasks: chess-env (A:), chess-policy (P:) and chess (a mixture of both), in RookWorld's formats.

Each task brings its options (the flags it adds to train_lean.py), draws prompts (generated positions, or
a RookWorld-format --data file), scores completions (tasks/rookworld/rewards.py: python-chess for A:,
Stockfish for P:) and evaluates on the committed held-out set (tasks/rookworld/evaluate.py). docs/chess.md
tells the whole story.
"""
import functools
import os
import random
import typing
from collections import OrderedDict
from dataclasses import dataclass

from harness.config import opt
from harness.task import SampledEvalOptions, TaskError
from tasks.rookworld import evaluate as held_out
from tasks.rookworld.data import read_rookworld
from tasks.rookworld.engine import DEFAULT_TIMEOUT_S, INSTALL_HINT, EnginePool, find_stockfish
from tasks.rookworld.format import (env_prompt, expected_env_completion, parse_board, parse_env_prompt,
                                    policy_answer, policy_prompt, position_key, prompt_fen)
from tasks.rookworld.positions import history, random_board, random_transition
from tasks.rookworld.evaluate import EVAL_FULL, EVAL_SUBSET
from tasks.rookworld.rewards import (ENV_WEIGHTS, FEN_SIMILARITY_SHARE, POLICY_WEIGHTS, env_parts, env_reward,
                                     policy_parts, policy_reward)


@dataclass
class DataOptions(SampledEvalOptions):   # --eval-k: pass@K of P:'s best move and A:'s next FEN as well
    data: typing.Optional[str] = opt(None, "RookWorld-format text file to draw prompts from (default: generated "
                                     "positions)", path="in")
    # evaluation only: neither touches the weights. The subset keeps a 700-step run's evaluations near a sixth of its
    # time; the whole set, where a run's before and after are compared, sees a 3-point change (docs/chess.md).
    eval_samples: int = opt(EVAL_SUBSET, "held-out items per kind (P:, A:) at each evaluation between the run's first "
                            "and last: the set's first N of each kind (at most --eval-full-samples)", resume_free=True)
    eval_full_samples: int = opt(EVAL_FULL, "held-out items per kind at the run's first and last evaluation and with "
                                 "--eval-only: the set's first N of each kind (it has 1000)", resume_free=True)

    def __post_init__(self):
        super().__post_init__()
        for name in ("eval_samples", "eval_full_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")


def _fen_similarity_opt():
    return opt(FEN_SIMILARITY_SHARE, "A: reward: the share of the FEN credit a near miss can earn (x its character "
               "similarity; only boards a legal move reaches; 0: exact FENs only)")


def _check_fen_similarity(share: float) -> None:
    if not 0 <= share < 1:
        raise ValueError(f"--fen-similarity {share} must be in [0, 1): a near miss earns less than the exact FEN")


@dataclass
class EnvOptions(DataOptions):
    fen_similarity: float = _fen_similarity_opt()

    def __post_init__(self):
        super().__post_init__()
        _check_fen_similarity(self.fen_similarity)


@dataclass
class PolicyOptions(DataOptions):
    stockfish_path: typing.Optional[str] = opt(None, "Stockfish binary (default: stockfish on PATH, then "
                                               "/usr/games/stockfish)", resume_free=True)   # another machine's
    stockfish_depth: int = opt(10, "Stockfish search depth of the P: reward (multi-PV 5)")
    stockfish_timeout: float = opt(DEFAULT_TIMEOUT_S, "seconds one analysis may take before its engine is killed, "
                                   "restarted and the position retried (a normal one takes well under a second at "
                                   "depth 14)", resume_free=True)   # a guard: the scores are the same

    def __post_init__(self):
        super().__post_init__()
        if self.stockfish_depth < 1:
            raise ValueError(f"--stockfish-depth {self.stockfish_depth} must be at least 1")
        if self.stockfish_timeout <= 0:
            raise ValueError(f"--stockfish-timeout {self.stockfish_timeout} must be > 0")


@dataclass
class MixOptions(PolicyOptions):
    task_mix: float = opt(0.75, "share of P: (policy) prompts; the rest are A: (environment)")
    fen_similarity: float = _fen_similarity_opt()
    demo_mix: float = opt(0.0, "with --ptx-coef: share of P: texts (Stockfish's answer) among the demonstrations "
                          "learned by next-token loss; the rest are A: (python-chess's)")

    def __post_init__(self):
        super().__post_init__()
        for name, share in (("task-mix", self.task_mix), ("demo-mix", self.demo_mix)):
            if not 0 <= share <= 1:
                raise ValueError(f"--{name} {share} must be in [0, 1] (the share of P:)")
        _check_fen_similarity(self.fen_similarity)


def _per_kind(task, full: bool) -> int:
    """Held-out items per kind: --eval-full-samples at a run's first and last evaluation and with --eval-only (full,
    harness/task.py); the fixed subset --eval-samples, no more, between (--eval-full-samples 100 alone scores the
    original set's items at every evaluation)."""
    return task.eval_full_samples if full else min(task.eval_samples, task.eval_full_samples)


def _split(n: int, share: float, rng: random.Random) -> int:
    """How many of n go to the first kind: stochastic rounding keeps the expected share exact for any n."""
    exact = n * share
    return int(exact) + (rng.random() < exact - int(exact))


@functools.lru_cache(maxsize=None)
def _read_data(path: str):
    """Read a --data file once per process, logging its counts (the mixture's two tasks share it)."""
    if not os.path.isfile(path):
        raise TaskError(f"--data {path}: file not found")
    data = read_rookworld(path)
    kept = len(data.policy) + len(data.env)
    if data.skipped > kept:  # most lines unusable: the wrong file, not a few bad lines
        raise TaskError(f"--data {path}: {data.skipped} of {data.skipped + kept} lines are not RookWorld "
                        f"P:/A: samples: pass a RookWorld-format text file (see docs/chess.md)")
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
    options = EnvOptions
    reward_parts = (*(f"env_{k}" for k in ENV_WEIGHTS), "env_exact", "reward")

    def __init__(self, data: str | None = None, eval_samples: int = EVAL_SUBSET,
                 fen_similarity: float = FEN_SIMILARITY_SHARE, data_required: bool = True, expected_cache: int = 200_000,
                 eval_k: int = 0, eval_n: int = 0, eval_temperature: float = 1.0, eval_full_samples: int = EVAL_FULL):
        _check_fen_similarity(fen_similarity)
        self.data = _load_prompts(data, "A", data_required)
        self.eval_samples, self.eval_full_samples, self.fen_similarity = eval_samples, eval_full_samples, fen_similarity
        self.sampled_eval = (eval_k, eval_n, eval_temperature)
        self.held_out = held_out.held_out_positions()
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

    def demonstrations(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        """--ptx-coef's texts: n A: prompts, drawn as the prompts are, each with its exact answer."""
        return [(prompt, self.expected(prompt)) for prompt in self.prompts(n, rng)]

    def reward_breakdown(self, prompt: str, completion: str) -> dict[str, float]:
        expected = self.expected(prompt)
        fields = parse_env_prompt(prompt)
        parts = env_parts(expected, completion, parse_board(fields.fen), self.fen_similarity) if expected \
            else dict.fromkeys(ENV_WEIGHTS, 0.0)
        out = {f"env_{k}": v for k, v in parts.items()}
        out["env_exact"] = float(expected is not None and completion.rstrip() == expected)
        out["reward"] = env_reward(parts)
        return out

    def reward(self, prompt: str, completion: str) -> float:
        return self.reward_breakdown(prompt, completion)["reward"]

    def evaluate(self, complete, full: bool = False) -> dict:
        return held_out.evaluate(complete, ("A",), _per_kind(self, full), *self.sampled_eval)

    def close(self) -> None:
        pass


class ChessPolicyTask:
    """P: play a good move, with candidates and evaluations, scored against Stockfish.

    The engines start with the first prompts drawn, so evaluating (which needs none: the held-out set
    carries its answers) works without Stockfish; drawing prompts without one is a TaskError."""
    name = "chess-policy"
    min_reward = 0.0
    options = PolicyOptions
    reward_parts = (*(f"policy_{k}" for k in POLICY_WEIGHTS), "policy_legal", "reward")

    def __init__(self, data: str | None = None, stockfish_path: str | None = None, stockfish_depth: int = 10,
                 stockfish_timeout: float = DEFAULT_TIMEOUT_S, eval_samples: int = EVAL_SUBSET, engines: int | None = None,
                 data_required: bool = True, eval_k: int = 0, eval_n: int = 0, eval_temperature: float = 1.0,
                 eval_full_samples: int = EVAL_FULL):
        self.stockfish = find_stockfish(stockfish_path)
        self.missing = (f"no executable Stockfish at {stockfish_path}" if stockfish_path else "no Stockfish found") \
            + f": {INSTALL_HINT}"
        self.data = _load_prompts(data, "P", data_required)
        self.held_out = held_out.held_out_positions()
        self.depth, self.timeout, self.eval_samples = stockfish_depth, stockfish_timeout, eval_samples
        self.eval_full_samples = eval_full_samples
        self.sampled_eval = (eval_k, eval_n, eval_temperature)
        # One engine per 4 cores, at most 4: enough to keep up with generation without starving it.
        self.size = engines or min(4, max(1, (os.cpu_count() or 1) // 4))
        self.pool = None

    def engines(self) -> EnginePool:
        """The engine pool, started on first use."""
        if self.pool is None:
            if self.stockfish is None:
                raise TaskError(self.missing)
            self.pool = EnginePool(self.stockfish, depth=self.depth, size=self.size, timeout=self.timeout)
        return self.pool

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        pool = self.engines()
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
            pool.analyse(prompt_fen(prompt))
        return out

    def demonstrations(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        """--ptx-coef's texts: n P: prompts, drawn as the prompts are, each with Stockfish's answer (multi-PV 5 at
        --stockfish-depth) written as the shipped model learned it."""
        prompts = self.prompts(n, rng)   # their analyses are queued
        out = []
        for prompt in prompts:
            analysis = self.engines().analyse(prompt_fen(prompt)).result()
            out.append((prompt, policy_answer(analysis.moves, analysis.evals, analysis.moves[0])))
        return out

    def reward_breakdown(self, prompt: str, completion: str) -> dict[str, float]:
        fen = prompt_fen(prompt)
        board = parse_board(fen)
        if board is None or not any(board.legal_moves):
            parts = dict.fromkeys(POLICY_WEIGHTS, 0.0)
            legal = False
        else:
            pool = self.engines()
            try:
                analysis = pool.analyse(fen).result()
            except Exception:
                pool.forget(fen)   # a later call re-analyses instead of re-raising forever
                raise
            parts, legal = policy_parts(board, analysis, completion)
        out = {f"policy_{k}": v for k, v in parts.items()}
        out["policy_legal"] = float(legal)
        out["reward"] = policy_reward(parts, legal)
        return out

    def reward(self, prompt: str, completion: str) -> float:
        return self.reward_breakdown(prompt, completion)["reward"]

    def evaluate(self, complete, full: bool = False) -> dict:
        return held_out.evaluate(complete, ("P",), _per_kind(self, full), *self.sampled_eval)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class ChessMixTask:
    """chess: P: and A: prompts mixed, `task_mix` the share of P:."""
    name = "chess"
    min_reward = 0.0
    options = MixOptions
    # GRPO alone on the P: reward forgets the A: skill it never rewards (docs/chess.md); the pretraining mix of the
    # task's A: demonstrations keeps it. Declared here, so that the bare command is the main job (--ptx-coef 0: RL alone).
    trainer_settings = {"ptx_coef": 1.0}

    def __init__(self, task_mix: float = MixOptions.task_mix, data: str | None = None,
                 stockfish_path: str | None = None, stockfish_depth: int = 10,
                 stockfish_timeout: float = DEFAULT_TIMEOUT_S, eval_samples: int = EVAL_SUBSET,
                 fen_similarity: float = FEN_SIMILARITY_SHARE, eval_k: int = 0, eval_n: int = 0,
                 eval_temperature: float = 1.0, demo_mix: float = MixOptions.demo_mix,
                 eval_full_samples: int = EVAL_FULL):
        for name, share in (("task-mix", task_mix), ("demo-mix", demo_mix)):
            if not 0.0 <= share <= 1.0:
                raise TaskError(f"--{name} {share}: must lie in [0, 1] (the share of P:)")
        self.task_mix, self.demo_mix, self.eval_samples = task_mix, demo_mix, eval_samples
        self.eval_full_samples = eval_full_samples
        self.sampled_eval = (eval_k, eval_n, eval_temperature)
        # With --data, a kind the file lacks is generated instead of refused.
        self.policy = ChessPolicyTask(data, stockfish_path, stockfish_depth, stockfish_timeout,
                                      data_required=False) if task_mix > 0 else None
        self.env = ChessEnvTask(data, fen_similarity=fen_similarity, data_required=False) if task_mix < 1 else None
        # the demonstrations' kinds, built when the prompts' mix leaves one out
        self.policy_texts = self.policy or (ChessPolicyTask(data, stockfish_path, stockfish_depth, stockfish_timeout,
                                                            data_required=False) if demo_mix > 0 else None)
        self.env_texts = self.env or (ChessEnvTask(data, data_required=False) if demo_mix < 1 else None)

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        n_policy = _split(n, self.task_mix, rng)
        out = (self.policy.prompts(n_policy, rng) if n_policy else []) + \
              (self.env.prompts(n - n_policy, rng) if n > n_policy else [])
        rng.shuffle(out)
        return out

    def demonstrations(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        """--ptx-coef's texts: a --demo-mix share of P: demonstrations, the rest A: (the same generators as the
        prompts, which built the shipped model's data; never a held-out position)."""
        n_policy = _split(n, self.demo_mix, rng)
        out = (self.policy_texts.demonstrations(n_policy, rng) if n_policy else []) + \
              (self.env_texts.demonstrations(n - n_policy, rng) if n > n_policy else [])
        rng.shuffle(out)
        return out

    @property
    def reward_parts(self) -> tuple:
        """Both kinds' parts while both are drawn: a step of one kind alone is no reason to refuse the other's."""
        return tuple(dict.fromkeys(p for task in (self.policy, self.env) if task for p in task.reward_parts))

    def _task(self, prompt: str):
        task = self.policy if prompt.startswith("P: ") else self.env
        if task is None:
            raise TaskError(f"--task-mix {self.task_mix} leaves no task for the prompt {prompt[:20]!r}")
        return task

    def reward_breakdown(self, prompt: str, completion: str) -> dict[str, float]:
        return self._task(prompt).reward_breakdown(prompt, completion)

    def reward(self, prompt: str, completion: str) -> float:
        return self.reward_breakdown(prompt, completion)["reward"]

    def evaluate(self, complete, full: bool = False) -> dict:
        """Both kinds, whatever the mix: the held-out set measures the model, not the training diet."""
        return held_out.evaluate(complete, ("P", "A"), _per_kind(self, full), *self.sampled_eval)

    def close(self) -> None:
        for task in {id(t): t for t in (self.policy, self.env, self.policy_texts, self.env_texts)}.values():
            if task is not None:
                task.close()
