"""The shipped default model (models/rook-tiny) and the pieces of the script that builds it."""
import importlib.util
import json
import os

import chess
import pytest
import torch

from harness import config
from tasks.rookworld import evaluate
from grpo.model import load_policy, load_tokenizer
from grpo.rollout import encode_prompts
from harness.task import eval_completions
from tasks.rookworld.format import is_uci, parse_policy_completion, policy_format_checks

from helpers import REPO, means
MODEL = os.path.join(REPO, "models", "rook-tiny")
SCRIPT = os.path.join(REPO, "tasks", "rookworld", "build_model.py")


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
    # the shipped model was built before the script moved from scripts/make_default_model.py
    assert info["command"].split()[1] in ("tasks/rookworld/build_model.py", "scripts/make_default_model.py")


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


# The "first 100 per kind" column of docs/chess.md's table of the shipped model (greedy, the held-out set's first 100
# items of each kind: the original set, which the older tables in docs/history.md were measured on), in percent. A
# rebuilt or replaced model must come with new tables: this test and the README's below keep them together.
README_BEFORE = {"p_best_move_acc": 7, "p_top5_acc": 23, "p_legal_rate": 46, "p_format_rate": 84,
                 "a_format_rate": 87, "a_next_fen_acc": 8, "a_exact_acc": 7}


README_LABELS = {"P: best-move accuracy": "p_best_move_acc", "P: top-5 accuracy": "p_top5_acc",
                 "P: legal-move rate": "p_legal_rate", "P: format rate": "p_format_rate",
                 "A: format rate": "a_format_rate", "A: next-FEN accuracy": "a_next_fen_acc",
                 "A: exact-completion accuracy": "a_exact_acc"}


