"""The CUDA kernels of rlhfz._C against a float64 reference, and against the
CPU's plain C reference (simd="reference"), which they match bit for bit.

The AdamW kernel spells every operation as a round-to-nearest intrinsic (no
FMA contraction), in the reference's order, with correctly rounded division
and square root; the reference is built without contraction too. So every
finite result is the same fp32 value on both, and 16-bit outputs are the same
rounding of it. Only NaN payloads may differ (the GPU returns its canonical
NaN where x86 propagates the input's), so NaN positions are compared, not
their bits.

Every array sits between guard elements holding a signalling-NaN pattern
that no kernel writes; sizes have odd tails, and starts at element offsets
1 and 3 rule out 16-byte vector loads.

The device tests run on a GPU or on the simulated CUDA runtime of a
RLHFZ_CUDA=sim build (tests/device_support.py), which runs the kernels' own
device code on the host, one thread after another: there the sizes stop at
100_003, and LARGE, which every grid-stride loop goes round, comes in a few
cases of each kernel only. A few tests need torch's CUDA build (its
streams, CUDA graphs, compute-sanitizer) and run on a real GPU only. The
simulator has tests of its own where it can check more than a GPU can: a
failure injected into a launch, and work held in flight on a stream (a host
address handed to a kernel: test_cuda_ops_args.py). The argument checks
that come before any device work run everywhere.
"""
import itertools
import math
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import rlhfz
from device_support import (SENTINEL, SIMULATED, Guarded, assert_same_bits, bits, empty, held,
                            needs_device, needs_real_gpu, needs_simulator, to_device, zeros)
from device_support import stream as current_stream
from rlhfz import _C

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SIZES = [1, 7, 8, 9, 1023, 4097, 100_003] + sorted(
    int(n) for n in np.random.default_rng(20261122).integers(10, 300_000, 3))
if SIMULATED:
    SIZES = [n for n in SIZES if n <= 100_003]
# Element offsets past the guard of (master, exp_avg, exp_avg_sq, grad, param_out).
LAYOUTS = {"aligned": (0, 0, 0, 0, 0), "offset1": (1, 1, 1, 1, 1),
           "offset3": (3, 3, 3, 3, 3), "mixed": (0, 1, 0, 3, 2)}
HPARAMS = {
    "step1": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1),
    "decay-step1000": dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.1,
                           step=1000),
    "maximize-scaled": dict(lr=1e-2, beta1=0.8, beta2=0.999, eps=1e-8, weight_decay=0.01,
                            step=1, maximize=True, grad_scale=0.5),
    "unscale-step1000": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05,
                             step=1000, grad_scale=1 / 3),
}
# Relative to the magnitudes that enter each result: well above fp32's few
# ulps, far below any real error in the math.
RTOL = 1e-5
# Past RLHFZ_MAX_BLOCKS x 256 threads x 8 elements: every grid-stride loop goes round.
LARGE = 9_000_011


@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    """One torch thread on the simulator, whose stream workers share the
    host's cores with torch: there OpenMP's spinning threads cost far more
    than they save on arrays this small (several times the whole file's
    time, on a busy two-core machine)."""
    threads = torch.get_num_threads()
    if SIMULATED:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sweep(sizes, *axes, large_on_the_simulator=()):
    """Every combination of sizes, with LARGE added, and the other axes; on
    the simulator LARGE comes only with the combinations of the other axes
    given (one with a vector path and one without, where it matters)."""
    cases = list(itertools.product(list(sizes) + ([] if SIMULATED else [LARGE]), *axes))
    if SIMULATED:
        cases += [(LARGE, *rest) for rest in large_on_the_simulator]
    return cases


def _inputs(n, seed, grad_dtype):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    exp_avg = 0.1 * torch.randn(n, generator=gen)
    exp_avg_sq = 0.01 * torch.rand(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    return master, exp_avg, exp_avg_sq, grad


def adamw_f64(master, exp_avg, exp_avg_sq, grad, *, lr, beta1, beta2, eps, weight_decay, step,
              maximize=False, grad_scale=1.0):
    """AdamW in float64, as torch.optim.AdamW writes it, and for each result
    the magnitude of the terms that enter it (the first moment and the
    update can cancel, so only a tolerance relative to those is fair)."""
    g = grad.double() * grad_scale
    if maximize:
        g = -g
    p0, m0, v0 = master.double(), exp_avg.double(), exp_avg_sq.double()
    p = p0 * (1.0 - lr * weight_decay)
    m = m0 + (1.0 - beta1) * (g - m0)
    v = v0 * beta2 + (1.0 - beta2) * g * g
    step_size = lr / (1.0 - beta1 ** step)
    denom = v.sqrt() / math.sqrt(1.0 - beta2 ** step) + eps
    new_p = p - step_size * m / denom
    m_terms = m0.abs() + (1.0 - beta1) * g.abs()
    scales = (p.abs() + step_size * (m_terms + m.abs()) / denom, m_terms, v)
    return (new_p, m, v), scales


def _assert_close_f64(actual, expected, scale, what):
    err = (actual.double() - expected).abs()
    bad = ~(err <= RTOL * scale + 1e-30)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} elements off the float64 result; first "
                             f"at {i}: {actual[i].item()!r} vs {expected[i].item()!r} "
                             f"(allowed {RTOL * scale[i].item():.3g})")


def _cpu_reference(master, exp_avg, exp_avg_sq, grad, param_dtype, **hp):
    arrays = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
    out = None if param_dtype is None else torch.empty(master.numel(), dtype=param_dtype)
    _C.adamw_step(*arrays, grad, out, simd="reference", **hp)
    return arrays, out


