"""The floor: a bare Hugging Face `model.generate` of the benchmark's batch plus one forward+backward pass.

No reward, no reference, no optimizer: what any trainer on this model must at least spend per step
(sampling 64 x 144 tokens and one gradient over the result), with the same dtype handling as the
trainer (fp32 weights, bf16 autocast for bf16). One JSON record per step.
"""
import json
import os
import resource
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import get_bench_task, length_processor, row_lengths, step_prompts, workload_parser  # noqa: E402
from grpo.model import load_policy, load_tokenizer, position_ids_from_mask  # noqa: E402
from grpo.rollout import encode_prompts, left_pad  # noqa: E402


def main():
    args = workload_parser().parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    tok, model = load_tokenizer(args.model), load_policy(args.model, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    task = get_bench_task(args.task)
    records = []
    for step in range(1, args.steps + 1):
        prompts = step_prompts(task, args.batch_size // args.group_size, args.seed, step)
        ids, mask = left_pad(encode_prompts(tok, prompts, True), tok.eos_token_id, device)
        ids, mask = ids.repeat_interleave(args.group_size, 0), mask.repeat_interleave(args.group_size, 0)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.no_grad(), autocast:
            lengths = ({"min_new_tokens": args.new_tokens} if args.lengths == "fixed" else
                       {"logits_processor": [length_processor(step, args.new_tokens, tok.eos_token_id)]})
            seq = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                 temperature=1.0, max_new_tokens=args.new_tokens, pad_token_id=tok.eos_token_id,
                                 **lengths)
        t1 = time.perf_counter()
        full_mask = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1]:])], 1)
        with autocast:
            out = model(input_ids=seq, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask),
                        labels=seq.masked_fill(full_mask == 0, -100))
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        rec = {"step": step, "step_time_s": t2 - t0, "gen_time_s": t1 - t0, "score_time_s": 0.0, "ref_time_s": 0.0,
               "train_time_s": t2 - t1, "samples_per_s": args.batch_size / (t2 - t0),
               "tokens_per_s": (seq.shape[1] - ids.shape[1]) * args.batch_size / (t2 - t0) if args.lengths == "fixed"
               else sum(row_lengths(step, args.batch_size, args.new_tokens)) / (t2 - t0),
               "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if device.type == "cuda":
            rec["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        records.append(rec)
    with open(args.out, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
