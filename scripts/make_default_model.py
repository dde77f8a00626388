"""Build the embedded default model from a seed, with nothing downloaded: data, tokenizer, GPT-2.

    python scripts/make_default_model.py                       # data and 1,800 steps (41 min, 2 busy cores)
    python scripts/make_default_model.py --continue-training --train-steps 700 --lr 7.5e-4   # 10 min more:
                                                               # together, the shipped models/rook-tiny
    python scripts/make_default_model.py --out /tmp/toy --work-dir /tmp/toy --policy-positions 200 --env-samples 400 \
        --train-steps 50                                       # the pipeline end to end in a minute

1. Data. P: positions come from two sources: games played by Stockfish itself (a softmax over its own
   multi-PV 5 evaluations, so they look like real games) and the same seeded position generator the
   chess tasks draw their prompts from (openings to endgames, mates, draws, repetitions). Every P:
   position is labelled by Stockfish (fixed depth, multi-PV 5, the pool the P: reward uses): M: holds
   the top moves in rank order, E: their evaluations, B: the top move, for either side to move. A:
   samples cost no engine: the moves played in those games, plus generated transitions (rare rules
   and illegal moves weighted up), each answered by python-chess. Positions of the held-out
   evaluation set are excluded. All text is built by grpo.tasks.chess_format, so it is byte-identical
   to what the tasks prompt with.
2. Tokenizer. Byte-level BPE over chunks that never cross a space, '+' or '/', so a UCI move, a FEN
   rank or a number is learned as one or two tokens and runs of padding spaces merge.
3. Model. A small GPT-2 trained with next-token loss on the completion and the closing EOS only (the
   prompt is context, not target), saved in fp32 with the tokenizer and a build_info.json.
"""
import argparse
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import chess
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.tasks.chess_engine import EnginePool, find_stockfish  # noqa: E402
from grpo.tasks.chess_format import (env_prompt, expected_env_completion, policy_completion,  # noqa: E402
                                     policy_prompt, split_env_line, split_policy_line)
from grpo.tasks.chess_positions import history, random_board, random_transition  # noqa: E402
from grpo.tasks.chess_tasks import held_out_positions, position_key  # noqa: E402

EOS = "<|endoftext|>"
# One pre-token: an optional leading space or '/' then anything but space, '+' or '/' (a move, a FEN
# rank, a number, a field marker like "M:"), or a run of spaces that leaves its last space to the
# next word (as GPT-2 does), or one separator. BPE merges never cross these chunks.
PRETOKEN = r"[ /]?[^\s+/]+|\s+(?!\S)|\s+|[+/]"


# ---------------------------------------------------------------- 1. data

def policy_sample(pool: EnginePool, board: chess.Board) -> tuple[str, str, list[str], list[float]]:
    """A P: (prompt, completion) labelled by the engine, with the analysis for choosing a move."""
    fen = board.fen(en_passant="fen")    # the data writes the en-passant square after every double push
    analysis = pool.analyse(fen).result()
    moves, evals = list(analysis.moves), list(analysis.evals)
    # Rank order (the format allows any order): the first candidate is then B:, which is easy to learn.
    return policy_prompt(fen), policy_completion(moves, evals, moves[0]), moves, evals


def env_sample(board: chess.Board, move: chess.Move) -> tuple[str, str]:
    return env_prompt(board.fen(), move.uci(), history(board, move)), expected_env_completion(board, move.uci())


def engine_game(pool: EnginePool, rng: random.Random, held_out: set, max_plies: int = 160):
    """One game where each move is drawn from a softmax over the engine's top 5 (evals in pawns).

    Returns its P: samples and the A: samples of the moves played. A few random opening plies and an
    occasional random move keep games apart and put blunders (and their refutations) in the data.
    """
    board = chess.Board()
    temperature = rng.choice([0.3, 0.6, 1.0])
    random_plies = rng.randint(0, 4)
    policy, env = [], []
    for ply in range(max_plies):
        if board.is_game_over():
            break
        prompt, completion, moves, evals = policy_sample(pool, board)
        if ply < random_plies or rng.random() < 0.05:
            move = rng.choice(list(board.legal_moves))
        else:
            # evals are capped so that mate scores (about +-1000) still leave the other moves a chance
            weights = [math.exp((min(e, 20) - min(evals[0], 20)) / temperature) for e in evals]
            move = chess.Move.from_uci(rng.choices(moves, weights=weights)[0])
        if position_key(board.fen()) not in held_out:
            policy.append((prompt, completion))
            env.append(env_sample(board, move))
        board.push(move)
    return policy, env


