"""Where reload()'s time goes against one pinned cudaMemcpy, on one GPU.

4 GiB of state (params, grads and both moments of one 256M-element fp32
param). Each line is the median of ROUNDS, timed on the host with the
device synchronized: reload() itself, then the pieces a reload does alone:
allocating the four device buffers, copying into buffers already mapped,
and copying into memory just given back to the driver (torch's cache
emptied first), which pays the mapping as reload does. Run on a GPU machine:

    PYTHONPATH=. python3 tools/perf/reload_cost.py
"""
import gc
import os
import sys

import torch

import rlhfz
from rlhfz.engine import backend_for

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
from gpu_timing import median_seconds  # noqa: E402

ROUNDS = 5
GIB = 4


def median_ms(fn, setup=None):
    return median_seconds(fn, ROUNDS, setup=setup) * 1e3


def main():
    numel = (GIB << 30) // 16
    param = torch.nn.Parameter(torch.randn(numel, device="cuda"))
    opt = rlhfz.ZeroAdamW([param], lr=1e-3, nonfinite=None)
    param.grad = torch.randn_like(param)
    opt.step()
    rows = [("reload()", median_ms(opt.reload, setup=opt.offload)),
            ("offload()", median_ms(opt.offload, setup=opt.reload))]
    opt.reload()
    del opt, param
    gc.collect()
    torch.cuda.empty_cache()
    backend = backend_for(torch.device("cuda", 0))
    part = numel * 4
    held = []

    def allocate():
        held.extend(backend.buffer(part, zero=False) for _ in range(4))

    def free():
        held.clear()
        backend.reap()
        torch.cuda.empty_cache()
    rows.append(("4 x backend.buffer(1 GiB)", median_ms(allocate, setup=free)))
    free()
    pinned = torch.empty(4 * part, dtype=torch.uint8, pin_memory=True)
    mapped = torch.empty(4 * part, dtype=torch.uint8, device="cuda")
    rows.append(("one copy into mapped memory", median_ms(
        lambda: mapped.copy_(pinned, non_blocking=True))))
    pieces = [pinned[i * part:(i + 1) * part] for i in range(4)]
    rows.append(("4 copies into mapped memory", median_ms(
        lambda: [mapped[i * part:(i + 1) * part].copy_(p, non_blocking=True)
                 for i, p in enumerate(pieces)])))
    del mapped
    fresh = []

    def unmap():
        fresh.clear()
        torch.cuda.empty_cache()

    def allocate_and_copy():
        for p in pieces:
            fresh.append(torch.empty(part, dtype=torch.uint8, device="cuda"))
            fresh[-1].copy_(p, non_blocking=True)
    rows.append(("4 x (allocate from the driver, copy)", median_ms(allocate_and_copy,
                                                                  setup=unmap)))
    print(f"{GIB} GiB of state, median of {ROUNDS} (ms)")
    for name, ms in rows:
        print(f"  {name:<42} {ms:9.2f}  {GIB * 2**30 / ms / 1e6:7.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
