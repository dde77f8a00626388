"""The speed paths compute the same thing as the plain ones and as HF generate: decode loop (eager and
compiled), shared prompts, sampling, checkpointing."""
import functools
import math

import pytest
import torch
from transformers import DynamicCache

import grpo.decoders as decoders
from grpo.model import checkpoint_layers, completion_logprobs
from grpo.model import end_ids, load_policy, load_tokenizer
from grpo.decoders import generate, sample_token
from grpo.rollout import encode_prompts, left_pad
from helpers import INDUCTOR_BUILDS


# the compiled decode step (torch.compile's inductor builds C++ on the CPU: tens of seconds a
# shape) in the slow tier; the eager one in both
EAGER_AND_COMPILED = [False, pytest.param(True, marks=[pytest.mark.slow, INDUCTOR_BUILDS])]


@pytest.fixture
def traced(monkeypatch):
    """torch.compile as dynamo traces the step (one graph, fullgraph, its buffers and draws) and AOT
    autograd functionalises it, run by eager kernels (backend aot_eager): what a test of the step's
    logic needs, far cheaper cold on a CPU (two of these tests: 157 s with inductor, 22 s traced).
    Inductor's own code is run by test_compiled_decode_step_equals_the_eager_one and the trainer's
    compiled tests."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


def _group_batch(tok, group=4):
    """Two prompts of different lengths (the shorter one left-padded), `group` rows each, groups contiguous."""
    prompts = encode_prompts(tok, ["Repeat a: ", "Repeat d: and a longer prompt"], prepend_bos=True)
    ids, mask = left_pad(prompts, tok.eos_token_id)
    return ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)


def _save_tiny(path, tok, config_cls, **kw):
    """A random-init 2-layer model of config_cls (4 query heads on 2 K/V heads) with `tok`, random biases."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    config = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **kw)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases start at zero: random ones show whether a path applies them
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2", "mistral"])
def family(request, tmp_path_factory, tiny_model_dir, tiny_rotary_dir):
    """(folder, the decoder its model gets): GPT-2 and Llama (scripts/make_tiny_model.py), Qwen2 (q/k/v biases),
    Mistral."""
    from transformers import MistralConfig, Qwen2Config
    name = request.param
    if name == "gpt2":
        return tiny_model_dir, decoders.GPT2Decoder
    if name == "llama":
        return tiny_rotary_dir, decoders.LlamaDecoder
    tok = load_tokenizer(tiny_model_dir)
    path = str(tmp_path_factory.mktemp(f"tiny-{name}"))
    if name == "qwen2":
        return _save_tiny(path, tok, Qwen2Config, use_sliding_window=False), decoders.LlamaDecoder
    return _save_tiny(path, tok, MistralConfig, sliding_window=None), decoders.LlamaDecoder


def _decoder_used(monkeypatch):
    """Records the class of every decoder generate() builds."""
    used, make = [], decoders.decoder_for

    def recording(*args, **kwargs):
        decoder = make(*args, **kwargs)
        used.append(type(decoder))
        return decoder
    monkeypatch.setattr(decoders, "decoder_for", recording)
    return used


@pytest.mark.parametrize("order", ["groups", "interleaved"])
def test_fast_decoders_match_the_models_own_forward(family, monkeypatch, order):
    path, expected = family
    tok, model = load_tokenizer(path), load_policy(path, "cpu")
    ids, mask = _group_batch(tok)
    if order == "interleaved":  # rows of a group not contiguous: the decoder keeps one prompt copy per row
        ids, mask = ids[[0, 4, 1, 5, 2, 6, 3, 7]], mask[[0, 4, 1, 5, 2, 6, 3, 7]]
    kw = dict(end_ids=tok.eos_token_id, max_new_tokens=16, temperature=0.0)
    used = _decoder_used(monkeypatch)
    fast = generate(model, ids, mask, **kw)
    assert used == [expected]
    monkeypatch.setattr(expected, "fits", staticmethod(lambda m: False))
    plain = generate(model, ids, mask, **kw)
    assert used[-1] is decoders.HFDecoder
    assert torch.equal(fast.ids, plain.ids)
    assert (fast.logp - plain.logp).abs().max().item() <= 1e-5


