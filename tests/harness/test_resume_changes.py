"""--resume-allow-change keeps its promise: every setting it accepts is one the resumed run trains with.

Generated over the settings: each one --resume compares (neither free nor fixed) is changed on a resume from
one checkpoint and the resumed steps are read back (their records and weights), against the same resume with
nothing changed; they must differ. A new setting needs nothing here: its value comes from its own declaration
(changed_value: a flag flipped, another choice, a number its range allows); NEW below holds only the values that
rule cannot make, ENABLING the settings a change needs on. The fixed ones are refused, the reason said.
"""
import dataclasses
import os
import shutil

import pytest
import torch

import train_lean
from grpo import variants
from harness import cli, config, rundir
from tasks.toy import ToyTask

from helpers import CHAT_TASK, build_tiny_model, records, weights

BASE = ["--task", "toy", "--batch-size", "8", "--group-size", "4", "--mini-batch-size", "4", "--max-new-tokens", "8",
        "--learning-rate", "1e-2", "--lr-scheduler", "cosine", "--min-lr-ratio", "0.5", "--kl-coef", "0.05",
        "--steps", "3", "--save-interval", "1", "--keep-checkpoints", "3", "--eval-interval", "0",
        "--log-level", "warning"]
class PartsToy(ToyTask):
    """The toy task with its reward in two parts, for --reward-weights."""
    def reward_breakdown(self, prompt, completion):
        parts = {"hit": self.reward(prompt, completion), "len": len(completion.strip()) / 20}
        return {**parts, "reward": parts["hit"]}


def compared(option_fields=()):
    free, fixed = rundir.resume_free(option_fields), rundir.resume_fixed(option_fields)
    return sorted(n for n in [*config.FIELDS, *(f.name for f in option_fields)] if n not in free and n not in fixed)


def declared_enabling() -> dict:
    """A knob a variant declares (grpo/variants.py declares(knobs=...)) acts with that variant on."""
    out = {}
    for flag, table in train_lean.TABLES.items():
        for name, function in table.items():
            for knob in variants.declared(function, "knobs"):
                out.setdefault(knob, ["--" + flag.replace("_", "-"), name])
    return out


# the settings whose effect needs another one on: their runs start from a checkpoint made with these
# as well (a variant's knobs from its declaration, unless it needs more)
MIX = ["--ptx-coef", "0.5", "--ptx-file", "{texts_a}"]
ENABLING = {**declared_enabling(),
            "ref_sync_alpha": ["--ref-sync-steps", "1"],
            "max_sampling_rounds": ["--dynamic-sampling", "--temperature", "0.1"],   # groups flat round after round
            "overlong_penalty": ["--overlong-buffer", "4"],
            "ptx_coef": MIX, "ptx_file": MIX, "ptx_batch_size": MIX,
            # a wide band and share, so the tiny model's tokens fall in them
            "cov_ratio": ["--policy-loss", "kl-cov", "--cov-ratio", "0.1"],
            "kl_cov_coef": ["--policy-loss", "kl-cov", "--cov-ratio", "0.1"],
            "clip_cov_lb": ["--policy-loss", "clip-cov", "--cov-ratio", "0.5", "--clip-cov-lb=-100"],
            "clip_cov_ub": ["--policy-loss", "clip-cov", "--cov-ratio", "0.5", "--clip-cov-lb=-100"],
            "kl_horizon": ["--kl-target", "0.001"], "mismatch_cap": ["--mismatch-correction", "tis", "--dtype", "bf16"],   # weights above 1 only where bf16 rounds
            "mismatch_low": ["--mismatch-correction", "token-mask", "--top-p", "0.8"],
            # a conversational task (its own system message) on an instruct model
            "system_prompt": ["--task", "{chat_task}:ChatToy", "--model", "{chat_model}"],
            "reward_weights": ["--task", "tests.harness.test_resume_changes:PartsToy", "--reward-weights", "hit=1,len=1"]}
