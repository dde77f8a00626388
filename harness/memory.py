"""Memory readings for the per-step log, phase by phase, and on demand the evidence of where memory goes.

Each step's record gets, at the end of each phase (start: the step's start, then gen, score, ref, train),
the process RSS as {phase}_rss_mb, and on CUDA the memory allocated at the phase's end
({phase}_cuda_allocated_mb) and the peak within it ({phase}_cuda_peak_mb: the peak statistics are reset
as each phase starts); then the step's rss_mb, rss_peak_mb, CUDA allocated / reserved / peak, and the
caching allocator's retries and fragmentation. monitor_memory.py turns consecutive readings into the
memory each phase adds per step and names the phase that grows (memwatch.py).

--trace-memory N traces N steps after the first --trace-memory-after steps of the process (Trace) and
writes OUT_DIR/memory/trace.json. On CUDA an out-of-memory error always dumps the allocator's snapshot
to OUT_DIR/memory/oom_rank{R}.pickle, for https://pytorch.org/memory_viz.
"""
import ctypes
import gc
import json
import linecache
import os
import resource
import sysconfig
import time
import tracemalloc
import warnings
from collections import Counter

import torch
from torch._subclasses.fake_tensor import is_fake

from grpo import distributed
from harness import log

MB = 2**20
SUBDIR = "memory"   # OUT_DIR/memory: the evidence a run writes
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

    glibc keeps the pages freed after a transient peak (a batch whose completions ran long), so without
    this RSS ratchets up to the largest peak so far and reads as a leak in monitor_memory.py; called
    before each reading, RSS is what the process still holds."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def allocator_stats(stats: dict) -> dict:
    """The CUDA caching allocator's health from torch.cuda.memory_stats(device).

    cuda_alloc_retries counts (since the process started) the cudaMallocs that failed, made the
    allocator free its whole cache and try again: the run is at the edge of its memory, and slowed by
    it. cuda_frag_mb is memory reserved but not allocated; cuda_inactive_split_mb the part of it in
    free pieces of split blocks, which a larger request cannot use (fragmentation proper)."""
    reserved, allocated = stats.get("reserved_bytes.all.current", 0), stats.get("allocated_bytes.all.current", 0)
    return {"cuda_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "cuda_frag_mb": round((reserved - allocated) / MB, 1),
            "cuda_inactive_split_mb": round(stats.get("inactive_split_bytes.all.current", 0) / MB, 1)}


