"""Data parallel: `torchrun --nproc_per_node 2` (gloo, CPU) makes the same update as one process.

Sampling is seeded per generation chunk by (seed, step, the chunk's first global row), so one process
with --generation-batch-size equal to each rank's share samples exactly the rows the two ranks sample;
everything after that (global advantages, the global token count, gradients summed over ranks) must then
give the one-process update, up to float summation order.
"""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import torch

from helpers import PROCESS_DEADLINE_S, SMALL, TRAIN, env, line_starting, records, train, weights

pytestmark = pytest.mark.slow   # gloo processes, as under torchrun

ARGS = [*SMALL, "--task", "toy", "--batch-size", "16", "--group-size", "4", "--steps", "2", "--save-interval", "2",
        "--advantage", "batch", "--seed", "3"]


# GDPO reads the reward's parts of every rank's rows (its switch's advantage_inputs gathers them)
PARTED = """
from tasks.toy import ToyTask

class Parted(ToyTask):
    def reward_breakdown(self, prompt, completion):
        return {"reward": self.reward(prompt, completion), "letter": float(completion[:1] == prompt[7]),
                "short": 1 / (1 + len(completion))}
"""


@pytest.mark.parametrize("gdpo", [False, True])
def test_two_processes_make_the_one_process_update(tiny_model_dir, tmp_path, gdpo):
    one, two = tmp_path / "one", tmp_path / "two"
    (tmp_path / "parted.py").write_text(PARTED)
    args = [*ARGS, *(["--task", f"{tmp_path / 'parted.py'}:Parted", "--advantage", "gdpo", "--reward-weights",
                      "letter=1,short=0.5"] if gdpo else [])]
    single = train("--model", tiny_model_dir, *args, "--generation-batch-size", "8", "--out-dir", str(one))
    assert single.returncode == 0, single.stderr
    pair = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           TRAIN, "--model", tiny_model_dir, *args, "--out-dir", str(two)],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert pair.returncode == 0, pair.stderr[-3000:]
    # rank 0 alone prints: its header once, the batch over both devices; the full table, per device | global,
    # in OUT_DIR/settings.txt
    assert pair.stdout.count("train_lean.py: GRPO, steps 1-2") == 1
    assert "= 16 completions per step over 2 devices (8 each)" in pair.stdout
    assert "completions per step                       8 | 16" in (two / "settings.txt").read_text()

    a, b = records(one / "metrics.jsonl"), records(two / "metrics.jsonl")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        # the same rollouts, rewards and advantages; the loss and gradient up to summation order
        for k in ("reward_mean", "reward_std", "frac_zero_std", "completion_len_mean"):
            assert ra[k] == rb[k], k
        for k in ("loss", "kl", "clip_frac", "ratio_mean", "grad_norm", "mismatch_abs", "mismatch_max"):
            assert abs(ra[k] - rb[k]) <= 1e-5 * max(1.0, abs(ra[k])), (k, ra[k], rb[k])
    assert a[0]["grad_norm"] > 0 or a[1]["grad_norm"] > 0  # something was learned, so something was compared

    start = weights(tiny_model_dir)
    wa, wb = weights(one / "checkpoints" / "step_000002"), weights(two / "checkpoints" / "step_000002")
    assert max((wa[k] - start[k]).abs().max().item() for k in wa) > 1e-4
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-5)
    assert os.listdir(two / "checkpoints") == ["step_000002"]  # saved once, by rank 0


HALF_FAILING = '''
class Half:
    name = "half"

    def prompts(self, n, rng):
        return ["Repeat a: "] * (n // 2) + ["Repeat b: "] * (n - n // 2)   # rank 0 gets the a's, rank 1 the b's

    def reward(self, prompt, completion):
        if prompt == "Repeat b: " or self.always:
            return undefined_name
        return completion.count("a") / 10

    always = False


class Always(Half):
    always = True
'''


def torchrun(*args, extra_env=None):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           TRAIN, *args], capture_output=True, text=True,
                          env=env(**(extra_env or {})), timeout=300)


def test_reward_errors_are_decided_on_the_global_count_and_shown_by_rank_0(tiny_model_dir, tmp_path):
    (tmp_path / "half.py").write_text(HALF_FAILING)
    args = ["--model", tiny_model_dir, *SMALL, "--batch-size", "8", "--group-size", "2", "--steps", "2"]
    # every reward of rank 1 fails, none of rank 0: half the step's rewards, so both ranks train on
    half = torchrun(*args, "--task", f"{tmp_path / 'half.py'}:Half", "--out-dir", str(tmp_path / "half"))
    assert half.returncode == 0, half.stderr[-3000:]
    assert [r["reward_errors"] for r in records(tmp_path / "half" / "metrics.jsonl")] == [{"NameError": 4}] * 2
    # rank 0 shows rank 1's first failure, once, with the task's line
    assert half.stderr.count("the task's reward raised NameError: name 'undefined_name' is not defined") == 1
    assert half.stderr.count(f'File "{tmp_path / "half.py"}", line 10, in reward') == 1
    # every reward of both ranks fails: both stop at step 1 (none waits for the other)
    always = torchrun(*args, "--task", f"{tmp_path / 'half.py'}:Always", "--out-dir", str(tmp_path / "always"))
    assert always.returncode != 0 and "step 1/2" not in always.stdout
    assert always.stderr.count("RewardError: step 1: every reward failed (NameError 8;") == 2   # each rank's own


