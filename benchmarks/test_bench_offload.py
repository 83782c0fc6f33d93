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
from gpu_timing import median_seconds

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
    _time_host_resident_step(benchmark, STEP_NUMEL, ratio, ROUNDS * 2)


def _time_host_resident_step(benchmark, numel: int, ratio, rounds: int) -> None:
    """Times the step of `numel` fp32 params in 8 tensors on _device, with
    the last `ratio` of the state on the host (None: no offload)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel // 8, device=_device)) for _ in range(8)]
    options = {} if ratio is None else dict(offload="cpu", offload_ratio=ratio)
    opt = rlhfz.ZeroAdamW(params, lr=1e-3, nonfinite=None, **options)
    for p in params:
        p.grad = torch.randn_like(p)

    def step():
        opt.step()
        if _device == "cuda":
            torch.cuda.synchronize()
    benchmark.pedantic(step, rounds=rounds, warmup_rounds=1)
    benchmark.extra_info.update(device=_device, params=numel, offload_ratio=ratio,
                                host_threads=rlhfz.build_info().get("threads"))


# ---- offload / reload at 1-8 GiB of state, and a 1B step with host-resident state (GPU) -------

SWEEP_GIB = [1, 4, 8]


@needs_gpu
@pytest.mark.parametrize("gib", SWEEP_GIB)
def test_offload_reload_sweep(benchmark, gib):
    """rlhfz's offload and reload of `gib` GiB of state (params, grads and both
    moments of gib/16 G fp32 params) against one pinned cudaMemcpy of the same
    bytes each way, all timed in this test (median of 3 after a warm-up);
    the benchmark's own rounds time the offload + reload round trip."""
    benchmark.group = "offload sweep (GPU)"
    numel = (gib << 30) // 16
    param = torch.nn.Parameter(torch.randn(numel, device="cuda"))
    opt = rlhfz.ZeroAdamW([param], lr=1e-3, nonfinite=None)
    param.grad = torch.randn_like(param)
    opt.step()
    nbytes = _state_bytes(opt)

    offload_s = median_seconds(opt.offload, 3, setup=opt.reload)
    reload_s = median_seconds(opt.reload, 3, setup=opt.offload)
    del opt, param
    gc.collect()
    torch.cuda.empty_cache()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw_to_host_s = median_seconds(lambda: pinned.copy_(device, non_blocking=True), 3)
    raw_to_device_s = median_seconds(lambda: device.copy_(pinned, non_blocking=True), 3)

    def round_trip():
        pinned.copy_(device, non_blocking=True)
        device.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
    benchmark.pedantic(round_trip, rounds=1, iterations=1)
    info = benchmark.extra_info
    info.update(gib=gib, bytes=nbytes,
                offload_GBps=round(nbytes / offload_s / 1e9, 2),
                reload_GBps=round(nbytes / reload_s / 1e9, 2),
                raw_to_host_GBps=round(nbytes / raw_to_host_s / 1e9, 2),
                raw_to_device_GBps=round(nbytes / raw_to_device_s / 1e9, 2),
                offload_fraction_of_raw=round(raw_to_host_s / offload_s, 3),
                reload_fraction_of_raw=round(raw_to_device_s / reload_s, 3),
                offload_s=round(offload_s, 3), reload_s=round(reload_s, 3))
    print(f"\n{gib} GiB: offload {info['offload_GBps']} GB/s ({info['offload_fraction_of_raw']} "
          f"of raw), reload {info['reload_GBps']} GB/s ({info['reload_fraction_of_raw']} of raw)")


@needs_gpu
@pytest.mark.parametrize("ratio", [None, 0.5, 1.0], ids=["plain", "ratio0.5", "ratio1"])
def test_step_1B_with_host_resident_state(benchmark, ratio):
    """A 1B-param fp32 model's step (8 tensors) with its optimizer state on the
    device, half of it on the host, or all of it on the host (CPU SIMD Adam,
    params copied back): what offload="cpu" costs per step at scale."""
    benchmark.group = "1B step with offload='cpu' (cuda)"
    _time_host_resident_step(benchmark, 1_000_000_000, ratio, 3)
