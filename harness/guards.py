"""What keeps a long run alive: out-of-memory retries, non-finite updates, and a clean stop on a signal."""
import contextlib
import functools
import gc
import math
import signal

import torch

from grpo import distributed
from grpo.model import completion_logprobs, logprob_temperature, trainable_parameters


def is_oom(e: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or an allocator failure on CPU (a plain RuntimeError)."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in str(e) or "can't allocate memory" in str(e)))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def smaller_micro(micro: int, mini: int):
    """The largest divisor of the mini-batch at most micro / 2 (or None below 1): accumulation over
    micro-batches that divide the mini-batch keeps the gradient that of the whole mini-batch."""
    for m in range(micro // 2, 0, -1):
        if mini % m == 0:
            return m
    return None


@contextlib.contextmanager
def cpu_threads(n: int):
    """PyTorch's CPU threads set to n (0: left as they are) inside, restored after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(before)


class Guard:
    """What keeps the update alive, handed to the update (train_lean.py) and grpo/passes.py: the micro-batch size and its out-of-memory retry
    (fit), and the optimizer's step, skipped when not finite, with the count of such updates in a
    row (step). notes: this step's retries, said as they happen and counted in the step's record."""

    def __init__(self, micro: int, mini: int, info, nonfinite_streak: int = 0, threads: int = 0):
        self.micro, self.mini, self.info = micro, mini, info
        self.nonfinite_streak, self.notes = nonfinite_streak, []
        self.threads = threads   # --update-threads: the CPU threads fit's passes run on (0: all)

    def fit(self, run):
        """run(micro), with micro halved (to a divisor of the mini-batch) until it fits in memory; self.micro keeps
        the size that fitted. `run` must start from a clean slate (zeroed gradients) each call. All ranks agree on
        each retry, so no rank waits in a collective for one that ran out of memory.

        On --update-threads (1 by default) CPU threads: on several, PyTorch's backward gave gradients that differed
        in the last bits from one process to the next (same seed, same inputs), so same-seed runs drifted apart and a
        resumed run did not end where the straight one did; on one thread they are the same bits every time."""
        while True:
            try:
                with cpu_threads(self.threads):
                    result, oom = run(self.micro), False
            except Exception as e:  # noqa: BLE001 - anything but an out-of-memory is re-raised
                if not is_oom(e):
                    raise
                result, oom = None, True
            if not distributed.any_rank(oom):  # every rank
                return result
            # the exception (and its frames' tensors) is released by now
            result = None
            free_memory()
            smaller = smaller_micro(self.micro, self.mini)
            if smaller is None:
                raise torch.OutOfMemoryError("out of memory with a micro-batch of 1: lower --max-new-tokens, "
                                             "use --dtype bf16 or a smaller model")
            self.notes.append(f"out of memory at micro-batch {self.micro}: freed memory, retrying with {smaller}")
            self.info(self.notes[-1])
            self.micro = smaller

    def step(self, optimizer, loss: float, grad_norm: float) -> bool:
        """Step the optimizer unless its summed loss or gradient norm is not finite (the update is
        then skipped: weights and optimizer state untouched). From finite gradients at a
        --learning-rate below 1, an AdamW or Muon step cannot make a weight non-finite, so nothing
        is copied or checked after it (docs/failures.md). Returns whether it stepped; counts the
        skipped updates in a row."""
        ok = math.isfinite(loss) and math.isfinite(grad_norm)
        if ok:
            optimizer.step()
        else:   # one bad batch must not poison the weights or the optimizer's moments
            optimizer.zero_grad(set_to_none=True)
        self.nonfinite_streak = 0 if ok else self.nonfinite_streak + 1
        return ok


def _fit_test(policy, optimizer, moments: int, longest: int, eos: int, micro: int, cfg, autocast):
    """One forward and backward of micro rows of the longest sequence, with AdamW's moments' memory held."""
    stand_in = torch.empty(moments, device=next(policy.parameters()).device)
    ids = torch.full((micro, longest), eos, device=stand_in.device)
    logp = completion_logprobs(policy, ids, torch.ones_like(ids), cfg.max_new_tokens,
                               logprob_temperature(cfg.temperature), cfg.logprob_chunk_size, autocast)
    logp.sum().backward()
    optimizer.zero_grad(set_to_none=True)
    del stand_in


def probe_micro_batch(guard: Guard, policy, optimizer, longest: int, eos: int, cfg, autocast) -> int:
    """Set guard.micro to the largest micro-batch (a divisor of the per-device mini-batch) whose forward and
    backward fit at the longest sequence; AdamW's two moments do not exist before the first update, so a stand-in
    holds their place."""
    moments = 0 if optimizer.state else sum(2 * p.numel() for p in trainable_parameters(policy))
    guard.fit(functools.partial(_fit_test, policy, optimizer, moments, longest, eos,  # every rank
                                cfg=cfg, autocast=autocast))
    guard.notes.clear()
    return guard.micro


def nonfinite_abort(step: int, streak: int, path: str) -> str:
    """What the run says when it gives up after --max-nonfinite skipped updates in a row."""
    return (f"aborting at step {step}: the last {streak} optimizer updates had a non-finite loss, "
            f"gradient norm or weights and were skipped; checkpoint {path} holds the weights from "
            f"before them. Lower --learning-rate or check the task's rewards, then --resume")


class StopOnSignal:
    """SIGINT/SIGTERM set `requested`; the loop finishes its step, saves and exits 0. A second
    signal stops at once, without saving, except while a checkpoint or the model is written
    (deferred()): a kill there would leave neither. Restores the previous handlers on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, info):
        self.requested, self.info, self.previous, self.writing = False, info, {}, False

    @contextlib.contextmanager
    def deferred(self):
        """Inside, every signal only asks the run to stop: the write finishes first."""
        self.writing = True
        try:
            yield
        finally:
            self.writing = False

    def _handle(self, signum, frame):
        if self.requested and not self.writing:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.requested = True
        self.info(f"{signal.Signals(signum).name}: " + (
            "the save under way finishes first" if self.writing else
            "finishing this step, then saving a checkpoint (send it again to stop without saving)"))

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, h in self.previous.items():
            signal.signal(s, h)
