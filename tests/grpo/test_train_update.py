"""The update (train_lean.py): every loss knob keeps gradient accumulation exact: 8 micro-batches of 8 give the gradient of one batch of
64, and 2 gloo ranks of 32 rows each, their gradients summed, give the one-process gradient.

The batch is real: 64 completions sampled from the tiny GPT-2 (rollout64), with sampling logprobs moved
off-policy so that ratios spread out and every clip (low, high, sequence, dual) binds somewhere.
"""
import copy
import functools
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from grad_worker import (CHUNK_ROWS, GROUP, KNOBS, MAX_NEW_TOKENS, TEMPERATURE, as_rollout,
                         config_for, minibatch_gradient)
import train_lean as update
from grpo import packing, passes
from train_lean import RATIOS, group_advantages, grpo_loss, loss_denominator
from grpo.model import completion_logprobs, load_tokenizer, trainable_parameters
from grpo.ptx import PtxBatch, encode, ptx_loss
from grpo.sums import Largest
from harness.config import batch_layout
from harness.guards import Guard
from helpers import env, loss_config


@pytest.fixture(scope="module")
def batch(rollout64, tiny_model_dir):
    model, inputs, attention, cmask, old, adv = rollout64
    torch.manual_seed(2)
    with torch.no_grad():
        logp = completion_logprobs(model, inputs, attention, cmask.shape[1], TEMPERATURE, 4096)
    # 11 pretraining-mix texts of different lengths, some with a context: 8 + 3 per micro-batches of 8, 6 + 5 per rank
    texts = [("Repeat " + c * i + ": ", c * (11 - i)) if i % 3 else "plain " * i + c for i, c in enumerate("abcdeabcdea")]
    ptx = vars(encode(texts, load_tokenizer(tiny_model_dir), prepend_bos=True, context=None))
    # the sampler's logprobs (Rollout.sampler_logp) apart from the trainer's, so --mismatch-correction weighs and drops
    return {"inputs": inputs, "attention": attention, "cmask": cmask, "rewards": adv, "ptx": ptx,
            "old": old + 0.3 * torch.randn_like(old) * cmask, "ref": logp + 0.2 * torch.randn_like(logp) * cmask,
            "sampler": logp + 0.3 * torch.randn_like(logp) * cmask}


@pytest.fixture(scope="module")
def gradient(rollout64, batch):
    """gradient(knobs' name, micro): minibatch_gradient of the batch on rollout64's model, each
    computed once (the accumulation tests, the ranks' test and the every-knob control ask for the
    same ones)."""
    return functools.cache(
        lambda name, micro: minibatch_gradient(rollout64[0], batch, KNOBS[name], micro=micro))


@pytest.fixture(scope="module")
def padded_gradient(rollout64, batch):
    """gradient's, through the padded forward (every row at the batch's width; grpo/packing.py)."""
    def compute(name, micro):
        packs, packing.packs = packing.packs, lambda model: False
        try:
            return minibatch_gradient(rollout64[0], batch, KNOBS[name], micro=micro)
        finally:
            packing.packs = packs
    return functools.cache(compute)


def relative(a, b):
    return ((a - b).norm() / a.norm()).item()


@pytest.mark.parametrize("name", list(KNOBS))
def test_the_packed_forward_gives_the_padded_gradient(gradient, padded_gradient, name):
    """Real tokens only changes no gradient: packed micro-batches of 8 and one packed batch of 64 give
    the padded path's accumulated gradient, for every knob (the token-mean exact across micro-batches)."""
    padded = padded_gradient(name, 8)
    assert padded.norm() > 0
    assert relative(padded, gradient(name, 8)) <= 1e-5
    assert relative(padded, gradient(name, 64)) <= 1e-5


@pytest.mark.parametrize("name", ["defaults", "loss_agg seq-mean", "loss_agg dr-grpo",
                                  "top entropy token-mean", "clip-cov wide band", "pretraining mix",
                                  "all at once"])
def test_micro_batches_cut_by_tokens_give_the_padded_gradient(rollout64, batch, padded_gradient, name):
    """--micro-batch-tokens 100: micro-batches of 1, 3 and 4 rows, groups cut across them (the
    mix's texts cut by their own tokens), give the padded path's gradient."""
    cut = Guard(64, 64, print, tokens=100).cut
    sizes = [len(p) for p in cut.split(as_rollout(batch, config_for(KNOBS[name]), 0, 1), torch.arange(64))]
    assert set(sizes) == {1, 3, 4}
    tokens = minibatch_gradient(rollout64[0], batch, KNOBS[name], micro=64, tokens=100)
    assert relative(padded_gradient(name, 8), tokens) <= 1e-5


