"""Memory readings for the per-step log: process RSS, and on CUDA allocated / reserved / peak."""
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
