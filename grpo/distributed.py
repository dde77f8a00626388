"""Data parallelism under torchrun: one process per device, each with whole groups; gradients summed
by one all_reduce of a flat buffer per update, not DDP (docs/algorithm.md, "Data parallelism"). Each
helper is a no-op in one process. All but world_size(), rank() and is_main() wait for the other
ranks: a call of one, or of a function that makes one (Guard.fit, train_lean.py update, ...), is
marked `# every rank` on its line in train_lean.py, grpo/ and harness/.
"""
import contextlib
import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

# A rank that waits this long in one collective says so, and again as often (no silent hang: the
# rank it waits for may be stuck in a reward, or stopped); the process group gives up after 30 min.
WAIT_SAY_S = 60.0
_waiting = None   # the collective this rank waits in now (_Wait), or None


def init(device_choice: str):
    """Join the process group if launched by torchrun; return (rank, world size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = device_choice.startswith("cuda") or (
        device_choice == "auto" and torch.cuda.is_available())
    if world == 1:
        return 0, 1, torch.device(("cuda" if cuda else "cpu") if device_choice == "auto"
                                  else device_choice)
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:  # one GPU per process, whatever cuda:N says
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # NCCL between GPUs, gloo between CPU processes
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    threading.Thread(target=_say_waits, daemon=True).start()
    return dist.get_rank(), world, device


class _Wait:
    def __init__(self, what: str):
        self.what, self.since, self.said = what, time.perf_counter(), 0


@contextlib.contextmanager
def _collective(what: str):
    """Marks this rank as waiting in a collective while inside (read by _say_waits); an error
    raised in it is marked too (failed_collective)."""
    global _waiting
    _waiting = _Wait(what)
    try:
        yield
    except RuntimeError as e:   # a peer left: one that stopped on a signal, or crashed
        e.collective = what
        raise
    finally:
        _waiting = None


def failed_collective(exc) -> bool:
    """Whether exc is a collective's failure (the peer that left it may have been asked to stop)."""
    return getattr(exc, "collective", None) is not None


def _say_waits() -> None:
    while True:
        time.sleep(min(1.0, WAIT_SAY_S))
        w = _waiting
        if w is not None and time.perf_counter() - w.since >= (w.said + 1) * WAIT_SAY_S:
            w.said += 1
            print(f"train_lean.py: rank {rank()}: still waiting for the other ranks ({w.what}), "
                  f"{w.said * WAIT_SAY_S:g} s so far: a rank is held (its lines say where); "
                  f"Ctrl-C or SIGTERM stops the run", file=sys.stderr, flush=True)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Whether this process is rank 0, the one that prints, logs, saves and evaluates; before the
    process group exists, torchrun's RANK says so."""
    return dist.get_rank() == 0 if dist.is_initialized() else os.environ.get("RANK", "0") == "0"


def _device():
    # gloo reduces CPU tensors, NCCL CUDA tensors
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
            else torch.device("cpu"))


def all_sum(values: list) -> list:
    """Element-wise sum over ranks of a list of numbers (float64)."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    with _collective("a sum"):   # NCCL's waits in tolist()
        dist.all_reduce(t)
        return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any."""
    return all_sum([float(flag)])[0] > 0


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (error counts, log rows, rewards, ...)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * world_size()
    with _collective("a gather"):
        dist.all_gather_object(out, obj)
    return out


def sum_gradients(params) -> None:
    """Sum .grad over ranks in place, as one flat buffer (the loss is divided by global counts)."""
    if not dist.is_initialized():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with _collective("the gradients' sum"):
        dist.all_reduce(flat)
    for p, g, part in zip(params, grads, flat.split([g.numel() for g in grads])):
        p.grad = part.view_as(g)


def close(exc_type=None, exc=None, tb=None) -> None:
    """Tear the process group down. After a clean run the ranks first meet, so that none destroys
    gloo's connections while another still uses them; after an exception they do not (a peer may
    never come)."""
    if dist.is_initialized():
        if exc_type is None:
            with _collective("the run's end"):
                dist.barrier()
        dist.destroy_process_group()
