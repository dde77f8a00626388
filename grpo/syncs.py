"""Counting the operations that make the host wait on a CUDA device (a synchronisation): with
SyncCounter() as syncs: ...; syncs.events lists each one's kind and the line of the repository that
made it. Usable on the CPU, so the CPU tests bound a step's synchronisations before a GPU runs it.

What counts (each once), by kind, where it reads a tensor that lives on the device:
    scalar    a value read by Python: .item(), bool(), int(), float() (aten's _local_scalar_dense),
              torch.equal, torch.allclose
    list      .tolist(), .numpy(), np.asarray(tensor) (on the CPU no aten op: a function mode)
    copy      .cpu(), and any copy from a device to the host; a copy from the host to the device
              without non_blocking (.to(device), torch.tensor(data, device=device)), unless empty:
              torch waits for the device's queue to drain before it returns
    nonzero   nonzero, argwhere, torch.where(cond): the output's size is a count on the device
    mask      indexing, or assignment, by a boolean mask (index, index_put_), masked_select
    unique    unique, unique_consecutive (also sized by the data)
    repeat    repeat_interleave by a tensor of repeats without output_size

Which tensors live on the device is followed op by op, as it would be on a GPU, where on the CPU
every tensor is a host tensor: a parameter does; so does a tensor moved with .to(a device), or made
by a torch function given a device (torch.zeros(..., device=d)); so does an op's output when any
of its inputs does. A tensor made without a device (torch.tensor(list), torch.arange(n),
torch.from_numpy) does not, nor what .cpu() returns. Under the counter .cpu() of a CPU tensor, and
.to(device) of a host one, return a copy, as they do on a GPU. What the CPU cannot tell, and so
miscounts: a torch function given a host tensor's device (device=t.device) makes a device tensor
here (over-counted reads and copies), and host code that names the device in a string ("cuda") is
not told from the host. Explicit waits (torch.cuda.synchronize, an event's) are no tensor op: not
counted.
"""
import os
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

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
_READS = {torch.Tensor.tolist: "list", torch.Tensor.numpy: "list", torch.Tensor.__array__: "list",
          torch.Tensor.cpu: "copy"}
# torch functions that make a tensor on the device they are given; the first two copy host data
_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
              torch.arange, torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace,
              torch.eye, torch.empty_strided}
_COPYING = {torch.tensor, torch.as_tensor}

_HERE = os.path.realpath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE)) + os.sep


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


def _where() -> str:
    """The innermost line of the repository (outside this file) that the running op came from."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        if path.startswith(_ROOT) and path != _HERE and "site-packages" not in path:
            return f"{os.path.relpath(path, _ROOT)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _names_device(device) -> bool:
    """Whether a device argument names the device (the run's, by the code's convention: a torch
    device, or a string other than "cpu")."""
    return device is not None and device != "cpu"


def _target(args, kwargs):
    """The device a Tensor.to call names, or None (a dtype alone)."""
    return kwargs.get("device", next((a for a in args[1:] if isinstance(a, (torch.device, str))),
                                     None))


class SyncCounter:
    """A context that records the synchronising ops run in it (this thread's, and the autograd
    engine's on its behalf): events, a (kind, where) pair each. device: tensors that live on the
    device besides the parameters (which always do)."""

    def __init__(self, device=()):
        self.events = []
        self.device = WeakTensorKeyDictionary()   # the tensors that live on the device (by id)
        self.place(device)
        self._inside = threading.local()   # in a counted Tensor method: its own ops not again
        counter = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                on_device = counter.on_device(tree_leaves((args, kwargs)))
                if on_device and not getattr(counter._inside, "on", False):
                    found = kind(func, args, kwargs)
                    if found:
                        counter.events.append((found, _where()))
                out = func(*args, **kwargs)
                if on_device:
                    counter.place(tree_leaves(out))
                return out

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if getattr(counter._inside, "on", False):
                    return func(*args, **kwargs)
                if func in _READS and counter.on_device(args[:1]):
                    counter.events.append((_READS[func], _where()))
                if func in _READS:
                    counter._inside.on = True
                    try:
                        out = func(*args, **kwargs)
                    finally:
                        counter._inside.on = False
                    if func is torch.Tensor.cpu:   # a host copy, as on a GPU (a CPU tensor's is
                        out = out.clone() if out is args[0] else out   # itself)
                        counter.device.pop(out, None)
                    return out
                made = func in _FACTORIES and _names_device(kwargs.get("device"))
                moved = func is torch.Tensor.to and _names_device(_target(args, kwargs))
                out = func(*args, **kwargs)
                moved = moved and not counter.on_device(args[:1])   # from the host
                if (made and func in _COPYING or moved) and out.numel() \
                        and not kwargs.get("non_blocking", False):
                    counter.events.append(("copy", _where()))   # a copy to it that waits
                if moved and out is args[0]:   # a copy on the device, as on a GPU
                    out = out.clone()
                if made or moved:
                    counter.place([out])
                return out

        self._modes = (Function(), Dispatch())

    def place(self, values) -> None:
        """The tensors among values live on the device."""
        for t in values:
            if isinstance(t, torch.Tensor):
                self.device[t] = True

    def on_device(self, values) -> bool:
        """Whether any of values is a tensor that lives on the device."""
        return any(isinstance(t, torch.Tensor)
                   and (isinstance(t, torch.nn.Parameter) or t in self.device) for t in values)

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.events)