def test_sampled_logprobs_equal_the_training_forward(family):
    """Left-padded and unpadded prompts, groups of 4 sharing prompt K/V, 4 query heads on 2 K/V heads (rotary
    families): the logprobs recorded while sampling are the training forward's."""
    path, _ = family
    tok, model = load_tokenizer(path), load_policy(path, "cpu")
    ids, mask = _group_batch(tok)
    assert (mask[0] == 0).any() and (mask[-1] == 1).all()
    torch.manual_seed(0)
    out = generate(model, ids, mask, end_ids=tok.eos_token_id, max_new_tokens=24, temperature=0.8)
    scored = completion_logprobs(model, torch.cat([ids, out.ids], 1),
                                 torch.cat([mask, out.mask], 1), out.ids.shape[1], 0.8, 4096)
    assert ((scored - out.logp).abs() * out.mask).max().item() <= 1e-5


def test_greedy_decoding_equals_hf_generate(family):
    path, _ = family
    tok, model = load_tokenizer(path), load_policy(path, "cpu")
    ids, mask = _group_batch(tok, group=2)
    ours = generate(model, ids, mask, end_ids=tok.eos_token_id, max_new_tokens=20,
                    temperature=0.0).ids
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20,
                                pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    assert torch.equal(ours, theirs[:, ids.shape[1]:])


@pytest.mark.slow
@pytest.mark.parametrize("arch, backend", [pytest.param("gpt2", "inductor", marks=INDUCTOR_BUILDS),
                                           ("llama", "aot_eager")])
def test_compiled_decode_step_equals_the_eager_one(arch, backend, tiny_model_dir, tiny_rotary_dir, monkeypatch):
    """Batches of two prompt widths, the first one again last: the compiled step recompiles for the second
    width and reuses the first's K/V buffers for the third batch; always the eager step's tokens and logprobs.
    The compiled step samples too: inductor draws its random numbers from the eager generator here
    (fallback_random), so that the same seed draws the same tokens. Llama's step as traced (the
    `traced` fixture's backend): inductor runs it in test_compiled_decoding_trains_on_policy."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    path = tiny_model_dir if arch == "gpt2" else tiny_rotary_dir
    tok, model = load_tokenizer(path), load_policy(path, "cpu")
    first = _group_batch(tok)
    second = left_pad(encode_prompts(tok, ["Repeat b: ", "Repeat e: and some", "Repeat c: and a much longer one",
                                           "P: "], True), tok.eos_token_id)
    second = second[0].repeat_interleave(2, 0), second[1].repeat_interleave(2, 0)
    assert second[0].shape[1] != first[0].shape[1]
    for ids, mask in (first, second, first):
        runs = []
        for compile in (False, True):
            torch.manual_seed(0)
            with torch._inductor.config.patch(fallback_random=True):
                runs.append(generate(model, ids, mask, end_ids=tok.eos_token_id, max_new_tokens=20, compile=compile))
        eager, compiled = runs
        assert torch.equal(eager.ids, compiled.ids) and torch.equal(eager.mask, compiled.mask)
        assert (eager.logp - compiled.logp).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_the_compiled_step_ends_rows_at_any_end_as_the_eager_one_does(tiny_chat_model_dir, traced):
    """An instruct model's ends (EOS, the end of turn, and here more that the model emits): compiled,
    the rows stop where the eager loop stops them, banned alike before min_new_tokens."""
    tok, model = load_tokenizer(tiny_chat_model_dir), load_policy(tiny_chat_model_dir, "cpu")
    ids, mask = left_pad(encode_prompts(tok, [[{"role": "user", "content": c}] for c in ("a", "bb cc")], False),
                         tok.eos_token_id)
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    ends = (*end_ids(model, tok), *range(3, 60))   # a random-init model's near-uniform draws do end
    runs = []
    for compile in (False, True):
        torch.manual_seed(1)
        with torch._inductor.config.patch(fallback_random=True):
            runs.append(generate(model, ids, mask, end_ids=ends, max_new_tokens=12, min_new_tokens=2,
                                 compile=compile, group_size=4))
    eager, compiled = runs
    assert torch.equal(eager.ids, compiled.ids) and torch.equal(eager.mask, compiled.mask)
    lengths = eager.mask.sum(1)
    # ended, never before 2 tokens
    assert (lengths < eager.ids.shape[1]).any() and (lengths > 2).all()
    assert (eager.logp - compiled.logp).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_the_compiled_step_samples_inside_itself_what_the_eager_loop_samples(tiny_model_dir, traced):
    """Compiled, the decode step draws the next token itself (sampling, EOS bookkeeping, the records): the
    Python of sample_token's draw runs once per generate() (the first token, from the prefill), not once a token;
    top-k, top-p, min_new_tokens and the sampler's logprobs give what the eager loop gives."""
    import sys
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = _group_batch(tok)
    settings = dict(end_ids=tok.eos_token_id, max_new_tokens=16, top_k=20, top_p=0.9, temperature=0.8,
                    min_new_tokens=3, with_sampler=True, group_size=4)
    runs, calls = [], []
    for compile in (False, True, True):   # the second compiled call replays what the first compiled
        torch.manual_seed(0)
        count = [0]

        def profile(frame, event, _):
            if event == "call" and frame.f_code is decoders._sample.__code__:
                count[0] += 1
        sys.setprofile(profile)
        try:
            with torch._inductor.config.patch(fallback_random=True):
                runs.append(generate(model, ids, mask, compile=compile, **settings))
        finally:
            sys.setprofile(None)
        calls.append(count[0])
    eager = runs[0]
    steps = eager.ids.shape[1]
    assert steps > 3 and calls[0] == steps and calls[2] == 1, (steps, calls)
    for compiled in runs[1:]:
        assert torch.equal(eager.ids, compiled.ids) and torch.equal(eager.mask, compiled.mask)
        assert (eager.logp - compiled.logp).abs().max() <= 1e-5
        assert (eager.sampler_logp - compiled.sampler_logp).abs().max() <= 1e-5
    assert (eager.ids[:, :3] != tok.eos_token_id).all()


