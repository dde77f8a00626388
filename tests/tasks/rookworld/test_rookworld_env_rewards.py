"""A: rewards on generated transitions: exact answers score the maximum, any corruption less."""
import difflib
import os
import random
import subprocess
import sys
from collections import Counter

import chess
import pytest

from helpers import REPO
from tasks.rookworld.format import env_prompt, parse_env_prompt
from tasks.rookworld.positions import history, random_transition
from tasks.rookworld.format import position_key
from tasks.rookworld.rewards import env_parts
from tasks.rookworld.task import ChessEnvTask

N_TRANSITIONS = 1000


def oracle(board: chess.Board, move: chess.Move) -> str:
    """The A: completion straight from python-chess's own game-over logic."""
    if not board.is_legal(move):
        return f"{board.fen()}+-1.0+0+1"
    after = board.copy()
    after.push(move)
    outcome = after.outcome(claim_draw=False)
    value = "0.001" if outcome is None else "1.0" if outcome.winner is not None else "0.5"
    return f"{after.fen()}+{value}+{int(outcome is not None)}+0"


def kinds(board: chess.Board, move: chess.Move) -> set[str]:
    if not board.is_legal(move):
        return {"illegal"}
    out = set()
    if move.promotion:
        out.add("promote-" + chess.piece_symbol(move.promotion))
    if board.is_kingside_castling(move):
        out.add("O-O")
    if board.is_queenside_castling(move):
        out.add("O-O-O")
    if board.is_en_passant(move):
        out.add("en-passant")
    after = board.copy()
    after.push(move)
    outcome = after.outcome()
    if outcome:
        out.add(outcome.termination.name)
    return out


@pytest.fixture(scope="module")
def generated():
    """Transitions drawn as the task draws them, each with its game, and the task's prompts for them."""
    task = ChessEnvTask()
    task.held_out = set()   # no skipped draws, so the replay below sees exactly the task's draws
    head = task.prompts(100, random.Random(1234))
    rng = random.Random(1234)
    samples = []
    for i in range(N_TRANSITIONS):
        board, move = random_transition(rng)
        prompt = task.prompt_for(board, move)
        assert prompt == env_prompt(board.fen(), move.uci(), history(board, move))
        if i < len(head):
            assert prompt == head[i]
        samples.append((board, move, prompt))
    return task, samples


def test_generated_transitions_cover_the_rules(generated):
    _, samples = generated
    seen = Counter(k for board, move, _ in samples for k in kinds(board, move))
    need = ["illegal", "CHECKMATE", "STALEMATE", "INSUFFICIENT_MATERIAL", "SEVENTYFIVE_MOVES",
            "FIVEFOLD_REPETITION", "O-O", "O-O-O", "en-passant",
            "promote-q", "promote-r", "promote-b", "promote-n"]
    assert all(seen[k] >= 2 for k in need), seen
    assert 0.05 < seen["illegal"] / len(samples) < 0.25


def test_history_is_the_last_ten_moves_ending_with_the_move(generated):
    _, samples = generated
    for board, move, prompt in samples:
        fields = parse_env_prompt(prompt)
        assert fields.history[-1] == move.uci() and len(fields.history) <= 10
        assert fields.history[:-1] == [m.uci() for m in board.move_stack][-9:]


def test_exact_completion_matches_python_chess_and_scores_the_maximum(generated):
    task, samples = generated
    for board, move, prompt in samples:
        want = oracle(board, move)
        assert task.expected(prompt) == want
        parts = task.reward_breakdown(prompt, want)
        assert parts["reward"] == pytest.approx(1.0) and parts["env_exact"] == 1.0
        assert tuple(parts) == task.reward_parts   # what --reward-weights is checked against at start-up
        assert task.reward(prompt, want + "\n") == pytest.approx(1.0)   # a trailing newline is no error


def test_prompt_alone_gives_the_same_answer_except_fivefold(generated):
    _, samples = generated
    fresh = ChessEnvTask()   # knows none of the games
    for board, move, prompt in samples:
        if "FIVEFOLD_REPETITION" not in kinds(board, move):
            assert fresh.expected(prompt) == oracle(board, move)


