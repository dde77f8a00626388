"""P: rewards against the real Stockfish: the order of answers, bad input, engine death."""
import os
import random
import signal

import chess
import pytest

from harness.task import Scorer, TaskError, score
from tasks.rookworld.engine import find_stockfish
from tasks.rookworld.format import (parse_board, parse_policy_completion, policy_completion, policy_prompt, prompt_fen,
                                    split_policy_line)
from tasks.rookworld.positions import random_board
from tasks.rookworld.task import ChessEnvTask, ChessMixTask, ChessPolicyTask

from helpers import ROOK_VAL

DEPTH = 8   # shallower than training's default: the properties do not depend on depth


@pytest.fixture(scope="module")
def task():
    if find_stockfish() is None:
        pytest.skip("no Stockfish on PATH or at /usr/games/stockfish (make stockfish installs it)")
    t = ChessPolicyTask(stockfish_depth=DEPTH)
    yield t
    t.close()


@pytest.fixture(scope="module")
def positions(task):
    """Generated positions with at least 6 legal moves and an illegal-but-plausible move."""
    rng = random.Random(99)
    out = []
    while len(out) < 25:
        board = random_board(rng)
        if board.legal_moves.count() >= 6:
            prompt = policy_prompt(board.fen(en_passant="fen"))
            out.append(prompt)
    for prompt in out:
        task.engines().analyse(prompt_fen(prompt))   # analyse all at once, as prompts() does
    return out


def answer(task, prompt, best):
    """The engine's own analysis as the answer, with `best` as B:."""
    analysis = task.engines().analyse(prompt_fen(prompt)).result()
    return policy_completion(list(analysis.moves), list(analysis.evals), best)


def an_illegal_move(board: chess.Board) -> str:
    for move in board.pseudo_legal_moves:
        if not board.is_legal(move):
            return move.uci()
    for a in chess.SQUARES:
        for b in chess.SQUARES:
            move = chess.Move(a, b)
            if a != b and not board.is_legal(move):
                return move.uci()


def test_engine_best_beats_top5_beats_legal_beats_illegal_beats_garbage(task, positions):
    for prompt in positions:
        board = parse_board(prompt_fen(prompt))
        top = list(task.engines().analyse(prompt_fen(prompt)).result().moves)
        assert len(top) == 5
        other = next(m.uci() for m in board.legal_moves if m.uci() not in top)
        scores = [task.reward(prompt, answer(task, prompt, m)) for m in top]
        assert scores[0] == pytest.approx(1.0)
        assert all(a > b for a, b in zip(scores, scores[1:])), scores
        legal = task.reward(prompt, answer(task, prompt, other))
        illegal = task.reward(prompt, answer(task, prompt, an_illegal_move(board)))
        garbage = task.reward(prompt, "qwerty 123")
        assert scores[-1] > legal > illegal > garbage >= 0.0, (scores, legal, illegal, garbage)
        # a bare legal move still beats the best-looking answer around an illegal one
        bare = task.reward(prompt, f"B: {other}")
        assert bare > illegal


def test_answer_parts_earn_partial_credit(task, positions):
    prompt = positions[0]
    analysis = task.engines().analyse(prompt_fen(prompt)).result()
    best = analysis.moves[0]
    full = task.reward_breakdown(prompt, answer(task, prompt, best))
    assert tuple(full) == task.reward_parts   # what --reward-weights is checked against at start-up
    wrong_evals = task.reward_breakdown(
        prompt, policy_completion(list(analysis.moves), [e + 3 for e in analysis.evals], best))
    two = task.reward_breakdown(prompt, policy_completion(list(analysis.moves[:2]), list(analysis.evals[:2]), best))
    assert full["reward"] > wrong_evals["reward"] and wrong_evals["policy_evals"] == pytest.approx(0.25)
    assert full["reward"] > two["reward"] and two["policy_candidates"] == pytest.approx(0.4)
    # evaluations are paired with their own moves: swapping two of them costs
    evals = list(analysis.evals)
    evals[0], evals[4] = evals[4], evals[0]
    if evals[0] != evals[4]:
        swapped = task.reward_breakdown(prompt, policy_completion(list(analysis.moves), evals, best))
        assert swapped["policy_evals"] < 1.0