def make_data(seed: int, policy_positions: int, env_samples: int, depth: int, engines: int, log) -> dict:
    """P: and A: samples: half the P: positions from engine games, half from the task generator."""
    path = find_stockfish()
    if path is None:
        sys.exit("make_default_model.py: Stockfish is needed to label P: samples (apt-get install stockfish)")
    held_out = held_out_positions()
    pool = EnginePool(path, depth=depth, size=engines, cache_size=10 * policy_positions + 1000)
    seen, policy, env = set(), [], []

    def keep_policy(items):
        for prompt, completion in items:
            key = position_key(prompt[3:].strip())
            if key not in seen and len(policy) < policy_positions:
                seen.add(key)
                policy.append((prompt, completion))

    t0 = time.time()
    # generated positions: submitted at once, the pool analyses them while the games below run
    rng = random.Random(f"{seed}-positions")
    boards = []
    while len(boards) < policy_positions // 2:
        board = random_board(rng)
        if position_key(board.fen()) not in held_out:
            boards.append(board)
    with ThreadPoolExecutor(max_workers=engines) as games:
        game_results = games.map(lambda i: engine_game(pool, random.Random(f"{seed}-game-{i}"), held_out),
                                 range(policy_positions))
        keep_policy(policy_sample(pool, b)[:2] for b in boards)
        for i, (game_policy, game_env) in enumerate(game_results):
            keep_policy(game_policy)
            env.extend(game_env)
            if i % 20 == 0:
                log(f"data: {len(policy)}/{policy_positions} P: positions after {i + 1} games, "
                    f"{time.time() - t0:.0f}s")
            if len(policy) >= policy_positions:
                break
        games.shutdown(wait=False, cancel_futures=True)   # enough positions: drop the games not started
        pool.close()   # and end the running ones (their pending analyses are cancelled)
    rng = random.Random(f"{seed}-transitions")
    while len(env) < env_samples:
        board, move = random_transition(rng)
        if position_key(board.fen()) not in held_out:
            env.append(env_sample(board, move))
    env = env[:env_samples] if len(env) > env_samples else env
    log(f"data: {len(policy)} P: and {len(env)} A: samples in {time.time() - t0:.0f}s")
    return {"P": policy, "A": env, "seconds": time.time() - t0}


# ---------------------------------------------------------------- 2. tokenizer

def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE over space/'+'/'/'-bounded chunks, wrapped like GPT-2's (EOS = BOS, no pad)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKEN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS)