@pytest.mark.parametrize("name", list(KNOBS))
def test_eight_micro_batches_give_the_gradient_of_one_batch(gradient, name):
    whole, accumulated = gradient(name, 64), gradient(name, 8)
    assert whole.norm() > 0
    assert relative(whole, accumulated) <= 1e-5


def test_the_entropy_bonus_reaches_the_gradient(rollout64, batch, gradient):
    """--entropy-coef through the trainer's own update: the defaults' gradient less the coefficient
    times the gradient of the token-mean entropy, taken here directly with the entropy's graph (the
    update computes the entropy without one unless the loss reads it)."""
    model, cmask = rollout64[0], batch["cmask"]
    model.zero_grad()
    _, entropy = completion_logprobs(model, batch["inputs"], batch["attention"], cmask.shape[1],
                                     TEMPERATURE, CHUNK_ROWS, with_entropy=True)
    ((entropy * cmask).sum() / cmask.sum()).backward()
    direct = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    model.zero_grad()
    bonus = KNOBS["entropy bonus"]["entropy_coef"]
    assert relative(gradient("defaults", 64) - bonus * direct, gradient("entropy bonus", 64)) <= 1e-5


def test_the_batch_exercises_every_clip(rollout64, batch):
    """The control of the tests above: each knob's branch is taken on this batch, so each was compared."""
    model = rollout64[0]
    cmask = batch["cmask"]
    with torch.no_grad():
        logp = completion_logprobs(model, batch["inputs"], batch["attention"], cmask.shape[1], TEMPERATURE, 4096)
    adv = group_advantages(batch["rewards"], GROUP)[0]
    for knobs in (KNOBS["defaults"], KNOBS["dual clip"], KNOBS["gspo token-mean"]):
        _, stats = grpo_loss(logp, batch["old"], adv, cmask, 1.0, loss_config(**knobs))
        assert 0 < stats["clip_low_frac"] and 0 < stats["clip_high_frac"], knobs
        assert stats["clip_frac"] < cmask.sum()
    _, stats = grpo_loss(logp, batch["old"], adv, cmask, 1.0, loss_config(**KNOBS["dual clip"]))
    assert stats["clip_dual_frac"] > 0
    # the mismatch knobs: each mask drops some tokens (or sequences) and keeps others, the cap binds somewhere
    weights = {}
    for name, knobs in (*((n, KNOBS[n]) for n in ("tis cap", "token mask band", "sequence mask band")),
                        ("uncapped", {"mismatch_correction": "tis", "mismatch_cap": 100.0})):
        _, stats = grpo_loss(logp, batch["old"], adv, cmask, 1.0, loss_config(**knobs), sampler_logp=batch["sampler"])
        weights[name] = stats["mismatch_weight"]
        assert 0 < stats["mismatch_zero_frac"] < cmask.sum() if "mask" in name else stats["mismatch_zero_frac"] == 0
    assert weights["tis cap"] < weights["uncapped"]
    # sequence ratios: some sequences inside the GSPO clip range, some outside it
    seq = RATIOS["sequence"](logp, batch["old"], cmask).squeeze(1)
    assert ((seq - 1).abs() < 0.02).any() and ((seq - 1).abs() > 0.03).any()


def test_a_threshold_per_micro_batch_is_a_different_gradient(rollout64, batch, gradient):
    """The trap: the top-entropy threshold must come from the whole mini-batch, not each micro-batch."""
    whole = gradient("top entropy token-mean", 64)
    wrong = minibatch_gradient(rollout64[0], batch, KNOBS["top entropy token-mean"], micro=8,
                               threshold_per_micro_batch=True)
    assert relative(whole, wrong) > 1e-3


def one_update(model, batch, knobs, micro):
    """update() on a copy of model over the batch in 2 mini-batches of 32, micro rows per forward
    to start with: its record, the weights it left and its guard."""
    cfg = config_for({**knobs, "mini_batch_size": 32})
    policy = copy.deepcopy(model)
    params = trainable_parameters(policy)
    guard = Guard(micro, 32, print)
    torch.manual_seed(0)   # the mini-batches' shuffle
    record = update.update(policy, torch.optim.AdamW(params, lr=1e-3), as_rollout(batch, cfg, 0, 1),
                           cfg, batch_layout(cfg), None, guard)
    return record, [p.detach() for p in params], guard


