"""AdamW over bf16 and int8 moments against a float64 reference that stores
the moments the same way.

The float64 reference below decodes, steps and encodes with the maps the
kernels document (lowp_state.h): int8 blockwise with a linear map for
exp_avg and a square map of sqrt(exp_avg_sq); exp_avg rounded to
nearest (even, for bf16), exp_avg_sq to nearest or stochastically. Its
only difference from the kernels is float64 arithmetic, so a code may
differ by one where the exact value sits on a rounding boundary. The
scalar level gives the C reference's bits; the SIMD levels update the
moments with the same fp32 operations (bf16 moments bit for bit) but take
square roots and quotients from estimates, so their master and int8 codes
are held to tolerances instead.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlhfz import _C

LEVELS = ["reference", "scalar", "avx2", "avx512"]
_ORDER = {"scalar": 0, "avx2": 1, "avx512": 2}
AVAILABLE = [lv for lv in LEVELS
             if lv in ("reference", "scalar") or _ORDER[lv] <= _ORDER[_C.simd_level()]]
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
QBLOCK = _C.QBLOCK
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

sizes = st.one_of(st.integers(1, 70), st.integers(71, 3000), st.sampled_from([65537, 200_003]))


# ---- the counter hash and the maps, in NumPy ---------------------------------

def _mix32(x):
    x = x.astype(np.uint64) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def _key(seed, step):
    step_key = _mix32(np.array([(step & 0xFFFFFFFF) ^ int(_mix32(np.array([step >> 32]))[0])]))
    seed_key = _mix32(np.array([(seed + 0x9E3779B9) & 0xFFFFFFFF]))
    return int(_mix32(step_key ^ seed_key)[0])


def random_bits16(seed, step, index_base, n):
    """The 16 random bits of each element (its exp_avg_sq's)."""
    index = np.arange(n, dtype=np.uint64) + np.uint64(index_base)
    key = _key(seed, step)
    high = (index >> np.uint64(32)).astype(np.uint64)
    index_key = _mix32(np.uint64(key) ^ high)
    x = (((index & np.uint64(0xFFFFFFFF)) ^ index_key) * 0x9E3779B1) & 0xFFFFFFFF
    return x >> 16


def _bf16_bits(x32):
    return torch.from_numpy(np.ascontiguousarray(x32, dtype=np.float32)).to(torch.bfloat16)


def bf16_store(values, rounding, random16):
    """float64 moments stored as bf16: nearest even via torch, or
    stochastic (a NaN, or a sign bit, stored as the quiet NaN)."""
    x32 = values.astype(np.float32)
    if rounding == "nearest":
        return _bf16_bits(x32)
    bits = np.minimum(x32.view(np.uint32), np.uint32(0x7FC00000)).astype(np.uint64)
    rounded = ((bits + random16.astype(np.uint64)) >> 16).astype(np.uint16)
    return torch.from_numpy(rounded.view(np.int16).copy()).view(torch.bfloat16)


def _code(x, top, rounding, random16):
    """Nearest, or floor(x + random16 / 2^16) computed in 1/65536ths."""
    if rounding == "stochastic":
        code = np.floor((np.floor(x * 65536.0) + random16) / 65536.0)
    else:
        code = np.rint(x)
    return np.minimum(code, top)


def int8_decode(codes, sq_codes, scales, sq_scales, n):
    """The moments that codes stand for, (q / 127) * scale and
    ((q^2 / 255^2) * scale)^2, each operation rounded to fp32 as the format
    defines them (as float64 arrays)."""
    f32 = np.float32
    block = np.arange(n) // QBLOCK
    q = codes.astype(np.int32)
    m = q.astype(f32) * (f32(1) / f32(127)) * scales.astype(f32)[block]
    r = sq_codes.astype(np.int32)
    root = (r * r).astype(f32) * (f32(1) / f32(255 * 255)) * sq_scales.astype(f32)[block]
    return m.astype(np.float64), (root * root).astype(np.float64)


def int8_encode(m, v, rounding, random16):
    n = m.size
    blocks = (n + QBLOCK - 1) // QBLOCK
    codes = np.zeros(n, np.int8)
    sq_codes = np.zeros(n, np.uint8)
    scales = np.zeros(blocks, np.float32)
    sq_scales = np.zeros(blocks, np.float32)
    u_v = random16.astype(np.float64)
    for b in range(blocks):
        s = slice(b * QBLOCK, min(n, (b + 1) * QBLOCK))
        mb, vb = m[s], v[s]
        if not np.all(np.isfinite(mb)):
            scales[b] = np.nan
        else:
            scales[b] = np.abs(mb).max()
            if scales[b] > 0:
                x = np.abs(mb) / float(scales[b]) * 127.0
                q = _code(x, 127.0, "nearest", None)
                codes[s] = np.where(np.signbit(mb), -q, q).astype(np.int8)
        if not np.all(np.isfinite(vb)):
            sq_scales[b] = np.nan
        else:
            sq_scales[b] = np.sqrt(vb).max()
            if sq_scales[b] > 0:
                x = np.sqrt(np.sqrt(vb) / float(sq_scales[b])) * 255.0
                q = _code(x, 255.0, rounding, u_v[s])
                # a value above zero is never code 0
                sq_codes[s] = np.where(vb > 0, np.maximum(q, 1), q).astype(np.uint8)
    return codes, sq_codes, scales, sq_scales


def adamw_f64(master, m, v, grad, step, maximize=False, grad_scale=1.0):
    g = grad.astype(np.float64) * grad_scale
    if maximize:
        g = -g
    p = master.astype(np.float64) * (1.0 - HP["lr"] * HP["weight_decay"])
    m = m + (1.0 - HP["beta1"]) * (g - m)
    v = v * HP["beta2"] + (1.0 - HP["beta2"]) * g * g
    step_size = HP["lr"] / (1.0 - HP["beta1"] ** step)
    denom = np.sqrt(v) / math.sqrt(1.0 - HP["beta2"] ** step) + HP["eps"]
    return p - step_size * m / denom, m, v


# ---- the state a call works on ------------------------------------------------

class State:
    def __init__(self, state_dtype, n, seed=0, zero_blocks=()):
        gen = torch.Generator().manual_seed(seed)
        self.n, self.state_dtype = n, state_dtype
        self.master = torch.randn(n, generator=gen)
        blocks = (n + QBLOCK - 1) // QBLOCK
        if state_dtype == "bf16":
            self.exp_avg = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
            self.exp_avg_sq = (torch.rand(n, generator=gen) * 1e-4).to(torch.bfloat16)
            self.scales = self.sq_scales = None
        else:
            self.exp_avg = torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int8)
            self.exp_avg_sq = torch.randint(0, 256, (n,), generator=gen).to(torch.uint8)
            self.scales = torch.rand(blocks, generator=gen) * 1e-2
            self.sq_scales = torch.rand(blocks, generator=gen) * 1e-4
            for b in zero_blocks:
                if b < blocks:
                    self.scales[b] = self.sq_scales[b] = 0
                    self.exp_avg[b * QBLOCK:(b + 1) * QBLOCK] = 0
                    self.exp_avg_sq[b * QBLOCK:(b + 1) * QBLOCK] = 0

    def clone(self):
        other = State.__new__(State)
        other.__dict__ = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                          for k, v in self.__dict__.items()}
        return other

    def step(self, grad, step, *, param_out=None, simd=None, **kw):
        # the scales by position, as the signature lists them
        _C.adamw_step_lowp(self.master, self.exp_avg, self.exp_avg_sq, grad, param_out,
                           self.scales, self.sq_scales, step=step, simd=simd, **HP, **kw)

    def moments(self):
        """float64 values of the stored moments."""
        if self.state_dtype == "bf16":
            return (self.exp_avg.double().numpy(), self.exp_avg_sq.double().numpy())
        return int8_decode(self.exp_avg.numpy(), self.exp_avg_sq.numpy(), self.scales.numpy(),
                           self.sq_scales.numpy(), self.n)

    def raw(self):
        out = [self.master, self.exp_avg.view(torch.uint8) if self.exp_avg.dtype ==
               torch.int8 else self.exp_avg.view(torch.int16), self.exp_avg_sq.view(
                   torch.uint8) if self.exp_avg_sq.dtype == torch.uint8 else
               self.exp_avg_sq.view(torch.int16)]
        if self.scales is not None:
            out += [self.scales, self.sq_scales]
        return out


