"""The per-step memory readings and the release of freed heap pages."""
import ctypes

import pytest
import torch

from grpo import memory


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


def test_snapshot_has_rss_and_a_peak_at_least_as_large():
    rec = memory.snapshot(torch.device("cpu"))
    assert 0 < rec["rss_mb"] <= rec["rss_peak_mb"] + 1