def test_single_character_corruptions_score_less(generated):
    task, samples = generated
    rng = random.Random(5)
    alphabet = "0123456789/+-. abcdefghkKnNpPqQrRwx"
    for _, _, prompt in samples[:300]:
        want = task.expected(prompt)
        for _ in range(6):
            i = rng.randrange(len(want) + 1)
            op = rng.choice(["replace", "delete", "insert"])
            if op == "replace" and i < len(want):
                bad = want[:i] + rng.choice(alphabet.replace(want[i], "")) + want[i + 1:]
            elif op == "delete" and i < len(want):
                bad = want[:i] + want[i + 1:]
            else:
                bad = want[:i] + rng.choice(alphabet.replace(" ", "")) + want[i:]
            assert task.reward(prompt, bad) < 1.0, (prompt, bad)


def test_fen_similarity_counts_only_for_a_valid_position():
    # 1. e4 from the start: the exact FEN, a valid near miss (the pawn on e3), and a broken one that
    # looks closer still (one character dropped, so a rank holds seven squares)
    want = "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0"
    near = "rnbqkbnr/pppppppp/8/8/8/4P3/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0"
    broken = "rnbqkbnr/pppppppp/8/8/4P2/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0"
    start = chess.Board()
    assert env_parts(want, want, start)["fen"] == 1.0
    assert 0.7 < env_parts(want, near, start)["fen"] < 0.8   # e2e3 is legal: the board of a real move
    assert env_parts(want, broken, start)["fen"] == 0.0
    task = ChessEnvTask()
    prompt = env_prompt(chess.STARTING_FEN, "e2e4", ["e2e4"])
    assert task.reward(prompt, broken) < task.reward(prompt, near) - 0.3


@pytest.mark.parametrize("completion", [
    "", " ", "x" * 1_000_000, "+" * 100_000, b"\xff\xfe\x80junk\xc3".decode("utf-8", "surrogateescape"),
    "\x00\u202e\U0001F600", "M: e2e4 E: 0.1 B: e2e4"])
def test_bad_completions_get_a_low_reward(completion):
    task = ChessEnvTask()
    prompt = env_prompt(chess.STARTING_FEN, "e2e4", ["e2e4"])
    assert 0.0 <= task.reward(prompt, completion) < 0.3


@pytest.mark.parametrize("prompt", [
    "A: not a fen+e2e4+e2e4+", "A: 8/8/8/8/8/8/8/8 w - - 0 1+a1a2+a1a2+", "A: ++", "", "A: ",
    "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1"])
def test_prompts_that_are_no_position_get_the_minimum(prompt):
    task = ChessEnvTask()
    parts = task.reward_breakdown(prompt, "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+0.001+0+0")
    assert parts["reward"] == 0.0


def test_held_out_positions_are_never_generated():
    task = ChessEnvTask()
    first = task.prompts(30, random.Random(7))
    task.held_out = {position_key(parse_env_prompt(p).fen) for p in first}
    again = task.prompts(30, random.Random(7))
    assert not {position_key(parse_env_prompt(p).fen) for p in again} & task.held_out


def test_a_copied_board_earns_no_fen_credit_and_less_than_attempting_the_move():
    task = ChessEnvTask()
    prompt = env_prompt(chess.STARTING_FEN, "g1f3", ["g1f3"])
    exact = "rnbqkbnr/pppppppp/8/8/8/5N2/PPPPPPPP/RNBQKB1R b KQkq - 1 1+0.001+0+0"
    copy = f"{chess.STARTING_FEN}+0.001+0+0"
    wrong_move = "rnbqkbnr/pppppppp/8/8/8/7N/PPPPPPPP/RNBQKB1R b KQkq - 1 1+0.001+0+0"   # g1h3: legal, not asked
    parts = task.reward_breakdown(prompt, copy)
    assert parts["env_fen"] == 0.0
    # well formed, reward field and both flags right: 0.1 + 0.2 + 0.1 + 0.1, nothing for the board
    assert parts["reward"] == pytest.approx(0.5)
    attempt = task.reward_breakdown(prompt, wrong_move)
    assert attempt["env_fen"] == pytest.approx(
        0.8 * difflib.SequenceMatcher(None, wrong_move.split("+")[0], exact.split("+")[0], autojunk=False).ratio())
    assert attempt["reward"] > parts["reward"] and task.reward(prompt, exact) == 1.0