def assert_bits_equal(a, b):
    for x, y in zip(a.raw(), b.raw()):
        assert torch.equal(x.view(torch.uint8) if x.dtype != torch.uint8 else x,
                           y.view(torch.uint8) if y.dtype != torch.uint8 else y)


# ---- against the float64 reference -------------------------------------------

@SETTINGS
@given(n=sizes, seed=st.integers(0, 2**16), state_dtype=st.sampled_from(["bf16", "int8"]),
       rounding=st.sampled_from(["nearest", "stochastic"]),
       grad_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       index_base=st.sampled_from([0, 256 * 7, 2**32 - 512]),
       level=st.sampled_from(AVAILABLE))
def test_lowp_step_matches_float64_reference(n, seed, state_dtype, rounding, grad_dtype,
                                             index_base, level):
    state = State(state_dtype, n, seed, zero_blocks=(1,))
    gen = torch.Generator().manual_seed(seed + 1)
    grad = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
    m0, v0 = state.moments()
    master0 = state.master.double().numpy()
    want_p, want_m, want_v = adamw_f64(state.master.numpy(), m0, v0, grad.float().numpy(), 3)
    random16 = random_bits16(seed, 3, index_base, n)

    state.step(grad, 3, rounding=rounding, seed=seed, index_base=index_base, simd=level)

    # fp32 rounding, relative to the update (the new master can be a small
    # difference of two larger terms), and for the SIMD levels the step's
    # reciprocal estimates, ~2^-11 of each update
    update = np.abs(want_p - master0)
    tolerance = 1e-5 if level in ("reference", "scalar") else 2e-3
    err = np.abs(state.master.double().numpy() - want_p)
    assert np.all(err <= tolerance * update + 1e-5 * np.abs(want_p) + 1e-7)
    if state_dtype == "bf16":
        want_ea = bf16_store(want_m, "nearest", None)
        want_eas = bf16_store(want_v, rounding, random16)
        g = np.abs(grad.double().numpy())
        for got, want, exact, size in ((state.exp_avg, want_ea, want_m, np.abs(m0) + g),
                                       (state.exp_avg_sq, want_eas, want_v, v0 + g * g)):
            # within one bf16 step of the float64 value, past fp32's own error ...
            err = np.abs(got.double().numpy() - exact)
            assert np.all(err <= 2.0 ** -7 * np.abs(exact) + 1e-6 * size + 1e-30)
            # ... and, but where the float64 value sits on a cut, the same bits
            same = got.view(torch.int16) == want.view(torch.int16)
            assert float(same.float().mean()) > 0.99
        return
    codes, sq_codes, scales, sq_scales = int8_encode(want_m, want_v, rounding, random16)
    np.testing.assert_allclose(state.scales.numpy(), scales, rtol=1e-5)
    np.testing.assert_allclose(state.sq_scales.numpy(), sq_scales, rtol=1e-5)
    for got, want in ((state.exp_avg, codes), (state.exp_avg_sq, sq_codes)):
        diff = np.abs(got.numpy().astype(np.int32) - want.astype(np.int32))
        assert diff.max() <= 1
        # (a cut falls within the estimate's error for ~1% of elements)
        assert (diff > 0).sum() <= 4 + 0.03 * n
    # the stored moments are the true ones to within the maps' resolution
    m, v = state.moments()
    block = np.arange(n) // QBLOCK
    # exp_avg: half a step of scale / 127 from rounding, and a code off by one.
    # exp_avg_sq: a code off by one on the square-root axis t moves the value by
    # (2t + 1) steps (by a little more where a SIMD level's root estimate moved
    # the position)
    scale, sq_root = scales[block].astype(np.float64), sq_scales[block].astype(np.float64)
    assert np.all(np.abs(m - want_m) <= 1.55 * scale / 127 + 1e-12)
    root = np.sqrt(want_v)
    assert np.all(np.abs(np.sqrt(v) - root) <= 2.05 * np.sqrt(root * sq_root) / 255
                  + 1.05 * sq_root / 255 ** 2 + 1e-12)


