"""The native NCCL communicator behind ZeroAdamW(collectives="nccl"), on a GPU.

One GPU allows one NCCL rank, so these run a world of one: the unique-id
bootstrap over the gloo control group, each collective on rlhfz's stream
joined back to torch's, results read after torch's stream waits (no host
sync in between), and explicit destruction. Without a GPU they skip.
"""
import datetime
import os
import socket

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one():
    import torch.distributed as dist
    os.environ.setdefault("RLHFZ_COLLECTIVE_TIMEOUT", "60")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_native_collectives_round_trip(world_of_one):
    from rlhfz.nccl import NativeNcclCommunicator
    device = torch.device("cuda", torch.cuda.current_device())
    comm = NativeNcclCommunicator(None, device)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            full = torch.randn(4099, device=device).to(dtype)
            shard = torch.empty_like(full)
            comm.reduce_scatter(shard, full.clone())            # the mean of one rank: itself
            assert torch.equal(shard, full)
            gathered = torch.zeros_like(full)
            work = comm.all_gather(gathered, shard, async_op=True)
            work.wait()
            assert torch.equal(gathered, full)
            averaged = full.clone()
            comm.all_reduce_avg(averaged)
            assert torch.equal(averaged, full)
        # Work torch queued just before is seen by the collective.
        x = torch.zeros(1 << 20, device=device)
        x.add_(3.0)
        out = torch.empty_like(x)
        comm.all_gather(out, x)
        assert bool((out == 3.0).all())
        with pytest.raises(TypeError, match="float32, bfloat16 and float16"):
            comm.all_reduce_avg(torch.zeros(4, dtype=torch.float64, device=device))
        with pytest.raises(ValueError, match="contiguous CUDA tensors"):
            comm.all_reduce_avg(torch.zeros(4))
    finally:
        comm.destroy()
    assert not comm.nccl.alive