ONE_RANK_APART = '''
import os, runpy, sys
name, value = sys.argv.pop(1), sys.argv.pop(1)
if os.environ["RANK"] == "1":   # as a GRPO_ variable exported on one node only
    os.environ[name] = value
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
'''


def test_ranks_with_different_settings_refuse_to_start_in_one_line(tiny_model_dir, tmp_path):
    """Issue 59 case 5: ranks run with GRPO_LEARNING_RATE, GRPO_TEMPERATURE or GRPO_SEED on rank 1
    only exited 0, settings.txt recording rank 0's; case 4: with GRPO_STEPS there, rank 0 waited
    forever after its last step."""
    (tmp_path / "launch.py").write_text(ONE_RANK_APART.format(train=TRAIN))
    # --steps 1 for both ranks from the environment (the command line would win over rank 1's)
    for name, value, shown, first in (
            ("GRPO_TEMPERATURE", "0.5", "--temperature 0.5 (env)", "rank 0's 1.0 (default)"),
            ("GRPO_STEPS", "2", "--steps 2 (env)", "rank 0's 1 (env)")):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", "2", str(tmp_path / "launch.py"), name, value,
                               "--model", tiny_model_dir, *SMALL, "--task", "toy",
                               "--out-dir", str(out)], capture_output=True, text=True,
                              env=env(GRPO_STEPS="1"), timeout=300)
        assert proc.returncode != 0
        said = [line for line in proc.stderr.splitlines() if "error: rank 1's" in line]
        assert said and shown in said[0] and f"differs from {first}" in said[0], proc.stderr[-2000:]
        # torchrun's launcher prints its own traceback of the failed children; none of the trainer's
        assert "harness/" not in proc.stderr and not (out / "metrics.jsonl").exists()


RANK_1_HUNG = '''
import os, signal, sys, time
from tasks.toy import ToyTask

class Hung(ToyTask):
    calls = 0

    def reward(self, prompt, completion):
        Hung.calls += 1   # 4 a step on each rank
        if Hung.calls == 1 and os.environ.get("FORK"):   # a helper that ends as helpers do
            child = os.fork()
            if child == 0:
                sys.exit()
            os.waitpid(child, 0)
        if Hung.calls == 5 and os.environ["RANK"] == "1" and os.environ.get("HANG"):
            print("hung", os.getpid(), flush=True)
            if os.environ["HANG"] == "stop":   # as a process stopped by a debugger or a full node
                os.kill(os.getpid(), signal.SIGSTOP)
            while os.environ["HANG"] == "swallow":
                try:   # a slow call wrapped in a bare except
                    time.sleep(60)
                except:  # noqa: E722
                    pass
            time.sleep(600)
        return super().reward(prompt, completion)
'''


def hung_torchrun(tiny_model_dir, tmp_path, how):
    (tmp_path / "hung.py").write_text(RANK_1_HUNG)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            TRAIN, "--model", tiny_model_dir, *SMALL, "--task", f"{tmp_path / 'hung.py'}:Hung",
            "--steps", "3", "--stop-grace", "2", "--out-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(args, env=env(HANG=how), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    hung = int(line_starting(proc, "hung", PROCESS_DEADLINE_S).split()[1])
    return args, proc, hung


def test_one_sigterm_to_torchrun_with_a_rank_hung_saves_the_last_step_on_every_rank(
        tiny_model_dir, tmp_path):
    """Issue 59 case 3 under torchrun: rank 1's reward never returned, rank 0 waited in a
    collective; neither acted on torchrun's SIGTERM and both were killed 30 s later, unsaved."""
    args, proc, _ = hung_torchrun(tiny_model_dir, tmp_path, "sleep")
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.perf_counter() - start < 20, err   # torchrun kills at 30 s
    saved = tmp_path / "out" / "checkpoints" / "step_000001"
    assert f"stopped (SIGTERM) in step 2: saved step 1 to {saved}; continue with --resume" in err
    assert "harness/" not in err   # no trainer traceback
    again = subprocess.run(args + ["--resume"], env=env(), capture_output=True, text=True,
                           timeout=PROCESS_DEADLINE_S)   # every rank's RNG was saved: it goes on
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in records(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3]
    # issue 59 case 6 the other way: two ranks' checkpoint, one process
    alone = train(*args[args.index(TRAIN) + 1:], "--steps", "4", "--resume")
    assert alone.returncode == 2, alone.stderr[-3000:]
    assert "was saved by a run on 2 device(s) and this one runs on 1" in alone.stderr


