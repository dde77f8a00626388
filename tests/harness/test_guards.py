"""Guards: out-of-memory retries, --micro-batch-size auto, non-finite updates, rewards that raise.

Run in-process through train_lean.main(argv) so that the test can stand in for the CUDA allocator
(raising torch.OutOfMemoryError above a batch size) or make one loss non-finite.
"""
import contextlib
import math
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

import grpo.passes
import harness.checkpoint
import harness.guards
import train_lean
from helpers import SMALL, records, weights
from harness.task import score
from tasks import get_task


def run(tiny_model_dir, out, *extra):
    # the toy task: a random tiny model's rewards vary there, so every step has a gradient to skip or apply
    train_lean.main(["--model", tiny_model_dir, *SMALL, "--task", "toy", "--kl-coef", "0", "--out-dir", str(out),
                     *extra])
    return records(os.path.join(out, "metrics.jsonl"))


def fake_allocator(monkeypatch, rows_that_fit: int, let_through: int = 0):
    """Forwards of more rows than fit raise CUDA's out-of-memory error, after the first `let_through`."""
    real, big = grpo.passes.completion_logprobs, []

    def completion_logprobs(model, input_ids, *args, **kwargs):
        if input_ids.shape[0] > rows_that_fit:
            big.append(input_ids.shape[0])
            if len(big) > let_through:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (the test's allocator)")
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(grpo.passes, "completion_logprobs", completion_logprobs)
    monkeypatch.setattr(harness.guards, "completion_logprobs", completion_logprobs)   # the probe's forward


def test_out_of_memory_halves_the_micro_batch_and_redoes_the_step_exactly(tiny_model_dir, tmp_path,
                                                                          monkeypatch,
                                                                          user_threads):
    steps = ["--steps", "2", "--save-interval", "2"]
    plain = run(tiny_model_dir, tmp_path / "plain", "--micro-batch-size", "2", *steps)
    # micro-batch 4 of a mini-batch of 8: the first micro-batch's backward runs, the second runs out of
    # memory, so the retry must also throw away the half-accumulated gradient
    fake_allocator(monkeypatch, rows_that_fit=2, let_through=1)
    hit = run(tiny_model_dir, tmp_path / "hit", "--micro-batch-size", "4", *steps)
    assert hit[0]["oom_retries"] == 1 and hit[0]["micro_batch"] == 2 and "oom_retries" not in hit[1]
    same = ("reward_mean", "loss", "kl", "grad_norm")
    assert [[r[k] for k in same] for r in hit] == [[r[k] for k in same] for r in plain]
    a = weights(tmp_path / "plain" / "checkpoints" / "step_000002")
    b = weights(tmp_path / "hit" / "checkpoints" / "step_000002")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the effective batch, and so the update, is unchanged


def test_micro_batch_auto_probes_the_largest_that_fits(tiny_model_dir, tmp_path, monkeypatch, capsys):
    fake_allocator(monkeypatch, rows_that_fit=2)
    recs = run(tiny_model_dir, tmp_path, "--micro-batch-size", "auto", "--steps", "1")
    assert "micro-batch auto: 2 per device" in capsys.readouterr().out
    assert "oom_retries" not in recs[0]  # found before training, not during it


def poison_losses(monkeypatch, bad_calls):
    real, calls = train_lean.grpo_loss, []

    def grpo_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if bad_calls is None or len(calls) in bad_calls else loss), stats

    monkeypatch.setattr(train_lean, "grpo_loss", grpo_loss)