def test_illegal_never_outscores_legal(task, positions):
    rng = random.Random(3)
    for prompt in positions[:10]:
        board = parse_board(prompt_fen(prompt))
        illegal = an_illegal_move(board)
        best_illegal = max(task.reward(prompt, answer(task, prompt, illegal)),
                           task.reward(prompt, policy_completion([illegal], [0.0], illegal)))
        legal = [m.uci() for m in board.legal_moves]
        for _ in range(5):
            junk = policy_completion(rng.sample(legal, 1), [rng.uniform(-9, 9)], rng.choice(legal))
            assert task.reward(prompt, junk) > best_illegal
            assert task.reward(prompt, "B: " + rng.choice(legal)) > best_illegal


@pytest.mark.parametrize("completion", [
    "", "x" * 1_000_000, "M: " * 50_000, b"\xff\xfe\x80junk\xc3".decode("utf-8", "surrogateescape"),
    "\x00\u202e\U0001F600", "M: e2e4 E: nan B: e9e9", "M: E: B: 0000"])
def test_bad_completions_get_a_low_reward(task, completion):
    prompt = policy_prompt(chess.STARTING_FEN)
    assert 0.0 <= task.reward(prompt, completion) <= 0.1


@pytest.mark.parametrize("prompt", [
    "P: not a fen", "P: 8/8/8/8/8/8/8/8 w - - 0 1", "P: ", "",
    policy_prompt("7k/5Q2/6K1/8/8/8/8/8 b - - 0 1"),     # stalemate: no move to score
    policy_prompt("k7/8/8/8/8/8/8/K6Q w - - 0 1")])      # side not to move in check: invalid
def test_prompts_that_are_no_position_get_the_minimum(task, prompt):
    assert task.reward(prompt, "M: e2e4 E: 0.1 B: e2e4") == 0.0


def test_dead_engine_is_restarted_and_the_position_retried(task):
    engine = task.engines().engines()[0]
    os.kill(engine.transport.get_pid(), signal.SIGKILL)
    before = task.engines().restarts
    fen = "r1bqkbnr/pppp1ppp/2n5/4p3/4P3/5N2/PPPP1PPP/RNBQKB1R w KQkq - 2 3"
    assert task.reward(policy_prompt(fen), "B: f1b5") > 0.1
    assert task.engines().restarts == before + 1


def test_missing_engine_is_a_one_line_usage_error_when_prompts_are_drawn():
    # building the task needs no engine (evaluating needs none); drawing P: prompts does
    task = ChessPolicyTask(stockfish_path="/nonexistent/stockfish")
    with pytest.raises(TaskError) as err:
        task.prompts(2, random.Random(0))
    message = str(err.value)
    assert "\n" not in message and "--task chess-env" in message and "install" in message
    with pytest.raises(TaskError):
        ChessMixTask(stockfish_path="/nonexistent/stockfish").prompts(8, random.Random(0))
    mix = ChessMixTask(task_mix=0.0, stockfish_path="/nonexistent/stockfish")   # A: only: no engine
    assert all(p.startswith("A: ") for p in mix.prompts(4, random.Random(0)))
    mix.close()


def test_a_mostly_p_mixture_weighs_the_a_parts_a_step_did_not_draw():
    # --task-mix 0.95 draws steps of P: alone; --reward-weights env_fen=1 is still a part of the reward
    mix = ChessMixTask(task_mix=0.95, stockfish_path="/nonexistent/stockfish")
    assert mix.reward_parts == ChessPolicyTask.reward_parts + ChessEnvTask.reward_parts[:-1]
    p_only = {"errors": {}, "scored": 8, "reports": {}, "part_means": {"policy_best": 0.5, "policy_legal": 1.0}}
    Scorer(mix, tolerate=False, weights={"env_fen": 1.0, "policy_best": 1.0}).after_step(1, p_only, 0.0)
    p_alone = ChessMixTask(task_mix=1.0, stockfish_path="/nonexistent/stockfish")
    assert p_alone.reward_parts == ChessPolicyTask.reward_parts   # P: alone: an A: weight is refused at start-up
    mix.close()
    p_alone.close()


def test_mixture_draws_both_kinds_and_dispatches(task):
    mix = ChessMixTask(task_mix=0.5, stockfish_depth=DEPTH)
    try:
        prompts = mix.prompts(100, random.Random(0))
        share = sum(p.startswith("P: ") for p in prompts) / len(prompts)
        assert 0.35 < share < 0.65
        env = next(p for p in prompts if p.startswith("A: "))
        assert mix.reward(env, mix.env.expected(env)) == pytest.approx(1.0)
        assert "env_fen" in mix.reward_breakdown(env, "") and "policy_best" not in mix.reward_breakdown(env, "")
        # logged means are per kind: one exact A: answer and three P: ones give env_exact 1, not 0.25
        policy = [p for p in prompts if p.startswith("P: ")][:3]
        _, means, errors = score(mix, [env] + policy, [mix.env.expected(env)] + ["junk"] * 3)
        assert means["env_exact"] == 1.0 and means["policy_legal"] == 0.0 and not errors
    finally:
        mix.close()