def test_stochastic_rounding_is_unbiased():
    """Rounding one value many times over (as many elements) averages to it,
    and exp_avg, rounded to nearest, takes one value."""
    n = 1 << 16
    grad = torch.full((n,), 0.3 * 1e-2 + 1.234e-5)
    value = float(grad[0].double() ** 2)    # fp32's square: exact in float64
    state = State("bf16", n)
    state.exp_avg.fill_(0)
    state.exp_avg_sq.fill_(0)
    # with beta1 = beta2 = 0 the new moments are the grad and its square
    _C.adamw_step_lowp(state.master, state.exp_avg, state.exp_avg_sq, grad,
                       step=1, rounding="stochastic", **{**HP, "beta1": 0.0, "beta2": 0.0})
    assert state.exp_avg.unique().numel() == 1
    stored = state.exp_avg_sq.double()
    assert stored.unique().numel() == 2
    assert abs(float(stored.mean()) - value) < 1e-3 * value


# ---- every level against the reference ---------------------------------------

levels_case = dict(
    n=sizes, seed=st.integers(0, 2**16), state_dtype=st.sampled_from(["bf16", "int8"]),
    rounding=st.sampled_from(["nearest", "stochastic"]),
    grad_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    param_dtype=st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16]),
    maximize=st.booleans(), index_base=st.sampled_from([0, 2**32 - 300, 5 * 2**32 + 3]))