def _gpu_checks(monkeypatch):
    """generate()'s checks of which rows finished spaced as on a GPU."""
    spacing = decoders.check_spacing
    monkeypatch.setattr(decoders, "check_spacing", lambda device: spacing(torch.device("cuda")))


def test_checking_for_the_end_as_a_gpu_does_returns_what_checking_every_step_does(tiny_model_dir,
                                                                                  monkeypatch):
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = left_pad(encode_prompts(tok, ["Repeat a: ", "Repeat e: "], True), tok.eos_token_id)
    free = generate(model, ids, mask, end_ids=-1, max_new_tokens=40, temperature=0.0).ids
    ends = []
    for eos in set(free.flatten().tolist()):  # tokens the rows emit greedily: each row ends somewhere
        for min_new_tokens in (0, 3, 11):
            runs = []
            for gpu in (False, True):
                if gpu:
                    _gpu_checks(monkeypatch)
                runs.append(generate(model, ids, mask, end_ids=eos, max_new_tokens=40, temperature=0.0,
                                     min_new_tokens=min_new_tokens))
            monkeypatch.undo()
            a, b = runs
            assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
            assert torch.equal(a.logp, b.logp)
            ends.append(a.ids.shape[1])
    assert any(n % decoders.DONE_CHECK_EVERY for n in ends if n < 40), ends  # some ended between two checks


def _check_columns(device, min_new_tokens, lengths, running=None):
    """The columns drawn at which Checks reads the flags, for rows that end after `lengths` columns
    (a longer one never ends), and the columns drawn when the loop stops (generate()'s loop, 144
    columns at most; the rows it runs: all, or `running`)."""
    checks, seen = decoders.Checks(device, min_new_tokens), []
    for columns in range(1, 144):
        if checks.due(columns):
            seen.append(columns)
            done = [n <= columns for n in lengths]
            if all(done):
                return seen, columns
            checks.after(columns, done, running or len(lengths))
    return seen, 144


