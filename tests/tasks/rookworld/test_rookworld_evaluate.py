"""Held-out evaluation: the committed set is sound, and the metrics measure what they say."""
import hashlib
import json
import random
from fractions import Fraction
from math import comb

import chess
import pytest
from helpers import means

from tasks.rookworld.engine import EnginePool, find_stockfish
from tasks.rookworld.evaluate import EVAL_FULL, held_out_positions, load_eval_set, metrics, select
from tasks.rookworld.make_eval_set import ORIGINAL, _NoEngine, prompt_key, training_positions
from tasks.rookworld.format import (
    expected_env_completion, legal_move, parse_board, parse_env_prompt, policy_completion, policy_prompt, position_key)
from tasks.rookworld.task import ChessEnvTask, ChessMixTask, ChessPolicyTask


def test_committed_set_is_sound():
    items = load_eval_set()
    assert sum(i["kind"] == "P" for i in items) == EVAL_FULL == 1000 and sum(i["kind"] == "A" for i in items) == 1000
    for item in items:
        board = parse_board(item["fen"])
        if item["kind"] == "P":
            assert item["prompt"] == policy_prompt(item["fen"])
            assert 1 <= len(item["moves"]) == len(item["evals"]) <= 5
            assert all(legal_move(board, m) for m in item["moves"])
        else:
            fields = parse_env_prompt(item["prompt"])
            assert fields.fen == item["fen"]
            if not item["expected"].endswith("+0.5+1+0"):   # a draw may be a fivefold repetition
                assert expected_env_completion(chess.Board(fields.fen), fields.move) == item["expected"]
    assert len(held_out_positions()) == 2000 and ChessEnvTask().held_out == held_out_positions()   # all distinct


def test_the_set_begins_with_the_original_100_items_of_each_kind():
    # --eval-full-samples 100 scores the items the first-100 tables (docs/chess.md, docs/history.md) were measured
    # on: the original file (seed 20261122) was its first 100 P: lines, then its first 100 A: lines
    items = select(load_eval_set(), ("P", "A"), ORIGINAL[1])
    text = "".join(json.dumps(item) + "\n" for item in items)
    assert hashlib.sha256(text.encode()).hexdigest() == ORIGINAL_SHA256


def test_the_set_is_disjoint_from_the_training_stream():
    # a cheap sample of make_eval_set.py's own check, which covered steps 1-700 of seeds 0 and 1: the main job's
    # generators, with no held-out filter, draw none of the added items' positions (so the filter never fires there
    # and the training stream is what it was) ...
    added = {position_key(i["fen"]) for kind in ("P", "A") for i in
             [i for i in load_eval_set() if i["kind"] == kind][ORIGINAL[1]:]}
    drawn = training_positions(seeds=(0,), steps=3) | training_positions(seeds=(1,), steps=700, first_step=698)
    assert len(drawn) > 100 and not drawn & added
    # ... and with the filter, the trainer's prompts and demonstrations never hold a held-out position
    task = ChessMixTask(task_mix=0.5, stockfish_path="/nonexistent")
    task.policy.pool = _NoEngine()
    held = held_out_positions()
    for step in range(1, 4):
        prompts = task.prompts(64, random.Random(step)) + [c for c, _ in task.demonstrations(16, random.Random(step))]
        assert not {prompt_key(p) for p in prompts} & held


@pytest.mark.skipif(find_stockfish() is None, reason="needs Stockfish")
def test_the_added_p_items_carry_stockfishs_analysis():
    items = [i for i in load_eval_set() if i["kind"] == "P"][ORIGINAL[1]::300]   # three of the added ones
    pool = EnginePool(find_stockfish(), depth=items[0]["depth"], size=1)
    try:
        for item in items:
            analysis = pool.analyse(item["fen"]).result()
            assert list(analysis.moves) == item["moves"] and list(analysis.evals) == item["evals"]
    finally:
        pool.close()


ORIGINAL_SHA256 = "fcd963ed742f4ae5205e3a786b9efcee28898947e681b5063982eac519e95534"   # of that file, as committed


def perfect(item):
    if item["kind"] == "A":
        return item["expected"]
    return policy_completion(item["moves"], item["evals"], item["moves"][0])