def _cuda_step(inputs, offsets, param_dtype, buffer=False, **kwargs):
    """Runs cuda_adamw_step on guarded copies of inputs; returns the Guarded
    arrays (master, exp_avg, exp_avg_sq, grad) and param_out (or None)."""
    arrays = [Guarded(t, off, buffer=buffer) for t, off in zip(inputs, offsets)]
    out = (None if param_dtype is None else
           Guarded(None, offsets[4], n=inputs[0].numel(), dtype=param_dtype, buffer=buffer))
    kwargs.setdefault("stream", current_stream())
    _C.cuda_adamw_step(*(a.arg for a in arrays), out.arg if out else None, **kwargs)
    return arrays, out


def _check_step(arrays, out, inputs, param_dtype, hp, what, f64=None):
    """Guards intact, grad untouched, bit-identical to the CPU reference,
    close to float64, and param_out the master rounded to nearest even."""
    for name, a in zip(("master", "exp_avg", "exp_avg_sq", "grad"), arrays):
        assert a.guards_intact(), f"{what}: {name} written outside its range"
    if out is not None:
        assert out.guards_intact(), f"{what}: param_out written outside its range"
    assert_same_bits(arrays[3].host(), inputs[3], f"{what}: grad changed")
    got = [a.host() for a in arrays[:3]]
    names = ("master", "exp_avg", "exp_avg_sq")
    # the math first, so that a wrong result says so before a bits mismatch
    if f64 is not None:
        for name, g, r, s in zip(names, got, *f64):
            _assert_close_f64(g, r, s, f"{what}: {name}")
    expected, expected_out = _cpu_reference(*inputs, param_dtype, **hp)
    for name, g, e in zip(names, got, expected):
        assert_same_bits(g, e, f"{what}: {name} vs the CPU reference")
    if out is not None:
        assert_same_bits(out.host(), expected_out, f"{what}: param_out vs the CPU reference")
        assert_same_bits(out.host(), got[0].to(param_dtype), f"{what}: param_out vs master")


# ---- AdamW -----------------------------------------------------------------------------

@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
def test_adamw_matches_float64_and_the_cpu_reference_bit_for_bit(n, layout, grad_dtype):
    inputs = _inputs(n, seed=n, grad_dtype=DTYPES[grad_dtype])
    for hp_name, hp in HPARAMS.items():
        f64 = adamw_f64(*inputs, **hp)
        for param_dtype in (None, *DTYPES.values()):
            what = f"n={n} {layout} grad={grad_dtype} param_out={param_dtype} {hp_name}"
            arrays, out = _cuda_step(inputs, LAYOUTS[layout], param_dtype, **hp)
            _check_step(arrays, out, inputs, param_dtype, hp, what, f64)


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("layout", ["aligned", "offset1"])
@pytest.mark.parametrize("n", [7, 4097, 100_003])
def test_adamw_on_rlhfz_buffer_views(n, layout):
    """rlhfz's own device views (the optimizer's path) give the same bits."""
    inputs = _inputs(n, seed=5, grad_dtype=torch.bfloat16)
    hp = HPARAMS["decay-step1000"]
    arrays, out = _cuda_step(inputs, LAYOUTS[layout], torch.bfloat16, buffer=True, **hp)
    _check_step(arrays, out, inputs, torch.bfloat16, hp, f"buffer views n={n} {layout}")


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("layout", ["aligned", "offset3"])
def test_adamw_grid_stride_over_a_large_array(layout):
    inputs = _inputs(LARGE, seed=11, grad_dtype=torch.bfloat16)
    hp = HPARAMS["maximize-scaled"]
    arrays, out = _cuda_step(inputs, LAYOUTS[layout], torch.bfloat16, **hp)
    _check_step(arrays, out, inputs, torch.bfloat16, hp, f"n={LARGE} {layout}")


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_adamw_edge_values_match_the_cpu_reference(grad_dtype):
    """Zeros of both signs, grads whose squares are subnormal or overflow
    16 bits, Inf and NaN: finite results bit for bit, NaN where the CPU has it."""
    nan, inf = float("nan"), float("inf")
    grad = torch.tensor([0.0, -0.0, 1e-30, -1e-20, 1e-20, 1e18, -1e18, 1.0, nan, inf, -inf] * 7)
    grad = grad.to(DTYPES[grad_dtype])
    n = grad.numel()
    inputs = (torch.ones(n), torch.zeros(n), torch.zeros(n), grad)
    hp = HPARAMS["step1"]
    for offsets in (LAYOUTS["aligned"], LAYOUTS["offset1"]):
        arrays, out = _cuda_step(inputs, offsets, torch.float16, **hp)
        assert all(a.guards_intact() for a in arrays) and out.guards_intact()
        expected, expected_out = _cpu_reference(*inputs, torch.float16, **hp)
        for got, want in zip([a.host() for a in arrays[:3]] + [out.host()],
                             expected + [expected_out]):
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            keep = ~torch.isnan(want)
            assert_same_bits(got[keep], want[keep], f"edge values, grad {grad_dtype}")
        assert arrays[0].host()[0].item() == 1.0        # zero grad, zero state: no update