@pytest.mark.parametrize("seed", range(40))
def test_checks_are_spaced_within_their_bounds_and_the_steps_past_the_end_stay_bounded(seed):
    """On a GPU: no check before a row can end (min_new_tokens), none closer than DONE_CHECK_EVERY
    columns, none further than CHECK_SPREAD x the columns drawn, so that the columns drawn past the
    last end are fewer than max(DONE_CHECK_EVERY, CHECK_SPREAD x the longest completion); on a CPU
    every column from the first a row can end at, so the loop stops at the last end."""
    gen = torch.Generator().manual_seed(seed)
    min_new_tokens = int(torch.randint(0, 20, (), generator=gen))
    longest = int(torch.randint(min_new_tokens + 1, 140, (), generator=gen))
    lengths = torch.randint(min_new_tokens + 1, longest + 1, (64,), generator=gen).tolist()
    lengths[0] = longest
    every, spread = decoders.DONE_CHECK_EVERY, decoders.CHECK_SPREAD
    seen, stop = _check_columns(torch.device("cuda"), min_new_tokens, lengths)
    assert seen[0] == max(every, min_new_tokens + 1)
    for a, b in zip(seen, seen[1:]):
        assert every <= b - a <= max(every, a * spread), seen
    assert stop - longest < max(every, longest * spread), (seen, longest)
    seen, stop = _check_columns(torch.device("cpu"), min_new_tokens, lengths)
    assert seen == list(range(min_new_tokens + 1, stop + 1)) and stop == longest


def test_checks_follow_the_pace_at_which_rows_end():
    """Rows ending fast bring the next check forward to the bound (the stop or the compaction is
    near); rows that do not end space them as far as the bound allows."""
    cuda = torch.device("cuda")
    assert _check_columns(cuda, 0, [200] * 64) == ([8, 16, 24, 36, 54, 81, 121], 144)
    # the chess job's lengths: 9 to 28; the stop at the first check past 28, as every 8 columns
    lengths = [9, 9, 12, 13, 15, 17, 18, 19] + [20] * 8 + [21] * 8 + [22] * 24 + [24] * 8 + [28] * 8
    assert _check_columns(cuda, 0, lengths) == ([8, 16, 24, 32], 32)


def test_a_generate_reads_the_device_once_per_check_and_twice_besides(tiny_model_dir, monkeypatch):
    """Counted as on a GPU: the distinct prompts (one read of the prompts), one read of the finished
    rows per check (it serves the stop and the compaction), the last column (one read); 144 columns
    with no row ending: 7 checks. Besides, transformers' prefill reads whether the prompts' mask
    can be skipped (one or two scalars, at the line that calls the model)."""
    from grpo.syncs import SyncCounter
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = _group_batch(tok)
    _gpu_checks(monkeypatch)
    with SyncCounter(device=(ids, mask)) as syncs:
        out = generate(model, ids, mask, end_ids=-1, max_new_tokens=144)
    assert out.ids.shape[1] == 144
    ours = [what for what, where in syncs.events if "scalar" != what]
    prefill = [where for what, where in syncs.events if "scalar" == what]
    assert ours == ["list"] * (1 + 7 + 1), syncs.events
    assert len(prefill) <= 2 and len(set(prefill)) == 1, syncs.events


def test_compaction_from_the_flags_read_on_the_host_chooses_the_rows_the_device_index_did():
    """Draws.compact's rows, and the decoder's own rows it selects, against the old device formula
    (nonzero of the live flags, finished ones up to a power of two compiled, searchsorted among the
    rows run), over two compactions of random flags."""
    class Selected:   # the decoder's side of compact: which of its rows it is asked to keep
        def select(self, rows, prefill, step):
            self.rows = rows
            return self

    gen = torch.Generator().manual_seed(0)
    for compiled in (False, True):
        for _ in range(50):
            draws = decoders.Draws(None, 64, 8, (0,), (1.0, 0, 1.0), False, torch.device("cpu"),
                                   keep=False)
            rows, decoder = None, Selected()
            for share in (0.55, 0.8):
                draws.done |= torch.rand(64, generator=gen) < share
                done = draws.done
                live = (~done).nonzero().squeeze(1)
                running = 64 if rows is None else rows.shape[0]
                size = 1 << max(0, (live.shape[0] - 1).bit_length()) if compiled else live.shape[0]
                out = draws.compact(decoder, None, 3, compiled, done.tolist())
                if size > running // 2 or not live.shape[0]:
                    assert draws.rows is rows
                    continue
                if size > live.shape[0]:
                    live = torch.cat([live, done.nonzero().squeeze(1)[:size - live.shape[0]]]).sort().values
                own = live if rows is None else torch.searchsorted(rows, live)
                assert out is decoder and decoder.rows == own.tolist()
                assert torch.equal(draws.rows, live) and draws.kept_rows == live.tolist()
                rows = draws.rows


