"""What keeps a long run alive: out-of-memory retries, non-finite updates, and a clean stop on a signal."""
import gc
import math
import signal

import torch


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


class OomNotes:
    """The out-of-memory retries of the current step: said as they happen, counted in the step's record."""

    def __init__(self, say):
        self.say, self.notes = say, []

    def __call__(self, message: str) -> None:
        self.notes.append(message)
        self.say(message)


def finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def nonfinite_abort(step: int, streak: int, path: str) -> str:
    """What the run says when it gives up after --max-nonfinite skipped updates in a row."""
    return (f"aborting at step {step}: the last {streak} optimizer updates had a non-finite loss or gradient norm "
            f"and were skipped; checkpoint {path} holds the weights from before them. Lower --learning-rate or check "
            f"the task's rewards, then --resume")


class StopOnSignal:
    """SIGINT/SIGTERM set `requested`; the loop finishes its step, saves and exits 0. A second
    signal stops at once, without saving. Restores the previous handlers on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, note):
        self.requested, self.note, self.previous = False, note, {}

    def _handle(self, signum, frame):
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.requested = True
        self.note(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                  f"(send it again to stop without saving)")

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, h in self.previous.items():
            signal.signal(s, h)
