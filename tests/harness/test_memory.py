"""The per-step memory readings, phase by phase; the release of freed heap pages; the leak evidence of a
traced window (tracemalloc sites, the census of live tensors)."""
import ctypes
import json
import time
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness import memory

CPU = torch.device("cpu")


def settings(out_dir, trace=0, after=0):
    return SimpleNamespace(trace_memory=trace, trace_memory_after=after, out_dir=str(out_dir))


@pytest.mark.skipif(memory._MALLOC_TRIM is None, reason="no glibc malloc_trim on this platform")
def test_freed_heap_pages_go_back_to_the_os():
    # 400 MB in 100 kB blocks (below glibc's mmap threshold, so on the heap); freeing every other one
    # leaves 200 MB of holes between live blocks, which glibc keeps, as after a step's peak
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    for _ in range(4000):
        blocks.append(libc.malloc(100_000))
        ctypes.memset(blocks[-1], 1, 100_000)   # touched, so resident
    for block in blocks[::2]:
        libc.free(block)
    kept = memory.rss_mb()
    memory.release_free_heap()
    after = memory.rss_mb()
    for block in blocks[1::2]:
        libc.free(block)
    assert kept - after > 150, (kept, after)


def test_each_phase_gets_its_time_and_the_memory_at_its_end(tmp_path):
    with memory.Phases(CPU, 0, settings(tmp_path), print) as phases:
        phases.start(1)
        phases.end("gen")
        held = np.ones(50 * 2**20 // 8)   # 50 MB, every page written: resident
        time.sleep(0.05)
        phases.end("score")
        del held
        phases.end("train")
        times, rec = phases.times(), phases.record()
    assert [k for k in rec if k.endswith("_rss_mb")] == ["start_rss_mb", "gen_rss_mb", "score_rss_mb", "train_rss_mb"]
    assert rec["score_rss_mb"] - rec["gen_rss_mb"] == pytest.approx(50, abs=3)
    assert rec["train_rss_mb"] - rec["score_rss_mb"] == pytest.approx(-50, abs=3)
    assert rec["rss_mb"] == rec["train_rss_mb"] and 0 < rec["rss_mb"] <= rec["rss_peak_mb"] + 1
    assert set(times) == {"gen", "score", "train", "step", "heap_trim"}
    assert 0.05 <= times["score"] < times["step"] == pytest.approx(times["gen"] + times["score"] + times["train"])
    assert 0 < times["heap_trim"] < times["step"]   # the trims before each reading: part of the phases
    assert not any(k.startswith("cuda") or "_cuda_" in k for k in rec)   # CPU: no CUDA keys


def test_allocator_stats_from_the_keys_of_cuda_memory_stats():
    stats = {"num_alloc_retries": 3, "reserved_bytes.all.current": 6 * 2**30,
             "allocated_bytes.all.current": 4 * 2**30, "inactive_split_bytes.all.current": 512 * 2**20}
    # the names are torch's own: its memory_stats() documentation lists each of them
    assert all(key.split(".")[0] in torch.cuda.memory_stats.__doc__ for key in stats)
    assert memory.allocator_stats(stats) == {"cuda_alloc_retries": 3, "cuda_frag_mb": 2048.0,
                                             "cuda_inactive_split_mb": 512.0}


LEAK_LINE = next(i for i, line in enumerate(open(__file__), 1) if line.rstrip().endswith("# the leak"))


def run_steps(phases, steps, kept):
    for step in range(1, steps + 1):
        phases.start(step)
        kept.append((np.ones(2**17), torch.ones(64, 32)))   # the leak
        phases.end("gen")
        phases.record()


@pytest.mark.slow   # a process of its own (or a traced run): seconds
def test_a_trace_names_the_leaking_line_and_the_tensors_that_pile_up(tmp_path):
    said, kept = [], []
    # the process's steps 2-5 traced: the end of step 2 against the end of step 5, three steps of leak
    with memory.Phases(CPU, 0, settings(tmp_path, trace=4, after=1), said.append) as phases:
        run_steps(phases, 7, kept)
        assert not tracemalloc.is_tracing()   # the window is over: the steps after it run at full speed
    evidence = json.loads((tmp_path / "memory" / "trace.json").read_text())
    assert (evidence["from_step"], evidence["to_step"], evidence["ended_early"]) == (2, 5, False)
    top = evidence["sites"][0]
    assert top["site"] == f"{__file__}:{LEAK_LINE}" and top["code"].endswith("# the leak")
    assert top["mb"] == pytest.approx(3.0, abs=0.05) and top["blocks"] >= 3   # 3 x 1 MB of numpy, and the tuples
    assert evidence["tensors"][0] == {"shape": [64, 32], "dtype": "float32", "device": "cpu", "count": 3,
                                      "mb": pytest.approx(3 * 64 * 32 * 4 / 2**20, abs=1e-3), "count_end": 5}
    assert evidence["cuda_snapshot"] is None
    assert any("tracing steps 2-5" in s for s in said) and any("written to" in s for s in said)


@pytest.mark.slow   # a process of its own (or a traced run): seconds
def test_a_run_that_ends_inside_the_window_still_writes_its_evidence(tmp_path):
    kept = []
    with memory.Phases(CPU, 0, settings(tmp_path, trace=10, after=1), print) as phases:
        run_steps(phases, 4, kept)
    evidence = json.loads((tmp_path / "memory" / "trace.json").read_text())
    assert (evidence["from_step"], evidence["to_step"], evidence["ended_early"]) == (2, 4, True)
    assert evidence["tensors"][0]["count"] == 2 and not tracemalloc.is_tracing()


def test_no_trace_on_other_ranks_and_none_before_the_window(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")   # torchrun's second process, as distributed.is_main() reads it
    with memory.Phases(CPU, 1, settings(tmp_path / "a", trace=4, after=1), print) as phases:
        run_steps(phases, 6, [])
    monkeypatch.delenv("RANK")
    said = []
    with memory.Phases(CPU, 0, settings(tmp_path / "b", trace=4, after=10), said.append) as phases:
        run_steps(phases, 3, [])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert any("ended before the trace window" in s for s in said)


def test_the_census_skips_a_compilers_fake_tensors():
    # --compile leaves fake tensors alive, some with symbolic shapes (unhashable sizes); they hold no memory.
    # Counting them crashed a traced run after a compiled one; real tensors beside them are still counted
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    symbolic = mode.from_tensor(torch.zeros(4, 3), symbolic_context=dynamic)
    static = mode.from_tensor(torch.zeros(3, 17, 19))
    real = torch.zeros(5, 7, 11)
    census = memory.tensor_census()
    assert census[((5, 7, 11), "float32", "cpu")][0] >= 1
    assert ((3, 17, 19), "float32", "cpu") not in census
    del symbolic, static, real
