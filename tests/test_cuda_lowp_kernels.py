"""The CUDA step over low-precision moments (cuda_adamw_step_lowp) against
the CPU's plain C reference (adamw_step_lowp(..., simd="reference")), bit
for bit: exp_avg_sq rounded to nearest or stochastically, int8 codes and
their blockwise scales, for every grad and param_out dtype, maximize,
grad_scale, and index bases whose shard parts cross a 2**32 boundary.
test_lowp_kernels.py holds the reference to the float64 maps; here the GPU
is held to the reference's bits.

The kernels spell every fp32 operation as a round-to-nearest intrinsic, so
every finite value, every code and every scale (a NaN scale included: both
sides write the one constant) is the reference's. Only a NaN that arithmetic
makes may differ in its bits (the GPU returns its canonical NaN where x86
propagates an input's), so in the master, param_out and bf16 moments NaN
positions are compared, not their bits.

Arrays sit between guard elements (device_support.Guarded); starts at
element offsets 1 and 3 rule out the bf16 step's 16-byte vector loads. The
device tests run on a GPU or on the simulated runtime of a RLHFZ_CUDA=sim
build (tests/device_support.py); the checks that come before any device work
run everywhere.
"""
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_support import (SENTINEL, SIMULATED, Guarded, assert_same_bits, bits, held,
                            needs_device, needs_simulator, to_device)
from device_support import stream as current_stream
from rlhfz import _C

QBLOCK = _C.QBLOCK
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FIELDS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
# Past one wave of blocks, so that both kernels' grid-stride loops go round:
# on the simulator (4 multiprocessors) a few hundred thousand elements do.
LARGE = 300_007 if SIMULATED else 9_000_011
# Index bases whose shards cross 2**32 (the high half of the counter changes
# inside them) as well as plain ones.
INDEX_BASES = [0, 7 * QBLOCK, 2**32 - 300, 2**32 - 3 * QBLOCK - 5, 5 * 2**32 + 3]

sizes = st.one_of(st.integers(1, 70), st.integers(71, 3000), st.sampled_from([65_537]))


@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    """One torch thread on the simulator, as in test_cuda_kernels.py: its
    stream workers share the host's few cores with torch."""
    threads = torch.get_num_threads()
    if SIMULATED:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Shard:
    """A shard part's state on the host: the master, the moments and, for
    int8, their scales (None for bf16). zero_blocks start all zero (scale 0);
    nan_blocks start as a non-finite step leaves a block (scale NaN, codes 0)."""

    def __init__(self, state_dtype, n, seed, zero_blocks=(), nan_blocks=()):
        gen = torch.Generator().manual_seed(seed)
        blocks = (n + QBLOCK - 1) // QBLOCK
        self.n = n
        master = torch.randn(n, generator=gen)
        if state_dtype == "bf16":
            exp_avg = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
            exp_avg_sq = (torch.rand(n, generator=gen) * 1e-4).to(torch.bfloat16)
            scales = [None, None]
        else:
            exp_avg = torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int8)
            exp_avg_sq = torch.randint(0, 256, (n,), generator=gen).to(torch.uint8)
            scales = [torch.rand(blocks, generator=gen) * 1e-2,
                      torch.rand(blocks, generator=gen) * 1e-4]
        for b in (b for b in (*zero_blocks, *nan_blocks) if b < blocks):
            exp_avg[b * QBLOCK:(b + 1) * QBLOCK] = 0
            exp_avg_sq[b * QBLOCK:(b + 1) * QBLOCK] = 0
            if scales[0] is not None:
                for s in scales:
                    s[b] = float("nan") if b in nan_blocks else 0.0
        self.arrays = [master, exp_avg, exp_avg_sq, *scales]

    def reference(self, grad, param_dtype=None, **kw):
        """The CPU reference's step on a copy: the arrays and param_out."""
        arrays = [None if a is None else a.clone() for a in self.arrays]
        out = None if param_dtype is None else torch.empty(self.n, dtype=param_dtype)
        _C.adamw_step_lowp(*arrays[:3], grad, out, exp_avg_scale=arrays[3],
                           exp_avg_sq_scale=arrays[4], simd="reference", **HP, **kw)
        return arrays, out

    def on_device(self, offset=0):
        return [None if a is None else Guarded(a, offset) for a in self.arrays]

    def advance(self, arrays):
        """The state from then on: the arrays a step left."""
        self.arrays = arrays