def test_the_gap_is_per_token_measured_and_its_largest_over_the_micro_batches(rollout64, batch):
    """Of two updates, the first measures the sampler/trainer gap (its forward is at the sampling
    weights; the second's is not): the record's mismatch_kl and mismatch_abs are per token of that
    mini-batch, not of the step, and mismatch_max the largest over its 4 micro-batches, each
    against the formula over those tokens."""
    record = one_update(rollout64[0], batch, KNOBS["defaults"], micro=8)[0]
    cfg = config_for({"mini_batch_size": 32})
    rollout = as_rollout(batch, cfg, 0, 1)
    torch.manual_seed(0)   # one_update's shuffle: the first mini-batch's rows
    first = torch.randperm(64)[:32].sort().values
    with torch.no_grad():
        logp = completion_logprobs(rollout64[0], rollout.input_ids[first], rollout.attention[first],
                                   MAX_NEW_TOKENS, TEMPERATURE, CHUNK_ROWS)
    measured = passes.loss_mask(rollout, cfg)[first].bool()
    gap = (logp - rollout.sampler_logp[first])[measured].double()
    assert record["mismatch_kl"] == pytest.approx((gap.exp() - 1 - gap).mean().item(), rel=1e-4)
    assert record["mismatch_abs"] == pytest.approx(gap.abs().mean().item(), rel=1e-5)
    assert record["mismatch_max"] == pytest.approx(gap.abs().max().item(), rel=1e-5)


@pytest.mark.parametrize("name, entropy", [("top entropy token-mean", True),
                                           ("clip-cov wide band", False)])
def test_an_out_of_memory_in_a_token_selection_pass_retries_it_with_fewer_rows(
        rollout64, batch, monkeypatch, name, entropy):
    """The top-entropy and clip-cov / kl-cov tokens come from a no-gradient pass over the mini-batch
    before its micro-batches: an out-of-memory there shrinks the micro-batch (it crashed the run),
    and the update is that of the smaller micro-batch, bit for bit."""
    plain = one_update(rollout64[0], batch, KNOBS[name], micro=8)
    real, raised = passes.completion_logprobs, []

    def completion_logprobs(model, input_ids, *args, with_entropy=False, **kwargs):
        # the test's allocator: no room for a no-gradient forward of more than 8 rows (the pass
        # under test is the update's only one with these knobs)
        if not torch.is_grad_enabled() and input_ids.shape[0] > 8:
            raised.append(with_entropy)
            raise torch.OutOfMemoryError("CUDA out of memory (the test's allocator)")
        return real(model, input_ids, *args, with_entropy=with_entropy, **kwargs)

    monkeypatch.setattr(passes, "completion_logprobs", completion_logprobs)
    hit = one_update(rollout64[0], batch, KNOBS[name], micro=16)
    assert raised == [entropy]   # the pass under test ran out of memory, once
    assert hit[2].cut.rows == 8
    assert hit[2].notes == ["out of memory at micro-batch 16: freed memory, retrying with 8"]
    assert hit[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(hit[1], plain[1]))


@pytest.mark.parametrize("name", ["defaults", "sequence mask band", "pretraining mix"])
def test_the_statistics_read_once_per_update_are_those_read_after_each_micro_batch(rollout64, batch,
                                                                                   name):
    """accumulate reads its micro-batches' sums once, after the last (the mix's texts' once too):
    the sums (mismatch_max's peak too) are exactly those of reading each micro-batch's statistics,
    loss and token count after its backward and summing them on the host in order, as before (the
    record's every value)."""
    model, cfg = rollout64[0], config_for(KNOBS[name])
    rollout = as_rollout(batch, cfg, 0, 1)
    if cfg.ptx_coef:
        rollout.extra["ptx"] = [PtxBatch(**batch["ptx"]).for_device(0, 1)]
    mask, rows, micro = passes.loss_mask(rollout, cfg), torch.arange(64), Guard(8, 64, print).cut
    inputs, denominator = {"sampler_logp": rollout.sampler_logp}, loss_denominator(mask, cfg)
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=0.0)
    sums = update.accumulate(model, optimizer, rollout, rows, micro, mask, denominator, cfg, None,
                             cfg.kl_coef, **inputs)
    direct = Counter()
    for part in micro.split(rollout, rows):
        logp, entropy = passes.token_logprobs(model, rollout, part, cfg, None, with_entropy=True)
        loss, stats = grpo_loss(logp, rollout.old_logp[part], rollout.advantages[part], mask[part],
                                denominator, cfg, cfg.kl_coef, ref_logp=rollout.ref_logp[part],
                                entropy=entropy, **{k: v[part] for k, v in inputs.items()})
        stats, tokens = dict(stats), mask[part].sum().item()
        peak = float(stats.pop("mismatch_max"))   # the gap's tokens measured are among stats
        direct.update(stats, loss=loss.item(), tokens=tokens)
        direct["mismatch_max"] = Largest(max(direct["mismatch_max"], peak))
    if cfg.ptx_coef:   # the mix's texts after them (grpo/ptx.py backward), read one by one
        mix = rollout.extra["ptx"][0]
        direct.update(ptx_nll=0.0, ptx_tokens=0)
        for part in micro.split(mix, shared=0):
            logp = completion_logprobs(model, mix.input_ids[part], mix.attention[part],
                                       mix.target.shape[1], 1.0, cfg.logprob_chunk_size,
                                       share_prompts=False, predict=mix.target[part])
            loss, nll = ptx_loss(logp, mix.target[part], mix.tokens, cfg.ptx_coef)
            direct.update(loss=loss.item(), ptx_nll=nll.item(),
                          ptx_tokens=mix.target[part].sum().item())
    assert len(micro.split(rollout, rows)) == 8 and direct["mismatch_max"] > 0
    assert sums == direct and all(type(sums[k]) is type(direct[k]) for k in direct)


