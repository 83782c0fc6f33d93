"""What the GPU benchmarks and tools/perf share: a median of host-timed,
device-synchronized calls, and a world of one rank over NCCL on GPU 0."""
import contextlib
import datetime
import socket
import statistics
import time

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


def median_seconds(fn, rounds: int, *, setup=None, warmup: int = 1, sync: bool = True) -> float:
    """The median wall time of fn() over `rounds` calls, after `warmup` more.
    setup() runs before each call, untimed. With sync the device is idle as
    each call starts and is synchronized before its time is read; without,
    the calls queue back to back and the time is the host's alone."""
    times = []
    for i in range(warmup + rounds):
        if setup is not None:
            setup()
        if sync or i == warmup:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