def cuda_step(arrays, grad, out=None, **kw):
    """cuda_adamw_step_lowp on Guarded device arrays (grad Guarded too)."""
    kw.setdefault("stream", current_stream())
    _C.cuda_adamw_step_lowp(*(a.arg for a in arrays[:3]), grad.arg, out.arg if out else None,
                            exp_avg_scale=arrays[3].arg if arrays[3] else None,
                            exp_avg_sq_scale=arrays[4].arg if arrays[4] else None, **HP, **kw)


def assert_reference_bits(arrays, grad, out, expected, expected_out, grad_before, what):
    """Guards intact, grad untouched, and every array the reference's bits
    (the NaNs of the float arrays at the same places)."""
    assert grad.guards_intact(), f"{what}: grad written outside its range"
    assert_same_bits(grad.host(), grad_before, f"{what}: grad changed")
    pairs = list(zip(FIELDS, arrays, expected))
    if out is not None:
        pairs.append(("param_out", out, expected_out))
    for name, got, want in pairs:
        if got is None:
            continue
        assert got.guards_intact(), f"{what}: {name} written outside its range"
        got = got.host()
        if got.is_floating_point() and "scale" not in name:
            assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: {name} NaNs"
            keep = ~torch.isnan(want)
            got, want = got[keep], want[keep]
        assert_same_bits(got, want, f"{what}: {name} vs the CPU reference")


