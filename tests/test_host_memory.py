"""Host memory really goes back to the OS, whatever the buffer's size.

glibc keeps blocks under its mmap threshold on the heap, and a free does
not return their pages; the threshold rises to 32 MiB after the first large
free, which is where stage-3 units and stage-2 shards sit. rlhfz maps host
buffers from 64 KiB up on their own, so freeing one (an offload, a dropped
optimizer) lowers RSS by its size. Each case runs in a fresh process, with
the threshold raised first as a long-running program would have it.
"""
import pytest
import torch

import host_memory_workers as workers
import rlhfz
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


def _resident_kib_of_files_in(directory) -> int:
    """Resident KiB of this process's mappings of files in `directory`."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:          # a mapping's header
                inside = len(fields) >= 6 and fields[5].startswith(str(directory) + "/")
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_a_checkpoint_leaves_state_offloaded_to_disk_on_disk(tmp_path):
    """save_checkpoint and load_checkpoint read and write the state through
    its files' mappings: what they bring in goes back out after them, so
    an optimizer offloaded to disk keeps its pages out of RAM."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    away = tmp_path / "away"
    away.mkdir()
    opt.offload(to="disk", path=away)
    assert _resident_kib_of_files_in(away) < 64
    rlhfz.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert _resident_kib_of_files_in(away) < 64
    rlhfz.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert _resident_kib_of_files_in(away) < 64
    opt.reload()
