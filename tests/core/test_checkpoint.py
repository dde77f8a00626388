"""Checkpoints and resume: a run killed with SIGKILL and resumed equals an uninterrupted one, exactly."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import SMALL, TRAIN, env, records, train, weights
from grpo import checkpoint


def wait_for(predicate, proc, timeout=90):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended early:\n{proc.communicate()[1][-2000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def saved_steps(out):
    return [int(n[5:]) for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_")] \
        if os.path.isdir(os.path.join(out, "checkpoints")) else []


def test_sigkill_then_resume_equals_an_uninterrupted_run(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    steps = 8
    args = [TRAIN, "--model", tiny_model_dir, *SMALL, "--steps", str(steps), "--save-interval", "1",
            "--keep-checkpoints", "2"]
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    assert subprocess.run([sys.executable, *args, "--out-dir", whole], env=env(), capture_output=True).returncode == 0

    proc = subprocess.Popen([sys.executable, *args, "--out-dir", cut], env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: max(saved_steps(cut), default=0) >= 2, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed_at = max(saved_steps(cut))
    assert killed_at < steps, "the run finished before the kill: nothing was tested"
    assert len(records(os.path.join(cut, "metrics.jsonl"))) >= killed_at

    resumed = train("--model", tiny_model_dir, *SMALL, "--steps", str(steps), "--save-interval", "1",
                    "--out-dir", cut, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"after step {killed_at}" in resumed.stdout  # it did continue from the checkpoint, not restart

    # every logged number (rewards, losses, KL, gradient norms, ...) of every step, and the final weights
    assert records(os.path.join(cut, "metrics.jsonl")) == records(os.path.join(whole, "metrics.jsonl"))
    final = f"checkpoints/step_{steps:06d}"
    a, b = weights(os.path.join(whole, final)), weights(os.path.join(cut, final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(saved_steps(cut)) == [steps - 1, steps]  # the last K only

    # a checkpoint is a plain transformers folder
    model = AutoModelForCausalLM.from_pretrained(os.path.join(cut, final))
    tok = AutoTokenizer.from_pretrained(os.path.join(cut, final))
    assert torch.equal(model.state_dict()["lm_head.weight"], b["transformer.wte.weight"])
    assert tok.eos_token_id is not None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_saves_and_exits_0(tiny_model_dir, tmp_path, sig):
    out = str(tmp_path / "out")
    proc = subprocess.Popen([sys.executable, TRAIN, "--model", tiny_model_dir, *SMALL, "--steps", "1000",
                             "--out-dir", out], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(out, "metrics.jsonl")
    wait_for(lambda: os.path.exists(metrics) and len(open(metrics).readlines()) >= 2, proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    done = len(records(metrics))
    assert done < 1000 and saved_steps(out) == [done]  # the step in flight was finished, logged and saved
    assert "stopped after step" in stdout


def test_latest_skips_half_written_and_incomplete_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    for name, complete in (("step_000002", True), ("step_000010", False), (".tmp-step_000012", True)):
        (folder / name).mkdir(parents=True)
        if complete:
            (folder / name / checkpoint.STATE).write_bytes(b"x")
    assert checkpoint.latest(str(tmp_path)) == str(folder / "step_000002")
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in"):
        checkpoint.resolve(str(tmp_path / "elsewhere"), str(tmp_path))


def test_rng_states_round_trip_through_a_saved_file(tmp_path):
    import random

    import numpy as np
    states = checkpoint.rng_states()
    torch.save(states, tmp_path / "rng.pt")
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_a_dynamic_sampling_run_resumes_exactly(tiny_model_dir, tmp_path, clean_env):
    # the extra rounds draw from the step's own seeded prompt stream, so a resumed run redoes them exactly
    import train_lean
    args = ["--model", tiny_model_dir, "--task", "toy", "--batch-size", "8", "--group-size", "4",
            "--max-new-tokens", "8", "--learning-rate", "1e-3", "--dynamic-sampling", "--log-level", "warning",
            "--save-final", "false"]
    train_lean.main([*args, "--steps", "3", "--out-dir", str(tmp_path / "straight")])
    train_lean.main([*args, "--steps", "2", "--save-interval", "2", "--out-dir", str(tmp_path / "resumed")])
    train_lean.main([*args, "--steps", "3", "--resume", "--out-dir", str(tmp_path / "resumed")])
    straight, resumed = records(tmp_path / "straight" / "metrics.jsonl"), records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed == straight
    assert all(r["groups_drawn"] >= 2 for r in straight)