def ulps(x, count=2):
    """count units in the last place of fp32 x (the fused multiply-add that
    applies the step rounds once where the reference rounds twice)."""
    return count * torch.finfo(torch.float32).eps * x.abs() + 1e-38


def _steps(level, n, seed, state_dtype, rounding, grad_dtype, param_dtype, maximize,
               index_base, grad_scale=0.5, steps=2):
    state = State(state_dtype, n, seed, zero_blocks=(0, 2))
    start = state.master.clone()
    # the int8 scales it starts from: a decode's error is relative to them
    state.start_scales = (None, None) if state.scales is None else (state.scales.clone(),
                                                                    state.sq_scales.clone())
    gen = torch.Generator().manual_seed(seed + 7)
    grads = [(torch.randn(n, generator=gen) * 10.0 ** -k).to(grad_dtype) for k in (1, 3)]
    grads = grads[:steps]
    out = torch.empty(n, dtype=param_dtype) if param_dtype else None
    # how far each master travelled, step by step: two steps can cancel,
    # while each one's error is relative to its own update
    state.travelled = torch.zeros(n)
    for step, grad in enumerate(grads, start=5):
        before = state.master.clone()
        state.step(grad, step, param_out=out, simd=level, rounding=rounding, seed=seed,
                   index_base=index_base, maximize=maximize, grad_scale=grad_scale)
        state.travelled += (state.master - before).abs()
    if param_dtype is not None:
        # the 16-bit param is the new master rounded to nearest even
        assert torch.equal(out.view(torch.uint8), state.master.to(param_dtype).view(torch.uint8))
    return state, start, out


@SETTINGS
@given(**levels_case)
def test_the_scalar_level_gives_the_reference_bits(n, seed, state_dtype, rounding, grad_dtype,
                                                   param_dtype, maximize, index_base):
    args = (n, seed, state_dtype, rounding, grad_dtype, param_dtype, maximize, index_base)
    ref, _, ref_out = _steps("reference", *args)
    state, _, out = _steps("scalar", *args)
    assert_bits_equal(state, ref)
    if param_dtype is not None:
        assert torch.equal(out.view(torch.uint8), ref_out.view(torch.uint8))


SIMD = [lv for lv in AVAILABLE if lv not in ("reference", "scalar")]


@pytest.mark.skipif(not SIMD, reason="this CPU has no AVX2")
@SETTINGS
@given(level=st.sampled_from(SIMD or ["scalar"]), grad_scale=st.sampled_from([0.5, 1.0]),
       **levels_case)
# an element whose second update undoes 94% of its first
@example(level="avx2", grad_scale=1.0, n=65537, seed=167, state_dtype="bf16",
         rounding="nearest", grad_dtype=torch.float32, param_dtype=None, maximize=True,
         index_base=0)
# a one-element last block whose exp_avg update cancels 98% of its old value
@example(level="avx2", grad_scale=0.5, n=65537, seed=144, state_dtype="int8",
         rounding="nearest", grad_dtype=torch.float32, param_dtype=None, maximize=False,
         index_base=0)
