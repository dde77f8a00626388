"""The RookWorld text formats (docs: ../shared/docs/rookworld-tasks.md), built and parsed.

P: (policy)       "P: " + FEN padded to 89 | "M: " moves padded to 30 | "E: " evals padded to 40 | "B: " move
A: (environment)  "A: {fen}+{move}+{history}+" | "{new_fen}+{reward}+{terminated}+{truncated}"

Prompts must be byte-identical to the training data, so the padding widths are part of the format,
not cosmetics. Parsers of model output are lenient about spacing (they look for the field markers)
and report what they could not read as None; they never raise on junk.
"""
import re
from dataclasses import dataclass
from typing import Optional

import chess

FEN_WIDTH = 89      # "P: " + 89 characters puts "M: " at column 92
MOVES_WIDTH = 30    # puts "E: " at column 125
EVALS_WIDTH = 40    # puts "B: " at column 168
HISTORY_LEN = 10    # A: history: the last 10 moves, ending with the move itself

# The four reward values of the A: format, written as Python writes these floats.
REWARD_MOVE, REWARD_MATE, REWARD_DRAW, REWARD_ILLEGAL = "0.001", "1.0", "0.5", "-1.0"

_UCI = re.compile(r"^[a-h][1-8][a-h][1-8][qrbn]?$")


def is_uci(token: str) -> bool:
    """A syntactically valid UCI move (not the null move). Says nothing about legality."""
    return bool(_UCI.match(token))


def parse_board(fen: str) -> Optional[chess.Board]:
    """A board for a FEN that describes a legal chess position, else None.

    Invalid positions (no king, side not to move in check, ...) are refused here because they
    have no meaningful answer and some engines crash on them.
    """
    try:
        board = chess.Board(fen)
    except ValueError:
        return None
    return board if board.is_valid() else None


def legal_move(board: chess.Board, uci: Optional[str]) -> Optional[chess.Move]:
    """The move if `uci` names a legal move in `board`, else None."""
    if uci is None or not is_uci(uci):
        return None
    try:
        move = chess.Move.from_uci(uci)
    except ValueError:   # python-chess refuses a move to its own square ("c6c6")
        return None
    return move if board.is_legal(move) else None


def format_eval(pawns: float) -> str:
    """An evaluation as the data writes it: pawns rounded to 2 decimals, Python's float repr."""
    return repr(round(float(pawns), 2))


# ---------------------------------------------------------------- P: policy

def policy_prompt(fen: str) -> str:
    return "P: " + fen.ljust(FEN_WIDTH)


def policy_completion(moves: list[str], evals: list[float], best: str) -> str:
    return policy_layout(moves, [format_eval(e) for e in evals], best)


def policy_answer(moves: list[str], evals: list[float], best: str) -> str:
    """The P: answer as the shipped model learned it: the candidates, each with its evaluation, in UCI string
    order (tasks/rookworld/build_model.py, uci_order, says why), then the best move."""
    pairs = sorted(zip(moves, evals))
    return policy_completion([m for m, _ in pairs], [e for _, e in pairs], best)


def policy_layout(moves: list[str], evals: list[str], best: str) -> str:
    """A P: answer from its fields as written (evaluations as strings), in the data's column layout."""
    return "M: " + " ".join(moves).ljust(MOVES_WIDTH) + "E: " + " ".join(evals).ljust(EVALS_WIDTH) + "B: " + best


def prompt_fen(prompt: str) -> str:
    """The FEN of a P: prompt or an A: prompt (its first field)."""
    body = prompt[3:]
    return body.split("+", 1)[0].strip() if prompt.startswith("A: ") else body.strip()


_FIELD = re.compile(r"([MEB]):")


@dataclass
class PolicyAnswer:
    """What a P: completion says. Fields that could not be read are None."""
    moves: Optional[list[str]]
    evals: Optional[list[Optional[float]]]   # one per E: token; None for a token that is no number
    best: Optional[str]
    layout_ok: bool      # the exact column layout of the data
    order_ok: bool       # exactly one M:, E:, B: marker each, in that order, nothing before M:


def _to_float(token: str) -> Optional[float]:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None


def parse_policy_completion(completion: str) -> PolicyAnswer:
    text = completion.rstrip()
    marks = list(_FIELD.finditer(text))
    fields: dict[str, str] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        fields.setdefault(m.group(1), text[m.end():end])
    order_ok = ([m.group(1) for m in marks] == ["M", "E", "B"] and text.startswith("M:"))
    moves = fields["M"].split() if "M" in fields else None
    evals = [_to_float(t) for t in fields["E"].split()] if "E" in fields else None
    best_tokens = fields["B"].split() if "B" in fields else []
    best = best_tokens[0] if len(best_tokens) == 1 else None
    layout_ok = order_ok and best is not None and text == policy_layout(moves, fields["E"].split(), best)
    return PolicyAnswer(moves, evals, best, layout_ok, order_ok)


def policy_format_checks(answer: PolicyAnswer) -> list[bool]:
    """The format of a P: answer, check by check: markers in order, 1-5 distinct UCI candidates,
    one number per candidate, one UCI best move, and the data's exact column layout."""
    moves, evals = answer.moves or [], answer.evals or []
    return [answer.order_ok,
            1 <= len(moves) <= 5 and len(set(moves)) == len(moves) and all(map(is_uci, moves)),
            bool(moves) and len(evals) == len(moves) and None not in evals,
            answer.best is not None and is_uci(answer.best),
            answer.layout_ok]


def split_policy_line(line: str) -> tuple[str, str]:
    """A P: data line split into (prompt, completion): the prompt runs up to, not including, M:."""
    cut = line.index("M:")
    return line[:cut], line[cut:]


# ---------------------------------------------------------------- A: environment

def env_prompt(fen: str, move: str, history: list[str]) -> str:
    return f"A: {fen}+{move}+{' '.join(history)}+"


def env_completion(new_fen: str, reward: str, terminated: bool, truncated: bool) -> str:
    return f"{new_fen}+{reward}+{int(terminated)}+{int(truncated)}"


def expected_env_completion(board: chess.Board, uci: str) -> str:
    """The exact A: completion for playing `uci` in `board`, as python-chess rules it.

    `board` should carry the game's move stack: fivefold repetition depends on it. (The prompt's
    10-move history can never show a fivefold repetition: five occurrences of a position span at
    least 16 plies.) An illegal move leaves the position unchanged and truncates the episode.
    """
    move = legal_move(board, uci)
    if move is None:
        return env_completion(board.fen(), REWARD_ILLEGAL, False, True)
    after = board.copy()
    after.push(move)
    outcome = after.outcome()
    if outcome is None:
        reward = REWARD_MOVE
    elif outcome.termination == chess.Termination.CHECKMATE:
        reward = REWARD_MATE
    else:
        reward = REWARD_DRAW
    return env_completion(after.fen(), reward, outcome is not None, False)


@dataclass
class EnvPrompt:
    fen: str
    move: str
    history: list[str]


def parse_env_prompt(prompt: str) -> Optional[EnvPrompt]:
    """The fields of an A: prompt "A: fen+move+history+", or None if it has another shape."""
    if not prompt.startswith("A: ") or not prompt.endswith("+"):
        return None
    parts = prompt[3:-1].split("+")
    if len(parts) != 3:
        return None
    fen, move, history = parts
    return EnvPrompt(fen, move, history.split())


def split_env_line(line: str) -> Optional[tuple[str, str]]:
    """An A: data line (with or without the "A: " prefix) as (prompt, completion), or None."""
    body = line[3:] if line.startswith("A: ") else line
    parts = body.split("+")
    if len(parts) != 7:
        return None
    return "A: " + "+".join(parts[:3]) + "+", "+".join(parts[3:])


def position_key(fen: str) -> str:
    """A position's identity without its move clocks (and en-passant notation style)."""
    board = parse_board(fen)
    return " ".join(board.fen().split()[:4]) if board else fen