def readme_before() -> dict:
    """The README chess table's "before" column: {metric key: percent}."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        rows = [line.split("|")[1:3] for line in f if line.startswith("| P: ") or line.startswith("| A: ")]
    return {README_LABELS[label.strip()]: float(before.strip().split("%")[0]) for label, before in rows}


@pytest.mark.slow
def test_the_readmes_before_column_is_the_shipped_model_on_the_whole_set(shipped):
    tok, model = shipped
    before = readme_before()
    assert set(before) == set(README_LABELS.values())
    items = evaluate.select(evaluate.load_eval_set(), ("P", "A"), evaluate.EVAL_FULL)   # what --eval-only scores
    texts = eval_completions(model, tok, [i["prompt"] for i in items], prepend_bos=True, max_new_tokens=144,
                             batch=64)
    got = means(evaluate.metrics(items, texts))
    # 1 point of 1,000 items: another CPU's float rounding may flip an argmax or a few
    assert all(abs(100 * got[k] - v) <= 1.0 for k, v in before.items()), (got, before)


@pytest.mark.slow   # 200 greedy decodings of 144 tokens by the shipped model
def test_the_first_100_items_score_what_docs_chess_md_reports(shipped):
    tok, model = shipped
    items = evaluate.select(evaluate.load_eval_set(), ("P", "A"), 100)
    # what `python train_lean.py --eval-only --eval-full-samples 100` decodes: BOS first, 144 new tokens, batches of 64
    texts = eval_completions(model, tok, [i["prompt"] for i in items], prepend_bos=True, max_new_tokens=144,
                             batch=64)
    got = means(evaluate.metrics(items, texts))
    # 3 points of slack: another CPU's float rounding may flip an argmax or two
    assert all(abs(100 * got[k] - v) <= 3 for k, v in README_BEFORE.items()), got
    # every P: answer has its markers in order and a UCI best move; the candidates are distinct in all
    # but a few (the unlikelihood loss of the build), and the exact column layout is what fails most
    answers = [parse_policy_completion(t) for i, t in zip(items, texts) if i["kind"] == "P"]
    assert all(a.order_ok and is_uci(a.best) for a in answers)
    assert sum(len(set(a.moves)) == len(a.moves) for a in answers) >= 90
    assert sum(a.layout_ok and len(a.moves) == len(a.evals) and None not in a.evals and all(map(is_uci, a.moves))
               for a in answers) >= 80


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


def test_plain_attention_the_cpu_build_trains_with_gives_sdpa_logits_under_right_padding():
    from transformers import GPT2Config, GPT2LMHeadModel
    script = build_script()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       activation_function="gelu_pytorch_tanh")).eval()
    input_ids, attention = script.right_pad([[1, 2, 3, 4, 5, 6], [7, 8, 9]], 0)
    logits = {}
    for implementation in ("eager", "sdpa"):
        model.set_attn_implementation(implementation)
        logits[implementation] = model(input_ids=input_ids, attention_mask=attention).logits
    real = attention.bool()
    torch.testing.assert_close(logits["eager"][real], logits["sdpa"][real], atol=1e-5, rtol=1e-5)


def test_repeated_candidates_are_found_in_the_m_field_only(shipped):
    script = build_script()
    tok, _ = shipped   # the build's own tokenizer
    pieces = [tok.decode([i]) for i in range(len(tok))]
    completion = "M: b8c6 b8c6 g6h7 a7a8q a7a8q g6h7     E: 0.1 0.1 0.1 0.1     B: b8c6"
    ids = tok(completion, add_special_tokens=False)["input_ids"]
    found = script.repeated_candidates(ids, pieces)
    # the second b8c6, the second a7a8q and the second g6h7 (however each splits into tokens); B: is no repeat
    assert [tok.decode(ids[j]) for j in found] == [" b8c6", " a7a8", tok.decode(tok(" g6h7")["input_ids"][0])]
    assert script.repeated_candidates(tok("M: a1a2 b1b2 c1c2     E: 0 0 0     B: a1a2")["input_ids"], pieces) == []


def test_policy_labels_give_the_engines_best_move_for_black_too():
    from tasks.rookworld.engine import EnginePool, find_stockfish
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


def test_training_text_lists_candidates_in_uci_order_each_with_its_evaluation():
    script = build_script()
    ranked = "M: f7f8q d1e2 d1c1 d1d2 d1c2     E: 6.51 6.49 6.48 -0.5 6.36                B: f7f8q"
    ordered = script.uci_order(ranked)
    answer, before = parse_policy_completion(ordered), parse_policy_completion(ranked)
    assert answer.moves == ["d1c1", "d1c2", "d1d2", "d1e2", "f7f8q"]
    assert dict(zip(answer.moves, answer.evals)) == dict(zip(before.moves, before.evals))
    assert answer.best == "f7f8q" and all(policy_format_checks(answer))
    assert len(ordered) == len(ranked)   # the column layout is kept


@pytest.mark.slow   # four builds (Stockfish's labels, training) on the script's own threads
def test_a_build_is_reproducible_from_its_seed_and_reuses_its_data(tmp_path, capsys):
    from tasks.rookworld.engine import find_stockfish
    if find_stockfish() is None:
        pytest.skip("Stockfish not installed")
    from safetensors.torch import load_file
    script = build_script()
    tiny = ["--policy-positions", "12", "--env-samples", "24", "--depth", "4", "--train-steps", "8", "--batch-size", "8",
            "--n-layer", "1", "--n-embd", "32", "--vocab-size", "300", "--save-every", "2", "--log-every", "2",
            "--policy-repeats", "6"]
    for name in ("a", "b"):   # two builds from scratch, nothing shared
        script.main(["--out", str(tmp_path / name), "--work-dir", str(tmp_path / f"work-{name}"), *tiny])
    data = [(tmp_path / f"work-{name}" / "data.txt").read_text() for name in ("a", "b")]
    assert data[0] == data[1] and data[0].count("\nP: ") + data[0].startswith("P: ") == 12
    weights = [load_file(str(tmp_path / name / "model.safetensors")) for name in ("a", "b")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert (tmp_path / "work-a" / "checkpoint" / "model.safetensors").exists()   # what a crash would leave
    # the unlikelihood loss decoded the model's own P: lists (and stays reproducible with it)
    curve = json.load(open(tmp_path / "a" / "build_info.json"))["loss_curve"]
    assert any("repeats_per_greedy_list" in point for point in curve)
    # the same data arguments with another model size: the data is read back, not generated again
    capsys.readouterr()
    script.main(["--out", str(tmp_path / "c"), "--work-dir", str(tmp_path / "work-a"), *tiny, "--n-embd", "64"])
    assert "reused from" in capsys.readouterr().out
    info = json.load(open(tmp_path / "c" / "build_info.json"))
    assert info["data_seconds"] is None and info["samples"]["P"] == 12
    # a second stage trains that model further on the same data and records where it started
    script.main(["--out", str(tmp_path / "d"), "--work-dir", str(tmp_path / "work-a"), *tiny,
                 "--continue-training", "--from", str(tmp_path / "c"), "--train-steps", "2"])
    info = json.load(open(tmp_path / "d" / "build_info.json"))
    assert info["previous_stage"]["args"]["n_embd"] == 64 and info["args"]["train_steps"] == 2
    assert load_file(str(tmp_path / "d" / "model.safetensors"))["transformer.wte.weight"].shape[1] == 64
