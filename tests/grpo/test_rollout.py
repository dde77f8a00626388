import dataclasses

import pytest
import torch

import train_lean
from grpo.rollout import flat_groups
from grpo.decoders import completion_mask, generate, sample_token
from grpo.model import (completion_logprobs, declared_end_ids, end_ids, load_policy, load_tokenizer,
                        position_ids_from_mask, turn_end)
from grpo.rollout import (Rollout, Sampler, decode_completions, encode_prompts, left_pad, merge,
                          merge_rounds, missing_groups, truncated_rows)
from helpers import read_jsonl


def _padded(tok, prompt, completion_ids, pad):
    """One row holding prompt + completion, left-padded by `pad` tokens."""
    ids = encode_prompts(tok, [prompt], prepend_bos=False)[0] + completion_ids
    return torch.tensor([[tok.eos_token_id] * pad + ids]), torch.tensor([[0] * pad + [1] * len(ids)])


def test_completion_logprobs_do_not_depend_on_left_padding(any_model_dir):
    tok, model = load_tokenizer(any_model_dir), load_policy(any_model_dir, "cpu")
    completion = tok("aaab cc", add_special_tokens=False)["input_ids"]
    unpadded = completion_logprobs(model, *_padded(tok, "Repeat a: ", completion, 0), len(completion), 1.0, 4096)
    padded = completion_logprobs(model, *_padded(tok, "Repeat a: ", completion, 30), len(completion), 1.0, 4096)
    assert (unpadded - padded).abs().max().item() <= 1e-5


def test_gpt2_without_position_ids_scores_padded_rows_wrong(tiny_model_dir):
    """The control for the test above: absolute positions make left padding matter."""
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    completion = tok("aaab cc", add_special_tokens=False)["input_ids"]
    with torch.no_grad():  # no position_ids: the default counts pad columns as positions
        logp = [torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[0, -len(completion) - 1:-1], -1)
                for ids, mask in (_padded(tok, "Repeat a: ", completion, pad) for pad in (0, 30))]
    assert (logp[0] - logp[1]).abs().max().item() > 1e-3


def test_greedy_generation_does_not_depend_on_left_padding(any_model_dir):
    tok, model = load_tokenizer(any_model_dir), load_policy(any_model_dir, "cpu")
    short = encode_prompts(tok, ["Repeat b: "], prepend_bos=False)[0]
    long = encode_prompts(tok, ["Repeat c: and a much longer prompt that forces thirty pad tokens"], False)[0]
    ids, mask = left_pad([short, long, short], tok.eos_token_id)
    assert mask[0].sum() < mask[1].sum()
    alone_ids, alone_mask = left_pad([short], tok.eos_token_id)
    kw = dict(end_ids=-1, max_new_tokens=12, temperature=0.0)
    batch = generate(model, ids, mask, **kw)
    alone = generate(model, alone_ids, alone_mask, **kw)
    assert torch.equal(batch.ids[0], alone.ids[0])
    assert (batch.logp[0] - alone.logp[0]).abs().max().item() <= 1e-5


def test_sampling_logprobs_equal_training_logprobs(any_model_dir):
    """The behaviour logprobs kept from sampling are the policy's: the first update is on-policy."""
    tok, model = load_tokenizer(any_model_dir), load_policy(any_model_dir, "cpu")
    prompts = encode_prompts(tok, ["Repeat a: ", "Repeat d: and more"], prepend_bos=True)
    ids, mask = left_pad(prompts, tok.eos_token_id)
    torch.manual_seed(1)
    out = generate(model, ids, mask, end_ids=tok.eos_token_id, max_new_tokens=20, temperature=0.7,
                   top_k=50, top_p=0.9)
    logp = completion_logprobs(model, torch.cat([ids, out.ids], 1), torch.cat([mask, out.mask], 1),
                               out.ids.shape[1], 0.7, 4096)
    assert ((logp - out.logp).abs() * out.mask).max().item() <= 1e-5


def test_completion_mask_keeps_first_eos_and_hides_the_rest():
    eos = 0  # pad == EOS, as with GPT-2
    ids = torch.tensor([[5, 6, 0, 0, 0],    # EOS at 2: the EOS itself is an action and is kept
                        [0, 0, 0, 0, 0],    # EOS first
                        [5, 6, 7, 8, 9],    # never stops: every token counts
                        [5, 0, 7, 0, 9]])   # tokens after the first EOS are hidden even if not EOS
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    assert torch.equal(completion_mask(ids, eos), expected)
    # the trap: a mask from `token != pad` would drop the EOS the policy chose to emit
    assert not torch.equal((ids != eos).long(), expected)