def grads(n, seed, dtype, steps=2, zero_blocks=()):
    """Grads of a few magnitudes, zero over zero_blocks (which keeps an
    all-zero block all zero through a step)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        g = torch.randn(n, generator=gen) * 10.0 ** -(1 + 2 * k)
        for b in zero_blocks:
            g[b * QBLOCK:(b + 1) * QBLOCK] = 0
        out.append(g.to(dtype))
    return out


# ---- the reference's bits --------------------------------------------------------------

@pytest.mark.gpu
@needs_device
@SETTINGS
@given(n=sizes, seed=st.integers(0, 2**16), state_dtype=st.sampled_from(["bf16", "int8"]),
       rounding=st.sampled_from(["nearest", "stochastic"]),
       grad_dtype=st.sampled_from(GRAD_DTYPES),
       param_dtype=st.sampled_from([None, *GRAD_DTYPES]), maximize=st.booleans(),
       grad_scale=st.sampled_from([1.0, 0.5, 1 / 3]), index_base=st.sampled_from(INDEX_BASES),
       offset=st.sampled_from([0, 1, 3]))
def test_lowp_step_gives_the_reference_bits(n, seed, state_dtype, rounding, grad_dtype,
                                            param_dtype, maximize, grad_scale, index_base,
                                            offset):
    """Two steps in a row, each from the state the last left; block 0 starts
    all zero, block 2 stays all zero (its grads are zero too)."""
    shard = Shard(state_dtype, n, seed, zero_blocks=(0, 2))
    arrays = shard.on_device(offset)
    out = Guarded(None, offset, n=n, dtype=param_dtype) if param_dtype else None
    kw = dict(rounding=rounding, seed=seed, index_base=index_base, maximize=maximize,
              grad_scale=grad_scale)
    for step, grad in enumerate(grads(n, seed + 1, grad_dtype, zero_blocks=(2,)), start=5):
        what = (f"n={n} {state_dtype} {rounding} grad={grad_dtype} out={param_dtype} "
                f"index_base={index_base} offset={offset} step={step}")
        expected, expected_out = shard.reference(grad, param_dtype, step=step, **kw)
        on_device = Guarded(grad, offset)
        cuda_step(arrays, on_device, out, step=step, **kw)
        assert_reference_bits(arrays, on_device, out, expected, expected_out, grad, what)
        shard.advance(expected)


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("offset", [0, 1])
def test_a_large_shard_goes_round_the_grid(state_dtype, offset):
    n = LARGE
    shard = Shard(state_dtype, n, seed=11, zero_blocks=(3,))
    (grad,) = grads(n, 12, torch.bfloat16, steps=1)
    kw = dict(step=7, rounding="stochastic", seed=99, index_base=2**32 - n // 2)
    expected, expected_out = shard.reference(grad, torch.bfloat16, **kw)
    arrays = shard.on_device(offset)
    on_device, out = Guarded(grad, offset), Guarded(None, offset, n=n, dtype=torch.bfloat16)
    cuda_step(arrays, on_device, out, **kw)
    assert_reference_bits(arrays, on_device, out, expected, expected_out, grad,
                          f"n={n} {state_dtype} offset={offset}")


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nonfinite_blocks_match_the_reference(state_dtype, rounding):
    """An Inf or NaN grad makes its block non-finite (int8: scale NaN and all
    codes 0, the whole block reading NaN); a block that already was stays so;
    the blocks beside them step as usual."""
    n = 6 * QBLOCK + 77
    shard = Shard(state_dtype, n, seed=5, nan_blocks=(4,))
    (grad,) = grads(n, 6, torch.float32, steps=1)
    grad[QBLOCK + 17] = float("nan")
    grad[2 * QBLOCK + 3] = float("inf")
    grad[6 * QBLOCK + 76] = -float("inf")         # in the short last block
    kw = dict(step=2, rounding=rounding, seed=3, index_base=2**32 - 2 * QBLOCK)
    expected, expected_out = shard.reference(grad, torch.float16, **kw)
    arrays = shard.on_device(1)
    on_device, out = Guarded(grad, 1), Guarded(None, 1, n=n, dtype=torch.float16)
    cuda_step(arrays, on_device, out, **kw)
    assert_reference_bits(arrays, on_device, out, expected, expected_out, grad,
                          f"non-finite {state_dtype} {rounding}")
    if state_dtype == "int8":
        scales, codes = arrays[3].host(), arrays[1].host()
        for b in (1, 2, 4, 6):
            assert scales[b].isnan(), b
            assert int(codes[b * QBLOCK:(b + 1) * QBLOCK].abs().sum()) == 0, b
        assert not scales[[0, 3, 5]].isnan().any()


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_parts_with_their_index_base_give_the_whole_shard(state_dtype):
    """A shard cut at block boundaries into parts, each stepped on the GPU
    with its offset as index_base, gives the CPU's whole shard: stochastic
    rounding does not depend on where a part starts, across 2**32 too."""
    n = 10 * QBLOCK + 37
    base = 2**32 - 4 * QBLOCK
    shard = Shard(state_dtype, n, seed=3)
    (grad,) = grads(n, 4, torch.float32, steps=1)
    kw = dict(step=9, rounding="stochastic", seed=11)
    expected, _ = shard.reference(grad, index_base=base, **kw)
    for a, b in ((0, 3 * QBLOCK), (3 * QBLOCK, 8 * QBLOCK), (8 * QBLOCK, n)):
        blocks = slice(a // QBLOCK, (b + QBLOCK - 1) // QBLOCK)
        part = [t[a:b] for t in shard.arrays[:3]] + \
            [None if t is None else t[blocks] for t in shard.arrays[3:]]
        arrays = [None if t is None else Guarded(t, 1) for t in part]
        cuda_step(arrays, Guarded(grad[a:b], 1), index_base=base + a, **kw)
        for name, got, want in zip(FIELDS, arrays, expected):
            if got is not None:
                whole = want[blocks] if "scale" in name else want[a:b]
                assert_same_bits(got.host(), whole, f"{state_dtype} part [{a}, {b}): {name}")


# ---- skip_if, empty shards, streams -----------------------------------------------------

def _flag(value):
    skip = _C.Buffer(4, tier="device")
    _C.cuda_store(skip, 0, struct.pack("<i", value), stream=current_stream())
    return skip


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("flag", [1, -1])
def test_skip_if_nonzero_writes_nothing(state_dtype, flag):
    n = 4 * QBLOCK + 9
    shard = Shard(state_dtype, n, seed=8)
    (grad,) = grads(n, 9, torch.bfloat16, steps=1)
    kw = dict(step=4, rounding="stochastic", seed=1)
    for offset in (0, 3):
        arrays = shard.on_device(offset)
        out = Guarded(None, offset, n=n, dtype=torch.float16)
        cuda_step(arrays, Guarded(grad, offset), out, skip_if=_flag(flag), **kw)
        for name, got, before in zip(FIELDS, arrays, shard.arrays):
            if got is not None:
                assert got.guards_intact()
                assert_same_bits(got.host(), before, f"skip_if={flag}: {name}")
        assert out.guards_intact()
        assert bool((bits(out.values) == SENTINEL[torch.float16]).all())
    expected, expected_out = shard.reference(grad, torch.float16, **kw)
    arrays = shard.on_device(1)
    on_device, out = Guarded(grad, 1), Guarded(None, 1, n=n, dtype=torch.float16)
    cuda_step(arrays, on_device, out, skip_if=_flag(0), **kw)
    assert_reference_bits(arrays, on_device, out, expected, expected_out, grad, "skip_if=0")


@pytest.mark.gpu
@needs_device
def test_an_empty_shard_is_a_no_op():
    # On the simulator torch exports an empty slice of device memory with a
    # null pointer, which no longer says where it lies: rlhfz views there
    # (of float dtypes only, so the bf16 step).
    arrays = [Guarded(torch.empty(0, dtype=dtype), 1, buffer=SIMULATED)
              for dtype in (torch.float32, torch.bfloat16, torch.bfloat16, torch.float32)]
    _C.cuda_adamw_step_lowp(*(a.arg for a in arrays), step=1, stream=current_stream(), **HP)
    assert all(a.guards_intact() for a in arrays)


@pytest.mark.gpu
@needs_simulator
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_step_on_a_held_stream_is_seen_only_after_a_sync(state_dtype):
    """The step only queues its work on the stream it is given; the host
    sees the reference's bits once the stream is synchronized."""
    n = 3 * QBLOCK + 5
    shard = Shard(state_dtype, n, seed=13)
    (grad,) = grads(n, 14, torch.float32, steps=1)
    kw = dict(step=3, rounding="stochastic", seed=2)
    expected, _ = shard.reference(grad, **kw)
    arrays, on_device = shard.on_device(1), Guarded(grad, 1)
    side = _C.CudaStream()
    with held(side):
        cuda_step(arrays, on_device, stream=side, **kw)
        for name, got, before in zip(FIELDS, arrays, shard.arrays):
            if got is not None:
                assert_same_bits(got.host(), before, f"queued, not run: {name}")
    side.synchronize()
    assert_reference_bits(arrays, on_device, None, expected, None, grad, "after the sync")
    side.close()