@pytest.mark.gpu
@needs_device
def test_empty_arrays_are_a_no_op():
    # On the simulator torch exports an empty slice of device memory with a
    # null pointer, which no longer says where it lies: rlhfz views there.
    views = SIMULATED
    inputs = _inputs(0, seed=0, grad_dtype=torch.float32)
    arrays, out = _cuda_step(inputs, LAYOUTS["offset1"], torch.bfloat16, buffer=views,
                             **HPARAMS["step1"])
    assert all(a.guards_intact() for a in arrays) and out.guards_intact()
    x = Guarded(torch.empty(0), 1, buffer=views)
    out8, workspace = _sumsq_buffers()
    _C.cuda_store(out8, 0, struct.pack("d", 5.0))
    assert _sumsq(x.arg, out8, workspace, accumulate=True) == 5.0
    assert _sumsq(x.arg, out8, workspace) == 0.0


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("flag", [1, 256, -1])
def test_skip_if_nonzero_writes_nothing(flag):
    """A nonzero int in skip_if (any of its bytes) leaves every array as it
    was; zero lets the step through, exactly as without skip_if."""
    n = 4097
    inputs = _inputs(n, seed=3, grad_dtype=torch.bfloat16)
    hp = HPARAMS["decay-step1000"]
    skip = _C.Buffer(4, tier="device")
    _C.cuda_store(skip, 0, struct.pack("<i", flag), stream=current_stream())
    for offsets in (LAYOUTS["aligned"], LAYOUTS["offset3"]):
        arrays, out = _cuda_step(inputs, offsets, torch.bfloat16, skip_if=skip, **hp)
        for a, before in zip(arrays, inputs):
            assert a.guards_intact()
            assert_same_bits(a.host(), before, f"skip_if={flag}")
        assert out.guards_intact()
        assert bool((bits(out.values) == SENTINEL[torch.bfloat16]).all())
    _C.cuda_store(skip, 0, struct.pack("<i", 0), stream=current_stream())
    arrays, out = _cuda_step(inputs, LAYOUTS["mixed"], torch.bfloat16, skip_if=skip, **hp)
    _check_step(arrays, out, inputs, torch.bfloat16, hp, "skip_if=0")


def _hparams_buffer(hp):
    blob = _C.adamw_hparams_bytes(**hp)
    buffer = _C.Buffer(len(blob), tier="device")
    _C.cuda_store(buffer, 0, blob, stream=current_stream())
    return buffer


# Valid keyword values that differ from every HPARAMS entry: with
# device_hparams the kernel must not use them.
DECOY = dict(lr=0.5, beta1=0.5, beta2=0.5, eps=1.0, weight_decay=0.5, step=3, maximize=False,
             grad_scale=2.0)


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("hp_name", HPARAMS)
def test_device_hparams_equal_the_keyword_path_bit_for_bit(hp_name):
    hp = HPARAMS[hp_name]
    n = 100_003
    inputs = _inputs(n, seed=17, grad_dtype=torch.float16)
    on_device = _hparams_buffer(hp)
    for offsets in (LAYOUTS["aligned"], LAYOUTS["offset1"]):
        keyword, keyword_out = _cuda_step(inputs, offsets, torch.bfloat16, **hp)
        device, device_out = _cuda_step(inputs, offsets, torch.bfloat16,
                                        device_hparams=on_device, **DECOY)
        for a, b in zip(device + [device_out], keyword + [keyword_out]):
            assert a.guards_intact()
            assert_same_bits(a.host(), b.host(), f"device_hparams {hp_name}")


@pytest.mark.gpu
@needs_real_gpu
def test_captured_step_replays_with_the_values_on_the_device():
    """A CUDA graph captured once replays with whatever hyperparameters and
    skip flag the device holds at replay."""
    n = 4097
    inputs = _inputs(n, seed=23, grad_dtype=torch.bfloat16)
    master, exp_avg, exp_avg_sq, grad = (t.cuda() for t in inputs)
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    first, second = HPARAMS["step1"], dict(HPARAMS["step1"], step=2, lr=2e-3)
    on_device = _hparams_buffer(first)
    skip = _C.Buffer(4, tier="device")
    _C.cuda_store(skip, 0, struct.pack("<i", 1), stream=current_stream())
    args = (master, exp_avg, exp_avg_sq, grad, out)
    # a skipped launch first: the kernel is loaded before capture, nothing written
    _C.cuda_adamw_step(*args, device_hparams=on_device, skip_if=skip, stream=current_stream(),
                       **DECOY)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        _C.cuda_adamw_step(*args, device_hparams=on_device, skip_if=skip, stream=current_stream(),
                           **DECOY)
    graph.replay()                       # skip flag still set
    for t, before in zip(args, inputs):
        assert_same_bits(t, before, "replay with skip_if set")

    ref = [t.clone() for t in inputs[:3]]
    ref_out = torch.empty(n, dtype=torch.bfloat16)
    _C.cuda_store(skip, 0, struct.pack("<i", 0), stream=current_stream())
    for hp in (first, second):
        _C.cuda_store(on_device, 0, _C.adamw_hparams_bytes(**hp), stream=current_stream())
        graph.replay()
        _C.adamw_step(*ref, inputs[3], ref_out, simd="reference", **hp)
        for got, want in zip((master, exp_avg, exp_avg_sq, out), ref + [ref_out]):
            assert_same_bits(got, want, f"replay with step={hp['step']}")


@pytest.mark.gpu
@needs_simulator
def test_a_queued_step_uses_the_values_on_the_device_when_it_runs():
    """The captured step's counterpart on the simulator, which has no CUDA
    graphs: a step held in flight on a stream uses the hyperparameters and
    skip flag the device holds when it runs, not those of when it was queued."""
    n = 4097
    inputs = _inputs(n, seed=23, grad_dtype=torch.bfloat16)
    on_device = _hparams_buffer(HPARAMS["step1"])
    later = dict(HPARAMS["step1"], step=2, lr=2e-3)
    skip = _C.Buffer(4, tier="device")                  # zeroed: the flag is clear
    arrays = [Guarded(t, 1) for t in inputs]
    out = Guarded(None, 1, n=n, dtype=torch.bfloat16)
    args = [a.arg for a in arrays] + [out.arg]
    side = _C.CudaStream()
    # The default stream's copies run at once, while the step still waits.
    with held(side):
        _C.cuda_adamw_step(*args, device_hparams=on_device, skip_if=skip, stream=side, **DECOY)
        _C.cuda_store(skip, 0, struct.pack("<i", 1))
    side.synchronize()
    for a, before in zip(arrays, inputs):
        assert_same_bits(a.host(), before, "a step whose flag was set after it was queued")
    assert bool((bits(out.values) == SENTINEL[torch.bfloat16]).all())
    with held(side):
        _C.cuda_adamw_step(*args, device_hparams=on_device, skip_if=skip, stream=side, **DECOY)
        _C.cuda_store(skip, 0, struct.pack("<i", 0))
        _C.cuda_store(on_device, 0, _C.adamw_hparams_bytes(**later))
    side.synchronize()
    _check_step(arrays, out, inputs, torch.bfloat16, later, "hyperparameters stored after queueing")
    side.close()


