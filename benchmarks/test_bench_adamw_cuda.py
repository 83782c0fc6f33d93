"""CUDA AdamW step: rlhfz against torch's fused and foreach AdamW, in one run.

Each group holds one size of fp32 params. GB/s counts AdamW's 28 bytes per
param (read p, g, m, v: 16; write p, m, v: 12) over the median round. The
bound is the device's copy bandwidth, measured in the same run: dst.copy_(src)
(a cudaMemcpy device to device) moves 2 x nbytes, a read and a write.

- rlhfz_kernel: _C.cuda_adamw_step on flat device Buffers, one launch, as a
  bucket is stepped.
- rlhfz_optimizer: ZeroAdamW.step() on one flat param; "checked" is the
  default nonfinite="raise" (one more read of the grads, and a host sync for
  its result), "unchecked" is torch's semantics.
- torch_fused, torch_foreach: torch.optim.AdamW over the same size split
  into 4M-element params, as a model's would be.

Targets (reported in extra_info, not asserted): the kernel at >= 0.9 of the
copy bound, and >= 1.1x torch fused at 1B. Every timed call synchronizes
the device, so wall time is GPU time; a synchronize before each round
starts it on an idle device.

Run: make gpu-check   (or: python -m pytest benchmarks/test_bench_adamw_cuda.py,
with -k 100M or -k 1B for one size, as make gpu-check runs them)
"""
import gc

import pytest
import torch

import rlhfz
from rlhfz import _C


def _gpu_usable() -> bool:
    return torch.cuda.is_available() and bool(_C.build_info()["cuda"])


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_usable(),
                                 reason="needs a CUDA device visible to torch and to rlhfz")]

BYTES_PER_PARAM = 28
SIZES = {"100M": 100_000_000, "1B": 1_000_000_000}
ROUNDS = {"100M": 50, "1B": 20}
CHUNK = 4_000_000            # elements per torch param
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
TARGET_FRACTION_OF_BOUND = 0.9
TARGET_SPEEDUP_1B = 1.1
# Filled as the run goes (benchmarks run in file order: the bound and torch
# first), so later rows can report their fraction and speedup.
_copy_gbps: dict[str, float] = {}
_torch_fused_ms: dict[str, float] = {}


@pytest.fixture(autouse=True)
def _free_between():
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _need(nbytes: int) -> None:
    """Skips the test unless the device has nbytes free (and some margin)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes * 1.05:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB free on the device; "
                    f"{free / 2**30:.1f} GiB are")


def _synced(fn):
    def timed():
        fn()
        torch.cuda.synchronize()
    return timed


def _run(benchmark, fn, size):
    timed = _synced(fn)
    for _ in range(2):          # lazy state, kernel loading, clocks
        timed()
    benchmark.pedantic(timed, setup=torch.cuda.synchronize, rounds=ROUNDS[size], iterations=1,
                       warmup_rounds=1)


def _record(benchmark, implementation, size, traffic_bytes=None):
    n = SIZES[size]
    seconds = benchmark.stats.stats.median
    gbps = (traffic_bytes or BYTES_PER_PARAM * n) / seconds / 1e9
    info = benchmark.extra_info
    info.update(implementation=implementation, size=size, params=n,
                ms=round(seconds * 1e3, 3), gbps=round(gbps, 1),
                device=torch.cuda.get_device_name(), torch=torch.__version__)
    if size in _copy_gbps:
        info["copy_gbps"] = round(_copy_gbps[size], 1)
        info["fraction_of_bound"] = round(gbps / _copy_gbps[size], 3)
    if size in _torch_fused_ms and implementation != "torch_fused":
        info["speedup_vs_torch_fused"] = round(_torch_fused_ms[size] / (seconds * 1e3), 3)
    return seconds


def _group(size):
    return f"adamw-cuda-fp32-{size}"


@pytest.mark.parametrize("size", SIZES)
def test_copy_bound(benchmark, size):
    benchmark.group = _group(size)
    n = SIZES[size]
    _need(8 * n)
    src = torch.rand(n, device="cuda")
    dst = torch.empty_like(src)
    _run(benchmark, lambda: dst.copy_(src), size)
    _copy_gbps[size] = 8 * n / benchmark.stats.stats.median / 1e9
    _record(benchmark, "copy_bound", size, traffic_bytes=8 * n)


def _torch_adamw(n, impl):
    sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    params = []
    for size in sizes:
        p = torch.nn.Parameter(torch.randn(size, device="cuda"))
        p.grad = torch.randn(size, device="cuda")
        params.append(p)
    return torch.optim.AdamW(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                             eps=HP["eps"], weight_decay=HP["weight_decay"],
                             foreach=True if impl == "foreach" else None,
                             fused=True if impl == "fused" else None)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_torch(benchmark, size, impl):
    benchmark.group = _group(size)
    n = SIZES[size]
    # p, g, m, v; foreach also holds a temporary the size of v (its sqrt)
    _need((16 if impl == "fused" else 20) * n)
    opt = _torch_adamw(n, impl)
    _run(benchmark, opt.step, size)
    seconds = _record(benchmark, f"torch_{impl}", size)
    if impl == "fused":
        _torch_fused_ms[size] = seconds * 1e3


def _targets(benchmark, size):
    benchmark.extra_info["target_fraction_of_bound"] = TARGET_FRACTION_OF_BOUND
    if size == "1B":
        benchmark.extra_info["target_speedup_vs_torch_fused"] = TARGET_SPEEDUP_1B


@pytest.mark.parametrize("size", SIZES)
def test_rlhfz_kernel(benchmark, size):
    benchmark.group = _group(size)
    n = SIZES[size]
    _need(16 * n)
    buffers = [_C.Buffer(4 * n, tier="device", zero=False) for _ in range(4)]
    views = [b.view("float32") for b in buffers]
    master, exp_avg, exp_avg_sq, grad = (torch.from_dlpack(v) for v in views)
    master.normal_()
    grad.normal_()
    exp_avg.zero_()
    exp_avg_sq.zero_()
    stream = torch.cuda.current_stream().cuda_stream
    # the step number only changes host-side constants; a fixed one keeps rounds alike
    _run(benchmark, lambda: _C.cuda_adamw_step(*views, step=10, stream=stream, **HP), size)
    _record(benchmark, "rlhfz_kernel", size)
    _targets(benchmark, size)


def _fresh_grads(opt):
    """Marks the grads as written since the last step, as a backward would,
    so the checked step cannot reuse an earlier finiteness check."""
    for group in opt.param_groups:
        for p in group["params"]:
            torch.autograd.graph.increment_version(p.grad)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("nonfinite", [None, "raise"], ids=["unchecked", "checked"])
def test_rlhfz_optimizer(benchmark, size, nonfinite):
    benchmark.group = _group(size)
    n = SIZES[size]
    _need(20 * n)           # p, g, m, v, and the param's first copy until it moves in
    param = torch.nn.Parameter(torch.randn(n, device="cuda"))
    opt = rlhfz.ZeroAdamW([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                          weight_decay=HP["weight_decay"], nonfinite=nonfinite)
    param.grad = torch.randn(n, device="cuda")
    opt.step()               # moves the grad into the bucket

    def step():
        _fresh_grads(opt)
        opt.step()

    _run(benchmark, step, size)
    name = "rlhfz_optimizer" + ("_checked" if nonfinite else "_unchecked")
    _record(benchmark, name, size)
    _targets(benchmark, size)