@pytest.mark.gpu
@needs_simulator
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_an_injected_launch_failure_raises_and_writes_nothing(state_dtype):
    n = 2 * QBLOCK + 1
    shard = Shard(state_dtype, n, seed=21)
    (grad,) = grads(n, 22, torch.float32, steps=1)
    arrays, on_device = shard.on_device(1), Guarded(grad, 1)
    _C.cuda_sim_inject("kernel launch:1")
    try:
        with pytest.raises(RuntimeError, match="^cuda_adamw_step_lowp: CUDA error: "):
            cuda_step(arrays, on_device, step=1)
    finally:
        _C.cuda_sim_inject("")
    for name, got, before in zip(FIELDS, arrays, shard.arrays):
        if got is not None:
            assert_same_bits(got.host(), before, f"a failed launch wrote {name}")
    expected, _ = shard.reference(grad, step=1)
    cuda_step(arrays, on_device, step=1)
    assert_reference_bits(arrays, on_device, None, expected, None, grad, "after the failure")


# ---- bad input -------------------------------------------------------------------------

def test_host_arrays_and_bad_scalars_are_refused_before_any_device_work():
    """Runs with or without a GPU: the scalar checks come first, then where
    the arrays are."""
    n = 300
    host = dict(master=torch.zeros(n), exp_avg=torch.zeros(n, dtype=torch.bfloat16),
                exp_avg_sq=torch.zeros(n, dtype=torch.bfloat16), grad=torch.zeros(n))
    for bad, error, text in ((dict(rounding="up"), ValueError, "rounding"),
                             (dict(seed=-1), ValueError, "seed"),
                             (dict(seed=2**32), ValueError, "seed"),
                             (dict(index_base=-5), ValueError, "index_base"),
                             (dict(step=0), ValueError, "step must be >= 1"),
                             (dict(lr=float("nan")), ValueError, "lr"),
                             (dict(stream="default"), TypeError, "stream must be"),
                             (dict(simd="reference"), TypeError, "unexpected keyword"),
                             (dict(seed=1.5), TypeError, "seed must be an integer"),
                             ({}, BufferError, "needs CUDA device memory")):
        with pytest.raises(error, match=text):
            _C.cuda_adamw_step_lowp(**host, **{"step": 1, **HP, **bad})
    assert all(not t.any() for t in host.values())


