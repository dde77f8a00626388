"""GRPO on a small causal language model: one run, told top to bottom.

    python train_lean.py --batch-size 64          # 8 prompts x 8 completions per step
    python train_lean.py --help                   # every flag (each also reads GRPO_<FLAG>)

config -> model, reference, task -> loop: sample groups of completions, score them, turn rewards into
group-relative advantages, update the policy with a clipped PPO loss plus a KL penalty, log one line
and one JSON record (with memory) per step. The pieces live in grpo/, one concept per module.
"""
import os
import random
import sys
import time

import numpy as np
import torch

from grpo import config, evaluate, log, memory
from grpo.advantages import group_advantages
from grpo.loss import completion_logprobs, grpo_loss
from grpo.model import ModelLoadError, frozen_copy, load_policy, load_tokenizer
from grpo.rollout import decode_completions, encode_prompts, generate, left_pad, logprob_temperature
from grpo.tasks import TaskError, get_task, score
from grpo.tasks.chess_tasks import OPTIONS as CHESS_OPTIONS


def usage_error(message: str):
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
    eos = tokenizer.eos_token_id
    texts = []
    for s in range(0, len(items), batch):
        ids, mask = left_pad(encode_prompts(tokenizer, [i["prompt"] for i in items[s:s + batch]], prepend_bos),
                             eos, device)
        out_ids, out_mask, _ = generate(policy, ids, mask, eos_id=eos, max_new_tokens=max_new_tokens,
                                        temperature=0.0, autocast=autocast)
        texts += decode_completions(tokenizer, out_ids, out_mask, eos)
    result = evaluate.metrics(items, texts)
    print(evaluate.table(result, step), flush=True)
    return {"kind": "eval", "step": step, **result, "eval_time_s": time.perf_counter() - t0}