def test_fast_paths_refuse_what_they_do_not_compute():
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    assert decoders.LlamaDecoder.fits(LlamaForCausalLM(LlamaConfig(**small)))
    assert decoders.LlamaDecoder.fits(Qwen2ForCausalLM(Qwen2Config(**small)))
    # sliding-window attention, and rotary frequencies that change with the sequence length
    assert not decoders.LlamaDecoder.fits(Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True,
                                                                       sliding_window=8, max_window_layers=0)))
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert not decoders.LlamaDecoder.fits(LlamaForCausalLM(LlamaConfig(**small, rope_parameters=dynamic)))
    gpt2 = dict(vocab_size=32, n_embd=16, n_layer=1, n_head=2)
    assert decoders.GPT2Decoder.fits(GPT2LMHeadModel(GPT2Config(**gpt2)))
    assert not decoders.GPT2Decoder.fits(GPT2LMHeadModel(GPT2Config(**gpt2, scale_attn_by_inverse_layer_idx=True)))
    assert not decoders.LlamaDecoder.fits(GPT2LMHeadModel(GPT2Config(**gpt2)))


def test_min_new_tokens_masks_eos_but_keeps_its_probability(tiny_model_dir):
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = _group_batch(tok)
    # pretend the greedy first token is EOS: with min_new_tokens it cannot be drawn
    first = int(generate(model, ids, mask, end_ids=-1, max_new_tokens=1, temperature=0.0).ids[0, 0])
    out = generate(model, ids, mask, end_ids=first, max_new_tokens=6, min_new_tokens=3,
                   temperature=0.0)
    comp = out.ids
    assert (comp[:, :3] != first).all() and comp.shape[1] >= 3
    scored = completion_logprobs(model, torch.cat([ids, comp], 1), torch.cat([mask, out.mask], 1),
                                 comp.shape[1], 1.0, 4096)
    assert ((scored - out.logp).abs() * out.mask).max().item() <= 1e-5


def _sampled_inputs(tok, model):
    """completion_logprobs' arguments for 12 sampled tokens per row of a group batch, and the mask."""
    ids, mask = _group_batch(tok)
    torch.manual_seed(0)
    out = generate(model, ids, mask, end_ids=tok.eos_token_id, max_new_tokens=12)
    return (torch.cat([ids, out.ids], 1), torch.cat([mask, out.mask], 1), out.ids.shape[1], 1.0,
            4096), out.mask


def test_shared_prompt_forward_equals_the_plain_one_with_gradients(any_model_dir):
    tok, model = load_tokenizer(any_model_dir), load_policy(any_model_dir, "cpu")
    inputs, cmask = _sampled_inputs(tok, model)
    results = []
    for share in (False, True):
        model.zero_grad()
        logp = completion_logprobs(model, *inputs, share_prompts=share)
        (logp * cmask).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    assert ((results[0][0] - results[1][0]).abs() * cmask).max().item() <= 1e-5
    # per tensor, relative to its norm: float32 summation order differs between the two paths (and between
    # CPUs: AMX kernels), which an element-wise rtol trips on entries that cancel to near zero; measured
    # ~4e-7 here, where a wrong attention pattern gives errors of order 1e-1
    for a, b in zip(results[0][1], results[1][1]):
        assert (a - b).norm() <= 1e-5 * a.norm()