# ---- sum of squares ----------------------------------------------------------------------

def _sumsq_buffers():
    return (_C.Buffer(8, tier="device"),
            _C.Buffer(_C.cuda_sumsq_workspace_bytes(), tier="device"))


def _sumsq_bytes(x, out, workspace, accumulate=False, stream=None):
    stream = current_stream() if stream is None else stream
    _C.cuda_sumsq(x, out, workspace, accumulate=accumulate, stream=stream)
    return _C.cuda_fetch(out, 0, 8, stream=stream)


def _sumsq(x, out, workspace, accumulate=False, stream=None):
    return struct.unpack("d", _sumsq_bytes(x, out, workspace, accumulate, stream))[0]


@pytest.mark.gpu
@needs_device
# one LARGE case is enough: it sums at offsets 0 and 3, with and without vector loads
@pytest.mark.parametrize("n, offset, dtype", _sweep(SIZES, [0, 1, 3], DTYPES,
                                                    large_on_the_simulator=[(0, "float16")]))
def test_sumsq_matches_the_exact_sum_and_repeats_bit_for_bit(n, offset, dtype):
    gen = torch.Generator().manual_seed(n + offset)
    values = (3 * torch.randn(n, generator=gen)).to(DTYPES[dtype])
    x = Guarded(values, offset)
    out, workspace = _sumsq_buffers()
    results = {_sumsq_bytes(x.arg, out, workspace) for _ in range(3)}
    assert len(results) == 1, "the same input gave different sums"
    value = struct.unpack("d", results.pop())[0]
    # squares of 16- and 32-bit floats are exact in float64: fsum rounds once
    expected = math.fsum((values.double() ** 2).tolist())
    assert value == pytest.approx(expected, rel=1e-12, abs=0)
    assert x.guards_intact()
    assert_same_bits(x.host(), values, "sumsq changed its input")
    # The partition of the elements depends on n alone: another alignment,
    # through an rlhfz view this time, adds in the same order.
    other = Guarded(values, 3 - offset, buffer=True)
    assert _sumsq(other.arg, out, workspace) == value


@pytest.mark.gpu
@needs_device
def test_sumsq_accumulates_in_double():
    out, workspace = _sumsq_buffers()
    a = Guarded(torch.randn(4097) * 1e3, 1)
    b = Guarded(torch.randn(100_003).to(torch.bfloat16), 0)
    sa, sb = _sumsq(a.arg, out, workspace), _sumsq(b.arg, out, workspace)
    _sumsq(a.arg, out, workspace)
    assert _sumsq(b.arg, out, workspace, accumulate=True) == sa + sb


@pytest.mark.gpu
@needs_device
def test_sumsq_writes_each_sum_to_its_own_slot_and_leaves_the_others():
    sizes = [1, 7, 4097, 9, 100_003]
    out = _C.Buffer(8 * (len(sizes) + 1), tier="device")
    _, workspace = _sumsq_buffers()
    stream = current_stream()
    _C.cuda_store(out, 0, struct.pack(f"{len(sizes) + 1}d", *([-1.0] * (len(sizes) + 1))),
                  stream=stream)
    gen = torch.Generator().manual_seed(5)
    arrays = [Guarded(torch.randn(n, generator=gen).to(torch.bfloat16), i % 2)
              for i, n in enumerate(sizes)]
    # backwards, so a slot written past its own would show in a later one
    for index in reversed(range(len(sizes))):
        _C.cuda_sumsq(arrays[index].arg, out, workspace, index=index, stream=stream)
    _C.cuda_sumsq(arrays[0].arg, out, workspace, index=2, accumulate=True, stream=stream)
    got = struct.unpack(f"{len(sizes) + 1}d", _C.cuda_fetch(out, 0, 8 * (len(sizes) + 1),
                                                             stream=stream))
    for index, (n, a) in enumerate(zip(sizes, arrays)):
        alone = _sumsq(a.arg, *_sumsq_buffers())
        expected = alone + (_sumsq(arrays[0].arg, *_sumsq_buffers()) if index == 2 else 0.0)
        assert got[index] == expected, index
        assert alone == pytest.approx(math.fsum((a.host().double() ** 2).tolist()), rel=1e-12)
    assert got[-1] == -1.0, "a slot no launch named was written"


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("index, error", [(-1, ValueError), (2, ValueError), (2**62, ValueError),
                                          (2**63, ValueError), (1.0, TypeError)])
