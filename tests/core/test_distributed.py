"""Data parallel: `torchrun --nproc_per_node 2` (gloo, CPU) makes the same update as one process.

Sampling is seeded per generation chunk by (seed, step, the chunk's first global row), so one process
with --generation-batch-size equal to each rank's share samples exactly the rows the two ranks sample;
everything after that (global advantages, the global token count, gradients summed over ranks) must then
give the one-process update, up to float summation order.
"""
import os
import subprocess
import sys

import torch

from helpers import SMALL, TRAIN, env, records, train, weights

ARGS = [*SMALL, "--task", "toy", "--batch-size", "16", "--group-size", "4", "--steps", "2", "--save-interval", "2",
        "--scale-rewards", "batch", "--seed", "3"]


def test_two_processes_make_the_one_process_update(tiny_model_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    single = train("--model", tiny_model_dir, *ARGS, "--generation-batch-size", "8", "--out-dir", str(one))
    assert single.returncode == 0, single.stderr
    pair = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           TRAIN, "--model", tiny_model_dir, *ARGS, "--out-dir", str(two)],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert pair.returncode == 0, pair.stderr[-3000:]
    # rank 0 alone prints, and its start-up table shows per-device | global sizes
    assert pair.stdout.count("batch layout (per device | global)") == 1
    assert "completions per step                       8 | 16" in pair.stdout

    a, b = records(one / "metrics.jsonl"), records(two / "metrics.jsonl")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        # the same rollouts, rewards and advantages; the loss and gradient up to summation order
        for k in ("reward_mean", "reward_std", "frac_zero_std", "completion_len_mean"):
            assert ra[k] == rb[k], k
        for k in ("loss", "kl", "clip_frac", "ratio_mean", "grad_norm"):
            assert abs(ra[k] - rb[k]) <= 1e-5 * max(1.0, abs(ra[k])), (k, ra[k], rb[k])
    assert a[0]["grad_norm"] > 0 or a[1]["grad_norm"] > 0  # something was learned, so something was compared

    start = weights(tiny_model_dir)
    wa, wb = weights(one / "checkpoints" / "step_000002"), weights(two / "checkpoints" / "step_000002")
    assert max((wa[k] - start[k]).abs().max().item() for k in wa) > 1e-4
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-5)
    assert os.listdir(two / "checkpoints") == ["step_000002"]  # saved once, by rank 0
