"""The decode step as a replayed graph: its stand-in catches what a capture would get wrong, and the
graphed decode samples what the eager one samples (grpo/graphs.py; on a GPU the real capture)."""
import pytest
import torch

import grpo.decoders as decoders
import grpo.graphs as graphs
from grpo.decoders import generate
from grpo.model import load_policy, load_tokenizer
from grpo.rollout import encode_prompts, left_pad


def _batch(tok, prompts, group=8):
    ids, mask = left_pad(encode_prompts(tok, prompts, True), tok.eos_token_id)
    return ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)


def _ends(model, ids, mask, n=16):
    """The n tokens the rows sample most: as ends, rows stop at many lengths (rows leave the
    decoder, buckets shrink)."""
    torch.manual_seed(0)
    drawn = generate(model, ids, mask, end_ids=-1, max_new_tokens=24).ids.flatten()
    return tuple(torch.bincount(drawn).argsort(descending=True)[:n].tolist())


def test_the_stand_in_refuses_a_step_that_waits_on_the_host():
    x = torch.arange(4.0)
    for step in (lambda: x.sum().item(), lambda: x[x > 1].add_(1), lambda: x.nonzero(),
                 lambda: x.tolist(), lambda: bool(x[0] > 0), lambda: torch.unique(x)):
        with pytest.raises(graphs.CaptureError, match="synchronises|reads a tensor on the host"):
            graphs.StandIn()(step)


def test_the_stand_in_refuses_what_a_replay_would_not_repeat():
    """A replay reads the addresses, shapes and Python values recorded at the capture."""
    buf, table, out = torch.zeros(4), torch.arange(12.0).view(3, 4), torch.zeros(4)
    made = [torch.ones(4), torch.ones(4)]   # outside the step, each call another
    calls = {"another tensor": lambda i: torch.add(made[i], 1, out=out),
             "a row by Python int": lambda i: out.copy_(table[i]),   # another offset each call
             "a Python scalar": lambda i: torch.add(buf, i, out=out),
             "a shape": lambda i: out[:i + 1].add_(1),
             "ops": lambda i: [out.add_(1) for _ in range(i + 1)]}
    for name, step in calls.items():
        stand_in = graphs.StandIn()
        stand_in(lambda: step(0))
        with pytest.raises(graphs.CaptureError, match="differs from the first|ran"):
            stand_in(lambda: step(1))
            pytest.fail(f"{name}: not refused")
    # the same buffers, a row chosen by an index tensor on the device, a constant: replayable
    column, stand_in = torch.zeros(1, dtype=torch.long), graphs.StandIn()
    for i in range(3):
        column.fill_(i)
        stand_in(lambda: out.copy_(table.index_select(0, column)[0] * float("inf") * 0 + buf + 2))
    assert stand_in.calls == 3


def test_the_eager_decode_step_is_not_replayable(tiny_model_dir):
    """What the stand-in is for: the eager step slices its tables by a Python int, which a replay
    would not follow."""
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")
    ids, mask = _batch(tok, ["Repeat a: ", "Repeat d: and a longer prompt"])
    stand_in, real = graphs.StandIn(), decoders.PreallocatedDecoder.advance

    def advance(self, draws, step, banned):   # the eager step through the stand-in
        stand_in(lambda: real(self, draws, step, banned))
    decoders.PreallocatedDecoder.advance = advance
    try:
        with pytest.raises(graphs.CaptureError, match="differs from the first"):
            generate(model, ids, mask, end_ids=-1, max_new_tokens=4)
    finally:
        decoders.PreallocatedDecoder.advance = real


@pytest.mark.parametrize("settings", [dict(), dict(top_k=50, top_p=0.9, min_new_tokens=3,
                                                   with_sampler=True, temperature=0.8)])
def test_the_graphed_decode_samples_what_the_eager_one_does(any_model_dir, settings):
    """Through the stand-in, batches of two prompt widths and the first again (its graphs replayed,
    none made): the eager decode's tokens and masks; logprobs to float round-off (the graphed
    step's attention reads every new column, the eager one's those written rounded up to 16, and
    its live rows are a power of two)."""
    tok, model = load_tokenizer(any_model_dir), load_policy(any_model_dir, "cpu")
    first = _batch(tok, ["Repeat a: ", "Repeat d: and a longer prompt"])
    second = _batch(tok, ["x", "Repeat e: and some", "P: a b c d e f g h i j k l m n o p q r"], 4)
    ends = _ends(model, *first)
    made = []
    for ids, mask in (first, second, first):
        runs = []
        for graph in (None, "check"):
            before = dict(graphs.COUNTS)
            torch.manual_seed(1)
            runs.append(generate(model, ids, mask, end_ids=ends, max_new_tokens=20, graph=graph,
                                 group_size=ids.shape[0] // len(set(map(tuple, ids.tolist()))),
                                 **settings))
        made.append(graphs.COUNTS["decode_graphs"] - before["decode_graphs"])
        eager, graphed = runs
        lengths = eager.mask.sum(1)
        assert lengths.min() < lengths.max() / 2   # rows left the decoder
        assert torch.equal(eager.ids, graphed.ids) and torch.equal(eager.mask, graphed.mask)
        torch.testing.assert_close(eager.logp * eager.mask, graphed.logp * eager.mask,
                                   atol=2e-6, rtol=0)
        if settings:
            torch.testing.assert_close(eager.sampler_logp * eager.mask,
                                       graphed.sampler_logp * eager.mask, atol=2e-6, rtol=0)
    assert made[0] > 1 and made[1] > 0 and made[2] == 0, made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU")
def test_the_captured_decode_samples_what_the_eager_one_does(tiny_model_dir):
    """On a GPU: captured and replayed, the eager decode's tokens (the exponential race's clocks
    drawn by the graph from the same generator state)."""
    tok, model = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cuda")
    ids, mask = (t.cuda() for t in _batch(tok, ["Repeat a: ", "Repeat d: and a longer prompt"]))
    ends = _ends(model, ids, mask)
    for _ in range(2):   # recorded, then replayed from the start
        runs = []
        for graph in (None, "capture"):
            torch.manual_seed(1)
            runs.append(generate(model, ids, mask, end_ids=ends, max_new_tokens=20, graph=graph))
        eager, graphed = runs
        assert torch.equal(eager.mask, graphed.mask) and torch.equal(eager.ids, graphed.ids)
        torch.testing.assert_close(eager.logp * eager.mask, graphed.logp * eager.mask,
                                   atol=1e-5, rtol=0)
