"""The RookWorld formats: real data lines round-trip, and A: answers follow python-chess's rules."""
import os

import chess
import pytest

from tasks.rookworld.format import (
    expected_env_completion, legal_move, parse_board, parse_env_prompt, parse_policy_completion,
    policy_completion, policy_prompt, prompt_fen, split_env_line, split_policy_line)

from helpers import ROOK_VAL


@pytest.fixture(scope="module")
def rook_val_lines():
    path = ROOK_VAL
    if not os.path.exists(path):
        pytest.skip("../shared/data/rook_val_400.txt is absent (it is not part of the repository)")
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def test_every_real_policy_line_parses(rook_val_lines):
    assert len(rook_val_lines) == 400
    for line in rook_val_lines:
        prompt, completion = split_policy_line(line)
        assert prompt == line[:line.index("M:")] and prompt + completion == line
        assert len(prompt) == 92 and prompt.endswith(" ")
        fen = prompt_fen(prompt)
        assert policy_prompt(fen) == prompt          # prompts we build are byte-identical
        board = parse_board(fen)
        assert board is not None
        answer = parse_policy_completion(completion)
        assert answer.order_ok and answer.layout_ok
        assert 1 <= len(answer.moves) <= 5 and len(answer.evals) == len(answer.moves)
        assert None not in answer.evals
        assert all(legal_move(board, m) for m in answer.moves), line
        assert answer.best in answer.moves
        # re-writing the parsed fields gives back the very same text
        assert policy_completion(answer.moves, answer.evals, answer.best) == completion


def test_documented_env_example_is_reproduced():
    line = ("A: 8/2k2b2/R1p4r/3p1p2/P7/2P2B1P/5PPK/4R3 w - - 1 31+a6a5+f7e7 h5f3 e6f7 b1b6 h8h6 "
            "a1e1 e7d8 b6a6 d8c7 a6a5+8/2k2b2/2p4r/R2p1p2/P7/2P2B1P/5PPK/4R3 b - - 2 31+0.001+0+0")
    for text in (line, line[3:]):   # lines without a prefix are A: samples too
        prompt, completion = split_env_line(text)
        assert prompt + completion == line
        fields = parse_env_prompt(prompt)
        assert fields.move == "a6a5" and fields.history[-1] == "a6a5" and len(fields.history) == 10
        assert expected_env_completion(chess.Board(fields.fen), fields.move) == completion


def play(*moves, fen=chess.STARTING_FEN):
    board = chess.Board(fen)
    for m in moves:
        board.push_uci(m)
    return board