def test_gradient_checkpointing_recomputes_each_layer_with_the_same_gradients(tiny_model_dir,
                                                                             monkeypatch):
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    inputs, cmask = _sampled_inputs(tok, model)
    with torch.no_grad():   # the first forward probes whether the model packs (grpo/packing.py)
        completion_logprobs(model, *inputs)
    calls, mlp = [], model.transformer.h[0].mlp   # a recomputed layer runs its MLP in backward
    caches, init = [], DynamicCache.__init__   # a training forward needs no KV cache
    monkeypatch.setattr(DynamicCache, "__init__",
                        lambda self, *a, **k: caches.append(1) or init(self, *a, **k))
    mlp.forward = lambda *a, forward=mlp.forward: calls.append(1) or forward(*a)   # (no hooks then)
    grads, counts = [], []
    # the packed forward, then checkpointed: packed, and padded (its prompts then not shared)
    for on, pack in ((False, True), (True, True), (True, False)):
        if on and pack:   # switched on once, before the first checkpointed forward
            checkpoint_layers(model)
        model.zero_grad()
        calls.clear()
        (completion_logprobs(model, *inputs, pack=pack) * cmask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        counts.append(len(calls))
    assert counts[0] == 1 and counts[1] > 1 and counts[2] > 1
    assert caches == []   # (so Hugging Face has none to switch off under checkpointing, and say so)
    assert not any(m.training for m in model.modules())  # switched back: dropout never ran
    for checkpointed in grads[1:]:
        for a, b in zip(grads[0], checkpointed):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    # without gradients (sampling, the reference's pass) nothing checkpoints: the KV cache is kept
    with torch.no_grad():
        assert model(inputs[0][:1], use_cache=True).past_key_values is not None
    generate(model, inputs[0][:2], inputs[1][:2], end_ids=tok.eos_token_id, max_new_tokens=3)
    assert not any(m.training for m in model.modules())


def test_inverse_cdf_sampling_never_draws_a_zero_probability_token():
    torch.manual_seed(0)
    logits = torch.randn(2000, 7)
    logits[:, [0, 3, 6]] = float("-inf")  # first, middle and last index impossible
    tokens, _ = sample_token(logits, 1.0, 0, 1.0)
    assert not set(tokens.tolist()) & {0, 3, 6}
    banned, _ = sample_token(torch.zeros(500, 4), 1.0, 0, 1.0, banned=2)
    assert 2 not in banned.tolist() and set(banned.tolist()) == {0, 1, 3}


@pytest.mark.parametrize("compile", EAGER_AND_COMPILED)
def test_a_decoder_is_freed_without_the_cycle_collector(tiny_model_dir, compile):
    """No reference cycle: a step's K/V buffers go when generate() returns, not at the next full collection
    (a cycle let a run's RSS climb by a step's buffers at a time between collections)."""
    import gc
    import weakref
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = _group_batch(tok)
    made = []
    make = decoders.decoder_for

    def recording(*args, **kwargs):
        decoder = make(*args, **kwargs)
        made.append(weakref.ref(decoder))
        return decoder
    gc.collect()
    gc.disable()
    try:
        decoders.decoder_for = recording
        generate(model, ids, mask, end_ids=tok.eos_token_id, max_new_tokens=8, compile=compile)
        assert len(made) == 1 and made[0]() is None
    finally:
        decoders.decoder_for = make
        gc.enable()


def test_the_decoder_a_model_gets_is_named(family):
    path, expected = family
    name = decoders.decoder_name(load_policy(path, "cpu"))
    assert name == {decoders.GPT2Decoder: "GPT2Decoder (fast GPT-2 path)",
                    decoders.LlamaDecoder: "LlamaDecoder (fast Llama-family path)"}[expected]
    from transformers import GPT2Config, GPT2LMHeadModel
    other = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0,
                                       scale_attn_by_inverse_layer_idx=True))
    assert decoders.decoder_name(other).startswith("HFDecoder (generic HF forward")


@pytest.mark.slow  # two profiled generate() calls of a 12-layer model: ~50 s
def test_an_eager_gpt2_decode_token_runs_at_most_260_top_level_ops():
    """The launch proxy the GPU issue set (672 ops a token before, 254 now): each op is host time, and each
    that computes a kernel launch on a GPU."""
    from bench.decode_ops import build_model, per_token
    ops, _ = per_token(build_model("gpt2", 12, torch.device("cpu")), torch.device("cpu"))
    assert ops <= 260, ops



def _truncated(logits, top_k, top_p, banned):
    """The distribution sample_token draws from, by its definition: the banned token out, then the top_k most
    likely, then the most likely whose mass before them is below top_p; renormalised."""
    p = [math.exp(x) if i != banned else 0.0 for i, x in enumerate(logits.tolist())]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order[:top_k or len(p)])
    total, above = sum(p[i] for i in keep), 0.0
    for i in [i for i in order if i in keep]:
        if above / total >= top_p:
            keep.discard(i)
        else:
            above += p[i]
    q = torch.tensor([p[i] if i in keep else 0.0 for i in range(len(p))], dtype=torch.float64)
    return q / q.sum()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (6, 0.9)])
