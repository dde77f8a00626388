"""GRPO on a small causal language model: one run, told top to bottom.

    python train_lean.py --batch-size 64          # 8 prompts x 8 completions per step
    python train_lean.py --task toy --help        # every flag (each also reads GRPO_<FLAG>), the task's included
    torchrun --nproc_per_node 2 train_lean.py ... # data-parallel: each process takes whole groups

Each step: draw prompts, sample groups of completions, score them, turn rewards into group-relative
advantages, update the policy with a clipped PPO loss plus a KL penalty against a frozen reference.
The algorithm is this file and three beside it: grpo/algorithm.py (the math), grpo/rollout.py (the step's
record and its sampling) and grpo/update.py (mini-batches, micro-batches, devices). What keeps the run safe
and recorded (settings, the run folder, checkpoints, logs, memory, guards, the checks of what a task returns)
is the harness/ package, called below by name as `run.<something>`; grpo/ never imports it. A call
that every rank makes together under torchrun (a collective, or a function that makes one) is
marked `# every rank` on its line, here, in grpo/ and in harness/: tests/test_repository.py checks.
"""
import dataclasses
import functools
import random

import torch

import tasks
from grpo import distributed, ptx
from grpo.algorithm import adaptive_kl_coef, group_advantages, kl_reward_penalty, learning_rate, overlong_penalty
from grpo.model import sync_reference
from grpo.optim import make_optimizer
from grpo.rollout import merge, missing_groups, sample_groups, stream_seed
from grpo.update import reference_logprobs, update
from harness.run import Run


def main(argv=None):
    # every setting checked (a bad one exits 2 with one line), OUT_DIR locked, the devices joined
    run = Run(argv, builtin=tasks.BUILTIN, default_task=tasks.DEFAULT)  # every rank
    cfg, layout, device, rank, world = run.cfg, run.layout, run.device, run.rank, run.world
    G, P, B = cfg.group_size, layout.prompts_per_device, layout.completions_per_device
    with run:   # every way out closes what the run opened; a failure after a completed step saves that step
        # ---- task, model, reference ----------------------------------------------------------------------
        task, mix_source = run.open_task()   # mix_source: --ptx-coef's texts (n, rng) -> n texts, or None
        policy, reference, tokenizer = run.load_models()   # reference: a frozen copy of the start, None without KL
        if cfg.eval_only:
            return run.evaluate_only()
        optimizer = make_optimizer(policy, cfg)   # AdamW, or --optimizer muon (grpo/optim.py)
        # the micro-batch and its out-of-memory retry, non-finite updates
        guard = run.start_training(optimizer)   # every rank
        sample = functools.partial(sample_groups, policy, tokenizer, group_size=G, prepend_bos=run.prepend_bos,
                                   generation_batch=layout.generation_batch, max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                   min_new_tokens=cfg.min_new_tokens, autocast=run.autocast, device=device,
                                   compile=cfg.compile == "on")

        for step in run.steps():   # every rank: checkpoints, a stop on Ctrl-C, the final model
            rec = {"step": step}   # the step's JSON record: the stages below add to it

            # ---- prompts: the step's groups, this rank's share of them -------------------------------------
            rng = random.Random(stream_seed(cfg.seed, step))
            prompts = task.prompts(layout.prompts_per_step, rng)[rank * P:(rank + 1) * P]

            # ---- rollout: G completions per prompt, sampled ids and logprobs kept --------------------------
            batch = sample(prompts, seed=stream_seed(cfg.seed, step), first_row=rank * B)   # the stages fill it
            run.phase_done("gen")

            # ---- rewards: the task scores the decoded text; a failing reward gets min_reward ----------------
            rounds = [batch.score(run.scorer)]
            # DAPO's dynamic sampling: more of the step's prompts while any rank lacks groups whose rewards
            # differ (later rounds sample at rows past every earlier round's: no two share a seed)
            while cfg.dynamic_sampling and len(rounds) <= cfg.max_sampling_rounds and distributed.any_rank(
                    missing_groups([r.rewards for r in rounds], G, P) > 0):  # every rank
                more = task.prompts(layout.prompts_per_step, rng)[rank * P:(rank + 1) * P]
                rounds.append(sample(more, seed=stream_seed(cfg.seed, step),
                                     first_row=(len(rounds) * world + rank) * B).score(run.scorer))
            if cfg.dynamic_sampling:   # the informative groups first
                batch, counts = merge(rounds, G, P, tokenizer.eos_token_id)
                rec.update(counts)
            if cfg.overlong_buffer:   # DAPO's soft penalty on completions near the length limit
                batch.penalties["overlong_penalty"] = overlong_penalty(batch.completion_mask.sum(1).cpu(), cfg)
            run.phase_done("score")

            # ---- reference logprobs, once per row: the KL penalty in the loss or in the reward --------------
            # (its coefficient --kl-coef, or with --kl-target the controller's, kept in checkpoints by the harness)
            step_cfg = dataclasses.replace(cfg, kl_coef=run.kl_coef) if cfg.kl_target else cfg
            if reference is not None:
                batch.ref_logp = reference_logprobs(  # every rank
                    reference, batch, cfg, run.autocast, guard)
                if cfg.kl_in == "reward":
                    batch.penalties["kl_reward_penalty"] = kl_reward_penalty(
                        batch.old_logp, batch.ref_logp, batch.completion_mask, step_cfg.kl_coef, cfg.kl_estimator).cpu()
            batch.shape()   # shaped_rewards: the rewards less the penalties above (none by default)
            run.phase_done("ref")

            # ---- advantages: each completion against its group, every rank's groups (--scale-rewards batch) --
            rewards = torch.cat(distributed.gather_objects(batch.shaped_rewards))  # every rank
            parts = None if cfg.scale_rewards != "gdpo" else torch.cat(  # GDPO: each part, weighted
                distributed.gather_objects(torch.tensor(batch.reward_parts)))  # every rank
            advantages, rec["frac_zero_std"] = group_advantages(rewards, G, cfg.scale_rewards, parts=parts,
                                                                weights=list(run.scorer.weights.values()))
            batch.advantages = advantages[rank * B:(rank + 1) * B].to(device)
            run.check_rewards(step, batch, rec)   # every rank: failures shown; every reward failed: the run stops

            # ---- update: clipped PPO surrogate (+ KL, entropy), mini-batches of micro-batches ----------------
            rec["lr"] = learning_rate(step, cfg)   # --lr-scheduler, after its warmup
            for group in optimizer.param_groups:
                group["lr"] = rec["lr"]
            # the pretraining mix (--ptx-coef): each update's texts, drawn from (seed, step) as the prompts are
            mix = None if mix_source is None else [b.for_device(rank, world) for b in ptx.step_batches(
                mix_source, stream_seed(cfg.seed, step), layout.updates_per_step, cfg.ptx_batch_size, tokenizer,
                run.prepend_bos, run.context, device)]
            rec.update(update(  # every rank
                policy, optimizer, batch, step_cfg, layout, run.autocast, guard, mix))
            if cfg.kl_target:   # the next step's coefficient, from this step's KL (the same on every rank)
                rec["kl_coef"], run.kl_coef = run.kl_coef, adaptive_kl_coef(run.kl_coef, rec["kl"], cfg.batch_size, cfg)
            if cfg.ref_sync_steps and step % cfg.ref_sync_steps == 0:   # TR-DPO: the reference follows
                sync_reference(reference, policy, cfg.ref_sync_alpha)
            run.end_step(rec, batch)   # the record, the console line, the held-out evaluation when due


if __name__ == "__main__":
    main()
