"""Chess A: prompts for the benchmark, built with python-chess (bench-local stand-in for the chess task).

Prompt: `A: {fen}+{move}+{history}+` (see the RookWorld task formats). Reward: the share of the four
answer fields (new FEN, reward, terminated, truncated) the completion gets right. The benchmark only
needs both systems to draw the same prompts and run the same reward; the work per step is fixed by
the 144 new tokens every completion gets.
"""
import random

import chess


def _outcome(board: chess.Board) -> tuple:
    if board.is_checkmate():
        return 1.0, 1
    if board.is_game_over(claim_draw=False):
        return 0.5, 1
    return 0.001, 0


class ChessA:
    name = "chess-a"
    min_reward = 0.0

    def prompts(self, n: int, rng: random.Random) -> list:
        out = []
        while len(out) < n:
            board, played = chess.Board(), []
            for _ in range(rng.randrange(0, 60)):
                moves = list(board.legal_moves)
                if not moves:
                    break
                played.append(rng.choice(moves).uci())
                board.push_uci(played[-1])
            moves = list(board.legal_moves)
            if not moves:
                continue
            move = rng.choice(moves).uci()
            history = " ".join((played + [move])[-10:])
            out.append(f"A: {board.fen()}+{move}+{history}+")
        return out

    def answer(self, prompt: str) -> list:
        fen, move = prompt[3:].split("+")[:2]
        board = chess.Board(fen)
        board.push_uci(move)
        reward, terminated = _outcome(board)
        return [board.fen(), str(reward), str(terminated), "0"]

    def reward(self, prompt: str, completion: str) -> float:
        truth = self.answer(prompt)
        got = completion.strip().split("+")
        return sum(a == b for a, b in zip(got, truth)) / len(truth)
