"""The pretraining mix without RL: the ablation row that says what GRPO adds beyond continued pretraining.

    .venv/bin/python bench/ptx_alone.py --seed 0 --ptx-coef 1 --out-dir out/ptx-alone-s0   # train_lean.py's flags

Each step learns exactly the texts a `train_lean.py` run with the same flags adds to its updates (the same
grpo/ptx.py stream from (seed, step), the same coefficient, learning-rate schedule, AdamW and gradient clipping),
with no rollouts and no GRPO loss; it evaluates with the task's evaluate() at the same steps and writes the same
eval records to OUT_DIR/metrics.jsonl (one "ptx_loss" record per step beside them), then the model to OUT_DIR/model.
"""
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import tasks  # noqa: E402
from grpo import distributed, ptx  # noqa: E402
from grpo.optim import learning_rate  # noqa: E402
from grpo.ptx import ptx_loss  # noqa: E402
from grpo.model import (completion_logprobs, context_length, load_config, load_policy, load_tokenizer,  # noqa: E402
                        trainable_parameters)
from grpo.rollout import stream_seed, wants_bos  # noqa: E402
from harness import checkpoint, cli, config, log  # noqa: E402
from harness import task as task_lib  # noqa: E402
from train_lean import TABLES  # noqa: E402  (the variant flags' choices)


def main(argv=None):
    try:
        loaded = cli.load(argv, builtin=tasks.BUILTIN, default_task=tasks.DEFAULT, tables=TABLES)
        cfg = loaded.cfg
        layout = config.batch_layout(cfg)
        config.check_variants(cfg, TABLES)
        if not cfg.ptx_coef:
            raise config.ConfigError("--ptx-coef 0: give the coefficient of the run to compare with")
        task = task_lib.build(loaded.task, loaded.options, cfg.task)
        draw = task_lib.mix_source(task, cfg.ptx_file)
    except (config.ConfigError, task_lib.TaskError) as e:
        print(f"ptx_alone.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(cfg.out_dir, exist_ok=True)
    checkpoint.seed_all(cfg.seed)
    device = distributed.init(cfg.device)[2]   # one process
    tokenizer, policy = load_tokenizer(cfg.model), load_policy(cfg.model, device)
    prepend_bos = wants_bos(cfg.prompt_bos, tokenizer)
    context = context_length(load_config(cfg.model))
    params = trainable_parameters(policy)
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    evaluating = hasattr(task, "evaluate") and cfg.eval_interval > 0
    items = log.items_path(os.path.join(cfg.out_dir, "metrics.jsonl"))   # per-item scores, for compare_runs.py
    if os.path.exists(items):   # a fresh run: its evaluations append to a file of their own
        os.remove(items)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w", encoding="utf-8") as metrics:
        complete = functools.partial(task_lib.eval_completions, policy, tokenizer, prepend_bos=prepend_bos, device=device,
                                     max_new_tokens=cfg.max_new_tokens, batch=layout.generation_batch, seed=cfg.seed)
        if evaluating:
            task_lib.evaluate(task, complete, 0, metrics, items_path=items)
        t0 = time.perf_counter()
        for step in range(1, cfg.steps + 1):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, cfg)
            nll = tokens = 0
            for batch in ptx.step_batches(draw, stream_seed(cfg.seed, step), layout.updates_per_step, cfg.ptx_batch_size,
                                          tokenizer, prepend_bos, context, device):
                optimizer.zero_grad(set_to_none=True)
                logp = completion_logprobs(policy, batch.input_ids, batch.attention, batch.target.shape[1], 1.0,
                                           cfg.logprob_chunk_size, share_prompts=False)
                loss, summed = ptx_loss(logp, batch.target, batch.tokens, cfg.ptx_coef)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
                nll, tokens = nll + summed.item(), tokens + batch.tokens
            log.write(metrics, {"step": step, "ptx_loss": nll / tokens, "lr": learning_rate(step, cfg),
                                "elapsed_s": time.perf_counter() - t0})
            if step % 50 == 0:
                print(f"step {step}/{cfg.steps} | ptx {nll / tokens:.3f} | {time.perf_counter() - t0:.0f}s", flush=True)
            if evaluating and (step % cfg.eval_interval == 0 or step == cfg.steps):
                task_lib.evaluate(task, complete, step, metrics, items_path=items, full=step == cfg.steps)
    checkpoint.save_model(os.path.join(cfg.out_dir, "model"), policy, tokenizer, cfg.steps)
    task_lib.close(task)


if __name__ == "__main__":
    main()