def test_generation_stops_each_row_at_its_first_eos(tiny_model_dir):
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = left_pad(encode_prompts(tok, ["Repeat a: ", "Repeat e: "], False), tok.eos_token_id)
    free = generate(model, ids, mask, end_ids=-1, max_new_tokens=10, temperature=0.0).ids
    # pretend the token row 0 emits greedily at step 2 is EOS: row 0 must stop there
    eos = int(free[0, 2])
    out = generate(model, ids, mask, end_ids=eos, max_new_tokens=10, temperature=0.0)
    comp, cmask = out.ids, out.mask
    first0 = int((free[0] == eos).int().argmax())
    assert cmask[0].sum().item() == first0 + 1
    assert (comp[0, first0:] == eos).all()
    assert torch.equal(comp[0, :first0], free[0, :first0])
    if not (free[1] == eos).any():  # row 1 never emits it: it runs the full length
        assert comp.shape[1] == 10 and cmask[1].sum().item() == 10
    texts = decode_completions(tok, comp, cmask, eos)
    assert texts[0] == tok.decode(free[0, :first0].tolist())


def test_generation_ends_when_every_row_has_finished(tiny_model_dir):
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = left_pad(encode_prompts(tok, ["Repeat a: ", "Repeat a: "], False), tok.eos_token_id)
    free = generate(model, ids, mask, end_ids=-1, max_new_tokens=6, temperature=0.0).ids
    comp = generate(model, ids, mask, end_ids=int(free[0, 1]), max_new_tokens=50,
                    temperature=0.0).ids
    assert comp.shape[1] == int((free[0] == free[0, 1]).int().argmax()) + 1


