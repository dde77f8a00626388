"""grpo/syncs.py: the counter counts each kind of synchronising op on a device tensor once, and
nothing else; it follows which tensors live on the device; and a default toy step stays within its
bound of them (bench/syncs.py's count)."""
import numpy as np
import pytest
import torch

from grpo import packing
from grpo.model import completion_logprobs, load_policy
from grpo.syncs import SyncCounter, kind

aten = torch.ops.aten
T = torch.arange(6.0)   # device tensors: the counters below are told so
MASK = T > 2
REPEATS = torch.tensor([1, 2, 0, 1, 1, 1])

# each: what it runs, and the kind it is counted as (once)
SYNCS = {
    "item": (lambda: T.sum().item(), "scalar"),
    "bool": (lambda: bool(T.sum()), "scalar"),
    "int": (lambda: int(T[1]), "scalar"),
    "float": (lambda: float(T[1]), "scalar"),
    "equal": (lambda: torch.equal(T, T), "scalar"),
    "allclose": (lambda: torch.allclose(T, T), "scalar"),
    "tolist": (lambda: T.tolist(), "list"),
    "numpy": (lambda: T.numpy(), "list"),
    "asarray": (lambda: np.asarray(T), "list"),
    "cpu": (lambda: T.cpu(), "copy"),
    "nonzero": (lambda: T.nonzero(), "nonzero"),
    "argwhere": (lambda: torch.argwhere(T), "nonzero"),
    "where": (lambda: torch.where(MASK), "nonzero"),
    "mask index": (lambda: T[MASK], "mask"),
    "mask fill by index": (lambda: T.clone().__setitem__(MASK, 0.0), "mask"),
    "mask put": (lambda: T.clone().__setitem__(MASK, T[:3]), "mask"),
    "masked_select": (lambda: T.masked_select(MASK), "mask"),
    "unique": (lambda: T.unique(), "unique"),
    "unique rows": (lambda: torch.unique(T.view(2, 3), dim=0), "unique"),
    "unique_consecutive": (lambda: T.unique_consecutive(), "unique"),
    "repeat_interleave": (lambda: T.repeat_interleave(REPEATS), "repeat"),
}
# what stays on the device: sized by shapes alone
NONE = {
    "repeat_interleave sized": lambda: T.repeat_interleave(REPEATS, output_size=6),
    "repeat_interleave by int": lambda: T.repeat_interleave(2),
    "index by ints": lambda: T[torch.tensor([1, 2])],
    "index_select": lambda: T.index_select(0, torch.tensor([1, 2])),
    "masked_fill": lambda: T.masked_fill(MASK, 0.0),
    "where of three": lambda: torch.where(MASK, T, 0.0),
    "sum": lambda: T.sum(),
    "to the same device": lambda: T.to("cpu"),
}


@pytest.mark.parametrize("name", SYNCS)
def test_each_synchronising_op_counts_once_as_its_kind(name):
    run, expected = SYNCS[name]
    with SyncCounter(device=(T, MASK, REPEATS)) as syncs:
        run()
    assert [what for what, _ in syncs.events] == [expected]
    assert syncs.events[0][1].startswith("tests/grpo/test_syncs.py:")   # the line that made it


@pytest.mark.parametrize("name", NONE)
def test_ops_sized_by_shapes_alone_do_not_count(name):
    with SyncCounter(device=(T, MASK, REPEATS)) as syncs:
        NONE[name]()
    assert syncs.events == []


@pytest.mark.parametrize("name", SYNCS)
def test_the_same_ops_on_host_tensors_do_not_count(name):
    with SyncCounter() as syncs:   # T, MASK and REPEATS unknown to it: host tensors
        SYNCS[name][0]()
    assert syncs.events == []


def test_it_follows_which_tensors_live_on_the_device():
    device = torch.device("cpu")   # the run's device, as the code names it
    weight = torch.nn.Parameter(torch.ones(3))
    with SyncCounter() as syncs:
        host = torch.arange(3.0)   # made without a device
        host.sum().item()
        (host * weight).sum().item()   # computed from a parameter
        moved = host.to(device)
        assert moved is not host and moved.data_ptr() != host.data_ptr()   # a copy, as on a GPU
        moved.max().item()
        host.max().item()
        made = torch.zeros(3, device=device)
        (made + 1)[1:].tolist()   # a view of an op's output on it
        back = made.cpu()   # counted; a host copy, as on a GPU
        assert back is not made and back.data_ptr() != made.data_ptr()
        back.tolist()
        torch.tensor([1.0, 2.0]).sum().item()
    # host.to(device) is a copy to the device that waits
    assert [what for what, _ in syncs.events] == ["scalar", "copy", "scalar", "list", "copy"]


