"""End to end: the real train_lean.py on a tiny real model, through its command line."""
import math
import os

import pytest

import forked
import torch

import train_lean
from grpo import variants
from harness import config

from helpers import INDUCTOR_BUILDS, PARTED_TASK, REPO, header_rows, read_jsonl as records, user_env

STEP_KEYS = {"step", "reward_mean", "reward_std", "frac_zero_std", "loss", "kl", "clip_frac", "ratio_mean",
             "grad_norm", "completion_len_mean", "step_time_s", "gen_time_s", "train_time_s", "samples_per_s",
             "tokens_per_s", "rss_mb", "mismatch_kl", "mismatch_abs", "mismatch_max"}


def run(args, cwd, env=None):
    """train_lean.py as a user starts it: their threads (helpers.user_env), no GRPO_ variables."""
    full_env = user_env(**(env or {}))
    return forked.run([os.path.join(REPO, "train_lean.py"), *args], full_env, 300, cwd)




@pytest.fixture(scope="module")
def two_steps(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    proc = run(["--model", tiny_model_dir, "--task", "toy", "--steps", "2", "--max-new-tokens", "16", "--out-dir", str(out),
                "--log-completions", str(out / "completions.jsonl")], cwd=out)
    return proc, out


def steps(path):
    """A run's step records, without its eval records."""
    return [r for r in records(path) if r.get("kind") != "eval"]


def test_two_steps_write_every_key(two_steps):
    proc, out = two_steps
    assert proc.returncode == 0, proc.stderr
    recs = steps(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    # the toy task's held-out evaluation, by default before training and after the last step, greedy only
    evals = [r for r in records(out / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all(set(r) == {
        "kind", "step", "acc", "reward", "eval_time_s", *(f"{m}_{k}" for m in ("acc", "reward") for k in ("lo", "hi", "n"))}
        for r in evals)
    for r in recs:
        assert STEP_KEYS <= set(r), STEP_KEYS - set(r)
        assert r["kl"] >= 0 and 0 <= r["frac_zero_std"] <= 1
    # one update per step, on-policy: the ratio is 1 and nothing is clipped
    assert abs(recs[0]["ratio_mean"] - 1) < 1e-5 and recs[0]["clip_frac"] == 0
    # the header names the records' file (a long path wraps: read as rows)
    assert header_rows(proc.stdout)[1]["metrics"] == f"{out / 'metrics.jsonl'}"
    assert "step 2/2" in proc.stdout
    assert "prompts (groups) per step" in (out / "settings.txt").read_text()   # the full table, in the run folder


def test_a_default_run_keeps_the_trained_model(two_steps, tiny_model_dir):
    # no save flag: the trained weights are a plain Hugging Face folder, and they moved from the start
    from transformers import AutoModelForCausalLM, AutoTokenizer
    proc, out = two_steps
    assert f"saved the trained model to {out / 'model'}" in proc.stdout
    trained = AutoModelForCausalLM.from_pretrained(out / "model")
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert AutoTokenizer.from_pretrained(out / "model").eos_token_id == AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    moved = [not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values())]
    assert any(moved) and trained.config.vocab_size == start.config.vocab_size


def test_completions_log_has_one_record_per_completion(two_steps):
    _, out = two_steps
    recs = records(out / "completions.jsonl")
    assert len(recs) == 128
    for r in recs:
        assert set(r) == {"step", "prompt", "completion", "reward", "completion_tokens", "logprob_sum"}
        assert 1 <= r["completion_tokens"] <= 16 and r["logprob_sum"] < 0
        assert r["prompt"].startswith("Repeat ")


def test_same_seed_same_run(tiny_model_dir, tmp_path, two_steps):
    _, first = two_steps
    proc = run(["--model", tiny_model_dir, "--task", "toy", "--steps", "2", "--max-new-tokens", "16", "--out-dir", str(tmp_path)],
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    keys = ("reward_mean", "loss", "kl", "grad_norm", "completion_len_mean")
    assert [[r[k] for k in keys] for r in steps(tmp_path / "metrics.jsonl")] == \
        [[r[k] for k in keys] for r in steps(first / "metrics.jsonl")]


def test_rotary_model_with_accumulation_and_env_overrides(tiny_rotary_dir, tmp_path, clean_env,
                                                         monkeypatch, capsys):
    overrides = {"GRPO_MICRO_BATCH_SIZE": "4", "GRPO_MAX_NEW_TOKENS": "8", "GRPO_DTYPE": "bf16"}
    for name, value in overrides.items():
        monkeypatch.setenv(name, value)
    train_lean.main(["--model", tiny_rotary_dir, "--task", "toy", "--steps", "1", "--batch-size",
                     "16", "--group-size", "4", "--mini-batch-size", "8", "--ppo-epochs", "2",
                     "--eval-interval", "0", "--out-dir", str(tmp_path)])
    stdout = capsys.readouterr().out
    # the header's batch line: 16 completions, 2 updates of 8 a step, each 2 micro-batches of 4
    assert "micro-batch 4 (2 accumulation steps)" in stdout and "cpu, bf16" in stdout
    rows = [line.split() for line in (tmp_path / "settings.txt").read_text().splitlines()]
    assert ["--micro-batch-size", "4", "env"] in rows and ["--dtype", "bf16", "env"] in rows
    rec = records(tmp_path / "metrics.jsonl")[0]
    assert rec["completion_len_mean"] <= 8


def test_user_task_file_on_the_command_line(tiny_model_dir, tmp_path, clean_env):
    (tmp_path / "short.py").write_text(
        "class Short:\n    name = 'short'\n    def prompts(self, n, rng): return ['Say: '] * n\n"
        "    def reward(self, p, c): return -float(len(c))\n")
    train_lean.main(["--model", tiny_model_dir, "--task", f"{tmp_path / 'short.py'}:Short",
                     "--steps", "1", "--batch-size", "8", "--max-new-tokens", "4",
                     "--out-dir", str(tmp_path)])
    assert records(tmp_path / "metrics.jsonl")[0]["reward_mean"] < 0


# Every choice of a variant's flag (train_lean.py TABLES) and of --lr-scheduler runs end to end, so a new choice
# needs no line here unless it needs other settings to run (its check refuses it alone, as --advantage gdpo does
# without --reward-weights, and gdpo reads the reward's parts: a task that has some): its line below then takes
# the generated one's place. The knobs with a number, and combinations, by hand.
KNOBS = {f"{config.flag(name)} {choice}": ([config.flag(name), choice], "loss")
         for name, choices in [*train_lean.TABLES.items(), ("lr_scheduler", config.FIELDS["lr_scheduler"]
                                                            .metadata["choices"])]
         for choice in choices if choice != config.FIELDS[name].default}
KNOBS.update({
    "trl-name": (["--loss-agg", "dapo"], "loss"),
    "gspo": (["--importance-level", "sequence", "--clip-range", "3e-4", "--clip-range-high", "4e-4"], "clip_frac"),
    "dual-clip": (["--dual-clip", "3"], "clip_dual_frac"),
    "lr-schedule": (["--lr-scheduler", "cosine", "--lr-warmup-steps", "1", "--min-lr-ratio", "0.1"], "lr"),
    "ref-sync": (["--ref-sync-steps", "1", "--ref-sync-alpha", "0.5"], "kl"),
    "k1-in-reward": (["--kl-in", "reward", "--kl-estimator", "k1"], "kl_reward_penalty"),
    "dynamic-sampling": (["--dynamic-sampling", "--max-sampling-rounds", "2"], "groups_drawn"),
    "entropy-bonus": (["--entropy-coef", "0.01"], "entropy"),
    "top-entropy": (["--top-entropy-quantile", "0.2"], "entropy"),
    "mask-truncated": (["--mask-truncated"], "truncated_frac"),
    "overlong": (["--overlong-buffer", "4", "--overlong-penalty", "0.5"], "overlong_penalty"),
    "sapo-temperatures": (["--policy-loss", "sapo", "--sapo-tau-pos", "0.5", "--sapo-tau-neg", "2"], "loss"),
    "clip-cov-band": (["--policy-loss", "clip-cov", "--cov-ratio", "0.1", "--clip-cov-lb", "-100", "--clip-cov-ub",
                       "100"], "cov_frac"),
    "kl-cov-share": (["--policy-loss", "kl-cov", "--cov-ratio", "0.1", "--kl-cov-coef", "0.5"], "cov_frac"),
    # a task whose reward has parts ({parted}: PARTED_TASK written to a file): weighted, and GDPO's normalised apart
    "reward-weights": (["--task", "{parted}", "--reward-weights", "letter=1,short=0.5"], "reward_short"),
    "--advantage gdpo": (["--advantage", "gdpo", "--task", "{parted}", "--reward-weights", "letter=1,short=0.5"],
                             "reward_letter"),
    "tis-top-p": (["--mismatch-correction", "tis", "--top-p", "0.9", "--mismatch-cap", "1.5"], "mismatch_weight"),
    "token-mask-top-k": (["--mismatch-correction", "token-mask", "--top-k", "20", "--mismatch-low", "0.2"],
                         "mismatch_zero_frac"),
    "adaptive-kl": (["--kl-target", "0.01", "--kl-horizon", "100"], "kl_coef"),
    "muon": (["--optimizer", "muon"], "grad_norm"),
})
@pytest.mark.parametrize("knob", KNOBS)
def test_each_algorithm_knob_runs_end_to_end_and_logs(knob, tiny_model_dir, tmp_path, clean_env):
    args, key = KNOBS[knob]
    (tmp_path / "parted.py").write_text(PARTED_TASK)
    args = [a.replace("{parted}", f"{tmp_path / 'parted.py'}:Parted") for a in args]
    train_lean.main(["--model", tiny_model_dir, "--task", "toy", "--steps", "2", "--batch-size", "8",
                     "--group-size", "4", "--mini-batch-size", "4", "--micro-batch-size", "2", "--max-new-tokens", "12",
                     "--learning-rate", "1e-3", "--log-level", "warning", "--save-final", "false",
                     "--eval-interval", "0", "--out-dir", str(tmp_path), *args])
    recs = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2] and all(key in r and r[key] == r[key] for r in recs)
    assert all(math.isfinite(r["loss"]) for r in recs)
    rows = [line.split()[:2] for line in (tmp_path / "settings.txt").read_text().splitlines()]
    chosen = [(f, v) for f, v in zip(args, args[1:]) if f in ("--policy-loss", "--advantage", "--reward-weights")]
    assert all([f, v] in rows for f, v in chosen), rows   # the run's settings.txt names the choice
    for r in recs:   # the metrics every run logs
        assert r["completion_len_min"] <= r["completion_len_mean"] <= r["completion_len_max"] <= 12
        assert 0 <= r["truncated_frac"] <= 1 and r["entropy"] >= 0 and r["reward_std_group"] >= 0
        assert r["clip_frac"] == pytest.approx(r["clip_low_frac"] + r["clip_high_frac"])
        assert 0 <= r["mismatch_abs"] <= r["mismatch_max"] and r["mismatch_kl"] >= 0   # measured in every run
    if knob == "dynamic-sampling":
        assert all(r["groups_drawn"] >= 2 and r["groups_drawn"] - r["groups_dropped"] == 2 for r in recs)
    if knob == "mask-truncated":   # a random tiny model rarely stops: cut-off rows carry no loss at all
        assert all(r["loss"] == 0 and r["grad_norm"] == 0 for r in recs if r["truncated_frac"] == 1)
    if knob == "reward-weights":   # the reward is the weighted sum of the parts, their means in the record
        assert all(r["reward_mean"] == pytest.approx(r["reward_letter"] + 0.5 * r["reward_short"], rel=1e-5)
                   for r in recs)
    if knob == "overlong":   # a completion that runs to the limit loses the whole penalty, the task's reward kept
        assert all(r["truncated_frac"] < 1 or r["overlong_penalty"] == 0.5 for r in recs)
        assert all(0 <= r["overlong_penalty"] <= 0.5 for r in recs)


@pytest.mark.slow
@INDUCTOR_BUILDS
def test_compiled_decoding_trains_on_policy(tiny_rotary_dir, tmp_path, clean_env, capsys):
    # --compile: the decode step goes through torch.compile; its sampling logprobs must still be the
    # training forward's, so the first update of a step is exactly on-policy (ratio 1, nothing clipped);
    # each step's record counts the compilations it paid: the first step's, then none (the same widths).
    # A GPU's inductor that runs a graph without CUDA graphs bumps its counter (no CPU does): the task
    # bumps torch's counter as it would, and the run says so once
    task = tmp_path / "skips.py"
    task.write_text("import torch\nfrom tasks.toy import ToyTask\nclass Skips(ToyTask):\n"
                    "    def reward(self, prompt, completion):\n"
                    "        torch._dynamo.utils.counters['inductor']['cudagraph_skips'] += 1\n"
                    "        return super().reward(prompt, completion)\n")
    out = tmp_path / "run"
    train_lean.main(["--model", tiny_rotary_dir, "--task", f"{task}:Skips", "--steps", "2", "--batch-size",
                     "8", "--group-size", "4", "--max-new-tokens", "12", "--compile", "--log-level", "warning",
                     "--save-final", "false", "--eval-interval", "0", "--out-dir", str(out)])
    first, second = records(out / "metrics.jsonl")
    assert abs(first["ratio_mean"] - 1) < 1e-5 and first["clip_frac"] == 0
    assert first["decode_compiles"] >= 1 and second["decode_compiles"] == 0
    assert "decode_graph_skips" not in first   # a CPU's run: no CUDA graphs to skip, no field
    said = [line for line in capsys.readouterr().err.splitlines() if "without CUDA graphs" in line]
    assert len(said) == 1 and said[0].startswith("train_lean.py: step 1: torch.compile ran the decode step")
