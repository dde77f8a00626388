"""Build the embedded default model from a seed, with nothing downloaded: data, tokenizer, GPT-2.

    make default-model                       # the shipped models/rook-tiny: this script three times (Makefile), 1 h 10 min
    python tasks/rookworld/build_model.py     # one stage: data 14 min, 3,500 training steps in 24 min (2 cores)
    python tasks/rookworld/build_model.py --out /tmp/toy --work-dir /tmp/toy --policy-positions 200 --env-samples 400 \
        --train-steps 50                                       # the pipeline end to end in a minute
    python tasks/rookworld/build_model.py --continue-training --from out/default-model/checkpoint --train-steps 1000
                                                               # a second stage (its own warm-up and cosine)

The data is kept in --work-dir and reused by a later run with the same data arguments; a checkpoint is
written there every --save-every steps, so a crash loses at most that much training (a second stage from
it starts a new learning-rate schedule and optimizer: not an exact resume).

1. Data. P: positions come from two sources: games played by Stockfish itself (a softmax over its own
   multi-PV 5 evaluations, so they look like real games; a quarter) and the same seeded position generator
   the chess tasks draw their prompts from (openings to endgames, mates, draws, repetitions). Every P:
   position is labelled by Stockfish (fixed depth, multi-PV 5, the pool the P: reward uses): M: holds
   the top moves in rank order, E: their evaluations, B: the top move, for either side to move. A:
   samples cost no engine: the moves played in those games, plus generated transitions (rare rules
   and illegal moves weighted up), each answered by python-chess. Positions of the held-out
   evaluation set are excluded. All text is built by tasks.rookworld.format, so it is byte-identical
   to what the tasks prompt with.
2. Tokenizer. Byte-level BPE over chunks that never cross a space, '+' or '/', so a UCI move, a FEN
   rank or a number is learned as one or two tokens and runs of padding spaces merge.
3. Model. A small GPT-2 trained with next-token loss on the completion and the closing EOS only (the
   prompt is context, not target), bf16 autocast where the CPU has native bf16, saved in fp32 with the
   tokenizer and a build_info.json. The training text lists the P: candidates in UCI order (uci_order),
   and on P: batches an unlikelihood loss pushes down the candidates the model's own greedy lists repeat
   (own_repeats_loss): without the two, no greedy answer listed five distinct moves.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tasks.rookworld.engine import EnginePool, find_stockfish  # noqa: E402
from tasks.rookworld.format import (env_prompt, expected_env_completion, parse_policy_completion,  # noqa: E402
                                     policy_answer, policy_completion, policy_prompt, split_env_line,
                                     split_policy_line)
from tasks.rookworld.positions import history, random_board, random_transition  # noqa: E402
from tasks.rookworld.evaluate import held_out_positions  # noqa: E402
from tasks.rookworld.format import position_key  # noqa: E402

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
    # The data file keeps the engine's rank order; the training text reorders (uci_order)
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


def make_data(seed: int, policy_positions: int, game_share: float, env_samples: int, depth: int, engines: int,
              log) -> dict:
    """P: and A: samples: a `game_share` of the P: positions from engine games, the rest (the kind of
    position the chess tasks prompt with and the held-out set holds) from the task generator."""
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
    # Generated positions are queued as they are made: the engines work while this thread goes on
    # with the A: transitions (python-chess only), then the games take the engines.
    rng = random.Random(f"{seed}-positions")
    boards = []
    while len(boards) < round(policy_positions * (1 - game_share)):
        board = random_board(rng)
        if position_key(board.fen()) not in held_out:
            pool.analyse(board.fen(en_passant="fen"))
            boards.append(board)
    rng = random.Random(f"{seed}-transitions")
    while len(env) < env_samples:
        board, move = random_transition(rng)
        if position_key(board.fen()) not in held_out:
            env.append(env_sample(board, move))
    log(f"data: {len(env)} generated A: transitions, {len(boards)} generated P: positions queued, "
        f"{time.time() - t0:.0f}s")
    keep_policy(policy_sample(pool, b)[:2] for b in boards)
    log(f"data: {len(policy)} generated P: positions labelled, {time.time() - t0:.0f}s")
    with ThreadPoolExecutor(max_workers=engines) as games:
        game_results = games.map(lambda i: engine_game(pool, random.Random(f"{seed}-game-{i}"), held_out),
                                 range(policy_positions))
        for i, (game_policy, game_env) in enumerate(game_results):
            if len(policy) >= policy_positions:
                break
            keep_policy(game_policy)
            env.extend(game_env)
            if i % 20 == 0:
                log(f"data: {len(policy)}/{policy_positions} P: positions after {i + 1} games, "
                    f"{time.time() - t0:.0f}s")
        games.shutdown(wait=False, cancel_futures=True)   # enough positions: drop the games not started
        pool.close()   # and end the running ones (their pending analyses are cancelled)
    log(f"data: {len(policy)} P: and {len(env)} A: samples in {time.time() - t0:.0f}s")
    return {"P": policy, "A": env, "seconds": time.time() - t0}


def uci_order(completion: str) -> str:
    """The same P: answer with its candidates (each with its evaluation) in UCI string order, B: unchanged.

    The format gives the order no meaning. In rank order B: is a copy of the first candidate, but a small
    model's greedy list then repeats its favourite move (a rank-order build listed five distinct moves in
    none of its answers); an ascending list makes a repeat break the pattern it was taught."""
    answer = parse_policy_completion(completion)
    return policy_answer(answer.moves, answer.evals, answer.best)


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


def repeated_candidates(completion: list[int], pieces: list[str]) -> list[int]:
    """Indices of the tokens in a P: completion's M: field that begin a candidate the same way an earlier
    one began (" b8c6 b8c6"): the repeats of a small model's greedy list. `pieces` is each token's text."""
    seen, repeats = set(), []
    for j, token in enumerate(completion):
        piece = pieces[token]
        if piece.strip() in ("E:", "B:"):
            break
        if len(piece) >= 3 and piece[0] == " " and piece[1] in "abcdefgh" and piece[2] in "12345678":
            if token in seen:
                repeats.append(j)
            seen.add(token)
    return repeats


# ---------------------------------------------------------------- 3. model

def right_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack id lists to [B, L], padded on the right (positions start at 0 in every row), with the mask."""
    input_ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
    return input_ids, attention


