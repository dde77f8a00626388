"""The decode step as one replayed CUDA graph, without a compiler, and its stand-in on any device.

A CUDA graph records a step's kernels once and replays them with one launch: the kernels read and
write the addresses they were recorded with, with the shapes and Python values of that time, and
nothing in the step may wait on the host. Captured (a GPU) records the step on its first call and
replays it after; StandIn (the CPU, or --decode-graph check) runs the step eagerly every time and
checks that a replay would do what the eager step does: no synchronising operation inside it, and
the same operations on the same outside tensors (address, shape, strides) with the same arguments
at every call. What it checks, and why allocations inside the step are allowed: docs/algorithm.md,
"Decoding".
"""
import os
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# aten ops that wait for the device (their result's size or value is read on the host)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal",
            "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave"}
# Tensor methods that hand the host the values: on a CPU they dispatch no op to catch
HOST_READS = {"tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__index__"}

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CaptureError(RuntimeError):
    """The step does something a replayed graph would not repeat, or cannot record."""


def _ours(filename: str) -> bool:
    return (filename.startswith(_HERE) and "site-packages" not in filename
            and not filename.endswith("graphs.py"))


def _where() -> str:
    """file:line of the innermost frame of this repository's code (not this file's)."""
    frame = sys._getframe(1)
    while frame is not None and not _ours(frame.f_code.co_filename):
        frame = frame.f_back
    return "?" if frame is None else f"{os.path.relpath(frame.f_code.co_filename, _HERE)}:{frame.f_lineno}"


class _Trace(TorchDispatchMode):
    """Each op of a step as a replay would see it: its name and its arguments, an outside tensor by
    its address, shape, strides and dtype, a tensor made inside the step by its shape alone (a
    graph's own memory holds it), any other argument by its value."""

    def __init__(self):
        super().__init__()
        self.ops, self.inside, self.constants = [], set(), {}

    def _arg(self, a):
        if not isinstance(a, torch.Tensor):
            return repr(a)
        ptr = a.untyped_storage().data_ptr()
        if ptr in self.constants:
            return self.constants[ptr]
        if ptr in self.inside:
            return ("inside", tuple(a.shape), a.stride(), a.dtype)
        return ("outside", a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        inputs, _ = tree_flatten((args, kwargs))
        if name in SYNC_OPS or (name in ("index", "index_put", "index_put_") and any(
                i is not None and i.dtype == torch.bool for i in args[1])):   # a boolean mask
            raise CaptureError(f"the decode step synchronises with the host ({name}) at {_where()}: "
                               f"a CUDA graph cannot record it")
        if name.startswith("lift_fresh"):   # a Python constant made a tensor: a graph keeps its value
            ptr = inputs[0].untyped_storage().data_ptr()
            self.constants[ptr] = ("constant", inputs[0].tolist())
            self.inside.discard(ptr)
        self.ops.append((str(func), tuple(self._arg(a) for a in inputs), _where()))
        out = func(*args, **kwargs)
        seen = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in seen:
                # new memory (a freed tensor's address may come back for it)
                self.inside.add(o.untyped_storage().data_ptr())
                self.constants.pop(o.untyped_storage().data_ptr(), None)
        return out


class _HostReads(TorchFunctionMode):
    """Refuses the Tensor methods that copy values to the host (no op on a CPU shows them)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_READS:
            raise CaptureError(f"the decode step reads a tensor on the host ({func.__name__}) at "
                               f"{_where()}: a CUDA graph cannot record it")
        return func(*args, **(kwargs or {}))


class StandIn:
    """A graph's stand-in: runs the step eagerly at every call (the same values as eager), and
    raises CaptureError where a recorded graph's replay would differ from it."""

    def __init__(self):
        self.ops, self.calls = None, 0   # the first call's ops: what a graph would have recorded

    def __call__(self, step):
        trace = _Trace()
        with _HostReads(), trace:
            step()
        self.calls += 1
        if self.ops is None:
            self.ops = trace.ops
            return
        for i, (then, now) in enumerate(zip(self.ops, trace.ops)):
            if then[:2] != now[:2]:
                raise CaptureError(f"call {self.calls} of the decode step differs from the first at "
                                   f"op {i} ({now[0]} at {now[2]}): recorded {then[1]}, now "
                                   f"{now[1]}; a replay would reuse what was recorded")
        if len(self.ops) != len(trace.ops):
            raise CaptureError(f"call {self.calls} of the decode step ran {len(trace.ops)} ops, "
                               f"the first {len(self.ops)}: a replay runs the recorded ones")


class Captured:
    """The step as a torch.cuda.CUDAGraph: on the first call run once eagerly (that call's work,
    and the warm-up a capture needs: lazy initialisation stays out of the graph), then recorded;
    after, replayed. pool: the memory pool it shares with a model's other graphs."""

    def __init__(self, pool):
        self.pool, self.graph = pool, None

    def __call__(self, step):
        if self.graph is not None:
            self.graph.replay()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # autocast's cache of casts would hand the graph tensors made outside it
        dtype = torch.get_autocast_dtype("cuda")
        with torch.autocast("cuda", dtype=dtype, enabled=torch.is_autocast_enabled("cuda"),
                            cache_enabled=False):
            with torch.cuda.graph(graph, pool=self.pool):
                step()
        self.graph = graph


# each model's graphs by what they were recorded for (the decoder's shapes and settings), kept
# from one generate() to the next, as the buffers they read are (grpo/decoders.py _kept)
_GRAPHS = weakref.WeakKeyDictionary()
COUNTS = {"decode_graphs": 0, "decode_replays": 0}   # in this process so far: made, replayed


def graph_for(model, key, mode: str):
    """The graph (mode "capture") or stand-in (mode "check") of `model`'s step for `key`, made on
    first use."""
    graphs = _GRAPHS.setdefault(model, {})
    if key in graphs:
        COUNTS["decode_replays"] += 1
    else:
        COUNTS["decode_graphs"] += 1
        if mode == "capture":   # one memory pool for a model's graphs: one runs at a time
            graphs[key] = Captured(graphs.setdefault("pool", torch.cuda.graph_pool_handle()))
        else:
            graphs[key] = StandIn()
    return graphs[key]