def test_a_stop_one_ranks_task_swallows_still_saves_the_last_step(tiny_model_dir, tmp_path):
    """Issue 72 finding 4 under torchrun: rank 1's reward swallowed the give-up, rank 0 waited
    for it in a collective."""
    _, proc, _ = hung_torchrun(tiny_model_dir, tmp_path, "swallow")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    saved = tmp_path / "out" / "checkpoints" / "step_000001"
    assert f"stopped (SIGTERM) in step 2: saved step 1 to {saved}; continue with --resume" in err
    assert "rank 1: stopped (SIGTERM) while the task's code swallowed the stop" in err, err[-3000:]


def test_a_helper_each_ranks_task_forks_cannot_end_the_run(tiny_model_dir, tmp_path):
    """Issue 72 finding 2 under torchrun: the child ran the trainer's clean-up (the process
    group's, the locks')."""
    (tmp_path / "hung.py").write_text(RANK_1_HUNG)
    done = torchrun("--model", tiny_model_dir, *SMALL, "--task", f"{tmp_path / 'hung.py'}:Hung",
                    "--steps", "2", "--out-dir", str(tmp_path / "out"), extra_env={"FORK": "1"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert [r["step"] for r in records(tmp_path / "out" / "metrics.jsonl")] == [1, 2]


def test_a_bad_value_on_one_rank_only_is_said_by_that_rank(tiny_model_dir, tmp_path):
    """Issue 72 finding 9: a GRPO_ variable with a bad value on rank 1 alone: the run failed with no
    line from the trainer, only torchrun's exit codes."""
    (tmp_path / "launch.py").write_text(ONE_RANK_APART.format(train=TRAIN))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(tmp_path / "launch.py"), "GRPO_TEMPERATURE",
                           "-1", "--model", tiny_model_dir, *SMALL, "--task", "toy",
                           "--out-dir", str(tmp_path / "out")], capture_output=True, text=True,
                          env=env(), timeout=300)
    said = [line for line in proc.stderr.splitlines() if "error:" in line and "rank 1" in line]
    assert proc.returncode != 0 and len(said) == 1, proc.stderr[-3000:]
    assert said[0].startswith("train_lean.py: rank 1: error: --temperature -1.0 must be >= 0")


def test_a_rank_held_in_a_collective_by_a_stopped_peer_saves_and_ends_on_sigterm(
        tiny_model_dir, tmp_path):
    """No handler runs in a main thread held in native code: the grace's timer saves and ends it."""
    _, proc, stopped = hung_torchrun(tiny_model_dir, tmp_path, "stop")
    try:
        worker = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                 text=True).stdout.split()]
        rank0 = next(p for p in worker if p != stopped)
        os.kill(rank0, signal.SIGTERM)
        deadline = time.perf_counter() + 30
        while os.path.exists(f"/proc/{rank0}") and time.perf_counter() < deadline:
            time.sleep(0.2)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(rank0, os.WNOHANG)
    finally:
        os.kill(stopped, signal.SIGKILL)   # torchrun then ends
    _, err = proc.communicate(timeout=60)
    saved = tmp_path / "out" / "checkpoints" / "step_000001"
    assert (f"stopped (SIGTERM) in step 2: saved step 1 to {saved}; continue with --resume "
            "(held in a collective)") in err, err[-3000:]


WAITER = '''
import sys, time
sys.path.insert(0, {repo!r})
from grpo import distributed
distributed.WAIT_SAY_S = 0.5
rank, world, device = distributed.init("cpu")
if rank == 1:
    time.sleep(2.2)   # a reward that takes long
print(distributed.all_sum([1.0]), flush=True)
distributed.close()
'''


def test_a_rank_waiting_long_in_a_collective_says_so(tmp_path):
    """No silent hang: a rank that waits for another says so (every WAIT_SAY_S, 60 s in a run)."""
    (tmp_path / "waiter.py").write_text(WAITER.format(repo=os.path.dirname(TRAIN)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "waiter.py")], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in (0, 1)]
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert out0 == out1 == "[2.0]\n", err0 + err1
    said = [line for line in err0.splitlines() if "still waiting" in line]
    assert len(said) >= 2, err0
    for n, line in enumerate(said, 1):   # once every WAIT_SAY_S, however long rank 1 took
        assert line == (f"train_lean.py: rank 0: still waiting for the other ranks (a sum), "
                        f"{n * 0.5:g} s so far: a rank is held (its lines say where); Ctrl-C or "
                        f"SIGTERM stops the run")
    assert "still waiting" not in err1