def test_sumsq_refuses_a_slot_past_out(index, error):
    out = _C.Buffer(16, tier="device")
    _, workspace = _sumsq_buffers()
    with pytest.raises(error, match="index|out"):
        _C.cuda_sumsq(Guarded(torch.ones(4), 0).arg, out, workspace, index=index,
                      stream=current_stream())


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("offset", [0, 1])
def test_sumsq_sees_every_nonfinite_value(dtype, bad, offset):
    n = 100_003
    out, workspace = _sumsq_buffers()
    for position in (0, 8, n // 2, n - 3, n - 1):
        values = torch.ones(n, dtype=DTYPES[dtype])
        values[position] = bad
        assert not math.isfinite(_sumsq(Guarded(values, offset).arg, out, workspace)), position
    # the largest finite values square to a finite double
    huge = torch.full((n,), torch.finfo(DTYPES[dtype]).max, dtype=DTYPES[dtype])
    assert math.isfinite(_sumsq(Guarded(huge, offset).arg, out, workspace))


# ---- unscale, scale, cast ---------------------------------------------------------------

def _found_inf_buffer():
    found = _C.Buffer(4, tier="device")
    _C.cuda_store(found, 0, b"\0" * 4, stream=current_stream())
    return found


def _flag(buffer) -> int:
    return struct.unpack("<i", _C.cuda_fetch(buffer, 0, 4, stream=current_stream()))[0]


def _scaled(values, factor):
    """values * factor in fp32, rounded back to values' dtype (to nearest even)."""
    return (values.float() * torch.tensor(factor, dtype=torch.float32)).to(values.dtype)


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("n, offset, dtype, inv_scale", _sweep(
    [1, 7, 4097, 100_003], [0, 3], DTYPES, [1 / 1024, 1 / 3],
    large_on_the_simulator=[(0, "bfloat16", 1 / 3), (3, "float32", 1 / 1024)]))
def test_unscale_scales_and_flags_nonfinite_grads(n, offset, dtype, inv_scale):
    gen = torch.Generator().manual_seed(n)
    values = (64 * torch.randn(n, generator=gen)).to(DTYPES[dtype])
    found = _found_inf_buffer()
    g = Guarded(values, offset)
    _C.cuda_unscale_(g.arg, inv_scale, found, stream=current_stream())
    assert g.guards_intact()
    assert_same_bits(g.host(), _scaled(values, inv_scale), "unscale")
    assert _flag(found) == 0

    bad = values.clone()
    bad[n // 2] = float("inf")
    bad[n - 1] = float("nan")
    g = Guarded(bad, offset)
    _C.cuda_unscale_(g.arg, inv_scale, found, stream=current_stream())
    assert _flag(found) == 1
    got, want = g.host(), _scaled(bad, inv_scale)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and g.guards_intact()
    finite = torch.isfinite(want)
    assert_same_bits(got[finite], want[finite], "unscale beside an Inf")
    # never cleared here: a finite call after leaves the flag set
    _C.cuda_unscale_(Guarded(values, offset).arg, inv_scale, found, stream=current_stream())
    assert _flag(found) == 1


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("n, offset, dtype, factor", _sweep(
    [1, 9, 4097, 100_003], [0, 1], DTYPES, [0.0, 0.5, 7.25, 1 / 3],
    large_on_the_simulator=[(0, "float16", 1 / 3), (1, "float32", 7.25)]))
def test_scale_matches_torch_and_the_cpu_kernel(n, offset, dtype, factor):
    gen = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=gen).to(DTYPES[dtype])
    expected = _scaled(values, factor)
    on_cpu = values.clone()
    _C.scale_(on_cpu, factor)
    assert_same_bits(on_cpu, expected, "CPU scale_")
    x = Guarded(values, offset)
    _C.cuda_scale_(x.arg, factor, stream=current_stream())
    assert x.guards_intact()
    assert_same_bits(x.host(), expected, "cuda_scale_")
    # from the device: the factor there wins over the keyword
    factor_buffer = _C.Buffer(4, tier="device")
    _C.cuda_store(factor_buffer, 0, struct.pack("<f", factor), stream=current_stream())
    y = Guarded(values, offset, buffer=True)
    _C.cuda_scale_(y.arg, 123.0, scale_device=factor_buffer, stream=current_stream())
    assert y.guards_intact()
    assert_same_bits(y.host(), expected, "cuda_scale_ with scale_device")


def _cast_values(n, seed):
    """Normal, tiny (subnormal or zero in 16 bits), huge (Inf in fp16),
    signed zeros and infinities; no NaN (torch's NaN bits differ)."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.tensor([1.0, 1e-6, 1e-40, 7e4, 1e38])
    values = torch.randn(n, generator=gen) * magnitudes[torch.randint(0, 5, (n,), generator=gen)]
    specials = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 65504.0, 65520.0])
    k = min(n, specials.numel())
    values[:k] = specials[:k]
    return values


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("offsets", [(0, 0), (1, 3), (0, 1)])
@pytest.mark.parametrize("n", [1, 7, 4097, 100_003])
def test_cast_matches_torch_round_to_nearest_even(n, offsets, src, dst):
    values = _cast_values(n, seed=n).to(DTYPES[src])
    source = Guarded(values, offsets[0])
    target = Guarded(None, offsets[1], n=n, dtype=DTYPES[dst])
    _C.cuda_cast_(target.arg, source.arg, stream=current_stream())
    assert source.guards_intact() and target.guards_intact()
    assert_same_bits(source.host(), values, "cast changed its source")
    assert_same_bits(target.host(), values.to(DTYPES[dst]), f"cast {src} -> {dst}")


@pytest.mark.gpu
@needs_device
def test_cast_of_a_large_array_and_of_nans_gives_the_cpu_bits():
    values = _cast_values(LARGE, seed=1)
    for dst in (torch.bfloat16, torch.float16):
        target = Guarded(None, 1, n=LARGE, dtype=dst)
        _C.cuda_cast_(target.arg, Guarded(values, 0).arg, stream=current_stream())
        assert target.guards_intact()
        assert_same_bits(target.host(), values.to(dst), f"large cast to {dst}")
    # NaNs with payloads: quieted, the top of the payload kept, as on the CPU
    payloads = torch.tensor([0x7FC00001, 0x7F800001, 0xFFA5A5A5 - (1 << 32), 0x7FFFFFFF,
                             0x3F800000] * 5, dtype=torch.int32).view(torch.float32)
    for src in DTYPES.values():
        source = payloads.to(src) if src == torch.float32 else _cpu_cast(payloads, src)
        for dst in DTYPES.values():
            on_cpu = torch.empty(source.numel(), dtype=dst)
            _C.cast_(on_cpu, source)
            target = Guarded(None, 3, n=source.numel(), dtype=dst)
            _C.cuda_cast_(target.arg, Guarded(source, 1).arg, stream=current_stream())
            assert_same_bits(target.host(), on_cpu, f"NaN cast {src} -> {dst}")


def _cpu_cast(values, dtype):
    out = torch.empty(values.numel(), dtype=dtype)
    _C.cast_(out, values)
    return out


# ---- streams ------------------------------------------------------------------------------

def _sleep(ms: float) -> None:
    """Queues a busy kernel of about `ms` on torch's current stream, so work
    queued after it is still pending when the host moves on."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch")
    torch.cuda._sleep(int(ms * 2e6))     # ~2 GHz clock