def test_the_exponential_race_draws_the_distribution_multinomial_draws(monkeypatch, top_k, top_p):
    """Through sample_token (a banned token, top-k and top-p applied first), over 12 tokens: the race's and
    torch.multinomial's counts both fit the truncated distribution (chi-square under its 0.1% critical
    value for 11 degrees of freedom, 31.3), and neither draws a token outside it."""
    torch.manual_seed(0)
    logits, rows = torch.randn(12) * 1.5, 200_000
    target = _truncated(logits, top_k, top_p, banned=3)
    for sampler in (decoders.race_index, lambda p, *_: torch.multinomial(p, 1).squeeze(-1)):
        monkeypatch.setattr(decoders, "sample_index", sampler)
        torch.manual_seed(1)
        token, _ = sample_token(logits.expand(rows, 12), 1.0, top_k, top_p, banned=3)
        counts = torch.bincount(token, minlength=12).double()
        assert (counts[target == 0] == 0).all()
        expected = target[target > 0] * rows
        assert float(((counts[target > 0] - expected) ** 2 / expected).sum()) < 31.3


@pytest.mark.slow   # 400 million float64 clocks: 18 s on one quiet thread, minutes on a busy one
def test_the_exponential_race_gives_a_long_tail_its_mass():
    """One likely token and 20,000 rare ones (each 2e-5 of the head's probability, 0.29 of the mass
    together): the tail is drawn at its rate (within 4 standard errors over 20,000 draws)."""
    torch.manual_seed(0)
    probs = torch.full((20_001,), 2e-5)
    probs[0] = 1.0
    tail = float(probs[1:].sum() / probs.sum())
    drawn = torch.cat([decoders.race_index(probs.expand(500, -1)) for _ in range(40)])
    rate, se = float((drawn > 0).double().mean()), math.sqrt(tail * (1 - tail) / drawn.numel())
    assert abs(rate - tail) < 4 * se, (rate, tail)


@pytest.mark.parametrize("compile", EAGER_AND_COMPILED)
def test_a_padded_decode_head_samples_what_the_plain_one_does(tiny_model_dir, traced, tmp_path, monkeypatch, compile):
    """The decode step's head padded to 64 rows (a GPU's default) on the CPU, a vocabulary of 300: the same
    greedy tokens and logprobs within float rounding; never a padding row's token."""
    from helpers import small_vocab_model
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(small_vocab_model(tiny_model_dir, tmp_path / "m300"), "cpu")
    ids, mask = _group_batch(tok)
    ids = ids % 300   # the model's vocabulary
    runs = []
    for multiple in (1, 64):
        monkeypatch.setattr(decoders, "head_multiple", lambda device: multiple)
        runs.append(generate(model, ids, mask, end_ids=-1, max_new_tokens=12, temperature=0.0, compile=compile))
    plain, padded = runs
    assert torch.equal(plain.ids, padded.ids) and int(padded.ids.max()) < 300
    assert (plain.logp - padded.logp).abs().max().item() <= 1e-5


@pytest.mark.parametrize("compile", EAGER_AND_COMPILED)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_copies_of_the_weights_decode_what_autocast_does(arch, traced, tiny_model_dir, tiny_rotary_dir,
                                                              monkeypatch, compile):
    """Under bf16 autocast the decode step reads bf16 copies of the matmul weights (a GPU's default, forced
    here on the CPU): the same bits as autocast casting the fp32 weights itself, also after an update has
    changed the weights (compiled, the copies are kept and refreshed in place)."""
    path = tiny_model_dir if arch == "gpt2" else tiny_rotary_dir
    tok, model = load_tokenizer(path), load_policy(path, "cpu")
    ids, mask = _group_batch(tok)
    read, make = [], decoders.decoder_for

    def recording(*args, **kwargs):   # the dtypes the step's projections and head read
        decoder = make(*args, **kwargs)
        read.append({t.dtype for mats in decoder.mats for pair in mats for t in pair if t is not None}
                    | {t.dtype for t in decoder.head if t is not None})
        return decoder
    monkeypatch.setattr(decoders, "decoder_for", recording)
    for _ in range(2):
        runs = []
        for copies in (False, True):
            monkeypatch.setattr(decoders, "decode_copies", lambda device: copies)
            torch.manual_seed(0)
            runs.append(generate(model, ids, mask, end_ids=tok.eos_token_id, max_new_tokens=12, compile=compile,
                                 autocast=torch.autocast("cpu", dtype=torch.bfloat16)))
        a, b = runs
        assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
        assert torch.equal(a.logp, b.logp)
        assert read[-2:] == [{torch.float32}, {torch.bfloat16}]
        with torch.no_grad():   # an update
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)