def test_simd_levels_keep_to_the_reference(level, grad_scale, n, seed, state_dtype, rounding,
                                           grad_dtype, param_dtype, maximize, index_base):
    args = (n, seed, state_dtype, rounding, grad_dtype, param_dtype, maximize, index_base)
    # int8: one step, so that a code the estimate moved is not fed back
    steps = 2 if state_dtype == "bf16" else 1
    ref, _, _ = _steps("reference", *args, grad_scale=grad_scale, steps=steps)
    state, _, _ = _steps(level, *args, grad_scale=grad_scale, steps=steps)
    moved = ref.travelled
    if state_dtype == "bf16":
        # the moments take the reference's fp32 operations: the same bits
        assert torch.equal(state.exp_avg.view(torch.int16), ref.exp_avg.view(torch.int16))
        assert torch.equal(state.exp_avg_sq.view(torch.int16), ref.exp_avg_sq.view(torch.int16))
        # the step's reciprocal estimates are good to ~2^-11 of each update
        # (summed over the steps: a second update may undo most of the first)
        assert torch.all((state.master - ref.master).abs() <= 2e-3 * moved + ulps(ref.master))
        return
    # int8: a code decodes by one product, an ulp of the old moment off, so the
    # scales are a few ulps of the old and new scales off (the exp_avg update
    # can cancel most of the old value: then the new one is many of its own
    # ulps off); a code moves by one where the estimate and the exact root
    # straddle a cut (~1% of elements)
    for got, want, old in ((state.scales, ref.scales, ref.start_scales[0]),
                           (state.sq_scales, ref.sq_scales, ref.start_scales[1])):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got == 0, want == 0)
        assert torch.all((got - want).abs().nan_to_num() <= ulps(want, 4) + ulps(old, 4))
    for got, want in ((state.exp_avg, ref.exp_avg), (state.exp_avg_sq, ref.exp_avg_sq)):
        diff = (got.int() - want.int()).abs()
        assert int(diff.max()) <= 1
        assert int((diff > 0).sum()) <= 4 + 0.03 * n
    assert torch.all((state.master - ref.master).abs() <= 2e-3 * moved + ulps(ref.master))


