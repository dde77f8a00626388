"""The per-step memory readings and the release of freed heap pages."""
import pytest

from grpo import memory


@pytest.mark.skipif(memory._MALLOC_TRIM is None, reason="no glibc malloc_trim on this platform")
def test_freed_heap_pages_go_back_to_the_os():
    # 300 MB in 100 kB blocks (below glibc's mmap threshold, so on the heap), each followed by a small
    # block that stays alive: freeing the big ones leaves holes that glibc keeps, as after a step's peak
    big, small = [], []
    for _ in range(3000):
        big.append(bytearray(100_000))
        small.append(bytearray(200))
    before = memory.rss_mb()
    del big
    kept = memory.rss_mb()
    memory.release_free_heap()
    after = memory.rss_mb()
    assert kept - after > 150, (before, kept, after)
    assert len(small) == 3000


def test_snapshot_has_rss_and_a_peak_at_least_as_large():
    import torch
    rec = memory.snapshot(torch.device("cpu"))
    assert 0 < rec["rss_mb"] <= rec["rss_peak_mb"] + 1