@pytest.mark.slow   # compiles the decode step
def test_past_the_compile_limit_decoding_says_so_and_goes_on_eagerly(tiny_model_dir, traced, monkeypatch, capsys):
    """A process that compiles the decode step for more models and shapes than RECOMPILE_LIMIT: a note,
    then the eager step's tokens (a fullgraph compile past torch's limit raised before)."""
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    torch._dynamo.reset()
    monkeypatch.setattr(decoders, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(decoders, "_LIMIT_HIT", [])
    ids, mask = _group_batch(tok)
    with torch._dynamo.config.patch(recompile_limit=1):   # (monkeypatch would delete it from torch's config)
        for rows in (8, 4):   # the second shape would be the second compilation
            eager, compiled = [
                generate(model, ids[:rows], mask[:rows], end_ids=tok.eos_token_id, max_new_tokens=6,
                         temperature=0.0, compile=compile) for compile in (False, True)]
            assert torch.equal(eager.ids, compiled.ids)
            assert (eager.logp - compiled.logp).abs().max().item() <= 1e-5
    assert "limit of 1 compilations; decoding goes on eagerly" in capsys.readouterr().err
    assert decoders._LIMIT_HIT
    torch._dynamo.reset()


@pytest.mark.parametrize("compile", EAGER_AND_COMPILED)
@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_rows_that_finish_leave_the_decoder_and_no_row_draws_otherwise(any_model_dir, traced, monkeypatch, compile,
                                                                       engine):
    """Once half the rows it runs have ended, the decoder carries on with the live ones (compiled: a power of
    two of rows); each row's random numbers are drawn for the whole batch, so every completion is what the
    decoder that runs every row to the end samples."""
    tok, model = load_tokenizer(any_model_dir), load_policy(any_model_dir, "cpu")
    if engine == "hf":
        monkeypatch.setattr(decoders, "decoder_class", lambda model: decoders.HFDecoder)
    ids, mask = _group_batch(tok, group=8)
    torch.manual_seed(0)   # the ends: the 16 tokens the rows sample most, so that they end at many lengths
    drawn = torch.bincount(generate(model, ids, mask, end_ids=-1, max_new_tokens=40).ids.flatten())
    settings = dict(end_ids=tuple(drawn.argsort(descending=True)[:16].tolist()), max_new_tokens=40,
                    temperature=1.0, top_k=100, with_sampler=True, compile=compile)
    kept, real = [], decoders.Draws.compact

    def compact(self, decoder, *args):
        out = real(self, decoder, *args)
        kept.append(None if self.rows is None else self.rows.shape[0])
        return out
    runs = []
    for leave in (True, False):
        monkeypatch.setattr(decoders.Draws, "compact", compact if leave else lambda self, decoder, *a: decoder)
        # the logits differ in their last bits, so a draw within ~1e-7 of a token's boundary could flip
        # (seed 5 has one, compiled Llama's row 0 at column 17: 6e-8 from it); seed 1 has none
        torch.manual_seed(1)
        with torch._inductor.config.patch(fallback_random=True):
            runs.append(generate(model, ids, mask, **settings))
    left, stayed = runs
    cmask = left.mask
    lengths = cmask.sum(1)
    assert lengths.min() < lengths.max() / 2, lengths   # rows of very different lengths
    assert min(k for k in kept if k) < ids.shape[0] / 2, kept   # the decoder ran fewer rows
    if compile and engine == "fast":   # the HF decoder runs eagerly whatever compile says
        assert all(k & (k - 1) == 0 for k in kept if k)
    assert torch.equal(left.ids, stayed.ids) and torch.equal(cmask, stayed.mask)
    torch.testing.assert_close(left.logp * cmask, stayed.logp * cmask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(left.sampler_logp * cmask, stayed.sampler_logp * cmask, atol=1e-5,
                               rtol=1e-5)   # top-k's