@pytest.mark.gpu
@needs_real_gpu
def test_a_kernel_on_another_stream_waits_for_torchs_pending_writes():
    """DLPack's stream handshake: a torch tensor borrowed for a kernel on
    stream s has torch order its pending writes before s's next work."""
    n = 1 << 20
    x = torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    _sleep(50)
    x.fill_(2.0)                                      # still queued on the current stream
    _C.cuda_scale_(x, 3.0, stream=side)               # a stream object with .cuda_stream
    out, workspace = _sumsq_buffers()
    assert _sumsq(x, out, workspace, stream=side.cuda_stream) == 36.0 * n
    torch.cuda.current_stream().wait_stream(side)
    assert bool((x == 6.0).all())


@pytest.mark.gpu
@needs_real_gpu
def test_rlhfz_streams_and_events_order_work():
    """rlhfz's own views have no handshake: an event joins the streams."""
    n = 1 << 20
    buffer = _C.Buffer(4 * n, tier="device")
    alias = torch.from_dlpack(buffer.view("float32"))
    stream, event = _C.CudaStream(), _C.CudaEvent()
    assert stream.handle == stream.cuda_stream != 0
    torch.cuda.synchronize()
    _sleep(50)
    alias.fill_(2.0)
    event.record(torch.cuda.current_stream())
    event.wait(stream)
    _C.cuda_scale_(buffer.view("float32"), 3.0, stream=stream)
    data = np.frombuffer(_C.cuda_fetch(buffer, 0, 4 * n, stream=stream), dtype=np.float32)
    assert (data == 6.0).all()
    stream.synchronize()
    event.synchronize()
    stream.close()
    event.close()
    with pytest.raises(ValueError, match="closed"):
        stream.synchronize()


@pytest.mark.gpu
@needs_simulator
@pytest.mark.parametrize("ordered", [False, True])
def test_an_event_orders_kernels_on_two_rlhfz_streams(ordered):
    """The test above on the simulator, with rlhfz's streams only and
    nothing left to timing: the first stream is held, so its scale stays in
    flight; the sum of squares on the second sees the scaled values only
    when an event orders it after the scale."""
    n = 4097
    first, second = _C.CudaStream(), _C.CudaStream()
    assert first.handle == first.cuda_stream != 0
    x = Guarded(torch.full((n,), 2.0), 1)
    out, workspace = _sumsq_buffers()
    with held(first):
        _C.cuda_scale_(x.arg, 3.0, stream=first)        # 6.0, once the first stream runs
        if ordered:
            written = _C.CudaEvent()
            written.record(first)
            written.wait(second)
        _C.cuda_sumsq(x.arg, out, workspace, stream=second)
        if ordered:
            assert not written.query()
        else:
            second.synchronize()                         # done already, before the scale
    total = struct.unpack("d", _C.cuda_fetch(out, 0, 8, stream=second))[0]
    assert total == (36.0 if ordered else 4.0) * n
    first.synchronize()
    assert bool((x.values == 6.0).all()) and x.guards_intact()
    first.close()
    second.close()
    with pytest.raises(ValueError, match="closed"):
        first.synchronize()


# ---- what only the simulator can check ---------------------------------------------------

