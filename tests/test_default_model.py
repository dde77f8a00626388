"""The shipped default model (models/rook-tiny) and the pieces of the script that builds it."""
import importlib.util
import json
import os

import chess
import pytest
import torch

from grpo import config, evaluate
from grpo.model import load_policy, load_tokenizer
from grpo.rollout import decode_completions, encode_prompts, generate, left_pad
from grpo.tasks.chess_format import is_uci, parse_policy_completion, policy_format_checks
from grpo.tasks.chess_tasks import env_components

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "models", "rook-tiny")
SCRIPT = os.path.join(REPO, "scripts", "make_default_model.py")


def build_script():
    spec = importlib.util.spec_from_file_location("make_default_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shipped():
    return load_tokenizer(MODEL), load_policy(MODEL, "cpu")


def test_the_default_model_is_the_shipped_folder_and_small():
    assert config.Config().model == MODEL
    weights = os.path.join(MODEL, "model.safetensors")
    assert os.path.getsize(weights) < 30 * 2**20
    info = json.load(open(os.path.join(MODEL, "build_info.json")))
    assert info["command"].startswith("python scripts/make_default_model.py")


def test_loads_with_auto_classes_like_gpt2(shipped):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    tok, _ = shipped
    assert model.config.model_type == "gpt2"
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.eos_token_id
    # the trainer's longest case fits: a prompt plus the default --max-new-tokens
    assert model.config.n_positions >= 100 + config.Config().max_new_tokens


def test_tokenizer_keeps_moves_and_padding_whole(shipped):
    tok, _ = shipped
    for move in (" e2e4", " g1f3", " e1g1"):
        assert len(tok(move, add_special_tokens=False)["input_ids"]) == 1, move
    assert len(tok(" e7e8q", add_special_tokens=False)["input_ids"]) <= 2
    # a P: prompt's padding spaces do not cost a token each
    item = evaluate.load_eval_set()[0]
    assert item["kind"] == "P"
    assert len(tok(item["prompt"], add_special_tokens=False)["input_ids"]) < 40
    assert tok.decode(tok(item["prompt"], add_special_tokens=False)["input_ids"]) == item["prompt"]


def test_greedy_completions_of_held_out_prompts_are_well_formed(shipped):
    tok, model = shipped
    items = evaluate.load_eval_set()
    policy = [i for i in items if i["kind"] == "P"][:8]
    env = [i for i in items if i["kind"] == "A"][:8]
    eos = tok.eos_token_id
    ids, mask = left_pad(encode_prompts(tok, [i["prompt"] for i in policy + env], True), eos)
    out, out_mask, _ = generate(model, ids, mask, eos_id=eos, max_new_tokens=96, temperature=0)
    texts = decode_completions(tok, out, out_mask, eos)
    policy_ok = []
    for text in texts[:8]:
        # the column layout, one UCI move per candidate with one number each, a UCI best move. (Not
        # checked: distinct candidates; greedy decoding of this small model often repeats one.)
        answer = parse_policy_completion(text)
        assert answer.order_ok and is_uci(answer.best), text
        policy_ok.append(answer.layout_ok and len(answer.moves) == len(answer.evals) and None not in answer.evals
                         and all(map(is_uci, answer.moves)))
    assert sum(policy_ok) >= 5, texts[:8]
    env_ok = [env_components(i["expected"], t)["format"] == 1.0 for i, t in zip(env, texts[8:])]
    assert sum(env_ok) >= 6, texts[8:]


def test_training_rows_mask_the_prompt_and_tokenise_like_the_trainer():
    script = build_script()
    samples = [("P: 8/8/8/8/8/8/8/K6k w - - 0 1" + " " * 60, "M: a1a2 a1b1     E: 0.0 0.0       B: a1a2"),
               ("A: 8/8/8/8/8/8/8/K6k w - - 0 1+a1a2+a1a2+", "8/8/8/8/8/8/K7/7k b - - 1 1+0.001+0+0")]
    tok = script.train_tokenizer([p + c for p, c in samples] * 20, vocab_size=300)
    rows = script.encode(tok, samples)
    for (prompt, completion), (ids, start) in zip(samples, rows):
        eos = tok.eos_token_id
        assert ids[0] == ids[-1] == eos
        # the trainer's prompt ids (BOS first) are exactly the row's context part
        assert ids[:start] == encode_prompts(tok, [prompt], True)[0]
        assert tok.decode(ids[start:-1]) == completion


def test_policy_labels_give_the_engines_best_move_for_black_too():
    from grpo.tasks.chess_engine import EnginePool, find_stockfish
    path = find_stockfish()
    if path is None:
        pytest.skip("Stockfish not installed")
    script = build_script()
    # black to move and a queen hangs: the best move is the capture, for black
    board = chess.Board("4k3/8/8/3q4/8/8/3Q4/4K3 b - - 0 1")
    pool = EnginePool(path, depth=6)
    try:
        prompt, completion, moves, _ = script.policy_sample(pool, board)
    finally:
        pool.close()
    answer = parse_policy_completion(completion)
    assert all(policy_format_checks(answer))
    assert answer.best == moves[0] == "d5d2"
    assert prompt == "P: " + board.fen().ljust(89)