@pytest.mark.parametrize("level", AVAILABLE)
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_parts_with_their_index_base_give_the_whole_shard(state_dtype, level):
    """A shard cut into parts (int8 at block boundaries, bf16 anywhere), each
    called with its offset, steps exactly as the whole: stochastic rounding
    does not depend on where a shard part starts, nor does which elements a
    level steps in its short ends, so runs repeat across world sizes."""
    n = 10 * QBLOCK + 37
    whole = State(state_dtype, n, seed=3)
    parts = whole.clone()
    grad = torch.randn(n) * 1e-2
    whole.step(grad, 9, rounding="stochastic", seed=11, index_base=1000 * QBLOCK, simd=level)
    cuts = [0, 3 * QBLOCK, 8 * QBLOCK, n] if state_dtype == "int8" else [0, 773, 2053, n]
    for a, b in zip(cuts, cuts[1:]):
        blocks = slice(a // QBLOCK, (b + QBLOCK - 1) // QBLOCK)
        _C.adamw_step_lowp(parts.master[a:b], parts.exp_avg[a:b], parts.exp_avg_sq[a:b],
                           grad[a:b], exp_avg_scale=None if parts.scales is None
                           else parts.scales[blocks], exp_avg_sq_scale=None
                           if parts.sq_scales is None else parts.sq_scales[blocks],
                           step=9, rounding="stochastic", seed=11,
                           index_base=1000 * QBLOCK + a, simd=level, **HP)
    assert_bits_equal(parts, whole)


@pytest.mark.parametrize("level", AVAILABLE)
def test_a_nonfinite_block_reads_nan_and_leaves_the_others(level):
    n = 4 * QBLOCK
    state = State("int8", n, seed=5)
    grad = torch.randn(n) * 1e-2
    grad[QBLOCK + 17] = float("nan")
    grad[2 * QBLOCK + 3] = float("inf")
    clean = state.clone()
    clean.step(torch.where(grad.isfinite(), grad, 0), 2, simd=level)
    state.step(grad, 2, simd=level)
    assert state.scales[1].isnan() and state.sq_scales[1].isnan()
    assert state.scales[2].isnan() and state.sq_scales[2].isnan()
    assert int(state.exp_avg[QBLOCK:3 * QBLOCK].abs().sum()) == 0
    for b in (0, 3):
        s = slice(b * QBLOCK, (b + 1) * QBLOCK)
        assert torch.equal(state.exp_avg[s], clean.exp_avg[s])
        assert torch.equal(state.exp_avg_sq[s], clean.exp_avg_sq[s])
        assert state.scales[b] == clean.scales[b]
    m, _ = state.moments()
    assert np.isnan(m[QBLOCK:3 * QBLOCK]).all()



@pytest.mark.parametrize("level", AVAILABLE)
def test_a_block_read_as_nan_steps_its_master_to_nan_at_every_level(level):
    """A finite grad whose square overflows exp_avg_sq leaves its block's
    exp_avg_sq scale NaN (an int8 block cannot hold an Inf); the next step
    reads NaN there, and every level steps those elements to NaN, as the
    reference does, rather than to a finite value (the optimizer refuses
    such a grad before the kernels: test_low_precision_states)."""
    n = 2 * QBLOCK
    state = State("int8", n, seed=2)
    grad = torch.randn(n) * 1e-2
    grad[QBLOCK + 9] = 1e21
    state.step(grad, 2, simd=level)
    assert state.sq_scales[1].isnan() and not state.scales[1].isnan()
    state.step(torch.randn(n) * 1e-2, 3, simd=level)
    assert bool(state.master[QBLOCK:].isnan().all())
    assert not bool(state.master[:QBLOCK].isnan().any())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("level", AVAILABLE)
def test_a_small_exp_avg_sq_beside_an_old_spike_never_reads_as_zero(level, rounding):
    """A grad spike leaves its block a large exp_avg_sq scale long after its
    exp_avg decayed: elements' first small grads then sit below half an
    exp_avg_sq code while their exp_avg keeps one. Read as zero, they would
    step by exp_avg / eps (thousands of times torch's step); code 1 reads
    exp_avg_sq larger, so they step less than torch, never more."""
    state = State("int8", QBLOCK, seed=1)
    for t in (state.master, state.exp_avg, state.exp_avg_sq, state.scales, state.sq_scales):
        t.zero_()
    m = v = p = np.zeros(QBLOCK)
    for step in range(1, 101):
        grad = torch.zeros(QBLOCK)
        if step == 1:
            grad[0] = 1000.0
        if step == 80:
            grad[5:200] = 1e-3
        state.step(grad, step, rounding=rounding, seed=3, simd=level)
        p, m, v = adamw_f64(p, m, v, grad.numpy(), step)
    assert not np.any((state.exp_avg_sq.numpy() == 0) & (v > 0))
    moved, want = np.abs(state.master[5:200].double().numpy()), np.abs(p[5:200])
    assert np.all(moved <= 1.01 * want) and np.all(moved > 0.05 * want)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("level", AVAILABLE)
def test_nonfinite_bf16_moments_stay_nan_or_inf(level, rounding):
    """A NaN grad leaves NaN moments, whatever its payload (all ones would
    carry into the sign under a plain add), and an Inf grad an Inf exp_avg_sq;
    the other elements step as without them."""
    n = 3 * 64 + 5
    state = State("bf16", n, seed=3)
    grad = torch.randn(n) * 1e-2
    all_ones_nan = torch.tensor([-1], dtype=torch.int32).view(torch.float32)
    bad = {7: all_ones_nan, 70: torch.tensor(float("nan")), 131: torch.tensor(float("inf")),
           n - 1: torch.tensor(float("-inf"))}
    for i, value in bad.items():
        grad[i] = value
    clean = state.clone()
    clean.step(torch.where(grad.isfinite(), grad, 0), 2, rounding=rounding, seed=1, simd=level)
    state.step(grad, 2, rounding=rounding, seed=1, simd=level)
    for i in (7, 70):
        assert state.exp_avg[i].isnan() and state.exp_avg_sq[i].isnan()
    for i in (131, n - 1):
        assert state.exp_avg[i].isinf() and state.exp_avg_sq[i] == float("inf")
    if rounding == "stochastic":
        nan_bits = state.exp_avg_sq[[7, 70]].view(torch.int16)
        assert (nan_bits == 0x7FC0).all()
    good = torch.ones(n, dtype=torch.bool)
    good[list(bad)] = False
    assert torch.equal(state.exp_avg[good], clean.exp_avg[good])
    assert torch.equal(state.exp_avg_sq[good], clean.exp_avg_sq[good])

# ---- bad input is refused, and nothing changes -------------------------------

def _bad_calls():
    n = 300
    master, grad = torch.zeros(n), torch.zeros(n)
    i8, u8 = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
    bf = torch.zeros(n, dtype=torch.bfloat16)
    sc, sc_bad = torch.zeros(2), torch.zeros(3)
    return [
        (dict(master=master, exp_avg=i8, exp_avg_sq=u8, grad=grad), TypeError, "need"),
        (dict(master=master, exp_avg=i8, exp_avg_sq=u8, grad=grad, exp_avg_scale=sc,
              exp_avg_sq_scale=sc_bad), ValueError, "blocks"),
        (dict(master=master, exp_avg=i8, exp_avg_sq=i8.clone(), grad=grad, exp_avg_scale=sc,
              exp_avg_sq_scale=sc.clone()), TypeError, "uint8"),
        (dict(master=master, exp_avg=bf, exp_avg_sq=bf.clone(), grad=grad, exp_avg_scale=sc,
              exp_avg_sq_scale=sc.clone()), ValueError, "no scales"),
        (dict(master=master, exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n), grad=grad),
         TypeError, "bfloat16"),
        (dict(master=master, exp_avg=bf, exp_avg_sq=bf, grad=grad), ValueError, "overlap"),
        (dict(master=master, exp_avg=bf, exp_avg_sq=bf.clone(), grad=i8), BufferError, "int8"),
        (dict(master=master, exp_avg=bf, exp_avg_sq=torch.zeros(n + 1, dtype=torch.bfloat16),
              grad=grad), ValueError, "elements"),
        (dict(master=master, exp_avg=bf, exp_avg_sq=bf.clone(), grad=grad, rounding="up"),
         ValueError, "rounding"),
        (dict(master=master, exp_avg=bf, exp_avg_sq=bf.clone(), grad=grad, seed=-1),
         ValueError, "seed"),
        (dict(master=master, exp_avg=bf, exp_avg_sq=bf.clone(), grad=grad, index_base=-5),
         ValueError, "index_base"),
    ]


