"""Held-out evaluation through the task's evaluate(complete): the trainer decodes, the task scores.

`complete(prompts) -> list[str]` is greedy decoding of the policy being trained (the same prompt encoding,
BOS and --max-new-tokens as training). What the task returns (checked: names to finite numbers) is printed
as a table and written to the metrics log as a record with "kind": "eval".
"""
import functools
import time

from grpo import distributed, log
from grpo.task import check_metrics
from grpo.rollout import greedy_completions


def completer(policy, tokenizer, *, prepend_bos: bool, max_new_tokens: int, batch: int, device, autocast):
    """The complete(prompts) function a task's evaluate() calls."""
    return functools.partial(greedy_completions, policy, tokenizer, prepend_bos=prepend_bos,
                             max_new_tokens=max_new_tokens, batch=batch, device=device, autocast=autocast)


def run(task, complete, step: int, metrics_file=None, reporter=None) -> dict | None:
    """Rank 0 evaluates, prints the table and logs the record (to the JSONL file and the --report-to
    reporter); the other ranks wait for it."""
    record = None
    if distributed.is_main():
        t0 = time.perf_counter()
        result = check_metrics(task.evaluate(complete))
        record = {"kind": "eval", "step": step, **result, "eval_time_s": time.perf_counter() - t0}
        print(table(record), flush=True)
        if metrics_file is not None:
            log.write(metrics_file, record)
        if reporter is not None:
            reporter.log(record, step)
    distributed.barrier()
    return record


def table(record: dict) -> str:
    keys = [k for k in record if k not in ("kind", "step", "eval_time_s")]
    width = max(map(len, keys), default=0)
    lines = [f"eval at step {record['step']} ({record['eval_time_s']:.1f} s)"]
    lines += [f"  {k:<{width}}  {record[k]:.4f}" if isinstance(record[k], float) else f"  {k:<{width}}  {record[k]}"
              for k in keys]
    return "\n".join(lines)
