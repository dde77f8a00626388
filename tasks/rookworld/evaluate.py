"""Held-out chess evaluation: metrics from (item, completion) pairs, and the table that shows them.

The set (tasks/rookworld/eval_set.jsonl, made by tasks/rookworld/make_eval_set.py) carries its own answers: engine
analysis for P: items, the exact completion for A: items. Evaluating needs no engine and no network,
so it is reproducible anywhere. Generation (greedy) is the trainer's; everything here is pure.

P: best-move accuracy (B: is the engine's first choice), top-5 accuracy (B: among the engine's top 5),
   legal-move rate (B: is legal), format rate (every format check of the reward passes).
A: format rate (every format check of the A: reward passes: four fields, a valid FEN, one of the four
   reward values, 0/1 flags), next-FEN accuracy (the FEN field is exact), exact-completion accuracy.
"""
import json

from tasks.rookworld.format import legal_move, parse_board, parse_policy_completion, policy_format_checks
from tasks.rookworld.task import EVAL_SET, env_components

KINDS = {"chess-policy": ("P",), "chess-env": ("A",)}   # any other task: both


def eval_kinds(task_name: str) -> tuple[str, ...]:
    return KINDS.get(task_name, ("P", "A"))


def load_eval_set(path: str = EVAL_SET) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def select(items: list[dict], kinds: tuple[str, ...], per_kind: int) -> list[dict]:
    """The first `per_kind` items of each kind, in file order (the same items on every call)."""
    return [item for kind in kinds for item in [i for i in items if i["kind"] == kind][:per_kind]]


def _rate(hits: list[bool]) -> float:
    return sum(hits) / len(hits) if hits else 0.0


def policy_metrics(items: list[dict], completions: list[str]) -> dict:
    best, top5, legal, fmt = [], [], [], []
    for item, completion in zip(items, completions):
        answer = parse_policy_completion(completion)
        move = legal_move(parse_board(item["fen"]), answer.best)
        uci = move.uci() if move else None
        best.append(uci is not None and uci == item["moves"][0])
        top5.append(uci is not None and uci in item["moves"])
        legal.append(move is not None)
        fmt.append(all(policy_format_checks(answer)))
    return {"p_n": len(items), "p_best_move_acc": _rate(best), "p_top5_acc": _rate(top5),
            "p_legal_rate": _rate(legal), "p_format_rate": _rate(fmt)}


def env_metrics(items: list[dict], completions: list[str]) -> dict:
    fmt, fen, exact = [], [], []
    for item, completion in zip(items, completions):
        got = completion.rstrip()
        fmt.append(env_components(item["expected"], completion)["format"] == 1.0)
        fen.append(got.split("+", 1)[0] == item["expected"].split("+", 1)[0])
        exact.append(got == item["expected"])
    return {"a_n": len(items), "a_format_rate": _rate(fmt), "a_next_fen_acc": _rate(fen), "a_exact_acc": _rate(exact)}


def metrics(items: list[dict], completions: list[str]) -> dict:
    """All metrics of an evaluation; a kind without items is left out."""
    out = {}
    pairs = list(zip(items, completions))
    policy = [(i, c) for i, c in pairs if i["kind"] == "P"]
    env = [(i, c) for i, c in pairs if i["kind"] == "A"]
    if policy:
        out.update(policy_metrics(*map(list, zip(*policy))))
    if env:
        out.update(env_metrics(*map(list, zip(*env))))
    return out


ROWS = [("p_best_move_acc", "P: best-move accuracy"), ("p_top5_acc", "P: top-5 accuracy"),
        ("p_legal_rate", "P: legal-move rate"), ("p_format_rate", "P: format rate"),
        ("a_format_rate", "A: format rate"), ("a_next_fen_acc", "A: next-FEN accuracy"), ("a_exact_acc", "A: exact-completion accuracy")]


def table(result: dict, step: int) -> str:
    counts = " + ".join(f"{result[k]} {name}" for k, name in (("p_n", "P:"), ("a_n", "A:")) if k in result)
    lines = [f"eval at step {step}: greedy on {counts} held-out items"]
    lines += [f"  {label:<30} {100 * result[key]:6.1f}%" for key, label in ROWS if key in result]
    return "\n".join(lines)
