"""Where a native NCCL collective's time goes, against torch's, on one GPU.

A world of one rank over NCCL, a 1 MiB and a 256 MiB reduce-scatter. Each
line is the median of ROUNDS calls of one piece, timed on the host: the
whole call through each engine (then a device synchronize), and the native
engine's pieces alone (its events, its DLPack borrows, the NcclComm launch
with and without the stream hand-off). Run on a GPU machine:

    PYTHONPATH=. python3 tools/perf/nccl_call_cost.py
"""
import os
import sys

import torch
import torch.distributed as dist

from rlhfz import _C
from rlhfz import comm as rlhfz_comm
from rlhfz.engine import backend_for

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
from gpu_timing import median_seconds, one_rank_nccl  # noqa: E402

ROUNDS = 200


def median_us(fn, sync=True):
    return median_seconds(fn, ROUNDS, warmup=10, sync=sync) * 1e6


def main():
    with one_rank_nccl():
        measure()


def measure():
    torch_engine = rlhfz_comm.Communicator(None)
    native = rlhfz_comm.NativeNcclCommunicator(None, backend_for(torch.device("cuda", 0)))
    nccl, stream = native.data.nccl, native.data.stream
    # DLPack names the legacy default stream 1, not 0
    consumer = torch.cuda.current_stream().cuda_stream or 1
    try:
        for nbytes in (1 << 20, 256 << 20):
            full = torch.randn(nbytes // 4, device="cuda")
            shard = torch.empty_like(full)
            rows = [
                ("device synchronize alone", median_us(lambda: None)),
                ("torch engine reduce_scatter", median_us(
                    lambda: torch_engine.reduce_scatter(shard, full))),
                ("dist.reduce_scatter_tensor(AVG)", median_us(
                    lambda: dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG))),
                ("native engine reduce_scatter", median_us(
                    lambda: native.reduce_scatter(shard, full))),
                ("native: _C.CudaEvent() x2, no sync", median_us(
                    lambda: (_C.CudaEvent(0), _C.CudaEvent(0)), sync=False)),
                ("native: full.__dlpack__(stream) x2, no sync", median_us(
                    lambda: (full.__dlpack__(stream=consumer), shard.__dlpack__(stream=consumer)),
                    sync=False)),
            ]
            rows.append(("native: NcclComm.reduce_scatter on its stream", median_us(
                lambda: nccl.reduce_scatter(full, shard, "avg", stream=stream))))
            rows.append(("native: NcclComm.reduce_scatter 'sum'", median_us(
                lambda: nccl.reduce_scatter(full, shard, "sum", stream=stream))))
            rows.append(("native: NcclComm.reduce_scatter launch, no sync", median_us(
                lambda: nccl.reduce_scatter(full, shard, "avg", stream=stream), sync=False)))
            print(f"\n{nbytes >> 20} MiB, median of {ROUNDS} (us)")
            for name, us in rows:
                print(f"  {name:<48} {us:9.1f}", flush=True)
    finally:
        native.destroy()


if __name__ == "__main__":
    main()