def encode(tok, samples: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """Each sample as EOS + prompt + completion + EOS, tokenised as the trainer does (prompt and
    completion apart, BOS first), with the index where the completion starts."""
    eos = tok.eos_token_id
    prompts = tok([p for p, _ in samples], add_special_tokens=False)["input_ids"]
    completions = tok([c for _, c in samples], add_special_tokens=False)["input_ids"]
    return [([eos] + p + c + [eos], 1 + len(p)) for p, c in zip(prompts, completions)]


# ---------------------------------------------------------------- 3. model

def train_model(rows: list[tuple[list[int], int]], vocab_size: int, args, log, model=None) -> tuple:
    """A GPT-2 (new, or `model` continued) trained on completion tokens only; returns it and the loss curve."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    if model is None:
        config = GPT2Config(vocab_size=vocab_size, n_positions=args.n_positions, n_embd=args.n_embd,
                            n_layer=args.n_layer, n_head=args.n_embd // 64, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.train_steps // 50)
    # linear warm-up, then cosine decay to a tenth of the peak
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (
        1 + math.cos(math.pi * min(1.0, s / args.train_steps)))))
    rng = random.Random(f"{args.seed}-batches-{args.continue_training}")
    order: list[int] = []
    curve, t0, seen_tokens = [], time.time(), 0
    model.train()
    for step in range(1, args.train_steps + 1):
        batch = []
        for _ in range(args.batch_size):
            if not order:   # epochs: a fresh shuffle of all samples each time
                order = list(range(len(rows)))
                rng.shuffle(order)
            batch.append(rows[order.pop()])
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, start) in enumerate(batch):   # right padding: positions start at 0 in every row
            input_ids[i, :len(ids)] = torch.tensor(ids)
            attention[i, :len(ids)] = 1
            labels[i, start:len(ids)] = input_ids[i, start:len(ids)]
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        seen_tokens += int(attention.sum())
        if step % args.log_every == 0 or step == args.train_steps:
            elapsed = time.time() - t0
            curve.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(elapsed, 1)})
            log(f"train: step {step}/{args.train_steps} loss {loss.item():.3f} "
                f"{seen_tokens / elapsed:.0f} tokens/s {elapsed:.0f}s")
    model.eval()
    return model, curve


def greedy_samples(model, tok, samples: list[tuple[str, str]]) -> list[dict]:
    """Greedy completions of a few training prompts: a quick look that the format was learned."""
    from grpo.rollout import encode_prompts, generate, left_pad
    out = []
    for prompt, want in samples:
        ids, mask = left_pad(encode_prompts(tok, [prompt], True), tok.eos_token_id)
        got, got_mask, _ = generate(model, ids, mask, eos_id=tok.eos_token_id, max_new_tokens=96, temperature=0)
        text = tok.decode(got[0, :int(got_mask.sum()) - 1])
        out.append({"prompt": prompt, "expected": want, "greedy": text, "exact": text == want})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="models/rook-tiny", help="model folder to write")
    parser.add_argument("--work-dir", default="out/default-model", help="where the generated data is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy-positions", type=int, default=8000, help="P: samples (Stockfish-labelled)")
    parser.add_argument("--env-samples", type=int, default=16000, help="A: samples (python-chess)")
    parser.add_argument("--depth", type=int, default=8, help="Stockfish depth for the P: labels")
    parser.add_argument("--engines", type=int, default=2, help="Stockfish processes")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--n-positions", type=int, default=256,
                        help="context: the longest prompt plus the trainer's --max-new-tokens (144)")
    parser.add_argument("--train-steps", type=int, default=1800)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    # fp32 on one thread: on the shared 2-core reference machine bf16 autocast ran 50x slower (no AMX
    # exposed) and two threads 3x slower than one (the other core was busy)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--continue-training", action="store_true",
                        help="a second stage: train the model in --out further on the data kept in --work-dir")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    os.makedirs(args.work_dir, exist_ok=True)
    log_file = open(os.path.join(args.work_dir, "build.log"), "a", encoding="utf-8")

    def log(line: str):
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    data_file = os.path.join(args.work_dir, "data.txt")
    previous = None
    if args.continue_training:
        from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
        with open(data_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
        data = {"P": [split_policy_line(line) for line in lines if line.startswith("P: ")],
                "A": [split_env_line(line) for line in lines if line.startswith("A: ")], "seconds": 0}
        tok = PreTrainedTokenizerFast.from_pretrained(args.out)
        model = GPT2LMHeadModel.from_pretrained(args.out)
        with open(os.path.join(args.out, "build_info.json"), encoding="utf-8") as f:
            previous = json.load(f)
    else:
        data = make_data(args.seed, args.policy_positions, args.env_samples, args.depth, args.engines, log)
        with open(data_file, "w", encoding="utf-8") as f:
            for prompt, completion in data["P"] + data["A"]:
                f.write(prompt + completion + "\n")
        model = None

    t = time.time()
    samples = data["P"] + data["A"]
    if not args.continue_training:
        tok = train_tokenizer([p + c for p, c in samples], args.vocab_size)
    rows = encode(tok, samples)
    n_policy = len(data["P"])
    per_sample = {kind: round(sum(len(ids) for ids, _ in part) / max(len(part), 1), 1)
                  for kind, part in (("P", rows[:n_policy]), ("A", rows[n_policy:]))}
    longest = max(len(ids) for ids, _ in rows)
    log(f"tokenizer: {len(tok)} tokens in {time.time() - t:.0f}s; tokens per sample {per_sample}, "
        f"longest {longest} (EOS + prompt + completion + EOS)")

    model, curve = train_model(rows, len(tok), args, log, model)
    model.config.bos_token_id = model.config.eos_token_id = tok.eos_token_id
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    looks = greedy_samples(model, tok, data["P"][:3] + data["A"][:3])
    for sample in looks:
        log(f"greedy {'exact' if sample['exact'] else 'differs'}: {sample['prompt'][:40]!r}... -> "
            f"{sample['greedy']!r}")
    info = {
        "command": "python scripts/make_default_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args),
        "samples": {"P": n_policy, "A": len(data["A"])},
        "tokens_per_sample": per_sample,
        "longest_sample_tokens": longest,
        "parameters": sum(p.numel() for p in model.parameters()),
        "data_seconds": round(data["seconds"]),
        "build_seconds": round(time.time() - t_start),
        "loss_curve": curve,
    }
    if previous is not None:
        info["previous_stage"] = previous
    with open(os.path.join(args.out, "build_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    log(f"done: {args.out}, {info['parameters'] / 1e6:.1f}M parameters, {info['build_seconds']}s in all")


if __name__ == "__main__":
    main()
