"""The peer: Hugging Face TRL's GRPOTrainer on the benchmark's workload, one JSON record per step.

Run by bench/run.py with the interpreter of a venv that has requirements-bench.txt (TRL), never the
trainer's own venv. Same model folder, prompts (the trainer's (seed, step) stream, in order), reward,
64 completions per step (8 prompts x 8), exactly 144 new tokens (EOS masked by min_new_tokens, a
logits processor, so the logprobs TRL trains on are the model's own), beta 0.02, token-mean ("dapo")
loss, one update per step, fp32 weights with bf16 autocast for bf16, gradient checkpointing off.

The split is measured by wrapping TRL's own methods: generation (tokenize + generate + decode),
reward (our reward function), reference (the reference model's logprob forward); training is the rest
of the step (the policy forward/backward and the optimizer).
"""
import json
import os
import resource
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import get_bench_task, length_processor, row_lengths, step_prompts, workload_parser  # noqa: E402


def main():
    ap = workload_parser()
    ap.add_argument("--kl-coef", type=float, default=0.02)
    args = ap.parse_args()

    from datasets import Dataset
    from transformers import AutoTokenizer, LogitsProcessorList, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = get_bench_task(args.task)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.eos_token
    n_prompts = args.batch_size // args.group_size
    # the same prompts, in the same order, as train_lean.py draws them; its BOS first when BOS == EOS
    # (--prompt-bos auto), given as text, which the tokenizer turns into that one special token
    BOS_TEXT = tok.bos_token if tok.bos_token_id == tok.eos_token_id else ""
    prompts = [BOS_TEXT + p for step in range(1, args.steps + 1)
               for p in step_prompts(task, n_prompts, args.seed, step)]
    timers = {"gen": 0.0, "score": 0.0, "ref": 0.0}

    def reward(prompts, completions, **_):
        t = time.perf_counter()
        out = [float(task.reward(p[len(BOS_TEXT):], c)) for p, c in zip(prompts, completions)]
        timers["score"] += time.perf_counter() - t
        return out

    class Timed(GRPOTrainer):
        def _generate(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._generate(*a, **k)
            finally:
                timers["gen"] += time.perf_counter() - t

        def _get_per_token_logps_and_entropies(self, model, *a, **k):
            t = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(model, *a, **k)
            finally:
                if model is self.ref_model:
                    timers["ref"] += time.perf_counter() - t

    records = []
    cuda = torch.cuda.is_available()

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            for key in timers:
                timers[key] = 0.0
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - self.t
            tokens = (args.batch_size * args.new_tokens if args.lengths == "fixed"
                      else sum(row_lengths(len(records) + 1, args.batch_size, args.new_tokens)))
            rec = {"step": len(records) + 1, "step_time_s": dt, "gen_time_s": timers["gen"],
                   "score_time_s": timers["score"], "ref_time_s": timers["ref"],
                   "train_time_s": dt - timers["gen"] - timers["score"] - timers["ref"],
                   "samples_per_s": args.batch_size / dt, "tokens_per_s": tokens / dt,
                   "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            if cuda:
                rec["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            records.append(rec)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), max_steps=args.steps, seed=args.seed,
        per_device_train_batch_size=args.batch_size, num_generations=args.group_size,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens} if args.lengths == "fixed" else {},
        temperature=1.0, top_p=1.0, top_k=0, beta=args.kl_coef, epsilon=0.2, loss_type="dapo",
        scale_rewards="group", learning_rate=1e-5, weight_decay=0.0, max_grad_norm=1.0,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        bf16=args.dtype == "bf16", model_init_kwargs={"dtype": "float32"}, gradient_checkpointing=False,
        shuffle_dataset=False, disable_dropout=True, logging_steps=1, report_to=[], save_strategy="no",
        log_completions=False, dataloader_num_workers=0, use_cpu=not cuda,
    )
    trainer = Timed(model=args.model, reward_funcs=reward, args=config, processing_class=tok,
                    train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[Clock()])
    if args.lengths == "varied":   # each generate() call is a step's: its rows end at their lengths
        generate, calls = trainer.model.generate, []

        def varied(*a, **k):
            calls.append(1)
            return generate(*a, **k, logits_processor=LogitsProcessorList(
                [length_processor(len(calls), args.new_tokens, tok.eos_token_id)]))
        trainer.model.generate = varied
    trainer.train()
    with open(args.out, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
