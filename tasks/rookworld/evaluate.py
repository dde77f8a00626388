"""Held-out chess evaluation: the committed set, and metrics from (item, completion) pairs.

The set (tasks/rookworld/eval_set.jsonl, made by tasks/rookworld/make_eval_set.py) carries its own answers: engine
analysis for P: items, the exact completion for A: items. Evaluating needs no engine and no network,
so it is reproducible anywhere. Generation (greedy, and seeded samples) is the trainer's; everything here is pure.

P: best-move accuracy (B: is the engine's first choice), top-5 accuracy (B: among the engine's top 5),
   legal-move rate (B: is legal), format rate (every format check of the reward passes).
A: format rate (every format check of the A: reward passes: four fields, a valid FEN, one of the four
   reward values, 0/1 flags), next-FEN accuracy (the FEN field is exact), exact-completion accuracy.
With --eval-k K (and --eval-n N samples per item, default K): pass@K and mean@N of P:'s best move and of A:'s
next FEN (p_best_move_pass@K, a_next_fen_mean@N, ...), from completions sampled at --eval-temperature.
"""
import functools
import json
import os

from harness.task import sampled_metrics
from tasks.rookworld.format import legal_move, parse_board, parse_policy_completion, policy_format_checks, position_key
from tasks.rookworld.rewards import env_format_checks

EVAL_SET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval_set.jsonl")
EVAL_FULL = 1000    # items per kind in the set (make_eval_set.py), scored whole at a run's first and last evaluation
EVAL_SUBSET = 200   # its first items per kind, scored at the evaluations between


@functools.lru_cache(maxsize=None)
def held_out_positions(path: str = EVAL_SET) -> frozenset[str]:
    """Positions of the committed evaluation set; generated training prompts and demonstrations skip them (read once
    per process: each chess task holds them)."""
    if not os.path.exists(path):
        return frozenset()
    with open(path, encoding="utf-8") as f:
        return frozenset(position_key(json.loads(line)["fen"]) for line in f if line.strip())


def load_eval_set(path: str = EVAL_SET) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def select(items: list[dict], kinds: tuple[str, ...], per_kind: int) -> list[dict]:
    """The first `per_kind` items of each kind, in file order (the same items on every call)."""
    return [item for kind in kinds for item in [i for i in items if i["kind"] == kind][:per_kind]]


def _legal_best(item: dict, answer) -> str | None:
    """The UCI of the answer's best move (B:) when it is legal in the item's position, else None."""
    move = legal_move(parse_board(item["fen"]), answer.best)
    return move.uci() if move else None


def best_move_hit(item: dict, completion: str) -> bool:
    """P: the completion's best move is the engine's first choice."""
    return _legal_best(item, parse_policy_completion(completion)) == item["moves"][0]


def next_fen_hit(item: dict, completion: str) -> bool:
    """A: the completion's FEN field is the exact next position."""
    return completion.rstrip().split("+", 1)[0] == item["expected"].split("+", 1)[0]


def policy_metrics(items: list[dict], completions: list[str]) -> dict:
    best, top5, legal, fmt = [], [], [], []
    for item, completion in zip(items, completions):
        answer = parse_policy_completion(completion)
        uci = _legal_best(item, answer)
        best.append(uci == item["moves"][0])
        top5.append(uci in item["moves"])
        legal.append(uci is not None)
        fmt.append(all(policy_format_checks(answer)))
    return {"p_n": len(items), "p_best_move_acc": best, "p_top5_acc": top5, "p_legal_rate": legal, "p_format_rate": fmt}


def env_metrics(items: list[dict], completions: list[str]) -> dict:
    fmt, fen, exact = [], [], []
    for item, completion in zip(items, completions):
        got = completion.rstrip()
        fmt.append(all(env_format_checks(completion)))
        fen.append(next_fen_hit(item, completion))
        exact.append(got == item["expected"])
    return {"a_n": len(items), "a_format_rate": fmt, "a_next_fen_acc": fen, "a_exact_acc": exact}


def metrics(items: list[dict], completions: list[str]) -> dict:
    """All metrics of an evaluation, each a list of the kind's per-item hits (the trainer's eval record holds their
    rate with its Wilson interval: harness/task.py summarise_metrics) beside the kind's item count; a kind without
    items is left out."""
    out = {}
    pairs = list(zip(items, completions))
    policy = [(i, c) for i, c in pairs if i["kind"] == "P"]
    env = [(i, c) for i, c in pairs if i["kind"] == "A"]
    if policy:
        out.update(policy_metrics(*map(list, zip(*policy))))
    if env:
        out.update(env_metrics(*map(list, zip(*env))))
    return out


# what a sampled completion must get right, by kind: (metric name, judge)
HITS = {"P": ("p_best_move", best_move_hit), "A": ("a_next_fen", next_fen_hit)}


def sampled(complete, items: list[dict], kind: str, k: int, n: int, temperature: float) -> dict:
    """pass@k and mean@n of the kind's answer over n completions of each of its items, sampled at temperature."""
    name, hit = HITS[kind]
    answers = {item["prompt"]: item for item in items if item["kind"] == kind}
    return sampled_metrics(complete, list(answers), lambda prompt, c: hit(answers[prompt], c), k, n, temperature,
                           name)


def evaluate(complete, kinds: tuple[str, ...], per_kind: int, k: int = 0, n: int = 0,
             temperature: float = 1.0) -> dict:
    """Greedy completions of the first per_kind held-out items of each kind (complete: the trainer's
    decoding), scored against the answers the set carries; with k, sampled pass@k and mean@n as well."""
    items = select(load_eval_set(), kinds, per_kind)
    out = metrics(items, complete([item["prompt"] for item in items]))
    for kind in kinds if k else ():
        out.update(sampled(complete, items, kind, k, n, temperature))
    return out