def _bad_calls():
    """(arguments, error, message) for a step that must be refused."""
    n = 300
    # (a clone of device memory on the simulator is host memory: each array anew)
    master, grad = to_device(torch.randn(n)), to_device(torch.randn(n))
    i8, i8_other = (to_device(torch.randint(-127, 128, (n,), dtype=torch.int8)) for _ in "ab")
    u8 = to_device(torch.randint(0, 256, (n,)).to(torch.uint8))
    bf, bf_other = (to_device(torch.randn(n).to(torch.bfloat16)) for _ in "ab")
    sc, sc_other, sc_bad = (to_device(torch.rand(k)) for k in (2, 2, 3))
    i8_state = dict(master=master, exp_avg=i8, exp_avg_sq=u8, grad=grad, exp_avg_scale=sc,
                    exp_avg_sq_scale=sc_other)
    bf_state = dict(master=master, exp_avg=bf, exp_avg_sq=bf_other, grad=grad)
    calls = [
        (dict(i8_state, exp_avg_scale=None, exp_avg_sq_scale=None), TypeError, "need"),
        (dict(i8_state, exp_avg_sq_scale=sc_bad), ValueError, "blocks"),
        (dict(i8_state, exp_avg_sq=i8_other), TypeError, "uint8"),
        (dict(i8_state, exp_avg_scale=to_device(torch.rand(2).double())), BufferError, "float64"),
        (dict(i8_state, exp_avg_scale=torch.rand(2)), BufferError, "needs CUDA device memory"),
        (dict(i8_state, exp_avg_scale=sc[:1]), ValueError, "blocks"),
        (dict(i8_state, exp_avg_sq_scale=sc), ValueError, "overlap"),
        (dict(bf_state, exp_avg_scale=sc, exp_avg_sq_scale=sc_other), ValueError, "no scales"),
        (dict(bf_state, exp_avg=to_device(torch.zeros(n)), exp_avg_sq=to_device(torch.zeros(n))),
         TypeError, "bfloat16"),
        (dict(bf_state, exp_avg_sq=bf), ValueError, "overlap"),
        (dict(bf_state, grad=master), ValueError, "overlap"),
        (dict(bf_state, grad=i8), BufferError, "int8"),
        (dict(bf_state, exp_avg_sq=to_device(torch.zeros(n + 1, dtype=torch.bfloat16))),
         ValueError, "elements"),
        (dict(bf_state, grad=grad[:n - 1]), ValueError, "elements"),
        (dict(bf_state, master=to_device(torch.zeros(n, dtype=torch.bfloat16))), TypeError,
         "float32"),
        (dict(bf_state, param_out=bf), ValueError, "overlap"),
        (dict(bf_state, skip_if=to_device(torch.zeros(1, dtype=torch.int32))), TypeError,
         "device tier"),
        (dict(bf_state, skip_if=_C.Buffer(4)), BufferError, "device tier"),
        (dict(bf_state, skip_if=_C.Buffer(2, tier="device")), ValueError, "needs at least"),
    ]
    return calls, [master, grad, i8, i8_other, u8, bf, bf_other, sc, sc_other, sc_bad]


@pytest.mark.gpu
@needs_device
def test_bad_arguments_raise_and_change_nothing():
    calls, arrays = _bad_calls()
    before = [bits(a).clone() for a in arrays]
    for kwargs, error, text in calls:
        with pytest.raises(error, match=text):
            _C.cuda_adamw_step_lowp(step=1, stream=current_stream(), **HP, **kwargs)
    for got, was in zip(arrays, before):
        assert torch.equal(bits(got), was), "a refused call changed an array"