def test_decoded_text_excludes_eos_and_everything_after(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    head, tail = tok("aaab", add_special_tokens=False)["input_ids"], tok("cc", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([head + [tok.eos_token_id] + tail])
    assert decode_completions(tok, ids, completion_mask(ids, tok.eos_token_id), tok.eos_token_id) == ["aaab"]


# ---- conversations: an instruct model's prompts, rendered by its chat template ---------------------

CHAT = [{"role": "system", "content": "Answer with one letter."}, {"role": "user", "content": "Repeat a"}]


def test_a_conversation_is_rendered_once_by_the_chat_template(tiny_chat_model_dir, tiny_model_dir):
    tok = load_tokenizer(tiny_chat_model_dir)
    short = [{"role": "user", "content": "b"}]
    ids = encode_prompts(tok, [CHAT, "Repeat a: ", short], prepend_bos=True)
    for row, conversation in ((ids[0], CHAT), (ids[2], short)):   # the template's ids, nothing added
        assert row == tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
    assert tok.decode(ids[0]) == ("<|im_start|>system\nAnswer with one letter.<|im_end|>\n"
                                  "<|im_start|>user\nRepeat a<|im_end|>\n<|im_start|>assistant\n")
    assert ids[1] == encode_prompts(tok, ["Repeat a: "], prepend_bos=True)[0]   # a str beside them: as alone
    with pytest.raises(ValueError, match=r"the task's prompts are conversations \(\[\{'role': 'system'.*\) and the "
                                         r"model's tokenizer has no chat template"):
        encode_prompts(load_tokenizer(tiny_model_dir), ["x", CHAT], prepend_bos=False)


def test_conversation_logprobs_equal_the_training_forwards_under_left_padding(tiny_chat_model_dir):
    """Sampled from rendered conversations of different lengths (so left-padded): the kept prompt ids are
    the template's, and the sampling logprobs are the training forward's."""
    tok, model = load_tokenizer(tiny_chat_model_dir), load_policy(tiny_chat_model_dir, "cpu")
    long = [*CHAT, {"role": "assistant", "content": "a"}, {"role": "user", "content": "Now repeat b, twice"}]
    torch.manual_seed(0)
    sampler = Sampler(model, tok, group_size=2, prepend_bos=False, generation_batch=4,
                      max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_new_tokens=0,
                      autocast=None, device="cpu")
    batch = sampler.sample([CHAT, long], seed=0, first_row=0)
    T = batch.completion_len
    for row, conversation in zip(range(4), [CHAT, CHAT, long, long]):
        prompt = batch.input_ids[row, :-T][batch.attention[row, :-T].bool()].tolist()
        assert prompt == encode_prompts(tok, [conversation], prepend_bos=False)[0]
    assert batch.attention[0, :-T].sum() < batch.attention[2, :-T].sum()   # row 0 is left-padded
    logp = completion_logprobs(model, batch.input_ids, batch.attention, T, 1.0, 4096)
    assert ((logp - batch.old_logp).abs() * batch.completion_mask).max().item() <= 1e-5
    assert batch.prompts == [CHAT, CHAT, long, long]   # the reward gets the conversation itself


def test_an_instruct_model_ends_at_its_end_of_turn_too(tiny_chat_model_dir, tiny_model_dir):
    chat, base = load_tokenizer(tiny_chat_model_dir), load_tokenizer(tiny_model_dir)
    im_end, text_end = chat.convert_tokens_to_ids("<|im_end|>"), chat.convert_tokens_to_ids("<|endoftext|>")
    policy = load_policy(tiny_chat_model_dir, "cpu")
    assert end_ids(policy, chat) == declared_end_ids(policy, chat) == (im_end, text_end)
    assert turn_end(chat) == im_end and turn_end(base) is None   # GPT-2's tokenizer: no template
    assert end_ids(load_policy(tiny_model_dir, "cpu"), base) == (base.eos_token_id,)
    policy.generation_config.eos_token_id, chat.eos_token = text_end, "<|endoftext|>"   # files that forget it
    assert declared_end_ids(policy, chat) == (text_end,) and end_ids(policy, chat) == (text_end, im_end)
    chat.chat_template = chat.chat_template.replace("<|im_end|>", "END")   # a turn closed by plain text
    assert turn_end(chat) is None


def test_completion_mask_keeps_the_first_of_several_ends():
    eos, turn = 0, 2   # pad == EOS, and an end of turn
    ids = torch.tensor([[5, 2, 0, 0],    # end of turn at 1, EOS-filled after: the end of turn is kept
                        [5, 0, 2, 0],    # EOS first
                        [5, 6, 7, 8]])   # never stops
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    assert torch.equal(completion_mask(ids, (eos, turn)), expected)
    assert truncated_rows(ids, expected, (eos, turn)).tolist() == [False, False, True]
    assert not torch.equal(completion_mask(ids, eos), expected)   # EOS alone would run row 0 on


def test_generation_stops_at_an_end_of_turn_as_at_eos(tiny_chat_model_dir):
    tok, model = load_tokenizer(tiny_chat_model_dir), load_policy(tiny_chat_model_dir, "cpu")
    ids, mask = left_pad(encode_prompts(tok, [CHAT, [CHAT[1]]], False), tok.eos_token_id)
    free = generate(model, ids, mask, end_ids=-1, max_new_tokens=10, temperature=0.0).ids
    # pretend the token row 0 emits greedily at step 2 is the end of turn: row 0 must stop there
    turn = int(free[0, 2])
    ends = (tok.eos_token_id, turn)
    out = generate(model, ids, mask, end_ids=ends, max_new_tokens=10, temperature=0.0)
    comp, cmask = out.ids, out.mask
    first = int((free[0] == turn).int().argmax())
    assert cmask[0].sum().item() == first + 1 and comp[0, first] == turn
    assert (comp[0, first + 1:] == tok.eos_token_id).all()   # filled with the pad (EOS), masked
    assert torch.equal(comp[0, :first], free[0, :first])
    assert decode_completions(tok, comp, cmask, ends)[0] == tok.decode(free[0, :first].tolist())
    assert not truncated_rows(comp, cmask, ends)[0]
    if not (free[1] == turn).any():  # row 1 never emits it: it runs the full length, truncated
        assert comp.shape[1] == 10 and cmask[1].sum().item() == 10 and truncated_rows(comp, cmask, ends)[1]
    # never before min_new_tokens: every end is banned until then
    comp = generate(model, ids, mask, end_ids=ends, max_new_tokens=10, temperature=0.0,
                    min_new_tokens=first + 2).ids
    assert not (comp[0, :first + 2] == turn).any() and not (comp[0, :first + 2] == tok.eos_token_id).any()


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    best = logits.argmax(-1)
    assert torch.equal(sample_token(logits, 1.0, 1, 1.0)[0], best)
    assert torch.equal(sample_token(logits, 1.0, 0, 1e-6)[0], best)
    greedy, logp = sample_token(logits, 0.0, 0, 1.0)
    assert torch.equal(greedy, best)
    assert torch.allclose(logp, torch.log_softmax(logits, -1).max(-1).values)


def test_top_p_samples_only_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    torch.manual_seed(0)
    tokens, _ = sample_token(logits, 1.0, 0, 0.7)  # nucleus {0, 1}: 0.5 < 0.7 <= 0.8
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = sample_token(logits, 1.0, 3, 1.0)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_prompts_can_start_with_bos(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    plain, with_bos = encode_prompts(tok, ["Repeat a: "], False)[0], encode_prompts(tok, ["Repeat a: "], True)[0]
    assert with_bos == [tok.eos_token_id] + plain


def test_position_ids_count_only_real_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_the_tempered_distribution(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(20000, 1)
    torch.manual_seed(0)
    tokens, _ = sample_token(logits, temperature, 0, 1.0)
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    assert torch.allclose(freq, torch.softmax(logits[0] / temperature, -1), atol=0.015)


def test_a_prompt_that_encodes_to_nothing_is_named():
    # a tokenizer whose normaliser strips whitespace: "   " is a non-empty prompt with no tokens
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    bare = Tokenizer(models.WordLevel({"<eos>": 0, "a": 1}, unk_token="<eos>"))
    bare.normalizer, bare.pre_tokenizer = normalizers.Strip(), pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=bare, eos_token="<eos>")
    assert encode_prompts(tok, ["a", "a a"], prepend_bos=False) == [[1], [1, 1]]
    with pytest.raises(ValueError, match=r"the prompt '   ' encodes to no tokens with the model's tokenizer"):
        encode_prompts(tok, ["a", "   "], prepend_bos=False)


def test_a_prompt_and_its_completion_may_fill_the_context_exactly(tiny_model_dir, tmp_path, clean_env):
    tok = load_tokenizer(tiny_model_dir)
    room = 512 - len(encode_prompts(tok, ["Repeat a: "], True)[0])   # the toy task's prompts are this long
    base = ["--model", tiny_model_dir, "--task", "toy", "--batch-size", "2", "--group-size", "2", "--steps", "1",
            "--eval-interval", "0", "--log-level", "warning"]
    assert len(encode_prompts(tok, ["Repeat b: "], True, room, 512)[0]) == 512 - room
    with pytest.raises(ValueError, match=f"plus --max-new-tokens {room + 1} needs 513 positions, more than the model's "
                                        f"512: lower --max-new-tokens to {room} or shorten the task's prompts"):
        encode_prompts(tok, ["Repeat b: "], True, room + 1, 512)
    # every completion as long as the limit allows: the last position is 511, the model's last
    train_lean.main([*base, "--max-new-tokens", str(room), "--min-new-tokens", str(room), "--out-dir",
                     str(tmp_path / "fits")])
    assert read_jsonl(tmp_path / "fits" / "metrics.jsonl")[0]["completion_len_mean"] == room
    with pytest.raises(SystemExit) as exit_:   # one more and it does not fit: said before the weights load
        train_lean.main([*base, "--max-new-tokens", str(room + 1), "--out-dir", str(tmp_path / "over")])
    assert exit_.value.code == 2


# ---- dynamic sampling: which groups of several rounds make the batch -------------------------------------

def test_merge_rounds_takes_the_groups_that_are_not_flat_in_draw_order():
    # group size 2; round 0: [equal, differ], round 1: [differ, equal, differ]
    rounds = [torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0.0, 2.0, 3.0, 3.0, 1.0, 0.0])]
    assert missing_groups(rounds[:1], 2, 2) == 1
    assert missing_groups(rounds, 2, 2) == 0
    rows, counts = merge_rounds(rounds, 2, 2)
    # concatenated rows: round 0 is rows 0-3, round 1 rows 4-9; kept: round 0 group 1, round 1 group 0
    assert rows.tolist() == [2, 3, 4, 5]
    assert counts == {"groups_drawn": 5, "groups_dropped": 3, "groups_uninformative": 0}
    rows, counts = merge_rounds(rounds, 2, 3)
    assert rows.tolist() == [2, 3, 4, 5, 8, 9]
    assert counts == {"groups_drawn": 5, "groups_dropped": 2, "groups_uninformative": 0}
    # whatever is picked, no picked group is flat when enough were drawn
    all_rewards = torch.cat(rounds)
    assert not flat_groups(all_rewards[rows], 2).any()


def test_merge_rounds_fills_with_the_earliest_flat_groups_when_rounds_run_out():
    rounds = [torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([2.0, 2.0, 5.0, 5.0])]
    assert missing_groups(rounds, 2, 3) == 2
    rows, counts = merge_rounds(rounds, 2, 3)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5]  # the group not flat, then flat ones by draw order
    assert counts == {"groups_drawn": 4, "groups_dropped": 1, "groups_uninformative": 2}
    with pytest.raises(ValueError, match="fewer than the batch"):
        merge_rounds(rounds, 2, 5)


