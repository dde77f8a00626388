"""Memory readings for the per-step log: process RSS, and on CUDA allocated / reserved / peak."""
import ctypes
import os
import resource

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float:
    """Resident set size now (Linux: /proc/self/statm; elsewhere the peak is the best we have)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except OSError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    """Peak RSS of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim   # glibc; musl, macOS and Windows have none
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).

    glibc keeps the pages freed after a step's transient peak (a batch whose completions ran long), so
    without this RSS ratchets up to the largest peak so far and reads as a leak in monitor_memory.py;
    called once per step, before the memory snapshot, RSS is what the process still holds."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def reset_peak(device: torch.device) -> None:
    """Start a new peak window: called at the start of each step so cuda_peak_mb is that step's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def snapshot(device: torch.device) -> dict:
    rec = {"rss_mb": round(rss_mb(), 1), "rss_peak_mb": round(peak_rss_mb(), 1)}
    if device.type == "cuda":
        rec["cuda_allocated_mb"] = round(torch.cuda.memory_allocated(device) / 2**20, 1)
        rec["cuda_reserved_mb"] = round(torch.cuda.memory_reserved(device) / 2**20, 1)
        rec["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return rec
