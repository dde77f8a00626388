"""GRPO on a small causal language model: one run, told top to bottom.

    python train_lean.py --batch-size 64          # 8 prompts x 8 completions per step
    python train_lean.py --help                   # every flag (each also reads GRPO_<FLAG>)
    torchrun --nproc_per_node 2 train_lean.py ... # data-parallel: each process takes whole groups

config -> model, reference, task -> loop: sample groups of completions, score them, turn rewards into
group-relative advantages, update the policy with a clipped PPO loss plus a KL penalty, log one line
and one JSON record (with memory) per step, and checkpoint now and then. The pieces live in grpo/,
one concept per module.
"""
import dataclasses
import os
import random
import sys
import time
from collections import Counter

import numpy as np
import torch

from grpo import checkpoint, config, distributed, guards, log, memory
from tasks.rookworld import evaluate
from grpo.advantages import group_advantages
from grpo.loss import completion_logprobs, grpo_loss
from grpo.model import ModelLoadError, frozen_copy, load_policy, load_tokenizer
from grpo.rollout import decode_completions, encode_prompts, generate, greedy_completions, left_pad, logprob_temperature
from grpo.task import TaskError, get_task, score
from tasks.rookworld.task import OPTIONS as CHESS_OPTIONS


def usage_error(message: str):
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails alike; one says so
        print(f"train_lean.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def task_options(cfg, sources) -> dict:
    """The config fields the chosen task takes (chess tasks only); a flag it would ignore is an error."""
    wanted = CHESS_OPTIONS.get(cfg.task, ())
    for name in CHESS_OPTIONS["chess"]:
        if name not in wanted and sources[name] == "cli":
            raise config.ConfigError(f"{config.flag(name)} does not apply to --task {cfg.task}")
    return {name: getattr(cfg, name) for name in wanted}


@torch.no_grad()
def greedy_eval(policy, tokenizer, items, step, *, prepend_bos, max_new_tokens, batch, autocast, device) -> dict:
    """Greedy completions for the held-out items, scored; prints the table and returns the JSONL record."""
    t0 = time.perf_counter()
    texts = greedy_completions(policy, tokenizer, [i["prompt"] for i in items], prepend_bos=prepend_bos,
                               max_new_tokens=max_new_tokens, batch=batch, device=device, autocast=autocast)
    result = evaluate.metrics(items, texts)
    print(evaluate.table(result, step), flush=True)
    return {"kind": "eval", "step": step, **result, "eval_time_s": time.perf_counter() - t0}


def main(argv=None):
    # ---- configuration: validated in full before anything heavy is loaded ------------------------
    try:
        cfg, sources = config.load(argv)
        layout = config.batch_layout(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
        config.check_paths(cfg)
        resume_from = checkpoint.resolve(cfg.resume, cfg.out_dir) if cfg.resume else None
        if resume_from is None and checkpoint.latest(os.path.join(cfg.out_dir, checkpoint.SUBDIR)):
            raise config.ConfigError(f"--out-dir {cfg.out_dir} holds checkpoints of an earlier run: pass --resume "
                                     f"to continue it, or another --out-dir to start afresh")
    except (config.ConfigError, checkpoint.CheckpointError) as e:
        usage_error(str(e))
    rank, world, device = distributed.init(cfg.device)
    main_rank = rank == 0  # only rank 0 prints, logs and saves
    verbose = main_rank and cfg.log_level != "warning"

    def say(message):
        if verbose:
            print(message, flush=True)

    say(config.describe(cfg, sources, layout))
    # bf16 autocast over fp32 weights: the matmuls run in bf16, the weights and AdamW state stay fp32.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    if cfg.dtype == "bf16" and device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        print("train_lean.py: warning: this CPU has no native bf16 (AVX512-BF16 or AMX): bf16 matmuls are "
              "emulated, many times slower than fp32 (see BENCHMARKS.md); prefer --dtype fp32", file=sys.stderr)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # ---- model, reference, task ------------------------------------------------------------------
    # The held-out set carries its own answers, so evaluation needs neither the task nor an engine.
    chess = cfg.task in CHESS_OPTIONS
    if cfg.eval_interval > 0 and sources["eval_interval"] != "default" and not cfg.eval_only and not chess:
        usage_error(f"--eval-interval evaluates on the held-out chess set: use a chess task, not --task {cfg.task}")
    evaluating = cfg.eval_only or (cfg.eval_interval > 0 and chess)   # the default's evals are for chess tasks
    task = None
    try:
        task = None if cfg.eval_only else get_task(cfg.task, **task_options(cfg, sources))
        tokenizer = load_tokenizer(resume_from or cfg.model)
        policy = load_policy(resume_from or cfg.model, device)
        # the reference is a frozen copy of the starting policy on the same device, only when used;
        # a resumed run anchors its KL to the starting model too, not to the checkpoint
        reference = None
        if cfg.kl_coef > 0 and not cfg.eval_only:
            reference = frozen_copy(load_policy(cfg.model, device) if resume_from else policy)
    except (TaskError, ModelLoadError, config.ConfigError) as e:
        if hasattr(task, "close"):   # a chess task's Stockfish processes would keep this process alive
            task.close()
        usage_error(str(e))
    if cfg.gradient_checkpointing:  # layers recompute their activations in backward (grpo/loss.py)
        policy.activation_checkpointing_enable({"use_reentrant": False})
    eos = tokenizer.eos_token_id
    prepend_bos = cfg.prompt_bos == "on" or (cfg.prompt_bos == "auto" and tokenizer.bos_token_id == eos)
    if evaluating:
        eval_items = evaluate.select(evaluate.load_eval_set(), evaluate.eval_kinds(cfg.task), cfg.eval_samples)

        def run_eval(step):
            """Rank 0 evaluates and logs; the other ranks wait for it."""
            record = None
            if main_rank:
                record = greedy_eval(policy, tokenizer, eval_items, step, prepend_bos=prepend_bos,
                                     max_new_tokens=cfg.max_new_tokens, batch=layout["generation_batch"],
                                     autocast=autocast, device=device)
                if metrics_file is not None:
                    log.write(metrics_file, record)
            distributed.barrier()
            return record
    if cfg.eval_only:
        metrics_file = log.open_jsonl(cfg.log_file) if cfg.log_file and main_rank else None
        run_eval(0)
        if metrics_file is not None:
            metrics_file.close()
        distributed.close()
        return
    temperature = logprob_temperature(cfg.temperature)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    clip_high = cfg.clip_range_high if cfg.clip_range_high is not None else cfg.clip_range
    G, B = cfg.group_size, layout["completions_per_device"]
    P = layout["prompts_per_device"]
    gen_batch, mini, micro = layout["generation_batch"], layout["mini_batch_per_device"], layout["micro_batch"]
    start_step, nonfinite_streak = 0, 0
    if resume_from:
        state = checkpoint.load_state(resume_from)
        optimizer.load_state_dict(state["optimizer"])
        start_step, nonfinite_streak = state["step"], state["nonfinite_streak"]
        # each rank continues its own RNG streams (rank 0's when the device count changed)
        checkpoint.set_rng_states(state["rng"][rank] if len(state["rng"]) == world else state["rng"][0])
        say(f"resumed from {resume_from} after step {start_step}")

    def step_seed(step):
        """The seed of a step's prompts and sampling: the prompt stream needs no state to resume."""
        return cfg.seed * 1_000_003 + step

    oom_notes = []  # this step's out-of-memory retries

    def on_oom(message):
        oom_notes.append(message)
        say(message)

    if layout["micro_batch_auto"]:
        # the largest micro-batch whose forward and backward fit at the longest sequence, found before
        # training; AdamW's two moments do not exist before the first update, so a stand-in holds their place
        longest = max(map(len, encode_prompts(tokenizer, task.prompts(layout["prompts_per_step"], random.Random(
            step_seed(start_step + 1))), prepend_bos))) + cfg.max_new_tokens
        moments = 0 if optimizer.state else sum(2 * p.numel() for p in params)

        def fits(m):
            stand_in = torch.empty(moments, device=device)
            ids = torch.full((m, longest), eos, device=device)
            logp = completion_logprobs(policy, ids, torch.ones_like(ids), cfg.max_new_tokens, temperature,
                                       cfg.logprob_chunk_size, autocast)
            logp.sum().backward()
            optimizer.zero_grad(set_to_none=True)
            del stand_in

        _, micro = guards.shrinking(fits, micro, mini, on_oom)
        oom_notes.clear()
        say(f"micro-batch auto: {micro} per device ({micro * world} global) fits at {longest} tokens, "
            f"{mini // micro} gradient-accumulation steps")

    def save(step):
        rngs = distributed.gather_objects(checkpoint.rng_states())
        path = None
        if main_rank:
            path = checkpoint.save(cfg.out_dir, step, policy, tokenizer,
                                   {"optimizer": optimizer.state_dict(), "rng": rngs, "nonfinite_streak":
                                    nonfinite_streak, "config": dataclasses.asdict(cfg)}, cfg.keep_checkpoints)
            say(f"saved {path}")
        distributed.barrier()
        return path

    def reference_logprobs(input_ids, attention, T, m):
        with torch.no_grad():
            return torch.cat([completion_logprobs(reference, input_ids[s:s + m], attention[s:s + m], T, temperature,
                                                  cfg.logprob_chunk_size, autocast) for s in range(0, B, m)])

    def accumulate(mb, m, batch, denominator):
        """Forward and backward of one mini-batch, m rows at a time; returns summed loss statistics."""
        optimizer.zero_grad(set_to_none=True)
        input_ids, attention, T, old_logp, advantages, completion_mask, ref_logp = batch
        sums = Counter()
        for rows in mb.split(m):
            logp = completion_logprobs(policy, input_ids[rows], attention[rows], T, temperature,
                                       cfg.logprob_chunk_size, autocast)
            loss, stats = grpo_loss(logp, old_logp[rows], advantages[rows], completion_mask[rows], denominator,
                                    ref_logp=None if ref_logp is None else ref_logp[rows], kl_coef=cfg.kl_coef,
                                    clip_low=cfg.clip_range, clip_high=clip_high, loss_agg=cfg.loss_agg)
            loss.backward()
            sums.update(loss=loss.item(), **stats)
        return [sums[k] for k in ("loss", "kl", "clip", "ratio", "tokens")]

    metrics_path = cfg.log_file or os.path.join(cfg.out_dir, "metrics.jsonl")
    metrics_file = completions_file = None
    if main_rank:
        if resume_from:  # records of steps after the checkpoint belong to the killed run's lost future
            log.keep_until(metrics_path, start_step)
            if cfg.log_completions:
                log.keep_until(cfg.log_completions, start_step)
        metrics_file = log.open_jsonl(metrics_path, append=bool(resume_from))
        if cfg.log_completions:
            completions_file = log.open_jsonl(cfg.log_completions, append=bool(resume_from))
    seen_errors = set()
    exit_code = 0

    if evaluating and start_step == 0:  # where the run starts from
        run_eval(0)
    from tqdm import tqdm
    bar = tqdm(range(start_step + 1, cfg.steps + 1), desc="steps", initial=start_step, total=cfg.steps,
               disable=not (main_rank and sys.stderr.isatty()), file=sys.stderr)
    with guards.StopOnSignal(say) as stop:
        for step in bar:
            t_start = time.perf_counter()
            memory.reset_peak(device)
            oom_notes.clear()

            # ---- rollout: whole groups of completions per prompt, this rank's share of them -------
            prompts = task.prompts(layout["prompts_per_step"], random.Random(step_seed(step)))
            prompts = prompts[rank * P:(rank + 1) * P]
            row0 = rank * B  # this rank's first row in the global batch
            row_prompts = [p for p in prompts for _ in range(G)]  # rows of one group are contiguous
            prompt_ids, prompt_mask = left_pad(encode_prompts(tokenizer, prompts, prepend_bos), eos, device)
            prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
            chunks = []
            for s in range(0, B, gen_batch):
                # sampling is seeded by (seed, step, the chunk's first global row): the rollouts do not depend
                # on the number of devices (for the same --generation-batch-size) nor on a resume
                torch.manual_seed(step_seed(step) * 1_000_003 + row0 + s)
                chunks.append(generate(policy, prompt_ids[s:s + gen_batch], prompt_mask[s:s + gen_batch], eos_id=eos,
                                       max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                       top_k=cfg.top_k, top_p=cfg.top_p, min_new_tokens=cfg.min_new_tokens,
                                       autocast=autocast))
            T = max(c[0].shape[1] for c in chunks)
            pad = torch.nn.functional.pad
            completion_ids = torch.cat([pad(c[0], (0, T - c[0].shape[1]), value=eos) for c in chunks])
            completion_mask = torch.cat([pad(c[1], (0, T - c[1].shape[1])) for c in chunks])
            old_logp = torch.cat([pad(c[2], (0, T - c[2].shape[1])) for c in chunks])
            texts = decode_completions(tokenizer, completion_ids, completion_mask, eos)
            t_gen = time.perf_counter()

            rewards, components, errors = score(task, row_prompts, texts)
            # advantages over the global batch (--scale-rewards batch needs every rank's rewards)
            all_rewards = distributed.gather_rows(torch.from_numpy(rewards))
            all_advantages, frac_zero_std = group_advantages(all_rewards, G, cfg.scale_rewards)
            advantages = all_advantages[row0:row0 + B].to(device)
            gathered = distributed.gather_objects((components, errors))
            components = {k: sum(c.get(k, 0.0) for c, _ in gathered) / world for k in gathered[0][0]}
            errors = dict(sum((Counter(e) for _, e in gathered), Counter()))
            for kind in sorted(errors.keys() - seen_errors):  # once per kind; counts go in every record
                say(f"step {step}: the task's reward raised {kind}; such completions get the task's min_reward "
                    f"(counted in reward_errors)")
            seen_errors |= errors.keys()
            t_score = time.perf_counter()

            # ---- update --------------------------------------------------------------------------
            input_ids = torch.cat([prompt_ids, completion_ids], 1)
            attention = torch.cat([prompt_mask, completion_mask], 1)
            lengths = attention.sum(1).cpu()  # sorted on the host: no device round trip per mini-batch
            ref_logp = None
            if reference is not None:  # once per row per step, over completion positions only
                ref_logp, micro = guards.shrinking(lambda m: reference_logprobs(input_ids, attention, T, m),
                                                   micro, mini, on_oom)
            t_ref = time.perf_counter()
            batch = (input_ids, attention, T, old_logp, advantages, completion_mask, ref_logp)
            totals = Counter()
            updates = skipped = 0
            for _ in range(cfg.ppo_epochs):
                order = torch.randperm(B) if mini < B else torch.arange(B)
                for mb in order.split(mini):
                    # micro-batches of similar length waste less compute on padding
                    mb = mb[torch.argsort(lengths[mb], stable=True)].to(device)
                    # the denominator is global, so summing gradients over ranks gives the one-process gradient
                    local = completion_mask[mb].sum().item() if cfg.loss_agg == "token-mean" else len(mb)
                    denominator = max(distributed.all_sum([local])[0], 1)
                    sums, micro = guards.shrinking(lambda m: accumulate(mb, m, batch, denominator), micro, mini, on_oom)
                    distributed.sum_gradients(params)
                    loss, kl, clip, ratio, tokens = distributed.all_sum(sums)
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
                    if guards.finite(loss, grad_norm):
                        optimizer.step()
                        nonfinite_streak = 0
                    else:  # one bad batch must not poison the weights or AdamW's moments
                        optimizer.zero_grad(set_to_none=True)
                        skipped += 1
                        nonfinite_streak += 1
                    totals.update(loss=loss, kl=kl, clip=clip, ratio=ratio, tokens=tokens, grad_norm=grad_norm)
                    updates += 1
            t_end = time.perf_counter()

            # ---- log -----------------------------------------------------------------------------
            n_tokens = distributed.all_sum([completion_mask.sum().item()])[0]
            step_time = t_end - t_start
            memory.release_free_heap()   # else RSS ratchets up to the largest step's peak (grpo/memory.py)
            rec = {
                "step": step,
                "reward_mean": all_rewards.mean().item(),
                "reward_std": all_rewards.std().item(),
                "frac_zero_std": frac_zero_std,
                "loss": totals["loss"] / updates,
                "kl": totals["kl"] / max(totals["tokens"], 1),
                "clip_frac": totals["clip"] / max(totals["tokens"], 1),
                "ratio_mean": totals["ratio"] / max(totals["tokens"], 1),
                "grad_norm": totals["grad_norm"] / updates,
                "skipped_nonfinite": skipped,
                "completion_len_mean": n_tokens / cfg.batch_size,
                "step_time_s": step_time,
                "gen_time_s": t_gen - t_start,
                "score_time_s": t_score - t_gen,
                "ref_time_s": t_ref - t_score,
                "train_time_s": t_end - t_ref,
                "samples_per_s": cfg.batch_size / step_time,
                "tokens_per_s": n_tokens / step_time,
                **{f"reward_{k}": v for k, v in components.items()},
                **memory.snapshot(device),
            }
            if errors:
                rec["reward_errors"] = errors
            if oom_notes:
                rec["oom_retries"], rec["micro_batch"] = len(oom_notes), micro
            if cfg.log_completions:  # every rank's rows, written by rank 0
                lens = completion_mask.sum(1).tolist()
                sums = (old_logp * completion_mask).sum(1).tolist()
                rows = distributed.gather_objects(list(zip(row_prompts, texts, lens, sums)))
                for (p, c, n, s), r in zip([row for part in rows for row in part], all_rewards.tolist()):
                    if main_rank:
                        log.write(completions_file, {"step": step, "prompt": p, "completion": c, "reward": r,
                                                     "completion_tokens": n, "logprob_sum": s})
            if main_rank:
                log.write(metrics_file, rec)
                if verbose:
                    (tqdm.write if not bar.disable else print)(log.step_line(rec, cfg.steps))

            if evaluating and (step % cfg.eval_interval == 0 or step == cfg.steps):   # the last step: "after"
                run_eval(step)

            # ---- checkpoint, stop ----------------------------------------------------------------
            stopping = distributed.any_rank(stop.requested)
            aborting = nonfinite_streak >= cfg.max_nonfinite
            if stopping or aborting or (cfg.save_interval and (step % cfg.save_interval == 0 or step == cfg.steps)):
                path = save(step)
            if aborting:
                if main_rank:
                    print(f"train_lean.py: aborting at step {step}: the last {nonfinite_streak} optimizer updates had "
                          f"a non-finite loss or gradient norm and were skipped; checkpoint {path} holds the weights "
                          f"from before them. Lower --learning-rate or check the task's rewards, then --resume",
                          file=sys.stderr)
                exit_code = 1
                break
            if stopping:
                say(f"stopped after step {step}: continue with --resume")
                break
    for f in (metrics_file, completions_file):
        if f is not None:
            f.close()
    if hasattr(task, "close"):
        task.close()
    distributed.close()
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    main()