def test_a_field_added_to_the_rollout_survives_dynamic_sampling():
    # a researcher's new per-row fields, one of each shape; merge() must carry them without knowing their names
    @dataclasses.dataclass
    class Mine(Rollout):
        tags: list = None                  # one per row
        bonus: torch.Tensor = None         # [B]
        per_token: torch.Tensor = None     # [B, T]
        per_position: torch.Tensor = None  # [B, prompt width + T]

    def round_of(first, width, T, rewards):   # 4 rows (2 groups of 2), every value tells its row apart
        B, rows = 4, torch.arange(first, first + 4)
        full = rows[:, None] * 100 + torch.arange(width + T)
        return Mine(prompts=[f"p{r}" for r in rows.tolist()], texts=[f"t{r}" for r in rows.tolist()],
                    input_ids=full, attention=torch.ones(B, width + T, dtype=torch.long),
                    completion_mask=torch.ones(B, T, dtype=torch.long), old_logp=full[:, width:].float(),
                    truncated=rows % 2 == 0, rewards=torch.tensor(rewards), tags=[f"tag{r}" for r in rows.tolist()],
                    bonus=rows.float(), per_token=full[:, width:] + 0.5, per_position=full * 2)

    a, b = round_of(0, 3, 2, [1.0, 1.0, 0.0, 1.0]), round_of(4, 2, 4, [0.0, 1.0, 1.0, 1.0])
    batch, counts = merge([a, b], group_size=2, groups=2, pad_id=-1)   # not flat: a's second group, b's first
    assert type(batch) is Mine and counts["groups_uninformative"] == 0
    assert batch.prompts == ["p2", "p3", "p4", "p5"] and batch.tags == ["tag2", "tag3", "tag4", "tag5"]
    assert batch.bonus.tolist() == [2.0, 3.0, 4.0, 5.0] and batch.truncated.tolist() == [True, False, True, False]
    assert batch.per_token.tolist() == [
        [203.5, 204.5, 0, 0], [303.5, 304.5, 0, 0], [402.5, 403.5, 404.5, 405.5], [502.5, 503.5, 504.5, 505.5]]
    # prompts re-padded on the left to width 3, completions on the right to 4: input_ids with pad_id, others with 0
    assert batch.input_ids.tolist()[0] == [200, 201, 202, 203, 204, -1, -1]
    assert batch.input_ids.tolist()[2] == [-1, 400, 401, 402, 403, 404, 405]
    assert batch.per_position.tolist()[0] == [400, 402, 404, 406, 408, 0, 0]
    assert batch.per_position.tolist()[3] == [0, 1000, 1002, 1004, 1006, 1008, 1010]
    assert batch.attention.tolist()[2] == [0, 1, 1, 1, 1, 1, 1] and batch.completion_mask.tolist()[0] == [1, 1, 0, 0]

    @dataclasses.dataclass
    class Odd(Rollout):
        features: torch.Tensor = None      # [B, 3]: no shape select_rows can pad without misaligning
    odd = [Odd(**{f.name: getattr(r, f.name) for f in dataclasses.fields(Rollout)}, features=torch.zeros(4, 3))
           for r in (a, b)]
    with pytest.raises(ValueError, match=r"Rollout.features is \[4, 3\]: select_rows carries"):
        merge(odd, group_size=2, groups=2, pad_id=-1)


def test_a_samplers_settings_cannot_change_after_it_is_built(tiny_model_dir):
    """generate()'s settings are made once from the sampler's: a setting changed afterwards would
    not reach them, so it raises; dataclasses.replace builds a sampler whose settings follow."""
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    sampler = Sampler(model, tok, group_size=2, prepend_bos=False, generation_batch=4,
                      max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0, min_new_tokens=0,
                      autocast=None, device="cpu")
    assert not sampler.truncates and sampler.settings["temperature"] == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        sampler.temperature = 0.5
    nucleus = dataclasses.replace(sampler, top_p=0.9)
    assert nucleus.truncates and nucleus.settings["top_p"] == 0.9 and nucleus.settings["with_sampler"]
