"""Host memory really goes back to the OS, whatever the buffer's size.

glibc keeps blocks under its mmap threshold on the heap, and a free does
not return their pages; the threshold rises to 32 MiB after the first large
free, which is where stage-3 units and stage-2 shards sit. rlhfz maps host
buffers from 64 KiB up on their own, so freeing one (an offload, a dropped
optimizer) lowers RSS by its size. Each case runs in a fresh process, with
the threshold raised first as a long-running program would have it.
"""
import pytest

import host_memory_workers as workers
from rlhfz.launch import run_ranks
from soak_workers import footprint_is_measurable

pytestmark = pytest.mark.skipif(not footprint_is_measurable(),
                                reason="RSS under AddressSanitizer's allocator says nothing")

MIB = 1 << 20


@pytest.mark.parametrize("nbytes", [96 << 10, 1 * MIB, 8 * MIB], ids=["96KiB", "1MiB", "8MiB"])
def test_freed_host_buffers_under_32_mib_give_their_pages_back(nbytes):
    count = max(4, (64 * MIB) // nbytes)
    (result,) = run_ranks(workers.buffers_freed, 1, count, nbytes)
    grew = result["held"] - result["before"]
    assert grew >= 0.8 * count * nbytes // 1024, result     # the buffers were resident
    assert result["held"] - result["freed"] >= 0.95 * grew, result    # and all went back


@pytest.mark.parametrize("world_size, stage", [(2, 2), (3, 2), (2, 3)])
def test_offload_to_disk_gives_the_state_back_every_cycle(tmp_path, world_size, stage):
    """Offloading to disk leaves the state in files: RSS drops by most of
    what the optimizer held, cycle after cycle, with every buffer < 32 MiB."""
    results = run_ranks(workers.offload_cycles, world_size, stage, str(tmp_path), 4)
    for rank, result in enumerate(results):
        assert result["largest_buffer"] < 32 * MIB
        for cycle, (home, away) in enumerate(result["trace"]):
            assert home - away >= 0.8 * result["state_kib"], (rank, cycle, result)
