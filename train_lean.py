"""GRPO on a small causal language model: one run, told top to bottom.

    python train_lean.py --batch-size 64          # 8 prompts x 8 completions per step
    python train_lean.py --task toy --help        # every flag (each also reads GRPO_<FLAG>), the task's included
    torchrun --nproc_per_node 2 train_lean.py ... # data-parallel: each process takes whole groups

configuration -> task, model and reference -> a loop: draw prompts, sample groups of completions, score
them, turn rewards into group-relative advantages, update the policy with a clipped PPO loss plus a KL
penalty, log one line and one JSON record (with memory) per step, checkpoint now and then; at the end
the trained model is saved as a Hugging Face folder. The math is grpo/algorithm.py, the update loop around it
grpo/update.py, the other pieces beside them in grpo/; the tasks live in tasks/, which grpo/ never imports. The
calls every rank makes together under torchrun are marked `# every rank`: here and in grpo/update.py only.
"""
import contextlib
import functools
import os
import random
import sys

import torch
from tqdm import tqdm

import tasks
from grpo import distributed, ptx
from harness import checkpoint, cli, config, guards, log, memory, rundir, screen
from harness import task as task_lib
from grpo.algorithm import group_advantages, kl_penalised_rewards, learning_rate, missing_groups, overlong_penalty
from grpo.model import (ModelLoadError, context_length, frozen_copy, load_config, load_policy, load_tokenizer,
                        load_trainable, model_autocast, sync_reference)
from grpo.rollout import encode_prompts, eval_completions, merge, sample_groups, wants_bos
from grpo.update import probe_micro_batch, reference_logprobs, update


def usage_error(message: str):
    log.note(f"error: {message}")  # under torchrun every rank fails alike; rank 0 says so
    sys.exit(2)


def step_seed(seed: int, step: int) -> int:
    """The seed of a step's prompts and sampling: the prompt stream needs no state to resume."""
    return seed * 1_000_003 + step


