"""Offload and reload bandwidth: rlhfz against a raw copy of the same bytes.

The state is 1 GiB (64M fp32 params: params, grads, exp_avg, exp_avg_sq of
256 MiB each). Host <-> disk compares opt.offload(to="disk") and
opt.reload() with numpy copying the same four arrays into and out of
files it maps itself (np.memmap), files made and deleted alike: the raw
memcpy of the same bytes. On a GPU, device <-> pinned compares with one
cudaMemcpy of the same bytes (torch copy_ between one pinned and one
device tensor) and with a plain `tensor.to("cpu", non_blocking=True)`
loop over the same tensors. GB/s counts the bytes moved once.

Run: python -m pytest benchmarks/test_bench_offload.py. make gpu-check times the
GPU ones and the step (-k 'not disk'), then runs the whole file once as a test
(--benchmark-disable).
"""
import gc
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch

import rlhfz

NUMEL = 64 << 20
ROUNDS = 5
_raw: dict[str, float] = {}


def _record(benchmark, nbytes: int, key: str, raw: bool = False) -> None:
    if benchmark.stats is None:
        return      # --benchmark-disable: each ran once, as a test (make gpu-check does this)
    seconds = benchmark.stats.stats.median
    gbps = nbytes / seconds / 1e9
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB/s"] = round(gbps, 2)
    if raw:
        _raw[key] = gbps
    elif key in _raw:
        benchmark.extra_info["fraction_of_raw_copy"] = round(gbps / _raw[key], 3)


@pytest.fixture
def directory():
    path = tempfile.mkdtemp(prefix="rlhfz-bench-")
    yield path
    shutil.rmtree(path, ignore_errors=True)
    gc.collect()


def _optimizer(device="cpu"):
    param = torch.nn.Parameter(torch.randn(NUMEL, device=device))
    opt = rlhfz.ZeroAdamW([param], lr=1e-3, nonfinite=None)
    param.grad = torch.randn_like(param)
    opt.step()
    return param, opt


def _state_bytes(opt) -> int:
    return sum(sum(t.values()) for t in opt.memory_report().values())


# ---- host <-> disk -----------------------------------------------------------------------

def test_raw_copy_to_disk(benchmark, directory):
    benchmark.group = "host -> disk"
    arrays = [np.random.default_rng(i).standard_normal(NUMEL, dtype=np.float32)
              for i in range(4)]

    def write():
        for i, array in enumerate(arrays):
            target = np.memmap(os.path.join(directory, f"raw{i}"), np.float32, "w+",
                               shape=array.shape)
            np.copyto(target, array)
            del target

    def clean():
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
    benchmark.pedantic(write, setup=clean, rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, 4 * NUMEL * 4, "to disk", raw=True)


def test_rlhfz_offload_to_disk(benchmark, directory):
    benchmark.group = "host -> disk"
    _, opt = _optimizer()
    benchmark.pedantic(lambda: opt.offload(to="disk", path=directory), setup=opt.reload,
                       rounds=ROUNDS, warmup_rounds=1)
    opt.reload()
    _record(benchmark, _state_bytes(opt), "to disk")


def test_raw_copy_from_disk(benchmark, directory):
    benchmark.group = "disk -> host"
    paths = [os.path.join(directory, f"raw{i}") for i in range(4)]
    for i, path in enumerate(paths):
        mapped = np.memmap(path, np.float32, "w+", shape=(NUMEL,))
        mapped[:] = i
        del mapped

    def read():
        # as a reload does: map the file, copy into new host memory
        targets = []
        for path in paths:
            source = np.memmap(path, np.float32, "r", shape=(NUMEL,))
            targets.append(np.array(source))
            del source
        return targets
    benchmark.pedantic(read, rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, 4 * NUMEL * 4, "from disk", raw=True)


def test_rlhfz_reload_from_disk(benchmark, directory):
    benchmark.group = "disk -> host"
    _, opt = _optimizer()
    benchmark.pedantic(opt.reload, setup=lambda: opt.offload(to="disk", path=directory),
                       rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, _state_bytes(opt), "from disk")


# ---- device <-> pinned (GPU) -----------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and rlhfz.build_info()["cuda"]),
                               reason="needs a CUDA device")


@needs_gpu
def test_raw_cuda_memcpy_to_pinned(benchmark):
    benchmark.group = "device -> host (GPU)"
    source = torch.randn(4 * NUMEL, device="cuda")
    target = torch.empty(4 * NUMEL, pin_memory=True)

    def copy():
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
    benchmark.pedantic(copy, rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, source.numel() * 4, "to host", raw=True)


@needs_gpu
def test_torch_to_cpu_loop(benchmark):
    benchmark.group = "device -> host (GPU)"
    tensors = [torch.randn(NUMEL, device="cuda") for _ in range(4)]

    def move():
        moved = [t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.synchronize()
        return moved
    benchmark.pedantic(move, rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, 4 * NUMEL * 4, "to host")


@needs_gpu
def test_rlhfz_offload_to_pinned(benchmark):
    benchmark.group = "device -> host (GPU)"
    _, opt = _optimizer("cuda")
    benchmark.pedantic(opt.offload, setup=opt.reload, rounds=ROUNDS, warmup_rounds=1)
    opt.reload()
    _record(benchmark, _state_bytes(opt), "to host")


@needs_gpu
def test_raw_cuda_memcpy_to_device(benchmark):
    benchmark.group = "host -> device (GPU)"
    source = torch.randn(4 * NUMEL).pin_memory()
    target = torch.empty(4 * NUMEL, device="cuda")

    def copy():
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
    benchmark.pedantic(copy, rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, source.numel() * 4, "to device", raw=True)


@needs_gpu
def test_rlhfz_reload_from_pinned(benchmark):
    benchmark.group = "host -> device (GPU)"
    _, opt = _optimizer("cuda")
    benchmark.pedantic(opt.reload, setup=opt.offload, rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, _state_bytes(opt), "to device")


# ---- a training step with host-resident optimizer state ---------------------------------------

STEP_NUMEL = 32 << 20
_device = "cuda" if torch.cuda.is_available() and rlhfz.build_info()["cuda"] else "cpu"


@pytest.mark.parametrize("ratio", [None, 0.0, 0.5, 1.0], ids=["plain", "ratio0", "ratio0.5",
                                                               "ratio1"])
def test_step_with_host_resident_state(benchmark, ratio):
    """offload="cpu": the last `ratio` of each shard steps on the CPU, the rest
    on the params' device (here: the CPU when no GPU, where it only adds the
    split's copies). 32M fp32 params in 8 tensors."""
    benchmark.group = f"step with offload='cpu' ({_device}, {STEP_NUMEL >> 20}M params)"
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(STEP_NUMEL // 8, device=_device))
              for _ in range(8)]
    options = {} if ratio is None else dict(offload="cpu", offload_ratio=ratio)
    opt = rlhfz.ZeroAdamW(params, lr=1e-3, nonfinite=None, **options)
    for p in params:
        p.grad = torch.randn_like(p)

    def step():
        opt.step()
        if _device == "cuda":
            torch.cuda.synchronize()
    benchmark.pedantic(step, rounds=ROUNDS * 2, warmup_rounds=1)
    benchmark.extra_info["device"] = _device
    benchmark.extra_info["params"] = STEP_NUMEL
    benchmark.extra_info["offload_ratio"] = ratio