def test_a_copy_to_the_device_counts_unless_it_does_not_wait():
    device = torch.device("cpu")
    with SyncCounter() as syncs:
        host = torch.arange(3.0)
        host.to(device)
        torch.tensor([1.0], device=device)
        torch.tensor([], device=device)   # nothing to copy
        torch.arange(3, device=device)   # made there: no copy
        moved = host.to(device, non_blocking=True)
        moved.to(device)   # there already
        host.to(torch.float64)
        host.to("cpu")
    assert [what for what, _ in syncs.events] == ["copy", "copy"]


def test_a_boolean_index_counts_in_backward_too_and_the_optimizers_reads_do_not():
    x = torch.nn.Parameter(torch.randn(5))
    optimizer = torch.optim.AdamW([x])
    with SyncCounter() as syncs:
        x[x.detach() > 0].sum().backward()   # backward puts the gradient back by the mask
        optimizer.step()   # reads its step counter (.item()), made on the host
    assert [what for what, _ in syncs.events] == ["mask", "mask"]


def test_a_copy_between_host_and_device_counts_unless_it_does_not_wait():
    # the meta device stands in for a GPU: copies are classified by their devices alone
    host, device = torch.empty(2), torch.empty(2, device="meta")
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert kind(aten._to_copy.default, (device,), {"device": cpu}) == "copy"
    assert kind(aten._to_copy.default, (device,), {"device": cpu, "non_blocking": True}) == "copy"
    assert kind(aten._to_copy.default, (host,), {"device": meta}) == "copy"
    assert kind(aten._to_copy.default, (host,), {"device": meta, "non_blocking": True}) is None
    assert kind(aten.copy_.default, (host, device), {}) == "copy"
    assert kind(aten.copy_.default, (device, host), {}) == "copy"
    assert kind(aten.copy_.default, (device, host, True), {}) is None
    assert kind(aten._to_copy.default, (host,), {"dtype": torch.float64}) is None


def test_the_counter_stops_counting_when_it_is_left():
    with SyncCounter(device=(T,)) as syncs:
        T.sum().item()
    T.sum().item()
    with syncs:   # and counts on where it was entered again
        T.tolist()
    assert [what for what, _ in syncs.events] == ["scalar", "list"]


@pytest.mark.parametrize("predict", [False, True])
def test_a_packed_forward_and_its_backward_read_the_device_once(tiny_model_dir, predict):
    """The layout (and the positions whose logits are kept) built on the host from one read."""
    model = load_policy(tiny_model_dir, "cpu")
    assert packing.packs(model)   # its probe, once per model, before
    ids = torch.randint(1, 100, (6, 10))
    mask = torch.ones_like(ids)
    mask[:3, :4] = 0   # two prompts, three rows each, left-padded; completions of 1 to 4 tokens
    ids[3:, :5], mask[:, 9:] = ids[0, :5], torch.tensor([[0], [1], [0], [1], [0], [0]])
    mask[::2, 8] = 0
    chosen = (mask[:, 5:] * torch.tensor([1, 0, 1, 1, 1])).float() if predict else None
    with SyncCounter(device=(ids, mask, chosen)) as syncs:
        logp = completion_logprobs(model, ids, mask, 5, 1.0, 4096, predict=chosen)
        logp.sum().backward()
    assert [what for what, _ in syncs.events] == ["copy"]
    assert syncs.events[0][1].startswith("grpo/packing.py:")


def test_a_default_toy_step_stays_within_its_bound(tiny_model_dir, tmp_path, clean_env):
    """bench/syncs.py's count of a default toy step (64 x 144 tokens, the decoder's checks spaced as
    on CUDA): outside the decoder, one read to decode the completions, one per packed forward, the
    update's three (token count, statistics, gradient norm) and the record's two copies; the
    issue's bound of 20 in all (a275f24 made 94, 55 of them outside the decoder)."""
    from bench.syncs import PHASES, count_steps
    steps = count_steps(["--model", tiny_model_dir, "--task", "toy", "--steps", "2",
                         "--eval-interval", "0", "--log-level", "warning",
                         "--out-dir", str(tmp_path / "run")])
    assert len(steps) == 2
    for phases in steps:
        outside = {name: [e for e in phases[name] if not e[1].startswith("grpo/decoders.py")]
                   for name in PHASES}
        assert [len(outside[name]) for name in PHASES] == [1, 0, 1, 6], outside
        assert sum(len(phases[name]) for name in PHASES) <= 20
        assert phases["end"] == []   # the record reads host tensors alone
