import dataclasses

import pytest
import torch

import tasks
from harness import cli, config
from harness.config import ConfigError, batch_layout
from train_lean import TABLES


def load(argv, environ):
    """The trainer's settings (the default task's options aside) and their sources."""
    loaded = cli.load(argv, environ, tasks.BUILTIN, tasks.DEFAULT, tables=TABLES)
    return loaded.cfg, loaded.sources


def layout(argv, world=1):
    cfg, _ = load(argv, environ={})
    return checked(cfg, world)


def checked(cfg, world=1):
    """As the run checks its settings: the batch arithmetic, then the variants' rules."""
    out = batch_layout(cfg, world)
    config.check_variants(cfg, TABLES)
    return out


def test_defaults_are_the_seed_configuration():
    cfg, sources = load([], environ={})
    assert (cfg.batch_size, cfg.group_size, cfg.learning_rate, cfg.clip_range, cfg.kl_coef, cfg.max_new_tokens) == \
        (64, 8, 1e-4, 0.2, 0.02, 144)
    # the default chess task declares its pretraining mix (tests/harness/test_cli.py); the rest is the Config's
    assert {k for k, v in sources.items() if v != "default"} == {"ptx_coef"} and cfg.task == tasks.DEFAULT
    d = batch_layout(cfg)
    assert d.prompts_per_step == 8 and d.updates_per_step == 1 and d.grad_accum_steps == 1


def test_derived_sizes():
    d = layout(["--batch-size", "64", "--mini-batch-size", "32", "--micro-batch-size", "8", "--ppo-epochs", "2"])
    assert d.updates_per_step == 4 and d.grad_accum_steps == 4 and d.micro_batch == 8
    d = layout(["--batch-size", "64", "--micro-batch-size", "8"], world=2)
    assert d.completions_per_device == 32 and d.grad_accum_steps == 4 and d.prompts_per_device == 4
    assert d.micro_tokens == 0 and not d.micro_tokens_auto   # cut by rows unless asked
    d = layout(["--batch-size", "64", "--micro-batch-tokens", "2048"])
    assert d.micro_tokens == 2048 and not d.micro_tokens_auto and d.micro_batch == 64
    d = layout(["--batch-size", "64", "--micro-batch-tokens", "auto"])
    assert d.micro_tokens == 0 and d.micro_tokens_auto