def main(argv=None):
    # ---- configuration: validated in full before anything heavy is loaded ------------------------
    try:
        cfg, sources = config.load(argv)
        layout = config.batch_layout(cfg, world=1)
    except config.ConfigError as e:
        usage_error(str(e))
    verbose = cfg.log_level != "warning"
    if verbose:
        print(config.describe(cfg, sources, layout), flush=True)

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    # bf16 autocast over fp32 weights: the matmuls run in bf16, the weights and AdamW state stay fp32.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # ---- model, reference, task ------------------------------------------------------------------
    # The held-out set carries its own answers, so evaluation needs neither the task nor an engine.
    evaluating = cfg.eval_only or cfg.eval_interval > 0
    if cfg.eval_interval > 0 and not cfg.eval_only and cfg.task not in CHESS_OPTIONS:
        usage_error(f"--eval-interval evaluates on the held-out chess set: use a chess task, not --task {cfg.task}")
    task = None
    try:
        task = None if cfg.eval_only else get_task(cfg.task, **task_options(cfg, sources))
        tokenizer = load_tokenizer(cfg.model)
        policy = load_policy(cfg.model, device)
    except (TaskError, ModelLoadError, config.ConfigError) as e:
        if hasattr(task, "close"):   # a chess task's Stockfish processes would keep this process alive
            task.close()
        usage_error(str(e))
    eos = tokenizer.eos_token_id
    prepend_bos = cfg.prompt_bos == "on" or (cfg.prompt_bos == "auto" and tokenizer.bos_token_id == eos)
    if evaluating:
        eval_items = evaluate.select(evaluate.load_eval_set(), evaluate.eval_kinds(cfg.task), cfg.eval_samples)

        def run_eval(step):
            return greedy_eval(policy, tokenizer, eval_items, step, prepend_bos=prepend_bos,
                               max_new_tokens=cfg.max_new_tokens, batch=layout["generation_batch"],
                               autocast=autocast, device=device)
    if cfg.eval_only:
        record = run_eval(0)
        if cfg.log_file:
            with log.open_jsonl(cfg.log_file) as f:
                log.write(f, record)
        return
    # the reference is a frozen copy of the starting policy on the same device, only when used
    reference = frozen_copy(policy) if cfg.kl_coef > 0 else None
    temperature = logprob_temperature(cfg.temperature)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    clip_high = cfg.clip_range_high if cfg.clip_range_high is not None else cfg.clip_range

    os.makedirs(cfg.out_dir, exist_ok=True)
    metrics_file = log.open_jsonl(cfg.log_file or os.path.join(cfg.out_dir, "metrics.jsonl"))
    completions_file = log.open_jsonl(cfg.log_completions) if cfg.log_completions else None
    G, B = cfg.group_size, layout["completions_per_device"]
    gen_batch, mini, micro = layout["generation_batch"], layout["mini_batch_per_device"], layout["micro_batch"]

    if evaluating:   # where the run starts from
        log.write(metrics_file, run_eval(0))
    from tqdm import tqdm
    bar = tqdm(range(1, cfg.steps + 1), desc="steps", disable=not sys.stderr.isatty(), file=sys.stderr)
    for step in bar:
        t_start = time.perf_counter()
        memory.reset_peak(device)

        # ---- rollout: whole groups of completions per prompt -------------------------------------
        # prompts come from an rng seeded by (seed, step): the stream needs no state to resume
        prompts = task.prompts(layout["prompts_per_step"], random.Random(cfg.seed * 1_000_003 + step))
        row_prompts = [p for p in prompts for _ in range(G)]  # rows of one group are contiguous
        prompt_ids, prompt_mask = left_pad(encode_prompts(tokenizer, prompts, prepend_bos), eos, device)
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
        chunks = [generate(policy, prompt_ids[s:s + gen_batch], prompt_mask[s:s + gen_batch], eos_id=eos,
                           max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                           top_p=cfg.top_p, autocast=autocast) for s in range(0, B, gen_batch)]
        T = max(c[0].shape[1] for c in chunks)
        completion_ids = torch.cat([torch.nn.functional.pad(c[0], (0, T - c[0].shape[1]), value=eos) for c in chunks])
        completion_mask = torch.cat([torch.nn.functional.pad(c[1], (0, T - c[1].shape[1])) for c in chunks])
        old_logp = torch.cat([torch.nn.functional.pad(c[2], (0, T - c[2].shape[1])) for c in chunks])
        texts = decode_completions(tokenizer, completion_ids, completion_mask, eos)
        t_gen = time.perf_counter()

        rewards, components, errors = score(task, row_prompts, texts)
        rewards = torch.from_numpy(rewards)
        advantages, frac_zero_std = group_advantages(rewards, G, cfg.scale_rewards)
        advantages = advantages.to(device)
        t_score = time.perf_counter()

        # ---- update ----------------------------------------------------------------------------
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention = torch.cat([prompt_mask, completion_mask], 1)
        lengths = attention.sum(1)
        ref_logp = None
        if reference is not None:  # once per row per step, over completion positions only
            with torch.no_grad():
                ref_logp = torch.cat([completion_logprobs(reference, input_ids[s:s + micro], attention[s:s + micro],
                                                          T, temperature, cfg.logprob_chunk_size, autocast)
                                      for s in range(0, B, micro)])
        t_ref = time.perf_counter()
        totals = {"loss": 0.0, "kl": 0.0, "clip": 0.0, "ratio": 0.0, "tokens": 0.0, "grad_norm": 0.0}
        updates = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(B) if mini < B else torch.arange(B)
            for mb in order.split(mini):
                # micro-batches of similar length waste less compute on padding
                mb = mb[torch.argsort(lengths[mb.to(device)].cpu(), stable=True)].to(device)
                denominator = completion_mask[mb].sum().item() if cfg.loss_agg == "token-mean" else len(mb)
                optimizer.zero_grad(set_to_none=True)
                for rows in mb.split(micro):
                    logp = completion_logprobs(policy, input_ids[rows], attention[rows], T, temperature,
                                               cfg.logprob_chunk_size, autocast)
                    loss, stats = grpo_loss(logp, old_logp[rows], advantages[rows], completion_mask[rows],
                                            max(denominator, 1), ref_logp=None if ref_logp is None else ref_logp[rows],
                                            kl_coef=cfg.kl_coef, clip_low=cfg.clip_range, clip_high=clip_high,
                                            loss_agg=cfg.loss_agg)
                    loss.backward()
                    totals["loss"] += loss.item()
                    for k in ("kl", "clip", "ratio", "tokens"):
                        totals[k] += stats[k]
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                totals["grad_norm"] += grad_norm.item()
                optimizer.step()
                updates += 1
        t_end = time.perf_counter()

        # ---- log ---------------------------------------------------------------------------------
        n_tokens = completion_mask.sum().item()
        step_time = t_end - t_start
        rec = {
            "step": step,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "frac_zero_std": frac_zero_std,
            "loss": totals["loss"] / updates,
            "kl": totals["kl"] / max(totals["tokens"], 1),
            "clip_frac": totals["clip"] / max(totals["tokens"], 1),
            "ratio_mean": totals["ratio"] / max(totals["tokens"], 1),
            "grad_norm": totals["grad_norm"] / updates,
            "completion_len_mean": n_tokens / B,
            "step_time_s": step_time,
            "gen_time_s": t_gen - t_start,
            "score_time_s": t_score - t_gen,
            "ref_time_s": t_ref - t_score,
            "train_time_s": t_end - t_ref,
            "samples_per_s": B / step_time,
            "tokens_per_s": n_tokens / step_time,
            **{f"reward_{k}": v for k, v in components.items()},
            **memory.snapshot(device),
        }
        if errors:
            rec["reward_errors"] = errors
        log.write(metrics_file, rec)
        if completions_file is not None:
            lens = completion_mask.sum(1).tolist()
            sums = (old_logp * completion_mask).sum(1).tolist()
            for p, c, r, n, s in zip(row_prompts, texts, rewards.tolist(), lens, sums):
                log.write(completions_file, {"step": step, "prompt": p, "completion": c, "reward": r,
                                             "completion_tokens": n, "logprob_sum": s})
        if verbose:
            (tqdm.write if not bar.disable else print)(log.step_line(rec, cfg.steps))
        if evaluating and step % cfg.eval_interval == 0:
            log.write(metrics_file, run_eval(step))
    metrics_file.close()
    if completions_file is not None:
        completions_file.close()
    if hasattr(task, "close"):
        task.close()


if __name__ == "__main__":
    main()
