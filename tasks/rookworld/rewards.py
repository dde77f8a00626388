"""The rewards of the chess tasks, as pure functions of (expected answer or engine analysis, completion).

Rewards lie in [0, 1]; the exact expected answer (A:) or the engine's best move with the engine's
own analysis (P:) gets 1.0. The held-out evaluation counts the format (every check passes) and the
answer; the rewards are gated so that RL cannot buy one with the other (docs/chess.md, "Rewards").

A: (computed with python-chess alone)
    format      0.1   four '+'-separated fields: a FEN, one of the four reward values, two 0/1 flags
    new FEN     0.5   1 if exact; else 0.8 (--fen-similarity) x character similarity (difflib ratio), only for a
                      board that a legal move from the prompt's position reaches: a near miss of the
                      right kind earns something, a copied board or a broken position nothing (a
                      copy once earned 0.70 of this credit, more than attempting the move paid)
    reward      0.2   the reward field, as a string (so "1" for "1.0" does not count)
    terminated  0.1
    truncated   0.1
    Gate: a completion that fails a format check earns its format credit only (at most 0.08), less
    than any well-formed completion (at least 0.1). Any single wrong character lowers at least one
    part, so only the exact completion scores 1.0.

P: (scored against Stockfish: fixed depth, multi-PV 5)
    best move   0.5   rank among the engine's top 5: 1.0, 0.8, 0.65, 0.55, 0.45; another legal
                      move 0.25; an illegal or missing move 0
    format      0.1   M:/E:/B: in order, 1-5 distinct UCI candidates, one number per candidate,
                      one UCI best move, and the data's exact column layout (each a fifth)
    candidates  0.2   share of the engine's top moves among the (first 5) M: candidates
    evaluations 0.2   mean over candidates in the engine's top of 1 / (1 + |error in pawns|),
                      each E: value paired with its own M: move
    Gates: an answer whose B: move is illegal or missing gets its format credit only (at most 0.1),
    less than the least any legal move gets (0.5 x 0.25 = 0.125): illegal moves never outscore
    legal ones. A legal answer that fails a format check gets its best-move and format credits only
    (the candidates and evaluations, 0.4, are paid to well-formed answers alone), so the same move
    written in the evaluated format always earns more.
"""
import difflib

import chess

from tasks.rookworld.format import (REWARD_DRAW, REWARD_ILLEGAL, REWARD_MATE, REWARD_MOVE, legal_move, parse_board,
                                    parse_policy_completion, policy_format_checks)

ENV_WEIGHTS = {"format": 0.1, "fen": 0.5, "reward": 0.2, "terminated": 0.1, "truncated": 0.1}
FEN_SIMILARITY_SHARE = 0.8
POLICY_WEIGHTS = {"best": 0.5, "format": 0.1, "candidates": 0.2, "evals": 0.2}
RANK_CREDIT = (1.0, 0.8, 0.65, 0.55, 0.45)
LEGAL_CREDIT = 0.25
assert POLICY_WEIGHTS["format"] < POLICY_WEIGHTS["best"] * LEGAL_CREDIT, "illegal must score below legal"

MAX_COMPLETION_CHARS = 2000   # longer completions are judged on their start (keeps scoring O(1))


def env_format_checks(completion: str) -> list[bool]:
    """The format of an A: completion, check by check: four fields, a valid FEN, a reward value, 0/1 flags."""
    fields = completion[:MAX_COMPLETION_CHARS].rstrip().split("+")
    fen, reward, terminated, truncated = (fields + [""] * 4)[:4]
    return [len(fields) == 4, parse_board(fen) is not None,
            reward in (REWARD_MOVE, REWARD_MATE, REWARD_DRAW, REWARD_ILLEGAL),
            terminated in ("0", "1"), truncated in ("0", "1")]


def reached_boards(board: chess.Board) -> set[str]:
    """The piece placements that one legal move from `board` reaches."""
    out = set()
    for move in board.legal_moves:
        board.push(move)
        out.add(board.board_fen())
        board.pop()
    return out


def env_parts(expected: str, completion: str, start: chess.Board,
                   similarity_share: float = FEN_SIMILARITY_SHARE) -> dict[str, float]:
    """Credits in [0, 1] for an A: completion against the exact one (trailing whitespace ignored);
    `start` is the prompt's position, `similarity_share` what a near miss's FEN can earn at most."""
    fields = completion[:MAX_COMPLETION_CHARS].rstrip().split("+")
    want = expected.split("+")
    fen, reward, terminated, truncated = (fields + [""] * 4)[:4]
    checks = env_format_checks(completion)
    if fen == want[0]:
        fen_credit = 1.0
    elif not checks[1] or fen.split(" ")[0] not in reached_boards(start) | {want[0].split(" ")[0]}:
        fen_credit = 0.0
    else:
        fen_credit = similarity_share * difflib.SequenceMatcher(None, fen[:200], want[0], autojunk=False).ratio()
    return {"format": sum(checks) / len(checks), "fen": fen_credit,
            "reward": float(reward == want[1]), "terminated": float(terminated == want[2]),
            "truncated": float(truncated == want[3])}


def env_reward(parts: dict[str, float]) -> float:
    """The A: reward from its parts, with the format gate."""
    if parts["format"] < 1.0:
        return ENV_WEIGHTS["format"] * parts["format"]
    return sum(ENV_WEIGHTS[k] * parts[k] for k in ENV_WEIGHTS)


def policy_parts(board, analysis, completion: str) -> tuple[dict[str, float], bool]:
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


def policy_reward(parts: dict[str, float], legal: bool) -> float:
    """The P: reward from its parts, with the illegal-move and format gates."""
    if not legal:
        return POLICY_WEIGHTS["format"] * parts["format"]
    if parts["format"] < 1.0:
        return POLICY_WEIGHTS["best"] * parts["best"] + POLICY_WEIGHTS["format"] * parts["format"]
    return sum(POLICY_WEIGHTS[k] * parts[k] for k in POLICY_WEIGHTS)
