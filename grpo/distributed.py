"""Data parallelism under torchrun: one process per device, each with whole groups; gradients summed
by one all_reduce of a flat buffer per update, not DDP (docs/algorithm.md, "Data parallelism"). Each
helper is a no-op in one process. All but world_size(), rank() and is_main() wait for the other
ranks: a call of one, or of a function that makes one (Guard.fit, train_lean.py update, ...), is
marked `# every rank` on its line in train_lean.py, grpo/ and harness/.
"""
import datetime
import os

import torch
import torch.distributed as dist


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
    return dist.get_rank(), world, device


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
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any."""
    return all_sum([float(flag)])[0] > 0


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order, pickled: error counts, log rows, rewards, and
    with --top-entropy-quantile or Clip-Cov / KL-Cov every loss token's values of a mini-batch."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def sum_gradients(params) -> None:
    """Sum .grad over ranks in place (one flat buffer): the loss is already divided by global
    counts."""
    if not dist.is_initialized():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g)
        offset += g.numel()


def close(exc_type=None, exc=None, tb=None) -> None:
    """Tear the process group down. After a clean run the ranks first meet, so that none destroys
    gloo's connections while another still uses them; after an exception they do not (a peer may
    never come)."""
    if dist.is_initialized():
        if exc_type is None:
            dist.barrier()
        dist.destroy_process_group()