class Phases:
    """A run's memory, step by step and phase by phase: start(step) at the top of a step, end(phase)
    after each phase, then times() and record() for the step's JSONL record.

    A context manager: leaving it (the run's end, a crash, a signal) finishes a trace window that was
    still open, so the evidence of a run cut short is not lost."""

    def __init__(self, device: torch.device, rank: int, cfg, info):
        self.device, self.cuda, self.count, self.step = device, device.type == "cuda", 0, None
        self.marks, self.mem = [], {}
        self.trace = None
        if distributed.is_main() and cfg.trace_memory:
            self.trace = Trace(cfg.trace_memory_after + 1, cfg.trace_memory_after + cfg.trace_memory,
                               os.path.join(cfg.out_dir, SUBDIR), self.cuda, info)
        if self.cuda:
            attach_oom_snapshot(os.path.join(cfg.out_dir, SUBDIR, f"oom_rank{rank}.pickle"), info)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.trace is not None:
            self.trace.finish(self.step, early=True)

    def start(self, step: int) -> None:
        self.count, self.step, self.marks, self.mem, self.spent = self.count + 1, step, [], {}, 0.0
        if self.trace is not None:
            self.trace.step_started(self.count, step)
        self.end("start")

    def end(self, phase: str) -> None:
        """Close `phase`: the time, and the memory at its end (after glibc's free pages go back to the OS).
        On CUDA the phase's kernels finish first: otherwise what a phase queued (the reference pass) is
        timed in the next one (training)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        release_free_heap()
        self.marks.append((phase, time.perf_counter()))
        self.spent += self.marks[-1][1] - start
        self.mem[f"{phase}_rss_mb"] = round(rss_mb(), 1)
        if self.cuda:
            self.mem[f"{phase}_cuda_allocated_mb"] = round(torch.cuda.memory_allocated(self.device) / MB, 1)
            if phase != "start":
                self.mem[f"{phase}_cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(self.device) / MB, 1)
            torch.cuda.reset_peak_memory_stats(self.device)   # the next phase's peak is its own

    def times(self) -> dict:
        """Seconds per phase, the whole step's as "step", and as "heap_trim" the part of them spent giving
        free heap pages back before each reading (release_free_heap: glibc walks every arena)."""
        out = {b: tb - ta for (_, ta), (b, tb) in zip(self.marks, self.marks[1:])}
        return {**out, "step": self.marks[-1][1] - self.marks[0][1], "heap_trim": self.spent}

    def record(self) -> dict:
        """The step's memory keys: the step's readings first (its last phase's), then the phases'."""
        last = self.marks[-1][0]
        rec = {"rss_mb": self.mem[f"{last}_rss_mb"], "rss_peak_mb": round(peak_rss_mb(), 1)}
        if self.cuda:
            peaks = [v for k, v in self.mem.items() if k.endswith("_cuda_peak_mb")]
            rec.update(cuda_allocated_mb=self.mem[f"{last}_cuda_allocated_mb"],
                       cuda_reserved_mb=round(torch.cuda.memory_reserved(self.device) / MB, 1),
                       cuda_peak_mb=max(peaks), **allocator_stats(torch.cuda.memory_stats(self.device)))
        rec.update(self.mem)
        if self.trace is not None:
            self.trace.step_ended(self.count, self.step)
        return rec


def attach_oom_snapshot(path: str, info) -> None:
    """On CUDA, every out-of-memory error writes the allocator's snapshot to `path` (the latest one kept)
    and says where on the rank it happened, whatever --log-level says.

    torch calls the observer before it raises OutOfMemoryError, so the snapshot shows what filled the
    device, whether the error is then retried with a smaller micro-batch or ends the run. Allocation
    stack traces are in it only while a --trace-memory window records them."""
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        info("memory: this torch has no CUDA out-of-memory observer; an out-of-memory error dumps no snapshot")
        return

    def observer(device, alloc, device_allocated, device_free):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
        log.warn_here(f"out of memory on cuda:{device} asking for {alloc / MB:.0f} MB ({device_allocated / MB:.0f} "
                      f"MB allocated, {device_free / MB:.0f} MB free): allocator snapshot in {path} "
                      f"(https://pytorch.org/memory_viz)")
    attach(observer)


# --- leak evidence ------------------------------------------------------------------------------

TRACE_FRAMES = 8           # frames kept per allocation: enough to reach the user's line under library calls
CUDA_HISTORY = 100_000     # alloc/free events kept by the CUDA memory history (a ring buffer, a few KB each)
TOP = 10                   # sites and tensor groups reported
_LIBRARY = tuple(os.path.realpath(p) for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})


class Trace:
    """The evidence of where memory goes, over the process's steps first..last.

    At the first step's start tracemalloc starts (Python allocations with their stack, numpy's included;
    torch's CPU tensors are not seen by it) and on CUDA the allocator's memory history. At the end of
    that step a baseline is taken: tracemalloc's snapshot and a census of the live tensors (count and
    bytes by shape, dtype and device, found through gc). At the end of the last step both are taken again
    and compared: the allocation sites (the innermost frame outside the Python installation, file:line)
    and tensor groups that grew, in OUT_DIR/memory/trace.json, and on CUDA the history is dumped to
    OUT_DIR/memory/snapshot.pickle. What one step holds cancels out between the two ends; what piles up
    step after step remains. Tracing slows the traced steps (BENCHMARKS.md)."""

    def __init__(self, first: int, last: int, folder: str, cuda: bool, info):
        self.first, self.last, self.cuda, self.info, self.folder = first, last, cuda, info, folder
        self.path = os.path.join(folder, "trace.json")
        self.snapshot_path = os.path.join(folder, "snapshot.pickle") if cuda else None
        self.base = None       # (step, tracemalloc snapshot, tensor census) at the end of the first step
        self.started = self.done = False

    def step_started(self, count: int, step: int) -> None:
        if count == self.first:
            self.started = True
            self.info(f"memory: tracing steps {step}-{step + self.last - self.first} (slower); "
                     f"evidence in {self.path}")
            tracemalloc.start(TRACE_FRAMES)
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=CUDA_HISTORY)

    def step_ended(self, count: int, step: int) -> None:
        if count == self.first:
            self.base = (step, self._snapshot(), tensor_census())
        if count == self.last:
            self.finish(step)

    def finish(self, step, early: bool = False) -> None:
        """Compare the end of `step` with the baseline and write the evidence; stop tracing."""
        if self.done:
            return
        self.done = True
        if not self.started:
            self.info(f"memory: the run ended before the trace window (the process's steps {self.first}-{self.last}): "
                     f"no evidence")
            return
        if self.base is None:
            self.info("memory: the run ended inside the trace window's first step: no evidence to compare")
        else:
            base_step, base_snap, base_census = self.base
            evidence = {"from_step": base_step, "to_step": step, "ended_early": early,
                        "sites": grown_sites(self._snapshot().compare_to(base_snap, "traceback")),
                        "tensors": grown_tensors(base_census, tensor_census()),
                        "tracemalloc_mb": round(tracemalloc.get_tracemalloc_memory() / MB, 1),
                        "cuda_snapshot": self.snapshot_path}
            os.makedirs(self.folder, exist_ok=True)
            if self.cuda:
                torch.cuda.memory._dump_snapshot(self.snapshot_path)
            with open(self.path + ".tmp", "w") as f:
                json.dump(evidence, f, indent=1)
            os.replace(self.path + ".tmp", self.path)
            self.info(f"memory: trace of steps {base_step}-{step} written to {self.path}")
        tracemalloc.stop()
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)

    @staticmethod
    def _snapshot():
        # The tracer's own bookkeeping (the baseline it holds) is not the run's memory.
        return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__, all_frames=True),
                                                          tracemalloc.Filter(False, __file__, all_frames=True)])


def user_frame(traceback):
    """The innermost frame outside the Python installation (the standard library, site-packages): the
    user's line that asked for the memory, under the numpy or library code that allocated it; the
    innermost frame when every frame is library code."""
    frames = list(traceback)   # oldest first
    for frame in reversed(frames):
        if not os.path.realpath(frame.filename).startswith(_LIBRARY) and not frame.filename.startswith("<"):
            return frame
    return frames[-1]


def grown_sites(diffs, top: int = TOP) -> list:
    """tracemalloc's StatisticDiffs (by traceback) summed by user frame: the sites whose live memory grew."""
    size, count = Counter(), Counter()
    for d in diffs:
        frame = user_frame(d.traceback)
        size[frame.filename, frame.lineno] += d.size_diff
        count[frame.filename, frame.lineno] += d.count_diff
    return [{"site": f"{file}:{line}", "mb": round(size[file, line] / MB, 3), "blocks": count[file, line],
             "code": linecache.getline(file, line).strip()}
            for (file, line), _ in size.most_common(top) if size[file, line] > 0]