def configure(argv):
    """Every setting, checked before anything heavy is loaded: a bad one exits 2 with one line."""
    try:
        loaded = cli.load(argv, builtin=tasks.BUILTIN, default_task=tasks.DEFAULT)
        cfg = loaded.cfg
        layout = config.batch_layout(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
        rundir.check_paths(cfg)
        rundir.check_paths(loaded.options)
        held, resume_from = rundir.claim(cfg, loaded.options)  # OUT_DIR locked, never another run's records
    except (config.ConfigError, checkpoint.CheckpointError, task_lib.TaskError) as e:
        usage_error(str(e))
    evaluating = hasattr(loaded.task, "evaluate") and (cfg.eval_only or cfg.eval_interval > 0)
    return loaded, layout, held, resume_from, evaluating


def main(argv=None):
    # ---- configuration ---------------------------------------------------------------------------
    loaded, layout, held, resume_from, evaluating = configure(argv)
    cfg = loaded.cfg
    rank, world, device = distributed.init(cfg.device)
    main_rank = rank == 0  # only rank 0 prints, logs, saves and evaluates
    say = functools.partial(log.say, main_rank and cfg.log_level != "warning")
    screen.keep_settings(cfg, screen.describe(cfg, loaded.options, loaded.sources, layout), main_rank)  # settings.txt
    autocast = model_autocast(device, cfg.dtype)   # bf16 matmuls over fp32 weights and AdamW state
    checkpoint.seed_all(cfg.seed)
    start_step = checkpoint.step_of(resume_from) if resume_from else 0
    G, P, B, mini = cfg.group_size, layout.prompts_per_device, layout.completions_per_device, layout.mini_batch_per_device

    with contextlib.ExitStack() as stack:  # every way out, an exception included, closes what the run opened
        stack.enter_context(held)       # the lock on OUT_DIR, released last
        stack.push(distributed.close)   # told whether the run ended by an exception
        # ---- task, model, reference ------------------------------------------------------------------
        try:
            task = task_lib.build(loaded.task, loaded.options, cfg.task)
            stack.callback(task_lib.close, task)
            draw_text = ptx.source(task, cfg.ptx_file) if cfg.ptx_coef else None   # --ptx-coef's text
            # the first step's prompts, checked with the tokenizer and the model's config before the weights load
            first_prompts = [] if cfg.eval_only else task_lib.draw_prompts(task, layout.prompts_per_step, random.Random(
                step_seed(cfg.seed, start_step + 1)))
            tokenizer = load_tokenizer(resume_from or cfg.model)   # checked against the model's vocab_size
            eos = tokenizer.eos_token_id
            prepend_bos = wants_bos(cfg.prompt_bos, tokenizer)
            context = context_length(load_config(resume_from or cfg.model))
            first_ids = encode_prompts(tokenizer, first_prompts, prepend_bos, cfg.max_new_tokens, context)
            policy, lora = load_trainable(cfg, device, resume_from)  # lora: with --lora-rank, the PeftModel around it
            # the reference is a frozen copy of the starting policy on the same device, only when used (with LoRA the
            # policy, adapters off); a resumed run anchors its KL to the starting model too (unless synced)
            reference = None if cfg.kl_coef == 0 or cfg.eval_only else (
                lora or frozen_copy(load_policy(cfg.model, device) if resume_from else policy))
        except (task_lib.TaskError, ModelLoadError) as e:
            usage_error(str(e))
        say(screen.header(loaded, layout, device, policy, resume_from, lora))   # what runs, where its results go
        if cfg.gradient_checkpointing:  # layers recompute their activations in backward (grpo/model.py)
            policy.activation_checkpointing_enable({"use_reentrant": False})
        # the task's held-out evaluate(complete): greedy decoding, or seeded samples; rank 0 alone evaluates
        complete = functools.partial(eval_completions, policy, tokenizer, prepend_bos=prepend_bos, device=device,
                                     max_new_tokens=cfg.max_new_tokens, batch=layout.generation_batch, autocast=autocast,
                                     seed=cfg.seed)
        if cfg.eval_only:  # a log file only when asked for: an earlier run's metrics are not overwritten
            if main_rank:
                task_lib.evaluate(task, complete, start_step, stack.enter_context(log.open_jsonl(cfg.log_file))
                                  if cfg.log_file else None)
            return

        params = [p for p in policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        nonfinite_streak = 0
        if resume_from:
            state = checkpoint.load_state(resume_from)
            optimizer.load_state_dict(state["optimizer"])
            nonfinite_streak = state["nonfinite_streak"]
            if "reference" in state:  # --ref-sync-steps moved it: the checkpoint holds where it was
                reference.load_state_dict(state["reference"])
            # each rank continues its own RNG streams (rank 0's when the device count changed)
            checkpoint.set_rng_states(state["rng"][rank] if len(state["rng"]) == world else state["rng"][0])
            say(f"resumed from {resume_from} after step {start_step}")
        oom = guards.OomNotes(say)  # this step's out-of-memory retries
        micro = layout.micro_batch
        if layout.micro_batch_auto:
            longest = max(map(len, first_ids)) + cfg.max_new_tokens
            micro = probe_micro_batch(policy, optimizer, longest, eos, layout, cfg, autocast, oom)
            oom.notes.clear()
            say(f"micro-batch auto: {micro} per device ({micro * world} global) fits at {longest} tokens, "
                f"{mini // micro} gradient-accumulation steps")
        settings = config.settings(cfg, loaded.options)
        metrics_file, completions_file = log.open_run_logs(log.metrics_path(cfg), cfg.log_completions, start_step
                                                           if resume_from else None, stack) if main_rank else (None, None)
        try:  # TensorBoard or W&B as well, on rank 0 (--report-to)
            reporter = log.open_reporter(cfg.report_to if main_rank else "none", cfg.out_dir, settings)
        except log.ReportError as e:
            usage_error(str(e))
        stack.callback(reporter.close)
        # checkpoints; and on a failure after a completed step, that step's (harness/checkpoint.py)
        saver = stack.enter_context(checkpoint.Saver(cfg.out_dir, lora or policy, tokenizer, optimizer, settings,
                                                     cfg.keep_checkpoints, start_step, nonfinite_streak,
                                                     reference if cfg.ref_sync_steps else None))
        if evaluating and start_step == 0 and main_rank:  # where the run starts from
            task_lib.evaluate(task, complete, 0, metrics_file, reporter)
        scorer, exit_code = task_lib.Scorer(task, cfg.reward_errors == "tolerate"), 0
        bar = tqdm(range(start_step + 1, cfg.steps + 1), desc="steps", initial=start_step, total=cfg.steps,
                   disable=not (main_rank and sys.stderr.isatty()), file=sys.stderr)

        sample = functools.partial(sample_groups, policy, tokenizer, group_size=G, prepend_bos=prepend_bos,
                                   generation_batch=layout.generation_batch, max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                   min_new_tokens=cfg.min_new_tokens, autocast=autocast, device=device,
                                   compile=cfg.compile)
        phases = stack.enter_context(memory.Phases(device, rank, cfg, say))  # time and memory per phase, traces
        with guards.StopOnSignal(say) as stop:
            for step in bar:
                phases.start(step)
                oom.notes.clear()
                rec = {"step": step}  # the step's JSON record: the stages below add to it

                # ---- prompts: the step's groups, this rank's share of them ---------------------------
                rng = random.Random(step_seed(cfg.seed, step))
                prompts = task_lib.draw_prompts(task, layout.prompts_per_step, rng)[rank * P:(rank + 1) * P]

                # ---- rollout: G completions per prompt, sampled ids and logprobs kept --------------
                batch = sample(prompts, seed=step_seed(cfg.seed, step), first_row=rank * B)  # the stages fill it
                phases.end("gen")

                # ---- rewards: the task scores the decoded text; a failing reward gets min_reward ----
                rounds = [batch.score(scorer)]
                # DAPO's dynamic sampling: more of the step's prompts while any rank lacks groups whose rewards
                # differ (later rounds sample at rows past every earlier round's: no two share a seed)
                while cfg.dynamic_sampling and len(rounds) <= cfg.max_sampling_rounds and distributed.any_rank(
                        missing_groups([r.rewards for r in rounds], G, P) > 0):  # every rank
                    more = task_lib.draw_prompts(task, layout.prompts_per_step, rng)[rank * P:(rank + 1) * P]
                    rounds.append(sample(more, seed=step_seed(cfg.seed, step),
                                         first_row=(len(rounds) * world + rank) * B).score(scorer))
                if cfg.dynamic_sampling:  # the informative groups first
                    batch, counts = merge(rounds, G, P, eos)
                    rec.update(counts)
                if cfg.overlong_buffer:  # DAPO's soft penalty on completions near the length limit
                    batch.rewards = batch.rewards + overlong_penalty(batch.completion_mask.sum(1).cpu(), cfg)
                phases.end("score")

                # ---- reference logprobs, once per row: the KL penalty in the loss or in the reward ----
                if reference is not None:
                    batch.ref_logp, micro = reference_logprobs(reference, batch, micro, mini, cfg, autocast, oom)
                    if cfg.kl_in == "reward":
                        batch.train_rewards = kl_penalised_rewards(batch.rewards.to(device), batch.old_logp,
                                                                   batch.ref_logp, batch.completion_mask,
                                                                   cfg.kl_coef, cfg.kl_estimator).cpu()
                phases.end("ref")

                # ---- every rank's share of the step, gathered once (every rank): the advantages with
                # --scale-rewards batch, the record and the reward failures read it --------------------
                everyone = log.combine(distributed.gather_objects(log.share(batch, scorer, cfg.log_completions)))

                # ---- advantages: each completion against its group ------------------------------------
                advantages, frac_zero_std = group_advantages(everyone["train_rewards"], G, cfg.scale_rewards)
                scorer.after_step(step, everyone, frac_zero_std)  # failures shown; all failed: stop; all flat: said
                batch.advantages = advantages[rank * B:(rank + 1) * B].to(device)

                # ---- update: clipped PPO surrogate (+ KL, entropy), mini-batches of micro-batches ------
                rec["lr"] = learning_rate(step, cfg)  # --lr-scheduler, after its warmup
                for group in optimizer.param_groups:
                    group["lr"] = rec["lr"]
                # the pretraining mix (--ptx-coef): each update's texts, drawn from (seed, step) as the prompts are
                texts = None if draw_text is None else [b.share(rank, world) for b in ptx.step_batches(
                    draw_text, step_seed(cfg.seed, step), layout.updates_per_step, cfg.ptx_batch_size, tokenizer,
                    prepend_bos, context, device)]
                stats, micro, nonfinite_streak = update(policy, optimizer, batch, layout=layout, micro=micro, cfg=cfg,
                                                        autocast=autocast, on_oom=oom, nonfinite_streak=nonfinite_streak,
                                                        ptx=texts)
                if cfg.ref_sync_steps and step % cfg.ref_sync_steps == 0:  # TR-DPO: the reference follows
                    sync_reference(reference, policy, cfg.ref_sync_alpha)
                saver.completed(step, nonfinite_streak)
                phases.end("train")

                # ---- log: one JSON record and one console line per step ------------------------------
                rec.update(log.batch_stats(everyone, G), frac_zero_std=frac_zero_std, **stats)
                if oom.notes:
                    rec.update(oom_retries=len(oom.notes), micro_batch=micro)
                rec.update(log.throughput(phases.times(), everyone), **phases.record())
                if main_rank:
                    if cfg.log_completions:
                        log.write_completions(completions_file, step, everyone)
                    log.write(metrics_file, rec)
                    reporter.log(rec, step)
                    if cfg.log_level != "warning":
                        (tqdm.write if not bar.disable else print)(log.step_line(rec, cfg.steps))
                    if evaluating and (step % cfg.eval_interval == 0 or step == cfg.steps):  # the last: "after"
                        task_lib.evaluate(task, complete, step, metrics_file, reporter)

                # ---- checkpoint, stop ----------------------------------------------------------------
                stopping = distributed.any_rank(stop.requested)  # every rank
                aborting = nonfinite_streak >= cfg.max_nonfinite
                if stopping or aborting or (cfg.save_interval and (step % cfg.save_interval == 0 or step == cfg.steps)):
                    path = saver.save(distributed.gather_objects(checkpoint.rng_states()))  # every rank; rank 0 writes
                    say(f"saved {path}")
                if aborting:
                    log.note(guards.nonfinite_abort(step, nonfinite_streak, path))
                    exit_code = 1
                    break
                if stopping:
                    say(f"stopped after step {step}: continue with --resume")
                    break
            else:  # the run reached its last step: keep what it made
                if cfg.save_final and main_rank:
                    folder = checkpoint.save_model(os.path.join(cfg.out_dir, "model"), lora or policy, tokenizer)
                    say(f"saved the trained model to {folder} (from_pretrained loads it)")
        if exit_code:
            sys.exit(exit_code)


if __name__ == "__main__":
    main()