def test_for_an_illegal_move_the_unchanged_board_is_the_answer():
    task = ChessEnvTask()
    prompt = env_prompt(chess.STARTING_FEN, "e2e5", ["e2e5"])
    assert task.reward(prompt, f"{chess.STARTING_FEN}+-1.0+0+1") == 1.0
    # a near copy (the clock changed) is the expected board, so it keeps its similarity credit
    near = task.reward_breakdown(prompt, chess.STARTING_FEN.replace(" 0 1", " 1 1") + "+-1.0+0+1")
    assert 0.7 < near["env_fen"] < 0.8


@pytest.mark.parametrize("defect", [
    lambda c: c.replace("+0+0", "+0+2"),                     # a flag that is not 0/1
    lambda c: c.replace("+0.001+", "+0.01+"),                # not one of the four reward values
    lambda c: c + "+0",                                      # five fields
    lambda c: c.replace("/8/8/4P3", "/8/8/4P2"),             # a FEN that is no position
])
def test_a_malformed_completion_earns_its_format_credit_only(defect):
    task = ChessEnvTask()
    prompt = env_prompt(chess.STARTING_FEN, "e2e4", ["e2e4"])
    exact = "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0"
    parts = task.reward_breakdown(prompt, defect(exact))
    assert parts["env_format"] == pytest.approx(0.8)
    assert parts["reward"] == pytest.approx(0.1 * 0.8)
    # below the least a well-formed completion earns: a valid board no legal move reaches, every field wrong
    worst_formed = task.reward(prompt, "8/8/8/8/8/8/8/K1k5 w - - 0 1+1.0+1+1")
    assert worst_formed == pytest.approx(0.1) and parts["reward"] < worst_formed


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_fen_similarity_sets_what_a_near_miss_earns(share):
    from tasks.rookworld.task import ChessMixTask
    prompt = env_prompt(chess.STARTING_FEN, "e2e4", ["e2e4"])
    exact = "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1"
    near = "rnbqkbnr/pppppppp/8/8/8/4P3/PPPP1PPP/RNBQKBNR b KQkq - 0 1"   # e2e3: a legal move, not the one asked
    ratio = difflib.SequenceMatcher(None, near, exact, autojunk=False).ratio()
    for task in (ChessEnvTask(fen_similarity=share), ChessMixTask(task_mix=0.0, fen_similarity=share)):
        parts = task.reward_breakdown(prompt, near + "+0.001+0+0")
        assert parts["env_fen"] == pytest.approx(share * ratio)
        assert parts["reward"] == pytest.approx(0.5 + 0.5 * share * ratio)
        assert task.reward(prompt, exact + "+0.001+0+0") == 1.0


def test_demonstrations_are_drawn_prompts_with_their_exact_answers():
    """--ptx-coef's A: texts: drawn as the prompts are (never a held-out position), each answer python-chess's."""
    task = ChessEnvTask()
    texts = task.demonstrations(30, random.Random(4))
    assert [p for p, _ in texts] == ChessEnvTask().prompts(30, random.Random(4))
    for prompt, answer in texts:
        assert task.reward_breakdown(prompt, answer)["env_exact"] == 1.0
        assert position_key(parse_env_prompt(prompt).fen) not in task.held_out


@pytest.mark.slow
def test_the_prompt_stream_is_the_same_in_every_process():
    # a seed must name the same prompts in every process (a rerun, a resume): nothing may follow an object's address,
    # as a set of moves does before Python 3.12 (hash(None) is None's address); about 1 prompt in 60 showed it
    draw = ("import random, hashlib; from tasks.rookworld.task import ChessEnvTask; "
            "t = ChessEnvTask(); print(hashlib.sha256(repr([t.prompts(8, random.Random(s)) for s in range(60)])"
            ".encode()).hexdigest())")
    runs = [subprocess.run([sys.executable, "-c", draw], cwd=REPO, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)]
    assert len(set(runs)) == 1, runs