def test_dr_grpo_denominator_is_the_same_whatever_the_lengths(batch):
    cmask = batch["cmask"]
    assert loss_denominator(cmask, loss_config(loss_agg="dr-grpo", max_new_tokens=MAX_NEW_TOKENS)) == 64 * MAX_NEW_TOKENS
    assert loss_denominator(torch.ones_like(cmask), loss_config(loss_agg="dr-grpo", max_new_tokens=MAX_NEW_TOKENS)) == 64 * MAX_NEW_TOKENS


@pytest.mark.slow
def test_two_gloo_ranks_sum_to_the_one_process_gradient(batch, gradient, padded_gradient, tiny_model_dir,
                                                        tmp_path):
    batch_file, out_file, init_file = tmp_path / "batch.pt", tmp_path / "grads.pt", tmp_path / "rendezvous"
    torch.save(batch, batch_file)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grad_worker.py")
    ranks = [subprocess.Popen([sys.executable, worker, str(rank), "2", str(init_file), tiny_model_dir, str(batch_file),
                               str(out_file)], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    for p in ranks:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    summed = torch.load(out_file)
    assert set(summed) == set(KNOBS)
    for name in KNOBS:   # the ranks' packed forwards, and the padded one-process gradient
        assert relative(gradient(name, 8), summed[name]) <= 1e-5, name
        assert relative(padded_gradient(name, 64), summed[name]) <= 1e-5, name


def test_every_knob_changes_the_gradient(gradient):
    """Another control: no knob is silently ignored (each gives a gradient of its own)."""
    grads = {name: gradient(name, 64) for name in KNOBS}
    names = list(grads)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert relative(grads[a], grads[b]) > 1e-4, (a, b)


def test_every_choice_the_algorithm_owns_is_a_knob():
    """The generated knobs take each variant flag's choices from train_lean.py TABLES, which main hands to the
    harness: a table the step looks a flag up in but TABLES leaves out would drop its choices from the command
    line, the checks, the accumulation and the end-to-end runs without a word. This says so: every Table of
    train_lean.py and grpo/variants.py is in TABLES, its default is its flag's, and its choices are the CLI's."""
    import train_lean
    from grad_worker import CHOICES
    from grpo import variants
    from harness import cli
    from harness.config import FIELDS
    built = {id(v): v for module in (train_lean, variants) for v in vars(module).values()
             if isinstance(v, variants.Table)}
    assert sorted(id(t) for t in train_lean.TABLES.values()) == sorted(built)
    fields = cli.variant_fields(train_lean.TABLES)
    for flag, table in train_lean.TABLES.items():
        assert table.flag == flag and table.default == FIELDS[flag].default, flag
        assert list(fields[flag].metadata["choices"]) == list(table), flag
    expected = {f"{n} {c}" for n, t in train_lean.TABLES.items() for c in t if c != t.default}
    assert set(CHOICES) == expected


def test_max_grad_norm_0_is_no_clipping(tiny_model_dir, tmp_path, clean_env):
    """--max-grad-norm 0 trains unclipped: the weights of a run with a bound that never binds (it
    zeroed every gradient, and the weights stayed those of the start)."""
    import train_lean
    from helpers import SMALL, weights
    for bound in ("0", "1e30"):
        train_lean.main(["--model", tiny_model_dir, "--task", "toy", *SMALL, "--steps", "1",
                         "--log-level", "warning", "--max-grad-norm", bound,
                         "--out-dir", str(tmp_path / bound)])
    start, off, loose = (weights(p) for p in
                         (tiny_model_dir, tmp_path / "0" / "model", tmp_path / "1e30" / "model"))
    assert all(torch.equal(off[k], loose[k]) for k in off)
    assert not all(torch.equal(off[k], start[k]) for k in off)