def tensor_census() -> dict:
    """(shape, dtype, device) -> [count, bytes] of the tensors alive now (each view counts its own elements)."""
    gc.collect()
    census = {}
    with warnings.catch_warnings():   # isinstance() reads __class__, which some deprecated module objects warn on
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or is_fake(obj):
                    continue   # a compiler's fake tensors (--compile) hold no memory and may have symbolic shapes
                shape = tuple(obj.shape)
                if not all(type(d) is int for d in shape):
                    continue
                key = (shape, str(obj.dtype).replace("torch.", ""), str(obj.device))
                nbytes = obj.nelement() * obj.element_size()
            except Exception:  # noqa: BLE001 - an object that fails isinstance or has no storage is not counted
                continue
            entry = census.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += nbytes
    return census


def grown_tensors(before: dict, after: dict, top: int = TOP) -> list:
    """The tensor groups whose count or bytes grew between two censuses, largest growth in bytes first."""
    rows = []
    for key in after.keys() | before.keys():
        (n0, b0), (n1, b1) = before.get(key, (0, 0)), after.get(key, (0, 0))
        if n1 > n0 or b1 > b0:
            shape, dtype, device = key
            rows.append({"shape": list(shape), "dtype": dtype, "device": device, "count": n1 - n0,
                         "mb": round((b1 - b0) / MB, 3), "count_end": n1})
    return sorted(rows, key=lambda r: (-r["mb"], -r["count"]))[:top]