def test_a_non_finite_loss_skips_the_update(tiny_model_dir, tmp_path, monkeypatch):
    poison_losses(monkeypatch, bad_calls={2})  # one micro-batch per step: step 2's loss is NaN
    recs = run(tiny_model_dir, tmp_path, "--steps", "3", "--save-interval", "1", "--keep-checkpoints", "3")
    assert [r["skipped_nonfinite"] for r in recs] == [0, 1, 0]
    w = [weights(tmp_path / "checkpoints" / f"step_00000{s}") for s in (1, 2, 3)]
    assert all(torch.equal(w[0][k], w[1][k]) for k in w[0])  # step 2 left the weights alone
    assert not all(torch.equal(w[1][k], w[2][k]) for k in w[0])  # and training went on
    opt = [torch.load(tmp_path / "checkpoints" / f"step_00000{s}" / "trainer_state.pt")["optimizer"] for s in (1, 2)]
    assert opt[0]["state"][0]["step"] == opt[1]["state"][0]["step"] == 1  # nor did it touch AdamW's state


def test_too_many_non_finite_updates_in_a_row_abort_with_a_checkpoint(tiny_model_dir, tmp_path, monkeypatch,
                                                                     capsys):
    poison_losses(monkeypatch, bad_calls=None)
    with pytest.raises(SystemExit) as e:
        run(tiny_model_dir, tmp_path, "--steps", "5", "--max-nonfinite", "2")
    assert e.value.code == 1
    assert "aborting at step 2: the last 2 optimizer updates had a non-finite" in capsys.readouterr().err
    start, saved = weights(tiny_model_dir), weights(tmp_path / "checkpoints" / "step_000002")
    assert all(torch.equal(start[k], saved[k]) for k in saved)


def adam_bound(t: int, beta1=0.9, beta2=0.999) -> float:
    """The largest |m_hat / sqrt(v_hat)| AdamW's step t can take, whatever the gradients (Cauchy-Schwarz
    on the moments' sums): the move of a weight per unit of learning rate, weight decay aside."""
    r = beta1 ** 2 / beta2
    return ((1 - beta1) / (1 - beta1 ** t) * math.sqrt((1 - beta2 ** t) / (1 - beta2))
            * math.sqrt((1 - r ** t) / (1 - r)))


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_below_rate_1_an_update_from_finite_gradients_moves_a_weight_a_bounded_amount(name):
    """Why Guard.step copies nothing: from gradients whose norm is finite (so each |g| < 2e19: the
    norm squares them), at a rate below 1 with lr x wd < 1, one step moves a weight by at most
    lr x (a constant + wd |w|), so no run of any length makes one non-finite. Gradients from 1e-30
    to 1e18, signs flipping, clipping off; checked against the bound each step."""
    from grpo.optim import make_optimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 6), torch.nn.Linear(6, 5))
    model.get_output_embeddings = lambda: None
    lr, wd = 0.999, 0.5
    opt = make_optimizer(model, SimpleNamespace(optimizer=name, learning_rate=lr, weight_decay=wd))
    params = list(model.parameters())
    muon = 0.2 * math.sqrt(6) * 1.5   # Muon's match_rms_adamw scale x its orthogonalised update's entries
    for t in range(1, 41):
        for p in params:
            scale = 10.0 ** float(torch.randint(-30, 19, ()))
            p.grad = torch.randn_like(p) * scale
        assert math.isfinite(torch.nn.utils.clip_grad_norm_(params, math.inf).item())
        before = [p.detach().clone() for p in params]
        opt.step()
        for p, w in zip(params, before):
            move = (p.detach() - w * (1 - lr * wd)).abs().max().item()
            bound = muon if (name == "muon" and p.ndim == 2 and p is not params[0]) else adam_bound(t)
            assert move <= lr * bound * (1 + 1e-4) + 1e-6 * w.abs().max().item(), (t, p.shape)
            assert p.isfinite().all()


