"""Counting the operations that make the host wait on a CUDA device (a synchronisation): with
SyncCounter() as syncs: ...; syncs.events lists each one's kind and the line of the repository that
made it. Usable on the CPU, so the CPU tests bound a step's synchronisations before a GPU runs it.

What counts (each once), by kind:
    scalar    a tensor's value read by Python: .item(), bool(), int(), float() (aten's
              _local_scalar_dense), torch.equal, torch.allclose
    list      .tolist(), .numpy(), np.asarray(tensor): on the CPU no aten op, so a function mode
    nonzero   nonzero, argwhere, torch.where(cond): the output's size is a count on the device
    mask      indexing, or assignment, by a boolean mask (index, index_put_), masked_select
    unique    unique, unique_consecutive (also sized by the data)
    repeat    repeat_interleave by a tensor of repeats without output_size
    copy      a copy from a device to the host, and .cpu() (on the CPU no op: counted as the copy
              it is on a device); on a device also a copy from the host to it without non_blocking
              (torch waits for the stream before it returns)

On the CPU every tensor is a host tensor, so the count is what the same code would make on a
device where the code's tensors live there. It over-counts reads of tensors that live on the host
anyway on a GPU (the rewards, what .cpu() returned, a tensor made from a list) and .cpu() of a
host tensor; it under-counts copies from the host to the device (on the CPU `.to(device)` is no
op). Not counted: torch.optim's reads (its step counters, host tensors on a GPU unless capturable
or fused, which read none) and explicit waits (torch.cuda.synchronize, an event's: no tensor op).
"""
import os
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SCALAR = {aten._local_scalar_dense.default, aten.equal.default, aten.allclose.default}
_SIZED = {aten.nonzero.default: "nonzero", aten.masked_select.default: "mask",
          **{op: "unique" for op in (aten._unique.default, aten._unique2.default,
                                     aten.unique_dim.default, aten.unique_consecutive.default,
                                     aten.unique_dim_consecutive.default)}}
# ops whose indices (their second argument) synchronise when one of them is a boolean mask
_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
            aten._index_put_impl_.default}
_COPIES = {aten._to_copy.default, aten.copy_.default}
# Tensor methods that read every value on the host and dispatch no aten op on a CPU tensor
_METHODS = {torch.Tensor.tolist: "list", torch.Tensor.numpy: "list", torch.Tensor.__array__: "list",
            torch.Tensor.cpu: "copy"}

_HERE = os.path.realpath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE)) + os.sep
_OPTIM = os.path.dirname(os.path.realpath(torch.optim.__file__)) + os.sep


def kind(func, args, kwargs) -> str | None:
    """The kind of synchronisation the aten op `func` on args makes, or None."""
    if func in _SCALAR:
        return "scalar"
    if func in _SIZED:
        return _SIZED[func]
    if func in _INDEXED:
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return "mask"
    elif func is aten.repeat_interleave.Tensor:
        if kwargs.get("output_size") is None:
            return "repeat"
    elif func in _COPIES:
        return _copy_kind(func, args, kwargs)
    return None


def _copy_kind(func, args, kwargs) -> str | None:
    """"copy" for a copy from a device to the host, or from the host to a device that waits."""
    if func is aten._to_copy.default:
        src, dst = args[0].device, kwargs.get("device") or args[0].device
    else:
        src, dst = args[1].device, args[0].device
    src, dst = torch.device(src), torch.device(dst)
    waits = not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2])
    if src.type != "cpu" and dst.type == "cpu":
        return "copy"
    return "copy" if src.type == "cpu" and dst.type != "cpu" and waits else None


def _where() -> str | None:
    """The innermost line of the repository (outside this file) that the running op came from;
    None where torch.optim made it."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        if path.startswith(_OPTIM):
            return None
        if path.startswith(_ROOT) and path != _HERE and "site-packages" not in path:
            return f"{os.path.relpath(path, _ROOT)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class SyncCounter:
    """A context that records the synchronising ops run in it (this thread's, and the autograd
    engine's on its behalf): events, a (kind, where) pair each."""

    def __init__(self):
        self.events = []
        self._inside = threading.local()   # in a counted Tensor method: its own ops not again
        counter = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                found = None if getattr(counter._inside, "on", False) else kind(func, args, kwargs)
                if found:
                    counter.record(found)
                return func(*args, **kwargs)

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func not in _METHODS or getattr(counter._inside, "on", False):
                    return func(*args, **(kwargs or {}))
                counter.record(_METHODS[func])
                counter._inside.on = True
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    counter._inside.on = False

        self._modes = (Function(), Dispatch())

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def record(self, found: str) -> None:
        where = _where()
        if where is not None:
            self.events.append((found, where))

    @property
    def count(self) -> int:
        return len(self.events)
