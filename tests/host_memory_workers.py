"""Bodies of tests/test_host_memory.py, run in fresh processes (spawned ranks)
so that the allocator's state is that of a new program."""
import gc

import torch

from soak_workers import settled_rss_kib

MIB = 1 << 20


def raise_the_heap_threshold() -> None:
    """glibc serves blocks under its mmap threshold from the heap, and the
    threshold rises to the size of a mapped block once that is freed: after
    this, blocks of up to 32 MiB come from the heap, whose pages a free does
    not return."""
    block = torch.empty(48 * MIB, dtype=torch.uint8)
    block.fill_(1)
    del block
    gc.collect()


def buffers_freed(rank: int, world_size: int, count: int, nbytes: int) -> dict:
    """RSS before, while holding and after freeing `count` host buffers of
    nbytes, every page touched as a bucket's first write does; the second of
    two rounds, so that what the first does once (thread pools, caches) is
    not counted."""
    from rlhfz import _C
    raise_the_heap_threshold()
    for _ in range(2):
        before = settled_rss_kib()
        buffers = [_C.Buffer(nbytes, tier="host") for _ in range(count)]
        for b in buffers:
            torch.from_dlpack(b.view("float32")).fill_(7.0)
        held = settled_rss_kib()
        del buffers
        freed = settled_rss_kib()
    return {"before": before, "held": held, "freed": freed}


def offload_cycles(rank: int, world_size: int, stage: int, directory: str, cycles: int) -> dict:
    """A model whose buckets and shards are all under 32 MiB, trained on the
    CPU, offloaded to disk and reloaded `cycles` times: RSS after each
    offload, against RSS with the state in memory."""
    import rlhfz
    torch.manual_seed(0)
    raise_the_heap_threshold()
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])
    opt = rlhfz.ZeroAdamW(model, stage=stage, param_persistence_threshold=0)
    x = torch.randn(8, 512)
    trace = []
    for cycle in range(cycles):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        home = settled_rss_kib()
        opt.offload(to="disk", path=directory)
        away = settled_rss_kib()
        opt.reload()
        trace.append((home, away))
    report = opt.memory_report()
    state_bytes = sum(sum(tiers.values()) for tiers in report.values())
    largest = max(b.nbytes for bucket in opt.engine.buckets
                  for b in bucket.storage.buffers.values() if b is not None)
    opt.close()
    return {"trace": trace, "state_kib": state_bytes // 1024, "largest_buffer": largest}
