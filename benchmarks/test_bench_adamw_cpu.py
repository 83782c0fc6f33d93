"""CPU AdamW step: rlhfz against torch's foreach and fused AdamW, in one run.

Each group holds one size and dtype path. GB/s counts AdamW's 28 bytes per
param: fp32 reads p, g, m, v and writes p, m, v; the 16-bit path reads a
16-bit grad and fp32 master, m, v, and writes fp32 master, m, v and a 16-bit
param. The bound is rlhfz's traffic-bound kernel: exactly those 28 bytes per
param of fp32 traffic with trivial arithmetic, on the same threads, measured
in the same run. A plain copy would not do: write-allocate makes it
understate what the memory can sustain.

Run: make bench   (or: python -m pytest benchmarks -q)
"""
import gc

import pytest
import torch

import rlhfz
from rlhfz import _C

BYTES_PER_PARAM = 28
SIZES = {"10M": 10_000_000, "100M": 100_000_000}
ROUNDS = {"10M": 20, "100M": 5}
_bounds: dict[str, float] = {}


def _record(benchmark, numel: int, size: str, bound: bool = False) -> None:
    seconds = benchmark.stats.stats.min
    gbps = BYTES_PER_PARAM * numel / seconds / 1e9
    benchmark.extra_info["params"] = numel
    benchmark.extra_info["threads"] = rlhfz.get_num_threads()
    benchmark.extra_info["simd"] = rlhfz.build_info()["simd"]
    benchmark.extra_info["GB/s"] = round(gbps, 2)
    if bound:
        _bounds[size] = gbps
    if size in _bounds:
        benchmark.extra_info["fraction_of_bound"] = round(gbps / _bounds[size], 3)


def _run(benchmark, fn, size):
    fn()  # first step allocates lazily (torch) and warms the pages
    benchmark.pedantic(fn, rounds=ROUNDS[size], iterations=1, warmup_rounds=1)


@pytest.fixture(autouse=True)
def _free_between():
    yield
    gc.collect()


# Benchmarks run in file order: the bound first, so the others can report
# their fraction of it.
@pytest.mark.parametrize("size", SIZES)
def test_fp32_bound(benchmark, size):
    benchmark.group = f"adamw-cpu-fp32-{size}"
    n = SIZES[size]
    p, g, m, v = (torch.rand(n) for _ in range(4))
    _run(benchmark, lambda: _C.adamw_traffic_bound(p, g, m, v), size)
    _record(benchmark, n, size, bound=True)


@pytest.mark.parametrize("size", SIZES)
def test_fp32_rlhfz(benchmark, size):
    benchmark.group = f"adamw-cpu-fp32-{size}"
    n = SIZES[size]
    param = torch.nn.Parameter(torch.randn(n))
    opt = rlhfz.ZeroAdamW([param], lr=1e-3)
    param.grad = torch.randn(n)
    _run(benchmark, opt.step, size)
    _record(benchmark, n, size)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_fp32_torch(benchmark, size, impl):
    benchmark.group = f"adamw-cpu-fp32-{size}"
    n = SIZES[size]
    param = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.AdamW([param], lr=1e-3, foreach=impl == "foreach",
                            fused=(impl == "fused") or None)
    param.grad = torch.randn(n)
    _run(benchmark, opt.step, size)
    _record(benchmark, n, size)


@pytest.mark.parametrize("size", SIZES)
def test_bf16_bound(benchmark, size):
    benchmark.group = f"adamw-cpu-bf16-{size}"
    n = SIZES[size]
    p, g, m, v = (torch.rand(n) for _ in range(4))
    _run(benchmark, lambda: _C.adamw_traffic_bound(p, g, m, v), size)
    _record(benchmark, n, size, bound=True)


@pytest.mark.parametrize("size", SIZES)
def test_bf16_rlhfz(benchmark, size):
    """bf16 params and grads, fp32 master and moments: 28 bytes per param."""
    benchmark.group = f"adamw-cpu-bf16-{size}"
    n = SIZES[size]
    param = torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16))
    opt = rlhfz.ZeroAdamW([param], lr=1e-3)
    param.grad = torch.randn(n, dtype=torch.bfloat16)
    _run(benchmark, opt.step, size)
    _record(benchmark, n, size)


@pytest.mark.parametrize("size", SIZES)
def test_bf16_torch_fused_fp32_master(benchmark, size):
    """torch's nearest equivalent: fused AdamW on an fp32 master copy, then a
    cast into the bf16 param (grads cast up first): the same 28 bytes of
    state traffic plus the casts a torch user would write."""
    benchmark.group = f"adamw-cpu-bf16-{size}"
    n = SIZES[size]
    param = torch.randn(n, dtype=torch.bfloat16)
    master = torch.nn.Parameter(param.float())
    grad16 = torch.randn(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([master], lr=1e-3, fused=True)

    def step():
        master.grad = grad16.float()
        opt.step()
        param.copy_(master.detach())

    _run(benchmark, step, size)
    _record(benchmark, n, size)