@pytest.mark.parametrize("argv, world, message", [
    (["--batch-size", "60"], 1, "--batch-size 60 is not a multiple of --group-size 8: use 56 or 64"),
    (["--batch-size", "4"], 1, "--batch-size 4 is not a multiple of --group-size 8: use 8"),
    (["--group-size", "1"], 1, "--group-size 1: GRPO needs at least 2"),
    (["--batch-size", "24"], 2, "24 gives 3 prompts, which do not split over 2 devices in whole groups: use 16 or 32"),
    (["--mini-batch-size", "48"], 1, "--batch-size 64 is not a multiple of --mini-batch-size 48"),
    (["--micro-batch-size", "24"], 1, "--micro-batch-size 24 does not divide the per-device mini-batch 64"),
    (["--micro-batch-size", "0"], 1, "--micro-batch-size 0 must be at least 1"),
    (["--micro-batch-tokens", "0"], 1, "--micro-batch-tokens 0 must be at least 1"),
    (["--micro-batch-tokens", "512", "--micro-batch-size", "8"], 1,
     "--micro-batch-size 8 and --micro-batch-tokens 512: cut the mini-batch one way, leave one out"),
    (["--batch-size", "0"], 1, "--batch-size 0 must be at least 1"),
    (["--steps", "-1"], 1, "--steps -1 must be at least 1"),
    (["--temperature", "-1"], 1, "--temperature -1.0 must be >= 0"),
    (["--top-p", "0"], 1, "--top-p 0.0 must be in (0, 1]"),
    (["--top-k", "-2"], 1, "--top-k -2 must be >= 0"),
    (["--clip-range", "0"], 1, "--clip-range 0.0 must be > 0"),
    (["--kl-coef", "-0.1"], 1, "--kl-coef -0.1 must be >= 0"),
    (["--learning-rate", "0"], 1, "--learning-rate 0.0 must be in (0, 1)"),
    (["--trace-memory", "-2"], 1, "--trace-memory -2 must be >= 0"),
    (["--trace-memory", "1"], 1, "--trace-memory 1: the evidence compares the first traced step with the last"),
    (["--lr-warmup-steps", "5", "--lr-warmup-ratio", "0.1"], 1, "--lr-warmup-steps 5 and --lr-warmup-ratio 0.1: give"),
    (["--ref-sync-steps", "10", "--kl-coef", "0"], 1, "--ref-sync-steps 10 moves the reference, and --kl-coef 0 has"),
    # a warmup as long as the run never trains at the rate set (it was taken in silence)
    (["--lr-warmup-steps", "50", "--steps", "2"], 1, "--lr-warmup-steps 50 with --steps 2: the learning rate would "
                                                     "rise over the whole run"),
    (["--lr-warmup-steps", "2", "--steps", "2"], 1, "give a warmup below 2 steps, or more --steps"),
    (["--lr-warmup-ratio", "0.95", "--steps", "10"], 1, "--lr-warmup-ratio 0.95 (10 steps) with --steps 10"),
    # a device torch does not have here, or another kind: refused before anything loads
    # (they were tracebacks)
    (["--device", "mps"], 1, "--device mps: is not one of auto, cpu, cuda or cuda:N"),
    (["--device", "tpu"], 1, "--device tpu: is not one of auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], 1, "--device cuda:99: this machine has "),
    # every advantage 0 at every step, blamed on the temperature by the flat-groups note
    (["--reward-weights", "a=0,b=0", "--advantage", "gdpo"], 1,
     "--reward-weights a=0,b=0: every weight is 0, so every completion's reward (and advantage) "
     "would be 0: give a part a weight"),
])
def test_batch_rule_violations_name_the_values_and_a_fix(argv, world, message):
    with pytest.raises(ConfigError) as e:
        layout(argv, world)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA has it")
def test_cuda_on_a_machine_without_it_is_refused():
    with pytest.raises(ConfigError, match=r"--device cuda: this machine has no CUDA device that "
                                          r"torch can use: pass --device cpu \(or auto\)"):
        layout(["--device", "cuda"], 1)
    with pytest.raises(ConfigError, match="--device cuda:5: this machine has no CUDA device"):
        layout(["--device", "cuda:5"], 1)


# for each range opt(..., must=...) may declare: a value just outside it, and its edge (inside)
OUTSIDE = {"at least 1": (0, 1), ">= 0": (-1, 0), "> 0": (0.0, 1e-9), "> 1": (1.0, 1.5), "in (0, 1]": (0.0, 1.0),
           "in [0, 1)": (1.0, 0.0), "in (0, 1)": (1.0, 0.5), "in [0, 2**32)": (2**32, 2**32 - 1),
           "in [0, 1e6]": (1e6 + 1, 1e6), "in (0, 1e6]": (0.0, 1e6)}


@pytest.mark.parametrize("name", [n for n, f in config.FIELDS.items() if f.metadata["must"]])
def test_every_declared_range_is_checked_in_its_own_words(name):
    f = config.FIELDS[name]
    bad, edge = OUTSIDE[f.metadata["must"]]
    defaults, _ = load([], environ={})
    with pytest.raises(ConfigError) as e:
        batch_layout(dataclasses.replace(defaults, **{name: bad}))
    note = f" ({f.metadata['note']})" if f.metadata["note"] else ""
    assert str(e.value) == f"{config.flag(name)} {bad} must be {f.metadata['must']}{note}"
    try:   # the edge is inside the range: a rule between fields may still refuse it (--group-size 1)
        batch_layout(dataclasses.replace(defaults, **{name: edge}))
    except ConfigError as e:
        assert "must be" not in str(e)


# the variants' settings (grpo/settings.py) and LoRA's: refused before anything loads
@pytest.mark.parametrize("knobs, message", [
    ({"mismatch_cap": 3.0}, "--mismatch-cap 3.0 with --mismatch-correction none"),
    ({"mismatch_correction": "tis", "mismatch_low": 0.2}, "--mismatch-low 0.2 with --mismatch-correction tis"),
    ({"mismatch_correction": "tis", "mismatch_cap": 0.5}, "--mismatch-cap 0.5 must be at least 1"),
    ({"mismatch_correction": "token-mask", "mismatch_low": 1.0}, "--mismatch-low 1.0 must be in [0, 1)"),
])
def test_bad_mismatch_settings_are_refused(knobs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        checked(config.Config(**knobs))


@pytest.mark.parametrize("knobs, message", [
    ({"kl_target": 0.1, "kl_coef": 0.0}, "--kl-target 0.1 steers the KL coefficient, and --kl-coef 0 has no KL term"),
    ({"kl_horizon": 100}, "--kl-horizon 100 without --kl-target"),
    ({"kl_target": -1.0}, "--kl-target -1.0 must be > 0"),
    # 1 - 0.2 x 16 / 1 < 0: the coefficient's sign flipped every step (0.02, -0.044, 0.097, ...)
    ({"kl_target": 100.0, "kl_horizon": 1, "batch_size": 16},
     r"--kl-horizon 1 with --batch-size 16: .* by 1 - 0.2 x 16 / 1 = -2.2, to 0 or past it; "
     r"give --kl-horizon 4 or more"),
    ({"kl_target": 0.1, "kl_horizon": 8, "batch_size": 40},
     "--kl-horizon 8 with --batch-size 40: .* = 0, "),
])
def test_bad_adaptive_kl_settings_are_refused(knobs, message):
    with pytest.raises(ConfigError, match=message):
        checked(config.Config(**knobs))


def test_the_shortest_kl_horizon_allowed_is_accepted():
    # its coefficient stays above 0: tests/grpo/test_adaptive_kl.py
    checked(config.Config(kl_target=100.0, kl_horizon=4, batch_size=16))


def test_bad_lora_settings_are_refused():
    for changes, message in (({"lora_target_modules": "c_attn"}, "--lora-target-modules c_attn with --lora-rank 0"),
                             ({"lora_rank": 4, "ref_sync_steps": 2}, "--ref-sync-steps 2 with --lora-rank 4")):
        with pytest.raises(config.ConfigError, match=message):
            checked(config.Config(**changes))