def batches(kinds: list[tuple[str, list[tuple[list[int], int]]]], batch_size: int, rng: random.Random):
    """Endless (kind, batch) pairs, each batch of one kind of sample (P: and A: differ in length, so a batch
    of one kind carries little padding); every epoch is a fresh shuffle of all samples and of the batch order.

    Batches of like length would drop the remaining padding (a quarter of the tokens: 1.1x a step), but
    they train far worse: length goes with content here."""
    while True:
        epoch = []
        for kind, rows in kinds:
            order = rows[:]
            rng.shuffle(order)
            epoch += [(kind, order[i:i + batch_size]) for i in range(0, len(order), batch_size)]
        rng.shuffle(epoch)
        yield from epoch


def own_repeats_loss(model, batch, pieces: list[str], eos: int, device, autocast) -> tuple:
    """Unlikelihood (Welleck et al., 2019) on the model's own greedy M: lists: the mean -log(1 - p) of each
    token that repeats a candidate already listed, at the place the model chose it (None when nothing
    repeats), and the number of such tokens.

    Teacher forcing alone does not cure the repeats: after the engine's own (distinct) candidates the model
    gives a repeat little probability (2.5% on average); it repeats after its own guesses, which the data
    never shows it. So the prompts of `batch` are decoded greedily through the M: field and the repeats
    found there are pushed down."""
    from grpo.decoders import generate
    from grpo.rollout import left_pad
    prompts = [ids[:start] for ids, start in batch]
    model.eval()
    with torch.no_grad():
        ids, mask = left_pad(prompts, eos, device)
        completions = generate(model, ids, mask, end_ids=eos, max_new_tokens=16, temperature=0.0,
                               autocast=autocast).ids
    model.train()
    targets = [(i, len(p) + j - 1, c[j]) for i, (p, c) in enumerate(zip(prompts, completions.tolist()))
               for j in repeated_candidates(c, pieces)]
    if not targets:
        return None, 0
    input_ids, attention = right_pad([p + c for p, c in zip(prompts, completions.tolist())], eos)
    with autocast:
        logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
    row, position, token = (torch.tensor(column, device=device) for column in zip(*targets))
    p = logits[row, position].float().softmax(-1).gather(1, token[:, None]).squeeze(1)
    return -torch.log1p(-p.clamp(max=1 - 1e-6)).mean(), len(targets)


def model_config(vocab_size: int, eos_id: int, n_positions: int, n_embd: int, n_layer: int,
                 activation: str = "gelu_pytorch_tanh"):
    """The GPT-2 shape the build trains: heads of 32 dimensions, no dropout, EOS as BOS.

    gelu_pytorch_tanh is GPT-2's tanh GELU as one kernel (gelu_new spells it in eight): 1.3x a step here;
    bench/build_step.py passes the other activation to compare."""
    from transformers import GPT2Config
    return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                      n_head=n_embd // 32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      activation_function=activation, bos_token_id=eos_id, eos_token_id=eos_id)