def test_real_data_answers_agree_with_the_engine(task):
    """The data's own answers, scored: evaluations agree for both colours (same sign convention: side
    to move), and the documented defect shows: black's B: is the data's worst candidate."""
    path = ROOK_VAL
    if not os.path.exists(path):
        pytest.skip("../shared/data/rook_val_400.txt is absent (it is not part of the repository)")
    with open(path, encoding="utf-8") as f:
        lines = [split_policy_line(line.rstrip("\n")) for line in f][:40]
    for prompt, _ in lines:
        task.engines().analyse(prompt_fen(prompt))
    by_side = {"w": [], "b": []}
    for prompt, completion in lines:
        by_side[prompt_fen(prompt).split()[1]].append(task.reward_breakdown(prompt, completion))
    mean = {side: {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]} for side, parts in by_side.items()}
    for side in "wb":
        assert mean[side]["policy_legal"] == 1.0 and mean[side]["policy_format"] == 1.0
        assert mean[side]["policy_candidates"] > 0.5 and mean[side]["policy_evals"] > 0.5, mean
    assert mean["w"]["policy_best"] > mean["b"]["policy_best"] + 0.2, mean


def test_a_malformed_legal_answer_earns_its_move_and_format_credit_only(task, positions):
    for prompt in positions[:10]:
        analysis = task.engines().analyse(prompt_fen(prompt)).result()
        best = analysis.moves[0]
        well = task.reward(prompt, answer(task, prompt, best))
        # the same answer with the columns squeezed: one format check (the layout) fails
        squeezed = f"M: {' '.join(analysis.moves)} E: {' '.join(map(str, analysis.evals))} B: {best}"
        parts = task.reward_breakdown(prompt, squeezed)
        assert parts["policy_format"] == pytest.approx(0.8) and parts["policy_best"] == 1.0
        assert parts["reward"] == pytest.approx(0.5 * 1.0 + 0.1 * 0.8)
        assert well == pytest.approx(1.0) and parts["reward"] < well - 0.4
        # still a legal answer: above any illegal one
        illegal = an_illegal_move(parse_board(prompt_fen(prompt)))
        assert parts["reward"] > task.reward(prompt, answer(task, prompt, illegal))


def test_demonstrations_are_the_engines_answers_in_the_models_layout(task):
    """--ptx-coef's P: texts: a drawn prompt and Stockfish's five candidates with their evaluations, in UCI order
    (as the shipped model learned them), B: the engine's top move; the reward scores each as a right answer."""
    texts = task.demonstrations(6, random.Random(3))
    assert [p for p, _ in texts] == task.prompts(6, random.Random(3))   # drawn as the prompts are
    for prompt, answer in texts:
        analysis = task.engines().analyse(prompt_fen(prompt)).result()
        parsed = parse_policy_completion(answer)
        assert parsed.layout_ok and parsed.moves == sorted(analysis.moves) and parsed.best == analysis.moves[0]
        parts = task.reward_breakdown(prompt, answer)
        assert parts["policy_legal"] == 1 and parts["policy_best"] == 1


def test_the_mixtures_demonstrations_follow_demo_mix_not_task_mix(task):
    mix = ChessMixTask(task_mix=0.0, demo_mix=0.5, stockfish_depth=DEPTH)   # A: prompts, P: texts as well
    try:
        texts = mix.demonstrations(40, random.Random(0))
        share = sum(p.startswith("P: ") for p, _ in texts) / len(texts)
        assert 0.3 < share < 0.7 and all(p.startswith("A: ") for p in mix.prompts(8, random.Random(0)))
    finally:
        mix.close()
    mix = ChessMixTask(demo_mix=0.0, stockfish_path="/nonexistent/stockfish", task_mix=0.0)   # A: texts: no engine
    assert all(p.startswith("A: ") for p, _ in mix.demonstrations(8, random.Random(0)))
    with pytest.raises(TaskError):
        ChessMixTask(demo_mix=1.0, task_mix=0.0, stockfish_path="/nonexistent/stockfish").demonstrations(
            2, random.Random(0))
