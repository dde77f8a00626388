"""LoRA (--lora-rank, through peft): adapters on the policy that the fast decoders apply, the reference as the
same weights with the adapters off, the trainable share, the saved folders, --resume and two gloo ranks."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import INDUCTOR_BUILDS, SMALL, TRAIN, env, records, train, trained_in_process, usage_error

peft = pytest.importorskip("peft")

import train_lean  # noqa: E402
from harness import checkpoint  # noqa: E402
from grpo.decoders import GPT2Decoder, LlamaDecoder  # noqa: E402
from grpo.model import (ModelLoadError, adapters_off, add_lora, completion_logprobs, load_policy,  # noqa: E402
                        load_tokenizer, lora_summary)
from grpo.decoders import generate  # noqa: E402
from grpo.rollout import encode_prompts, left_pad  # noqa: E402

LORA = ["--task", "toy", "--lora-rank", "4", "--kl-coef", "0.5", "--learning-rate", "1e-2"]


def moved_lora(model_dir, seed=0):
    """(the PeftModel, the policy) with adapters whose B is random, not peft's zeros: they change the model."""
    lora = add_lora(load_policy(model_dir, "cpu"), 4, 16.0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return lora, lora.get_base_model()


def sampled(policy, model_dir, group=4, new=12):
    """Real sampled completions of two prompts (a group each): (input ids, attention mask, completion mask,
    sampling logprobs)."""
    tok = load_tokenizer(model_dir)
    ids, mask = left_pad(encode_prompts(tok, ["Repeat a: ", "Repeat bb: "], True), tok.eos_token_id)
    ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    torch.manual_seed(0)
    out = generate(policy, ids, mask, end_ids=tok.eos_token_id, max_new_tokens=new)
    return torch.cat([ids, out.ids], 1), torch.cat([mask, out.mask], 1), out.mask, out.logp


def logprobs(model, inputs, attention, cmask):
    with torch.no_grad():
        return completion_logprobs(model, inputs, attention, cmask.shape[1], 1.0, 2048) * cmask


def test_the_fast_decoders_sample_with_the_adapters(any_model_dir):
    # peft changes the layers in place, so GPT2Decoder's c_attn and LlamaDecoder's q_proj / v_proj are LoRA layers:
    # what they sample is scored the same by the training forward, and differs from the base model's
    lora, policy = moved_lora(any_model_dir)
    assert GPT2Decoder.fits(policy) or LlamaDecoder.fits(policy)
    inputs, attention, cmask, old = sampled(policy, any_model_dir)
    trained = logprobs(policy, inputs, attention, cmask)
    torch.testing.assert_close(trained, old * cmask, rtol=0, atol=1e-5)
    assert (trained - logprobs(load_policy(any_model_dir, "cpu"), inputs, attention, cmask)).abs().max() > 1e-2


def test_the_reference_is_the_base_model_with_the_adapters_off(tiny_model_dir):
    lora, policy = moved_lora(tiny_model_dir)
    inputs, attention, cmask, _ = sampled(policy, tiny_model_dir)
    base = logprobs(load_policy(tiny_model_dir, "cpu"), inputs, attention, cmask)
    with adapters_off(lora) as model:
        assert torch.equal(logprobs(model, inputs, attention, cmask), base)
    # on again afterwards, and still the only trainable weights
    assert (logprobs(policy, inputs, attention, cmask) - base).abs().max() > 1e-2
    assert all(("lora_" in n) == p.requires_grad for n, p in policy.named_parameters())


def test_the_trainable_share_is_the_adapters(tiny_model_dir):
    base = load_policy(tiny_model_dir, "cpu")
    n_base, c = sum(p.numel() for p in base.parameters()), base.config
    lora = add_lora(base, 4, 16.0)
    adapters = c.n_layer * 4 * (c.n_embd + 3 * c.n_embd)  # A: embd -> r, B: r -> 3 x embd, on each c_attn
    assert sum(p.numel() for p in lora.parameters() if p.requires_grad) == adapters
    line = lora_summary(lora, with_reference=True)
    assert f"LoRA rank 4, alpha 16 on c_attn: {adapters:,} of {n_base + adapters:,} parameters train " \
           f"({100 * adapters / (n_base + adapters):.3g}%)" in line
    assert f"({n_base * 4 / 2 ** 20:,.1f} MiB saved)" in line
    assert "reference" not in lora_summary(lora, with_reference=False)
    assert not lora.training and not any(m.training for m in lora.modules())  # no dropout anywhere
    assert all(not isinstance(m, torch.nn.Dropout) or m.p == 0 for n, m in lora.named_modules() if "lora_" in n)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lora_run(request, tiny_model_dir, tiny_rotary_dir, tmp_path_factory):
    model = tiny_model_dir if request.param == "gpt2" else tiny_rotary_dir
    out = tmp_path_factory.mktemp("lora") / "out"
    stdout = trained_in_process("--model", model, *SMALL, *LORA, "--steps", "3",
                                "--save-interval", "3", "--out-dir", str(out))
    return model, out, stdout


def test_every_step_starts_on_policy_and_the_kl_is_against_the_base(lora_run):
    # one update per step: each step's update is its first, exactly on-policy (ratio 1, nothing clipped), with
    # adapters that moved after step 1 (a KL above 0 against the base model)
    model, out, stdout = lora_run
    recs = records(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert abs(r["ratio_mean"] - 1) < 1e-5 and r["clip_frac"] == 0, r
    assert recs[0]["kl"] == 0 and recs[-1]["kl"] > 0
    assert "parameters train (" in stdout and "MiB saved)" in stdout


def test_the_saved_folder_loads_and_is_the_trained_policy(lora_run):
    from transformers import AutoModelForCausalLM
    model, out, _ = lora_run
    merged = AutoModelForCausalLM.from_pretrained(out / "model")   # a plain folder: the adapters merged in
    trained = peft.PeftModel.from_pretrained(load_policy(model, "cpu"), str(out / "model" / checkpoint.ADAPTER))
    inputs, attention, cmask, _ = sampled(trained.get_base_model(), model)
    expected = logprobs(trained.get_base_model(), inputs, attention, cmask)
    torch.testing.assert_close(logprobs(merged, inputs, attention, cmask), expected, rtol=0, atol=1e-5)
    assert (expected - logprobs(load_policy(model, "cpu"), inputs, attention, cmask)).abs().max() > 1e-4
    # the last checkpoint holds the same adapters, and no copy of the base weights
    step_3 = out / "checkpoints" / "step_000003"
    assert not (step_3 / "model.safetensors").exists() and (step_3 / "config.json").exists()
    ours, saved = (peft.utils.load_peft_weights(str(p)) for p in (step_3, out / "model" / checkpoint.ADAPTER))
    assert ours.keys() == saved.keys() and all(torch.equal(ours[k], saved[k]) for k in ours)


def test_a_lora_run_resumes_exactly(tiny_model_dir, tmp_path, clean_env, user_threads):
    args = ["--model", tiny_model_dir, *SMALL, *LORA, "--steps", "4", "--log-level", "warning",
            "--save-final", "false"]
    train_lean.main([*args, "--out-dir", str(tmp_path / "straight"), "--save-interval", "4"])
    train_lean.main([*args, "--save-interval", "2", "--out-dir", str(tmp_path / "resumed")])
    step_2 = tmp_path / "resumed" / "checkpoints" / "step_000002"
    train_lean.main([*args, "--save-interval", "2", "--resume", str(step_2), "--out-dir", str(tmp_path / "resumed")])
    straight, resumed = records(tmp_path / "straight" / "metrics.jsonl"), records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed == straight and straight[-1]["kl"] > 0
    a, b = (peft.utils.load_peft_weights(str(tmp_path / d / "checkpoints" / "step_000004")) for d in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_settings_are_checked_where_they_enter(tiny_model_dir):
    # the ones the harness refuses first: tests/harness/test_config.py
    with pytest.raises(ModelLoadError, match="--lora-target-modules nope on gpt2: .*nope"):
        add_lora(load_policy(tiny_model_dir, "cpu"), 4, 16.0, "nope")


def test_without_peft_lora_is_one_line_naming_the_package(tiny_model_dir, tmp_path, monkeypatch,
                                                          capsys, clean_env):
    # peft hidden, as on a machine without it (a None in sys.modules fails its import): exit 2
    # before any model loads
    monkeypatch.setitem(sys.modules, "peft", None)
    line = usage_error(["--model", tiny_model_dir, *SMALL, *LORA, "--steps", "1",
                        "--out-dir", str(tmp_path)], capsys)
    assert "--lora-rank 4 needs the peft package, which is not installed: pip install peft" in line


@pytest.mark.slow
def test_two_gloo_ranks_make_the_one_process_lora_update(tiny_model_dir, tmp_path):
    # the adapters' gradients are summed over ranks: two processes train the adapters one process does
    args = ["--model", tiny_model_dir, *SMALL, *LORA, "--batch-size", "16", "--group-size", "4", "--steps", "2",
            "--save-interval", "2", "--advantage", "batch", "--seed", "3"]
    single = train(*args, "--generation-batch-size", "8", "--out-dir", str(tmp_path / "one"))
    assert single.returncode == 0, single.stderr
    pair = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           TRAIN, *args, "--out-dir", str(tmp_path / "two")],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert pair.returncode == 0, pair.stderr[-3000:]
    a, b = records(tmp_path / "one" / "metrics.jsonl"), records(tmp_path / "two" / "metrics.jsonl")
    for ra, rb in zip(a, b):
        for k in ("reward_mean", "completion_len_mean"):
            assert ra[k] == rb[k], k
        for k in ("loss", "kl", "ratio_mean", "grad_norm"):
            assert abs(ra[k] - rb[k]) <= 1e-5 * max(1.0, abs(ra[k])), (k, ra[k], rb[k])
    assert a[0]["grad_norm"] > 0
    one, two = (peft.utils.load_peft_weights(os.path.join(tmp_path, d, "checkpoints", "step_000002"))
                for d in ("one", "two"))
    assert max(one[k].abs().max().item() for k in one if "lora_B" in k) > 1e-4   # the adapters moved
    for k in one:
        torch.testing.assert_close(one[k], two[k], rtol=0, atol=1e-5)


@pytest.mark.slow
@INDUCTOR_BUILDS
def test_compiled_decoding_and_checkpointed_layers_keep_lora_on_policy(tiny_model_dir, tmp_path, clean_env):
    # --compile captures the decode step with the adapters' layers in it; --gradient-checkpointing recomputes them
    # in backward: the second step's adapters have moved, and its update still starts at ratio 1
    for extra in (["--compile"], ["--gradient-checkpointing"]):
        out = tmp_path / extra[0].strip("-")
        train_lean.main(["--model", tiny_model_dir, *SMALL, *LORA, "--steps", "2", "--group-size", "4", *extra,
                         "--log-level", "warning", "--save-final", "false", "--out-dir", str(out)])
        recs = records(out / "metrics.jsonl")
        assert all(abs(r["ratio_mean"] - 1) < 1e-5 and r["clip_frac"] == 0 for r in recs) and recs[1]["kl"] > 0