def training_setup(model, args) -> tuple:
    """The model moved to its device; that device, AdamW, its schedule and whether bf16 autocast runs."""
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    # On a CPU, SDPA's backward under bf16 autocast dominates a step on these short rows, and plain matmul
    # attention is faster (bench/build_step.py measures it). A GPU keeps SDPA.
    model.set_attn_implementation("eager" if device.type == "cpu" else "sdpa")
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.train_steps // 50)
    # linear warm-up, then cosine decay to a tenth of the peak
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (
        1 + math.cos(math.pi * min(1.0, s / args.train_steps)))))
    # bf16 autocast over fp32 weights on a GPU, or where the CPU has native bf16 (AMX / AVX512-BF16);
    # elsewhere bf16 matmuls are emulated and far slower than fp32
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and (
        device.type == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    return device, optimizer, schedule, bf16


def train_model(kinds: list[tuple[str, list[tuple[list[int], int]]]], tok, args, log, model=None) -> tuple:
    """A GPT-2 (new, or `model` continued) trained on completion tokens only; returns it and the loss curve."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(args.seed)
    if model is None:
        model = GPT2LMHeadModel(model_config(len(tok), tok.eos_token_id, args.n_positions, args.n_embd, args.n_layer))
    device, optimizer, schedule, bf16 = training_setup(model, args)
    stream = batches(kinds, args.batch_size, random.Random(f"{args.seed}-batches-{args.continue_training}"))
    log(f"train: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}, "
        f"{'bf16 autocast' if bf16 else 'fp32'}, {args.threads} threads")
    curve, t0, seen_tokens = [], time.time(), 0
    pieces = [tok.decode([i]) for i in range(len(tok))]   # each token's text, to find repeated candidates
    decoded, repeated = 0, 0   # greedy P: lists decoded for the unlikelihood loss, and the repeats in them
    model.train()
    for step in range(1, args.train_steps + 1):
        kind, batch = next(stream)
        input_ids, attention = right_pad([ids for ids, _ in batch], 0)
        labels = torch.full_like(input_ids, -100)
        for i, (ids, start) in enumerate(batch):
            labels[i, start:len(ids)] = input_ids[i, start:len(ids)]
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
        with autocast:
            loss = model(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                         labels=labels.to(device)).loss
        if kind == "P" and args.unlikelihood > 0:
            repeats, count = own_repeats_loss(model, batch[:args.unlikelihood_rows], pieces, tok.eos_token_id,
                                              device, autocast)
            decoded, repeated = decoded + min(len(batch), args.unlikelihood_rows), repeated + count
            if repeats is not None:
                loss = loss + args.unlikelihood * repeats
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        seen_tokens += int(attention.sum())
        if step % args.log_every == 0 or step == args.train_steps:
            elapsed = time.time() - t0
            curve.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(elapsed, 1)})
            if decoded:
                curve[-1]["repeats_per_greedy_list"] = round(repeated / decoded, 3)
            log(f"train: step {step}/{args.train_steps} loss {loss.item():.3f} "
                f"{seen_tokens / elapsed:.0f} tokens/s {elapsed:.0f}s"
                + (f", {repeated / decoded:.2f} repeated candidates per greedy P: list" if decoded else ""))
            decoded, repeated = 0, 0
        if step % args.save_every == 0 and step < args.train_steps:
            # a crash loses at most --save-every steps: --continue-training picks this folder up
            save(model, tok, os.path.join(args.work_dir, "checkpoint"), {"step": step, "loss_curve": curve})
    model.eval()
    return model, curve


def save(model, tok, folder: str, info: dict) -> None:
    """The model, its tokenizer and build_info.json in `folder`, loadable with from_pretrained."""
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    with open(os.path.join(folder, "build_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)


def read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def greedy_samples(model, tok, samples: list[tuple[str, str]]) -> list[dict]:
    """Greedy completions of a few training prompts: a quick look that the format was learned."""
    from harness.task import eval_completions
    texts = eval_completions(model, tok, [p for p, _ in samples], prepend_bos=True, max_new_tokens=96,
                             batch=len(samples), device=model.device)
    return [{"prompt": prompt, "expected": want, "greedy": text, "exact": text == want}
            for (prompt, want), text in zip(samples, texts)]


def load_or_make_data(args, log) -> dict:
    """The P: and A: samples: those kept in WORK_DIR when made with the same data settings, else new ones,
    then kept there."""
    # The data depends on these alone; a re-run with the same ones (another model size, say) reuses it.
    data_args = {k: getattr(args, k) for k in ("seed", "policy_positions", "game_share", "env_samples", "depth")}
    data_file, data_args_file = os.path.join(args.work_dir, "data.txt"), os.path.join(args.work_dir, "data_args.json")
    reuse = os.path.exists(data_args_file) and read_json(data_args_file) == data_args
    if reuse:
        with open(data_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
        data = {"P": [split_policy_line(line) for line in lines if line.startswith("P: ")],
                "A": [split_env_line(line) for line in lines if line.startswith("A: ")], "seconds": None}
        log(f"data: {len(data['P'])} P: and {len(data['A'])} A: samples reused from {data_file}")
    else:
        data = make_data(args.seed, args.policy_positions, args.game_share, args.env_samples, args.depth, args.engines, log)
        with open(data_file, "w", encoding="utf-8") as f:
            for prompt, completion in data["P"] + data["A"]:
                f.write(prompt + completion + "\n")
        with open(data_args_file, "w", encoding="utf-8") as f:
            json.dump(data_args, f)
    return data


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="models/rook-tiny", help="model folder to write")
    parser.add_argument("--work-dir", default="out/default-model", help="where the generated data is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy-positions", type=int, default=40000, help="P: samples (Stockfish-labelled)")
    parser.add_argument("--game-share", type=float, default=0.25,
                        help="share of the P: positions taken from engine games (the rest: the task generator)")
    parser.add_argument("--env-samples", type=int, default=60000,
                        help="generated A: samples (python-chess); the moves of the engine games add more")
    parser.add_argument("--depth", type=int, default=8, help="Stockfish depth for the P: labels")
    parser.add_argument("--engines", type=int, default=2, help="Stockfish processes")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-positions", type=int, default=256,
                        help="context: the longest prompt plus the trainer's --max-new-tokens (144)")
    parser.add_argument("--policy-repeats", type=int, default=2,
                        help="times each P: sample is seen per epoch (the harder task, and the costlier data)")
    parser.add_argument("--candidate-order", choices=["uci", "rank"], default="uci",
                        help="order of the M: candidates in the training text: UCI string order, or the engine's rank")
    parser.add_argument("--unlikelihood", type=float, default=1.0,
                        help="weight of the loss against the repeated M: candidates of the model's own greedy "
                             "lists (0: off)")
    parser.add_argument("--unlikelihood-rows", type=int, default=16,
                        help="P: prompts per batch decoded greedily for that loss")
    parser.add_argument("--train-steps", type=int, default=3500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                        help="training matmuls: auto = bf16 autocast where the CPU has native bf16, else fp32")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=500,
                        help="steps between checkpoints in WORK_DIR/checkpoint (a crash loses at most these)")
    parser.add_argument("--continue-training", action="store_true",
                        help="a second stage: train the model in --from further on the data kept in --work-dir")
    parser.add_argument("--from", dest="start", default=None,
                        help="with --continue-training: the model folder to start from (default: --out; "
                             "WORK_DIR/checkpoint after a crash)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    os.makedirs(args.work_dir, exist_ok=True)
    log_file = open(os.path.join(args.work_dir, "build.log"), "a", encoding="utf-8")

    def log(line: str):
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    data = load_or_make_data(args, log)
    model, previous = None, None
    if args.continue_training:
        from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
        start = args.start or args.out
        tok = PreTrainedTokenizerFast.from_pretrained(start)
        model = GPT2LMHeadModel.from_pretrained(start)
        previous = read_json(os.path.join(start, "build_info.json"))

    if args.candidate_order == "uci":
        data["P"] = [(prompt, uci_order(completion)) for prompt, completion in data["P"]]
    t = time.time()
    samples = data["P"] + data["A"]
    if not args.continue_training:
        tok = train_tokenizer([p + c for p, c in samples], args.vocab_size)
    kinds = {kind: encode(tok, data[kind]) for kind in ("P", "A")}
    per_sample = {kind: round(sum(len(ids) for ids, _ in rows) / max(len(rows), 1), 1) for kind, rows in kinds.items()}
    longest = max(len(ids) for rows in kinds.values() for ids, _ in rows)
    log(f"tokenizer: {len(tok)} tokens in {time.time() - t:.0f}s; tokens per sample {per_sample}, "
        f"longest {longest} (EOS + prompt + completion + EOS)")

    model, curve = train_model([("P", kinds["P"])] * args.policy_repeats + [("A", kinds["A"])], tok, args, log, model)
    looks = greedy_samples(model, tok, data["P"][:3] + data["A"][:3])
    for sample in looks:
        log(f"greedy {'exact' if sample['exact'] else 'differs'}: {sample['prompt'][:40]!r}... -> "
            f"{sample['greedy']!r}")
    info = {
        "command": "python tasks/rookworld/build_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args),
        "samples": {"P": len(data["P"]), "A": len(data["A"])},
        "tokens_per_sample": per_sample,
        "longest_sample_tokens": longest,
        "parameters": sum(p.numel() for p in model.parameters()),
        "data_seconds": data["seconds"] and round(data["seconds"]),   # None: reused from an earlier run
        "build_seconds": round(time.time() - t_start),
        "loss_curve": curve,
    }
    if previous is not None:
        info["previous_stage"] = previous
    save(model, tok, args.out, info)
    log(f"done: {args.out}, {info['parameters'] / 1e6:.1f}M parameters, {info['build_seconds']}s in all")


if __name__ == "__main__":
    main()