@pytest.mark.parametrize("call", range(len(_bad_calls())))
def test_bad_input_is_refused_and_changes_nothing(call):
    kwargs, error, text = _bad_calls()[call]
    kwargs = {**kwargs}
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=text):
        _C.adamw_step_lowp(step=1, **HP, **kwargs)
    for k, v in before.items():
        assert torch.equal(kwargs[k].view(torch.uint8) if kwargs[k].dtype == torch.bfloat16
                           else kwargs[k], v.view(torch.uint8) if v.dtype == torch.bfloat16
                           else v)


def test_codes_are_taken_only_by_the_low_precision_step():
    """int8 codes (torch tensors, or views of rlhfz buffers) are refused by
    every other kernel."""
    buffer = _C.Buffer(64)
    for codes in (torch.zeros(4, dtype=torch.int8), buffer.view("int8"), buffer.view("uint8")):
        with pytest.raises(BufferError, match="int8|uint8"):
            _C.sumsq(codes)
        with pytest.raises(BufferError, match="int8|uint8"):
            _C.scale_(codes, 2.0)
    with pytest.raises(BufferError, match="uint8"):
        _C.describe_dlpack(torch.zeros(4, dtype=torch.uint8))


def test_buffer_views_of_codes_step_in_place():
    n = 3 * QBLOCK
    buffers = {name: _C.Buffer(n * size) for name, size in
               (("master", 4), ("grad", 4), ("exp_avg", 1), ("exp_avg_sq", 1))}
    scales = [_C.Buffer(16), _C.Buffer(16)]
    views = {"master": buffers["master"].view("float32"), "grad": buffers["grad"].view("float32"),
             "exp_avg": buffers["exp_avg"].view("int8"),
             "exp_avg_sq": buffers["exp_avg_sq"].view("uint8")}
    torch.from_dlpack(views["grad"]).copy_(torch.randn(n))
    state = State("int8", n)
    state.master.zero_()
    state.exp_avg.zero_()
    state.exp_avg_sq.zero_()
    state.scales.zero_()
    state.sq_scales.zero_()
    grad = torch.from_dlpack(views["grad"]).clone()
    state.step(grad, 1)
    _C.adamw_step_lowp(views["master"], views["exp_avg"], views["exp_avg_sq"], views["grad"],
                       exp_avg_scale=scales[0].view("float32", 0, (3,)),
                       exp_avg_sq_scale=scales[1].view("float32", 0, (3,)), step=1, **HP)
    assert torch.equal(torch.from_dlpack(views["exp_avg"]), state.exp_avg)
    assert torch.equal(torch.from_dlpack(views["exp_avg_sq"]), state.exp_avg_sq)
    assert torch.equal(torch.from_dlpack(views["master"]), state.master)