# --kl-in reward alone also moves the estimator's default to k1, a second change: the first run's estimator is kept
ALONG = {"kl_in": ["--kl-estimator", "k3"]}
# a value each compared setting changes to (choices of grpo/algorithm.py's dicts: their first other choice)
NEW = {"model": "{other_model}", "task": "tests.harness.test_resume_changes:OtherToy", "prompt_bos": "off",
       "batch_size": 16, "group_size": 2, "mini_batch_size": 8, "ppo_epochs": 2, "max_new_tokens": 6,
       "min_new_tokens": 6, "temperature": 0.5, "top_k": 3, "top_p": 0.3, "learning_rate": 1e-3,
       "lr_warmup_steps": 2, "lr_warmup_ratio": 0.5, "min_lr_ratio": 0.9, "weight_decay": 0.5, "max_grad_norm": 1e-3,
       "clip_range": 1e-4, "clip_range_high": 1e-4, "kl_coef": 0.5, "ref_sync_steps": 1, "ref_sync_alpha": 0.5,
       "dual_clip": 1.01, "entropy_coef": 0.5, "top_entropy_quantile": 0.3, "dynamic_sampling": True,
       "max_sampling_rounds": 1, "mask_truncated": True, "overlong_buffer": 4, "overlong_penalty": 3.0,
       "ptx_coef": 0.1, "ptx_file": "{texts_b}", "ptx_batch_size": 3, "seed": 1, "dtype": "bf16",
       "sapo_tau_pos": 5.0, "sapo_tau_neg": 5.0, "cov_ratio": 0.5, "kl_cov_coef": 5.0, "clip_cov_lb": -1e-6,
       "clip_cov_ub": 1e-6, "reward_weights": "hit=1,len=-3", "kl_target": 0.001, "kl_horizon": 10,
       "mismatch_cap": 1.0001, "mismatch_low": 0.999,
       "shaping_alpha": 0.01,   # the tiny model's entropy (about 5.7) x 0.2 still passes |A| / kappa
       "system_prompt": "Answer with the letter only."}