def test_metrics_of_perfect_partial_and_junk_answers():
    items = select(load_eval_set(), ("P", "A"), 10)
    assert [i["kind"] for i in items] == ["P"] * 10 + ["A"] * 10
    best = means(metrics(items, [perfect(i) for i in items]))
    assert best == {"p_n": 10, "p_best_move_acc": 1.0, "p_top5_acc": 1.0, "p_legal_rate": 1.0,
                    "p_format_rate": 1.0, "a_n": 10, "a_format_rate": 1.0, "a_next_fen_acc": 1.0,
                    "a_exact_acc": 1.0}
    second = [policy_completion(i["moves"], i["evals"], i["moves"][-1]) if i["kind"] == "P"
              else i["expected"][:-1] + ("0" if i["expected"][-1] == "1" else "1") for i in items]
    partial = means(metrics(items, second))
    assert partial["p_best_move_acc"] == 0.0 and partial["p_top5_acc"] == 1.0 and partial["p_format_rate"] == 1.0
    assert partial["a_next_fen_acc"] == 1.0 and partial["a_exact_acc"] == 0.0
    junk = means(metrics(items, ["B: e2e4 junk"] * len(items)))
    assert junk["p_format_rate"] == 0.0 and junk["a_exact_acc"] == 0.0 and junk["a_next_fen_acc"] == 0.0
    assert partial["a_format_rate"] == 1.0 and junk["a_format_rate"] == 0.0


def test_each_task_evaluates_its_kinds_through_the_trainers_decoding():
    # evaluate(complete): the task hands its held-out prompts to complete() and scores what comes back
    by_prompt = {i["prompt"]: perfect(i) for i in load_eval_set()}
    asked = []

    def complete(prompts):
        asked.append(len(prompts))
        return [by_prompt[p] for p in prompts]

    env = means(ChessEnvTask(eval_samples=4).evaluate(complete))
    assert env == {"a_n": 4, "a_format_rate": 1.0, "a_next_fen_acc": 1.0, "a_exact_acc": 1.0}
    policy = ChessPolicyTask(stockfish_path="/nonexistent", eval_samples=3)   # evaluating needs no engine
    assert policy.evaluate(complete)["p_best_move_acc"] == [True] * 3 and "a_n" not in policy.evaluate(complete)
    mix = ChessMixTask(task_mix=1.0, stockfish_path="/nonexistent", eval_samples=2).evaluate(complete)
    assert mix["p_n"] == 2 and mix["a_n"] == 2   # both kinds, whatever the training mix
    assert asked == [4, 3, 3, 4]


def test_sampled_pass_at_k_of_the_best_move_and_next_fen_over_known_answers():
    # sample j of an item is its right answer when j < the item's count (0 to 4 of n = 4), junk otherwise: the
    # task's pass@2 is then the unbiased estimator over those counts, and mean@4 their share
    items = select(load_eval_set(), ("P", "A"), 5)
    count = {item["prompt"]: i % 5 for i, item in enumerate(items)}
    by_prompt = {i["prompt"]: perfect(i) for i in items}
    temperatures = []

    def complete(prompts, n=None, temperature=None):
        if n is None:
            return [by_prompt[p] for p in prompts]
        temperatures.append(temperature)
        return [[by_prompt[p] if j < count[p] else "junk" for j in range(n)] for p in prompts]

    got = means(ChessMixTask(task_mix=1.0, stockfish_path="/nonexistent", eval_samples=5, eval_k=2, eval_n=4,
                             eval_temperature=0.8).evaluate(complete))
    for kind, name in (("P", "p_best_move"), ("A", "a_next_fen")):
        counts = [count[i["prompt"]] for i in items if i["kind"] == kind]
        assert sorted(counts) == [0, 1, 2, 3, 4]
        direct = sum(1 - Fraction(comb(4 - c, 2), comb(4, 2)) for c in counts) / 5
        assert got[f"{name}_pass@2"] == pytest.approx(float(direct)) and got[f"{name}_mean@4"] == 10 / 20
    assert got["p_best_move_acc"] == 1.0 and got["a_next_fen_acc"] == 1.0 and temperatures == [0.8, 0.8]
    # off by default: the greedy metrics alone, one call to complete
    assert not [k for k in ChessEnvTask(eval_samples=2).evaluate(complete) if "@" in k] and temperatures == [0.8] * 2
