"""A world of one rank over NCCL on GPU 0, for the NCCL benchmarks and tools."""
import contextlib
import datetime
import socket

import torch
import torch.distributed as dist


@contextlib.contextmanager
def one_rank_nccl():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()