class Launch:
    """One call of a CUDA entry point on fresh guarded arrays (the same
    values every time for the same op), and what it may write: its arrays
    with their guards, and its device scalars. state() reads them through
    the simulator's host alias as they are now, without synchronizing."""

    ENTRY = {"adamw": "cuda_adamw_step", "sumsq": "cuda_sumsq", "unscale": "cuda_unscale_",
             "scale": "cuda_scale_", "cast": "cuda_cast_", "copy": "cuda_cast_"}

    def __init__(self, op: str, n: int = 4097, offset: int = 1):
        self.entry = Launch.ENTRY[op]
        values = torch.randn(n, generator=torch.Generator().manual_seed(31))
        self.scalars = []
        if op == "adamw":
            self.arrays = [Guarded(t, offset) for t in _inputs(n, 31, torch.bfloat16)]
            self.arrays.append(Guarded(None, offset, n=n, dtype=torch.bfloat16))
            hp = HPARAMS["decay-step1000"]
            self.call = lambda stream: _C.cuda_adamw_step(*(a.arg for a in self.arrays),
                                                          stream=stream, **hp)
        elif op == "sumsq":
            x = Guarded(values, offset)
            out, workspace = _sumsq_buffers()
            _C.cuda_store(out, 0, struct.pack("d", 5.0))
            self.arrays, self.scalars = [x], [out]
            self.call = lambda stream: _C.cuda_sumsq(x.arg, out, workspace, stream=stream)
        elif op == "unscale":
            values[n // 2] = float("inf")
            g = Guarded(values.to(torch.float16), offset)
            found = _found_inf_buffer()
            self.arrays, self.scalars = [g], [found]
            self.call = lambda stream: _C.cuda_unscale_(g.arg, 1 / 3, found, stream=stream)
        elif op == "scale":
            x = Guarded(values.to(torch.bfloat16), offset)
            self.arrays = [x]
            self.call = lambda stream: _C.cuda_scale_(x.arg, 0.5, stream=stream)
        else:       # a cast, or with one dtype on both sides a copy
            dst = Guarded(None, offset, n=n, dtype=torch.float16 if op == "cast" else torch.float32)
            src = Guarded(values, offset)
            self.arrays = [dst, src]
            self.call = lambda stream: _C.cuda_cast_(dst.arg, src.arg, stream=stream)

    def state(self) -> list[torch.Tensor]:
        return ([a.full.view(torch.uint8).clone() for a in self.arrays] +
                [torch.from_dlpack(b.view("float32")).view(torch.uint8).clone()
                 for b in self.scalars])


def _same(state, other) -> bool:
    return all(torch.equal(a, b) for a, b in zip(state, other, strict=True))


OPS = list(Launch.ENTRY)


@pytest.mark.gpu
@needs_simulator
@pytest.mark.parametrize("op", OPS)
def test_work_on_an_rlhfz_stream_is_not_seen_before_a_sync(op):
    """Every entry point only queues its work on the stream it is given: the
    host sees none of it until the stream is synchronized, and then the same
    bytes as from the default stream."""
    reference = Launch(op)
    before = reference.state()
    reference.call(None)
    after = reference.state()
    assert not _same(after, before)
    launch = Launch(op)
    side = _C.CudaStream()
    with held(side):
        launch.call(side)
        done = _C.CudaEvent()
        done.record(side)
        assert not done.query()
        assert _same(launch.state(), before), "the host saw work still queued"
    side.synchronize()
    assert done.query() and _same(launch.state(), after)
    side.close()


FAILURES = [("adamw", "kernel launch:1"), ("sumsq", "kernel launch:1"),
            ("sumsq", "kernel launch:2"), ("unscale", "kernel launch:1"),
            ("scale", "kernel launch:1"), ("cast", "kernel launch:1"),
            ("copy", "cudaMemcpyAsync:1")]


@pytest.mark.gpu
@needs_simulator
@pytest.mark.parametrize("op, failure", FAILURES)
def test_an_injected_failure_raises_and_writes_nothing(op, failure):
    """A launch (or, for a cast to the same dtype, a copy) that the runtime
    refuses raises RuntimeError naming the entry point and the error, and
    leaves every output as it was (sumsq's second launch failing: out too);
    nothing of it stays behind, so the same call then goes through."""
    launch = Launch(op)
    before = launch.state()
    _C.cuda_sim_inject(failure)
    try:
        with pytest.raises(RuntimeError, match=f"^{launch.entry}: CUDA error: "):
            launch.call(None)
    finally:
        _C.cuda_sim_inject("")
    assert _same(launch.state(), before)
    launch.call(None)
    reference = Launch(op)
    reference.call(None)
    assert _same(launch.state(), reference.state())


# ---- bad input ----------------------------------------------------------------------------

HP = HPARAMS["step1"]


def test_host_arrays_are_refused_before_any_device_work():
    """Runs with or without a GPU: the placement check comes first."""
    host = [torch.zeros(8) for _ in range(4)]
    with pytest.raises(BufferError, match="needs CUDA device memory"):
        _C.cuda_adamw_step(*host, **HP)
    with pytest.raises(BufferError, match="needs CUDA device memory"):
        _C.cuda_adamw_step(*[np.zeros(8, np.float32) for _ in range(4)], **HP)
    with pytest.raises(BufferError, match="needs CUDA device memory"):
        _C.cuda_cast_(torch.zeros(8), torch.zeros(8))
    with pytest.raises(BufferError, match="needs CUDA device memory"):
        _C.cuda_scale_(torch.zeros(8), 2.0)
    with pytest.raises(ValueError, match="step must be >= 1"):
        _C.cuda_adamw_step(*host, **dict(HP, step=0))
    assert all(not t.any() for t in host)


@pytest.mark.gpu
@needs_device
def test_bad_arguments_raise_and_change_nothing():
    n = 33
    inputs = _inputs(n, seed=1, grad_dtype=torch.float32)
    on_device = [to_device(t) for t in inputs]
    master, exp_avg, exp_avg_sq, grad = on_device
    s = current_stream()

    def step(*arrays, **kwargs):
        _C.cuda_adamw_step(*arrays, stream=s, **{**HP, **kwargs})

    with pytest.raises(BufferError, match="master .*needs CUDA device memory"):
        step(inputs[0], exp_avg, exp_avg_sq, grad)
    with pytest.raises(BufferError, match="grad .*needs CUDA device memory"):
        step(master, exp_avg, exp_avg_sq, inputs[3])
    with pytest.raises(BufferError, match="host memory; this kernel needs CUDA"):
        step(master, exp_avg, _C.Buffer(4 * n).view("float32"), grad)
    with pytest.raises(ValueError, match="has 32 elements"):
        step(master, exp_avg, exp_avg_sq, grad[:32])
    with pytest.raises(ValueError, match="elements"):
        step(master, exp_avg, exp_avg_sq, grad, empty(n + 1, torch.bfloat16))
    wide = zeros(2 * n)
    with pytest.raises(ValueError, match="overlap"):
        step(wide[:n], wide[1:n + 1], exp_avg_sq, grad)
    with pytest.raises(ValueError, match="overlap"):
        step(master, exp_avg, exp_avg, grad)
    with pytest.raises(ValueError, match="overlap"):
        step(master, exp_avg, exp_avg_sq, grad, master)
    with pytest.raises(TypeError, match="must be float32"):
        step(to_device(inputs[0].bfloat16()), exp_avg, exp_avg_sq, grad)
    with pytest.raises(TypeError, match="device tier"):
        step(master, exp_avg, exp_avg_sq, grad, skip_if=zeros(1))
    with pytest.raises(BufferError, match="device tier"):
        step(master, exp_avg, exp_avg_sq, grad, skip_if=_C.Buffer(4))
    with pytest.raises(ValueError, match="needs at least"):
        step(master, exp_avg, exp_avg_sq, grad, device_hparams=_C.Buffer(8, tier="device"))
    with pytest.raises(TypeError, match="stream must be"):
        _C.cuda_adamw_step(master, exp_avg, exp_avg_sq, grad, stream="default", **HP)
    for got, before in zip(on_device, inputs):
        assert_same_bits(got, before, "a refused call changed an array")

    out, workspace = _sumsq_buffers()
    with pytest.raises(ValueError, match="needs at least"):
        _C.cuda_sumsq(grad, _C.Buffer(4, tier="device"), workspace, stream=s)
    with pytest.raises(ValueError, match="needs at least"):
        _C.cuda_sumsq(grad, out, _C.Buffer(8, tier="device"), stream=s)
    with pytest.raises(TypeError):
        _C.cuda_sumsq(grad, zeros(1, torch.float64), workspace, stream=s)
    with pytest.raises(ValueError, match="elements"):
        _C.cuda_cast_(empty(n, torch.bfloat16), grad[:32], stream=s)
    with pytest.raises(ValueError, match="overlap"):
        _C.cuda_cast_(wide[1:n + 1], wide[:n], stream=s)
    with pytest.raises(ValueError, match="lie outside"):
        _C.cuda_fetch(out, 4, 8, stream=s)


# ---- compute-sanitizer ------------------------------------------------------------------

# Each kernel on odd sizes and misaligned starts, with only rlhfz and numpy
# (no torch: a lighter process to instrument). Each array ends where its
# Buffer does, so an overrun leaves the allocation.
SANITIZER_CHILD = r"""
import struct
import numpy as np
from rlhfz import _C

DTYPES = ("float32", "bfloat16", "float16")
rng = np.random.default_rng(0)

def device_array(n, dtype, offset):
    values = rng.standard_normal(n).astype(np.float32)
    if dtype == "bfloat16":
        raw = (values.view(np.uint32) >> 16).astype(np.uint16)
    else:
        raw = values.astype(dtype)
    buffer = _C.Buffer((offset + n) * raw.itemsize, tier="device")
    _C.cuda_store(buffer, offset * raw.itemsize, raw.tobytes())
    return buffer, buffer.view(dtype, offset, (n,))

hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3)
blob = _C.adamw_hparams_bytes(**hp)
on_device = _C.Buffer(len(blob), tier="device")
_C.cuda_store(on_device, 0, blob)
flag = _C.Buffer(4, tier="device")
factor = _C.Buffer(4, tier="device")
_C.cuda_store(factor, 0, struct.pack("<f", 0.5))
out = _C.Buffer(8, tier="device")
workspace = _C.Buffer(_C.cuda_sumsq_workspace_bytes(), tier="device")
keep = []
for n in (1, 7, 9, 1029, 70_001):
    for offset in (0, 1, 3):
        state = [device_array(n, "float32", offset) for _ in range(3)]
        keep += state
        for grad_dtype in DTYPES:
            grad = device_array(n, grad_dtype, offset)
            keep.append(grad)
            for param_dtype in (None,) + DTYPES:
                param = device_array(n, param_dtype, offset) if param_dtype else (None, None)
                keep.append(param)
                _C.cuda_adamw_step(*(v for _, v in state), grad[1], param[1], **hp)
            _C.cuda_adamw_step(*(v for _, v in state), grad[1], device_hparams=on_device,
                               skip_if=flag, **hp)
        for dtype in DTYPES:
            x = device_array(n, dtype, offset)
            keep.append(x)
            _C.cuda_sumsq(x[1], out, workspace)
            _C.cuda_sumsq(x[1], out, workspace, accumulate=True)
            _C.cuda_unscale_(x[1], 0.5, flag)
            _C.cuda_scale_(x[1], 2.0)
            _C.cuda_scale_(x[1], scale_device=factor)
            for dst in DTYPES:
                y = device_array(n, dst, 3 - offset)
                keep.append(y)
                _C.cuda_cast_(y[1], x[1])
total = struct.unpack("d", _C.cuda_fetch(out, 0, 8))[0]
assert total == total and struct.unpack("<i", _C.cuda_fetch(flag, 0, 4))[0] == 0
print("rlhfz-sanitizer-ok")
"""

SANITIZER_TIMEOUT_S = 900


def _sanitizer():
    candidates = [shutil.which("compute-sanitizer")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "compute-sanitizer"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.mark.gpu
@needs_real_gpu
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "initcheck", "synccheck"])
def test_kernels_under_compute_sanitizer(tool):
    sanitizer = _sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(rlhfz.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                  else []))
    proc = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode=1", sys.executable, "-c",
                           textwrap.dedent(SANITIZER_CHILD)],
                          env=env, capture_output=True, text=True, timeout=SANITIZER_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{tool} failed ({proc.returncode}):\n{output[-8000:]}"
    assert "rlhfz-sanitizer-ok" in proc.stdout, output[-8000:]
    summary = ("RACECHECK SUMMARY: 0 hazards displayed (0 errors" if tool == "racecheck"
               else "ERROR SUMMARY: 0 errors")
    assert summary in output, output[-8000:]