def changed_value(name: str, f):
    """A value other than the field's default that its declaration allows: a flag flipped, its
    first other choice, or a number halved, doubled or one more, within its range (None: none)."""
    d, choices = f.default, f.metadata.get("choices")
    if isinstance(d, bool):
        return not d
    if choices:
        return next(c for c in choices if c != d)
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        tries = [d * 2, d + 1, d // 2] if isinstance(d, int) else [d / 2, d * 2, d + 1]
        return next((v for v in tries if v != d and config.range_error(name, v) is None), None)
    return None


NEW.update({name: changed_value(name, f) for name, f in cli.variant_fields(train_lean.TABLES).items()
            if name not in NEW and name in compared() and changed_value(name, f) is not None})


class OtherToy(ToyTask):
    """The toy task with other prompts: a --task that changes what is trained."""
    def prompts(self, n, rng):
        return [p + " " for p in super().prompts(n, rng)]


def test_every_compared_setting_has_a_new_value():
    missing = [n for n in compared(dataclasses.fields(ToyTask.options)) if n not in NEW]
    assert not missing, (f"no value follows from these settings' declarations: give each one in NEW "
                         f"(or mark it resume_free / resume_fixed): {missing}")


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """Per set of enabling flags: a checkpoint after step 1 of 3, and the run resumed from it unchanged."""
    root = tmp_path_factory.mktemp("changes")
    paths = {"other_model": build_tiny_model(str(root / "other"), seed=1), "texts_a": str(root / "a.txt"),
             "texts_b": str(root / "b.txt"), "chat_task": str(root / "chat_toy.py"),
             "chat_model": build_tiny_model(str(root / "chat"), seed=0, arch="qwen2", chat=True)}
    (root / "chat_toy.py").write_text(CHAT_TASK)
    model = build_tiny_model(str(root / "model"), seed=0)
    for name, text in (("texts_a", "aaa bbb\nccc ddd\n"), ("texts_b", "a much longer line of text here\nzz\n")):
        with open(paths[name], "w") as f:
            f.write(text * 4)
    made = {}

    def make(extra):
        key = tuple(extra)
        if key not in made:
            out = str(root / f"base{len(made)}")
            args = ["--model", model, *BASE, *[a.format(**paths) for a in extra]]
            train_lean.main([*args, "--steps", "1", "--out-dir", out])
            resumed = out + "-same"
            shutil.copytree(out, resumed)
            train_lean.main([*args, "--out-dir", resumed, "--resume"])
            made[key] = args, out, resumed
        return made[key]
    return make, paths


def behaviour(out):
    """What a resumed run did: its steps' records and its last weights."""
    return records(os.path.join(out, "metrics.jsonl")), weights(os.path.join(out, "checkpoints", "step_000003"))


# each setting from the checkpoint its ENABLING flags made; and some again where another setting holds its value
CASES = {**{name: (name, ENABLING.get(name, [])) for name in NEW},
         "kl_coef under --kl-target": ("kl_coef", ["--kl-target", "0.001"])}   # the coefficient starts over from it


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_allowed_change_is_the_one_the_resumed_run_trains_with(case, start, tmp_path, clean_env):
    make, paths = start
    name, enabling = CASES[case]
    args, out, same = make(enabling)
    changed = str(tmp_path / "changed")
    shutil.copytree(out, changed)
    value = NEW[name].format(**paths) if isinstance(NEW[name], str) else NEW[name]
    train_lean.main([*args, f"{config.flag(name)}={str(value).lower() if isinstance(value, bool) else value}",
                     *ALONG.get(name, []), "--out-dir", changed, "--resume", "--resume-allow-change", name])
    (recs, w), (recs_same, w_same) = behaviour(changed), behaviour(same)
    assert [r["step"] for r in recs] == [r["step"] for r in recs_same]
    same_weights = w.keys() == w_same.keys() and all(torch.equal(w[k], w_same[k]) for k in w)
    assert recs != recs_same or not same_weights, (
        f"{config.flag(name)} {value} was accepted and changed nothing: if it acts only with another "
        f"setting on, name that in ENABLING; if this value does nothing here, give one in NEW")


@pytest.mark.parametrize("name", sorted(rundir.resume_fixed(())))
def test_a_fixed_setting_is_refused_with_its_reason(name, tmp_path, clean_env, capsys):
    with pytest.raises(SystemExit) as e:
        train_lean.main(["--task", "toy", "--out-dir", str(tmp_path), "--resume", "--resume-allow-change", name])
    assert e.value.code == 2
    reason = config.FIELDS[name].metadata["resume_fixed"]
    assert f"{config.flag(name)} cannot change on --resume: {reason}" in capsys.readouterr().err


def test_a_lora_checkpoint_refuses_other_adapters_on_resume(tiny_model_dir, tmp_path, clean_env, capsys):
    pytest.importorskip("peft")
    args = ["--model", tiny_model_dir, *BASE, "--lora-rank", "4", "--kl-coef", "0"]
    train_lean.main([*args, "--steps", "1", "--out-dir", str(tmp_path)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_lean.main([*args, "--lora-rank", "8", "--out-dir", str(tmp_path), "--resume"])
    assert e.value.code == 2
    assert "--lora-rank 4 -> 8: this setting cannot change on --resume" in capsys.readouterr().err


@pytest.mark.parametrize("lora", [False, True])
def test_the_starting_model_is_compared_by_its_weights_on_resume(lora, tmp_path, clean_env, capsys):
    """--model is read again on --resume (the KL reference; with LoRA the base): the same path holding other
    weights is refused, unless --resume-allow-change model; the checkpoints after it record the new ones."""
    if lora:
        pytest.importorskip("peft")
    model = build_tiny_model(str(tmp_path / "model"), seed=0)
    args = ["--model", model, *BASE, "--out-dir", str(tmp_path / "run"), *(["--lora-rank", "4"] if lora else [])]
    train_lean.main([*args, "--steps", "1"])
    build_tiny_model(model, seed=1)   # the folder rebuilt: same path, other weights
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_lean.main([*args, "--steps", "2", "--resume"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--model {model} holds other weights than the run started from" in err
    assert ("LoRA base and KL reference" in err) == lora
    train_lean.main([*args, "--steps", "2", "--resume", "--resume-allow-change", "model"])
    assert "going on from them (--resume-allow-change model)" in capsys.readouterr().err
    train_lean.main([*args, "--steps", "3", "--resume"])   # step 2's checkpoint started from these weights
    assert "holds other weights" not in capsys.readouterr().err


def test_no_kl_and_no_lora_reads_nothing_of_the_model_on_resume(tmp_path, clean_env, capsys):
    model = build_tiny_model(str(tmp_path / "model"), seed=0)
    args = ["--model", model, *BASE, "--kl-coef", "0", "--out-dir", str(tmp_path / "run")]
    train_lean.main([*args, "--steps", "1"])
    build_tiny_model(model, seed=1)
    train_lean.main([*args, "--steps", "2", "--resume"])   # nothing of --model is used: nothing to compare
    assert "holds other weights" not in capsys.readouterr().err