@pytest.mark.parametrize("board, move, want", [
    (play("f2f3", "e7e5", "g2g4"), "d8h4",
     "rnb1kbnr/pppp1ppp/8/4p3/6Pq/5P2/PPPPP2P/RNBQKBNR w KQkq - 1 3+1.0+1+0"),             # mate
    (play(fen="7k/5Q2/6K1/8/8/8/8/8 w - - 0 1"), "f7f8",
     "5Q1k/8/6K1/8/8/8/8/8 b - - 1 1+1.0+1+0"),                                              # back-rank mate
    (play(fen="7k/8/5QK1/8/8/8/8/8 w - - 0 1"), "f6f7",
     "7k/5Q2/6K1/8/8/8/8/8 b - - 1 1+0.5+1+0"),                                              # stalemate
    (play(fen="8/8/8/8/8/2k5/2n5/K1B5 b - - 0 1"), "c2a3",
     "8/8/8/8/8/n1k5/8/K1B5 w - - 1 2+0.001+0+0"),
    (play(fen="8/8/8/8/8/2k5/2n5/K1B5 b - - 0 1"), "c3b3",
     "8/8/8/8/8/1k6/2n5/K1B5 w - - 1 2+0.001+0+0"),
    (play(fen="8/8/8/8/8/2k5/8/K1n5 w - - 0 1"), "a1b1",
     "8/8/8/8/8/2k5/8/1Kn5 b - - 1 1+0.5+1+0"),                                              # K+N v K
    (play(fen="8/8/8/8/8/2k5/8/K1b1N3 b - - 0 1"), "c1e3",
     "8/8/8/8/8/2k1b3/8/K3N3 w - - 1 2+0.001+0+0"),
    (play(fen="8/8/8/8/3k4/8/1b6/K1N5 w - - 0 1"), "a1b2",
     "8/8/8/8/3k4/8/1K6/2N5 b - - 0 1+0.5+1+0"),                                             # insufficient
    (play(fen="8/8/8/8/8/2k5/8/K6R w - - 149 120"), "h1h2",
     "8/8/8/8/8/2k5/7R/K7 b - - 150 120+0.5+1+0"),                                           # 75 moves
    (play(fen="8/8/8/8/8/2k5/8/K6R w - - 149 120"), "h1c1",
     "8/8/8/8/8/2k5/8/K1R5 b - - 150 120+0.5+1+0"),                                          # 75, check
    (play("e2e4", "a7a6", "e4e5", "d7d5"), "e5d6",
     "rnbqkbnr/1pp1pppp/p2P4/8/8/8/PPPP1PPP/RNBQKBNR b KQkq - 0 3+0.001+0+0"),               # en passant
    (play("e2e4"), "a7a6", "rnbqkbnr/1ppppppp/p7/8/4P3/8/PPPP1PPP/RNBQKBNR w KQkq - 0 2+0.001+0+0"),
    (play(), "e2e4", "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0"),  # no ep square
    (play(fen="r3k2r/8/8/8/8/8/8/R3K2R w KQkq - 0 1"), "e1g1", "r3k2r/8/8/8/8/8/8/R4RK1 b kq - 1 1+0.001+0+0"),
    (play(fen="r3k2r/8/8/8/8/8/8/R3K2R b KQkq - 0 1"), "e8c8", "2kr3r/8/8/8/8/8/8/R3K2R w KQ - 1 2+0.001+0+0"),
    (play(fen="8/1P6/8/8/8/k7/8/K7 w - - 0 1"), "b7b8n", "1N6/8/8/8/8/k7/8/K7 b - - 0 1+0.5+1+0"),
    (play(fen="8/1P6/8/8/8/k7/8/K7 w - - 0 1"), "b7b8r", "1R6/8/8/8/8/k7/8/K7 b - - 0 1+0.001+0+0"),
    (play(fen="8/1P6/8/8/8/k7/8/K7 w - - 0 1"), "b7b8", "8/1P6/8/8/8/k7/8/K7 w - - 0 1+-1.0+0+1"),  # illegal
    (play(), "e2e5", "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+-1.0+0+1"),
    (play(), "e7e5", "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+-1.0+0+1"),   # wrong side
    (play(), "0000", "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+-1.0+0+1"),
    (play(), "zz", "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+-1.0+0+1"),
])
def test_expected_env_completion(board, move, want):
    assert expected_env_completion(board, move) == want


def test_fivefold_repetition_needs_the_game_not_the_prompt():
    shuffle = ["g1f3", "g8f6", "f3g1", "f6g8"] * 4
    board = play(*shuffle[:-1])
    assert expected_env_completion(board, "f6g8").endswith("+0.5+1+0")
    # The same position and move without the game's history is an ordinary move.
    assert expected_env_completion(chess.Board(board.fen()), "f6g8").endswith("+0.001+0+0")


def test_junk_is_not_a_board():
    for fen in ["", "junk", "8/8/8/8/8/8/8/8 w - - 0 1", "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR x"]:
        assert parse_board(fen) is None
    assert parse_env_prompt("A: a+b+") is None and split_env_line("a+b+c") is None
    answer = parse_policy_completion("\udcff\x00 M: B: E:")
    assert not answer.order_ok and not answer.layout_ok


def test_a_move_to_its_own_square_is_not_legal_and_does_not_raise():
    # "c6c6" is UCI-shaped, but python-chess raises on it; a model can write it (the default model did)
    assert legal_move(chess.Board(), "e2e2") is None