def test_a_learning_rate_at_which_weights_could_overflow_is_refused_before_loading(tmp_path, capsys):
    """--learning-rate 1e308 (which made AdamW's weights inf from a finite loss and gradients): exit 2,
    one line, nothing written."""
    with pytest.raises(SystemExit) as e:
        train_lean.main(["--model", str(tmp_path / "no-such-model"), "--learning-rate", "1e308",
                         "--out-dir", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--learning-rate 1e+308 must be in (0, 1)" in err
    assert not (tmp_path / "out").exists()


class NaNAfterOneStep(torch.optim.AdamW):
    """A researcher's optimizer with a bug: its first step writes a NaN into the first weight."""

    def step(self, closure=None):
        super().step(closure)
        first = self.param_groups[0]["params"][0]
        if self.state[first]["step"] == 1:
            with torch.no_grad():
                first.view(-1)[0] = float("nan")


def test_non_finite_weights_are_never_saved_and_the_run_says_what_is_kept(
        tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Whatever writes the weights (here a buggy optimizer the guard's rule does not cover), a
    checkpoint or model that would hold a non-finite weight is not written: the run fails there
    (exit 1, traceback) and says the last save is the newest."""
    monkeypatch.setattr(train_lean, "make_optimizer",
                        lambda model, cfg: NaNAfterOneStep(model.parameters(), lr=cfg.learning_rate))
    with pytest.raises(harness.checkpoint.NonFiniteWeights, match="holds non-finite values"):
        run(tiny_model_dir, tmp_path, "--steps", "3", "--save-interval", "1")
    assert "the weights are not finite: nothing newer than the start is saved" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()
    assert not list((tmp_path / "checkpoints").glob("step_*"))


def test_a_reward_that_raises_gets_the_minimum_and_is_reported_once_per_kind(tiny_model_dir, tmp_path, capsys):
    # every reward raises: only --reward-errors tolerate trains on (tests/harness/test_task.py: the default stops)
    task = tmp_path / "flaky.py"
    task.write_text(
        "class Flaky:\n"
        "    name = 'flaky'\n"
        "    min_reward = -1.0\n"
        "    def prompts(self, n, rng):\n"
        "        return [f'Repeat {rng.choice(\"ab\")}: ' for _ in range(n)]\n"
        "    def reward(self, prompt, completion):\n"
        "        raise (ValueError if len(completion) % 2 else KeyError)('no reward for this one')\n")
    recs = run(tiny_model_dir, tmp_path / "out", "--task", f"{task}:Flaky", "--steps", "3", "--reward-errors",
               "tolerate")
    assert [r["reward_mean"] for r in recs] == [-1.0] * 3
    assert all(sum(r["reward_errors"].values()) == 8 for r in recs)
    kinds = set().union(*(r["reward_errors"] for r in recs))
    err = capsys.readouterr().err
    assert kinds and all(err.count(f"the task's reward raised {k}: ") == 1 for k in kinds)
    assert err.count(f'File "{task}", line 7, in reward') == len(kinds)   # each kind's traceback, once


def test_empty_enormous_and_invalid_completions_are_scored():
    class Strict:
        name, min_reward = "strict", -1.0

        def prompts(self, n, rng):
            return ["p"] * n

        def reward(self, prompt, completion):
            return float(len(completion.encode("utf-8")) > 0)  # raises on a lone surrogate

    completions = ["", "a" * 1_000_000, "\ud800 bbb"]
    rewards, _, errors = score(get_task("toy"), ["Repeat a: "] * 3, completions)
    assert rewards.tolist() == [0.0, 1.0, 0.0] and errors == {}
    rewards, _, errors = score(Strict(), ["p"] * 3, completions)
    assert rewards.tolist() == [0.0, 1.0, -1.0] and errors == {"UnicodeEncodeError": 1}


@pytest.mark.parametrize("threads, inside", [(1, 1), (0, 2)])
def test_the_update_runs_on_update_threads_and_the_rest_on_every_thread(threads, inside):
    """Guard.fit runs the update's passes on --update-threads CPU threads (0: as they are) and gives them back."""
    torch.set_num_threads(2)
    seen = []
    guard = harness.guards.Guard(4, 8, print, threads=threads)
    assert guard.fit(lambda cut: seen.append(torch.get_num_threads()) or cut.rows) == 4
    assert seen == [inside] and torch.get_num_threads() == 2
    with pytest.raises(ValueError):   # given back on a failure too
        guard.fit(lambda micro: (_ for _ in ()).throw(ValueError("boom")))
    assert torch.get_num_threads() == 2


def test_the_updates_passes_give_the_same_bits_on_any_thread_count(tiny_model_dir):
    """What the README says of --update-threads 1 (it said runs were bit-identical on every thread
    count, but sampling uses every thread: its last bits, and a run's, follow OMP_NUM_THREADS)."""
    from grpo.model import completion_logprobs, load_policy
    model = load_policy(tiny_model_dir, "cpu")
    seeded = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (8, 48), generator=seeded)
    grads = []
    for outside in (1, 2):
        torch.set_num_threads(outside)
        model.zero_grad(set_to_none=True)
        harness.guards.Guard(8, 8, print, threads=1).fit(lambda micro: completion_logprobs(
            model, ids, torch.ones_like(ids), 24, 1.0, 2048, None).sum().backward())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def cut_batch(prompts, completions):
    """A batch of left-padded prompts (token counts) and right-padded completions (token counts),
    each prompt's ids its own, as a Rollout lays them out."""
    P, T = max(prompts), max(completions)
    ids = torch.zeros(len(prompts), P + T, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - p:P] = 100 + p   # a prompt's tokens name it: equal counts, the same prompt
        att[i, P - p:P], att[i, P:P + c] = 1, 1
    return SimpleNamespace(input_ids=ids, attention=att, completion_len=T)


def direct_cost(prompts, completions, part):
    """Real tokens of a micro-batch as the packed forward runs it: each distinct prompt once."""
    return sum({prompts[i] for i in part}) + sum(completions[i] for i in part)


def test_a_token_budget_cuts_rows_in_order_each_micro_batch_as_full_as_it_may_be():
    """--micro-batch-tokens: rows in order, a group's prompt counted once, each micro-batch the
    longest run of rows within the budget (a row over it alone); every row once."""
    prompts = [12] * 4 + [7] * 4 + [30] * 2 + [9] * 3
    completions = [5, 17, 1, 40, 3, 3, 8, 60, 2, 9, 11, 4, 90]
    batch = cut_batch(prompts, completions)
    rows = torch.arange(len(prompts))
    for budget in (1, 40, 64, 100, 1000):
        cut = harness.guards.Micro(13, budget)
        parts = [p.tolist() for p in cut.split(batch, rows)]
        assert sum(parts, []) == rows.tolist()
        for a, b in zip(parts, parts[1:] + [None]):
            assert len(a) == 1 or direct_cost(prompts, completions, a) <= budget
            assert b is None or direct_cost(prompts, completions, a + b[:1]) > budget
        assert cut.most == max(map(len, parts))
    assert [p.tolist() for p in harness.guards.Micro(13, 1000).split(batch, rows)] == [rows.tolist()]
    # a subset in the update's order, and every row when rows is None
    sub = torch.tensor([1, 2, 3, 8, 9, 12])
    assert [p.tolist() for p in harness.guards.Micro(13, 60).split(batch, sub)] == [[1, 2], [3], [8, 9], [12]]
    assert sum((p.tolist() for p in harness.guards.Micro(13, 64).split(batch)), []) == rows.tolist()
    # rows: slices of every row, or the order's pieces
    assert harness.guards.Micro(5).split(batch) == [slice(0, 5), slice(5, 10), slice(10, 15)]


def test_out_of_memory_halves_the_token_budget_until_a_micro_batch_holds_one_row():
    cut = harness.guards.Micro(8, 1000)
    cut.most = 3
    assert cut.smaller(8).tokens == 500 and str(cut.smaller(8)) == "500 tokens"
    cut.most = 1
    assert cut.smaller(8) is None   # one row a forward already: nothing smaller to try
    assert harness.guards.Micro(8).smaller(8).rows == 4 and harness.guards.Micro(3).smaller(6).rows == 1


def test_out_of_memory_halves_the_token_budget_and_redoes_the_step_exactly(tiny_model_dir, tmp_path,
                                                                          monkeypatch):
    steps = ["--steps", "2", "--save-interval", "2"]
    # the toy's rows here are 5 + 12 tokens: 100 tokens hold 6 rows, 50 three
    plain = run(tiny_model_dir, tmp_path / "plain", "--micro-batch-tokens", "50", *steps)
    fake_allocator(monkeypatch, rows_that_fit=3)
    hit = run(tiny_model_dir, tmp_path / "hit", "--micro-batch-tokens", "100", *steps)
    assert hit[0]["oom_retries"] == 1 and hit[0]["micro_batch_tokens"] == 50
    assert "micro_batch" not in hit[0] and "oom_retries" not in hit[1]
    same = ("reward_mean", "loss", "kl", "grad_norm")
    assert [[r[k] for k in same] for r in hit] == [[r[k] for k in same] for r in plain]
    a = weights(tmp_path / "plain" / "checkpoints" / "step_000002")
    b = weights(tmp_path / "hit" / "checkpoints" / "step_000002")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_auto_budget_is_what_the_free_memory_holds():
    budget = harness.guards.token_budget   # (free, fixed, per token, longest row, mini-batch rows)
    fill = harness.guards.FILL
    assert budget(10_000 / fill + 2_000, 2_000, 1.0, 17, 1000) == 8192   # 10,000 down to a power of 2
    assert budget(10_000 / fill + 2_000, 2_000, 1.0, 17, 8) == 136       # at most the mini-batch
    assert budget(1_000, 2_000, 1.0, 17, 8) == 17                        # at least one row
    assert budget(4_096 * 300 / fill, 0, 300.0, 17, 1000) == 4096


def test_micro_batch_tokens_auto_takes_the_budget_from_the_free_memory(tiny_model_dir, tmp_path,
                                                                      monkeypatch, capsys):
    """auto on a roomy machine: the whole mini-batch in one forward (the default's cut, so its
    bits); the probe's out-of-memory halves it before training."""
    plain = run(tiny_model_dir, tmp_path / "plain", "--steps", "1")
    roomy = run(tiny_model_dir, tmp_path / "roomy", "--micro-batch-tokens", "auto", "--steps", "1")
    assert "micro-batch tokens auto: 136 real tokens" in capsys.readouterr().out   # 8 x (5 + 12)
    assert roomy[0]["loss"] == plain[0]["loss"] and roomy[0]["grad_norm"] == plain[0]["grad_norm"]
    fake_allocator(monkeypatch, rows_that_fit=2)
    recs = run(tiny_model_dir, tmp_path / "probed", "--micro-batch-tokens", "auto", "--steps", "1")
    assert "micro-batch tokens auto: 34 real tokens" in capsys.readouterr().out   # 136 halved twice
    assert "oom_retries" not in recs[0]


def stop_on_signal(grace: float, stuck_s: float = 5.0):
    """A StopOnSignal whose lines and stuck() calls are kept."""
    said, stuck = [], []
    stop = harness.guards.StopOnSignal(said.append, grace, lambda *why: stuck.append(why))
    stop.STUCK_S = stuck_s
    return stop, said, stuck


def test_one_signal_gives_a_step_that_does_not_end_up_after_the_grace():
    """Issue 59 case 3: torchrun, Slurm and Kubernetes send one SIGTERM, then kill: the step had to
    end by itself or take the steps trained with it."""
    stop, said, stuck = stop_on_signal(0.3)
    start = time.perf_counter()
    with pytest.raises(harness.guards.StoppedBySignal) as e:
        with stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)   # a reward that never returns
    assert 0.3 <= time.perf_counter() - start < 5
    assert (e.value.why, e.value.code) == ("SIGTERM", 143) and not stuck
    assert said == ["SIGTERM: finishing this step (given up after 0.3 s), then saving a checkpoint "
                    "(send it again to give the step up now and save the last finished one)"]


def test_a_step_that_ends_within_the_grace_is_not_given_up():
    stop, said, stuck = stop_on_signal(0.5)
    with stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        stop.step_ended()
        time.sleep(1)   # the next step (the loop stops before it; here it runs on)
    assert stop.requested and len(said) == 1 and not stuck


def test_a_main_thread_that_runs_no_handler_is_ended_by_stuck():
    """A rank held in a collective whose peer is stopped runs no signal handler: the timer calls
    stuck() (the run saves and ends the process there). Here the main thread blocks the signal."""
    stop, said, stuck = stop_on_signal(0.2, stuck_s=0.2)
    with stop:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            os.kill(os.getpid(), signal.SIGTERM)   # another thread takes it: the wakeup fd says it
            deadline = time.perf_counter() + 10
            while not stuck and time.perf_counter() < deadline:
                time.sleep(0.05)
        finally:
            with contextlib.suppress(harness.guards.StoppedBySignal):   # the pending SIGTERM's
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                time.sleep(0.01)
    assert stuck == [("SIGTERM", 143, "held in a collective")]


def test_a_stop_the_task_swallows_is_ended_by_stuck():
    """Issue 72 finding 4: a reward's bare `except:` took the give-up for its own error, and the
    step ran on past every SIGTERM (minutes) with nothing saved."""
    stop, said, stuck = stop_on_signal(0.2, stuck_s=0.3)
    with stop:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.perf_counter() + 10
        while not stuck and time.perf_counter() < deadline:
            try:   # a slow call wrapped in a bare except
                time.sleep(0.05)
            except BaseException:  # noqa: B036 - the task's mistake under test
                pass
    assert stuck == [("SIGTERM", 143, "the task's code swallowed the stop")]


def test_a_timeout_the_task_swallows_still_gives_the_step_up(monkeypatch):
    """Issue 72 finding 6: the timeout's exception, caught by the reward, became a score of 0.0
    counted as valid, and the one-shot timer was spent: the other rewards ran unbounded."""
    with pytest.raises(harness.guards.RewardTimeout):   # raised again once the reward returns
        with harness.guards.time_limit(0.1):
            try:
                time.sleep(5)
            except BaseException:  # noqa: B036
                pass
    monkeypatch.setattr(harness.guards, "STUCK_S", 1)
    stuck, start = [], time.perf_counter()
    with contextlib.suppress(harness.guards.RewardTimeout):
        with harness.guards.time_limit(0.1, lambda *why: stuck.append(why)):
            while not stuck and time.perf_counter() - start < 10:   # a reward that never returns
                try:
                    time.sleep(5)
                except BaseException:  # noqa: B036
                    pass
    assert stuck == [("--reward-timeout 0.1 s", 1, "the task's code swallowed the timeout")]
    assert time.perf_counter() - start < 5


def test_a_write_is_never_given_up():
    stop, said, stuck = stop_on_signal(0.1, stuck_s=0.1)
    with stop:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.6)   # a checkpoint's write, longer than the grace
        stop.step_ended()
    assert not stuck and said == ["SIGTERM: the save under way finishes first"]


def test_a_reward_past_the_time_limit_is_given_up_in_a_blocked_call():
    start = time.perf_counter()
    with pytest.raises(harness.guards.RewardTimeout) as e:
        with harness.guards.time_limit(0.3):
            os.read(os.pipe()[0], 1)   # a pipe that never speaks
    assert 0.3 <= time.perf_counter() - start < 5
    assert (e.value.why, e.value.code) == ("--reward-timeout 0.3 s", 1)
    with harness.guards.time_limit(0):   # off
        time.sleep(0.01)
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
