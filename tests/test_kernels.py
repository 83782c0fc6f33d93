"""CPU kernels against plain float64 NumPy references, over generated sizes.

Every SIMD level the CPU has is checked, plus the C reference kernel, over
sizes with odd tails. 16-bit outputs must be exactly the fp32 result rounded
to nearest even (torch's .to() rounds that way), and all levels must agree.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlhfz
from rlhfz import _C

LEVELS = ["reference", "scalar", "avx2", "avx512"]
_ORDER = {"scalar": 0, "avx2": 1, "avx512": 2}
AVAILABLE = [lv for lv in LEVELS
             if lv in ("reference", "scalar") or _ORDER[lv] <= _ORDER[_C.simd_level()]]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

sizes = st.one_of(st.integers(0, 70), st.integers(71, 5000), st.sampled_from([65537, 300_007]))


def adamw_reference_f64(master, exp_avg, exp_avg_sq, grad, *, lr, beta1, beta2, eps,
                        weight_decay, step, maximize=False, grad_scale=1.0):
    """AdamW in float64, the way torch.optim.AdamW writes it."""
    g = grad.astype(np.float64) * grad_scale
    if maximize:
        g = -g
    p = master.astype(np.float64) * (1.0 - lr * weight_decay)
    m = exp_avg.astype(np.float64) + (1.0 - beta1) * (g - exp_avg)
    v = exp_avg_sq.astype(np.float64) * beta2 + (1.0 - beta2) * g * g
    step_size = lr / (1.0 - beta1 ** step)
    denom = np.sqrt(v) / math.sqrt(1.0 - beta2 ** step) + eps
    return p - step_size * m / denom, m, v


def _error_bounds(master, exp_avg, exp_avg_sq, grad, ref_m, ref_v, *, lr, beta1, beta2, eps,
                  weight_decay, step, maximize=False, grad_scale=1.0):
    """Elementwise bounds on the fp32 kernel's error: a few ulps of the
    magnitudes that enter each operation (the first moment and the update
    can cancel, so a relative tolerance on the result alone would be wrong)."""
    ulp = 4 * float(np.finfo(np.float32).eps)
    g = np.abs(grad.astype(np.float64) * grad_scale)
    m0, v0, p0 = (np.abs(a.astype(np.float64)) for a in (exp_avg, exp_avg_sq, master))
    tol_m = ulp * (m0 + (1 - beta1) * g) + 1e-37
    tol_v = ulp * (v0 * beta2 + (1 - beta2) * g * g) + 1e-37
    step_size = lr / (1.0 - beta1 ** step)
    denom = np.sqrt(ref_v) / math.sqrt(1.0 - beta2 ** step) + eps
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_denom = ulp + np.where(ref_v > 0, 0.5 * tol_v / ref_v, 0.0)
    update = step_size * np.abs(ref_m) / denom
    tol_p = (ulp * p0 * (1 - lr * weight_decay) + step_size * tol_m / denom
             + update * (rel_denom + ulp) + 1e-37)
    return tol_m, tol_v, tol_p


def _assert_within(actual, expected, tol, what):
    err = np.abs(actual.astype(np.float64) - expected)
    bad = np.flatnonzero(~(err <= tol))
    assert bad.size == 0, (f"{what}: {bad.size} elements off, first at {bad[0]}: "
                           f"{actual[bad[0]]!r} vs {expected[bad[0]]!r} (bound {tol[bad[0]]:.3g})")


def _arrays(n, seed, grad_dtype):
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(n).astype(np.float32)
    exp_avg = (0.1 * rng.standard_normal(n)).astype(np.float32)
    exp_avg_sq = (0.01 * rng.random(n)).astype(np.float32)
    grad = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(DTYPES[grad_dtype])
    return master, exp_avg, exp_avg_sq, grad


def _run(level, master, exp_avg, exp_avg_sq, grad, param_out=None, **hp):
    master, exp_avg, exp_avg_sq = (torch.from_numpy(a.copy()) for a in (master, exp_avg, exp_avg_sq))
    _C.adamw_step(master, exp_avg, exp_avg_sq, grad, param_out, simd=level, **hp)
    return master.numpy(), exp_avg.numpy(), exp_avg_sq.numpy()


hparams = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 3e-4, 0.1]),
    "beta1": st.sampled_from([0.9, 0.8, 0.0]),
    "beta2": st.sampled_from([0.999, 0.95]),
    "eps": st.sampled_from([1e-8, 1e-6]),
    "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
    "step": st.integers(1, 10_000),
    "maximize": st.booleans(),
    "grad_scale": st.sampled_from([1.0, 0.5, 3.0]),
})


@SETTINGS
@given(n=sizes, seed=st.integers(0, 2**32 - 1), hp=hparams,
       grad_dtype=st.sampled_from(list(DTYPES)),
       param_dtype=st.sampled_from([None, "float32", "bfloat16", "float16"]))
def test_adamw_matches_float64_reference_at_every_level(n, seed, hp, grad_dtype, param_dtype):
    master, exp_avg, exp_avg_sq, grad = _arrays(n, seed, grad_dtype)
    ref_p, ref_m, ref_v = adamw_reference_f64(master, exp_avg, exp_avg_sq,
                                              grad.float().numpy(), **hp)
    outputs = {}
    for level in AVAILABLE:
        out = None if param_dtype is None else torch.empty(n, dtype=DTYPES[param_dtype])
        p, m, v = _run(level, master, exp_avg, exp_avg_sq, grad, out, **hp)
        tol_m, tol_v, tol_p = _error_bounds(master, exp_avg, exp_avg_sq, grad.float().numpy(),
                                            ref_m, ref_v, **hp)
        _assert_within(m, ref_m, tol_m, f"exp_avg at {level}")
        _assert_within(v, ref_v, tol_v, f"exp_avg_sq at {level}")
        _assert_within(p, ref_p, tol_p, f"master at {level}")
        if out is not None:
            # 16-bit output: exactly the fp32 master rounded to nearest even
            expected = torch.from_numpy(p).to(DTYPES[param_dtype])
            assert torch.equal(out, expected), level
        outputs[level] = (p, m, v)
    # Without FMA contraction every level computes the same fp32 operations
    # in the same order: the results are identical, bit for bit.
    first = outputs[AVAILABLE[0]]
    for level in AVAILABLE[1:]:
        for a, b in zip(first, outputs[level]):
            np.testing.assert_array_equal(a, b, err_msg=level)


@pytest.mark.parametrize("level", AVAILABLE)
def test_adamw_edge_values(level):
    """Zeros, tiny and huge grads, and a NaN that must stay where it is."""
    # |g| up to 1e18: g * g stays inside fp32 (1e30 would overflow v in torch too)
    grad = torch.tensor([0.0, 1e-30, -1e-30, 1e18, -1e18, 1.0, float("nan")] * 5)
    n = grad.numel()
    master = np.ones(n, dtype=np.float32)
    zeros = np.zeros(n, dtype=np.float32)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    p, m, v = _run(level, master, zeros, zeros, grad, **hp)
    nan = np.isnan(grad.numpy())
    assert np.isnan(p[nan]).all() and np.isfinite(p[~nan]).all()
    assert p[0] == 1.0  # zero grad, zero state: no update
    ref_p, _, _ = adamw_reference_f64(master, zeros, zeros, grad.numpy(), **hp)
    np.testing.assert_allclose(p[~nan], ref_p[~nan], rtol=1e-6)


@SETTINGS
@given(n=sizes, seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(list(DTYPES)))
def test_sumsq_matches_float64(n, seed, dtype):
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))
    x = x.to(DTYPES[dtype])
    expected = float(np.sum(x.double().numpy() ** 2))
    assert _C.sumsq(x) == pytest.approx(expected, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("position", [0, 17, 100_000, 199_999])
def test_sumsq_sees_every_nonfinite_value(dtype, bad, position):
    x = torch.ones(200_000, dtype=DTYPES[dtype])
    x[position] = bad
    assert not math.isfinite(_C.sumsq(x))


def test_sumsq_of_huge_finite_values_stays_finite():
    x = torch.full((1000,), 3e38)
    assert math.isfinite(_C.sumsq(x))


@SETTINGS
@given(n=sizes, seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(list(DTYPES)),
       scale=st.sampled_from([0.0, 0.5, 1.0, 1e-3, 7.25]))
def test_scale_matches_torch(n, seed, dtype, scale):
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))
    x = x.to(DTYPES[dtype])
    expected = (x.float() * np.float32(scale)).to(DTYPES[dtype])
    _C.scale_(x, scale)
    assert torch.equal(x, expected)


@SETTINGS
@given(n=sizes, seed=st.integers(0, 2**32 - 1), src=st.sampled_from(list(DTYPES)),
       dst=st.sampled_from(list(DTYPES)))
def test_cast_matches_torch_round_to_nearest_even(n, seed, src, dst):
    rng = np.random.default_rng(seed)
    # a mix of normal, huge (some overflow to Inf), tiny (subnormal in 16
    # bits) and special values
    with np.errstate(over="ignore"):
        values = rng.standard_normal(n).astype(np.float32) * rng.choice(
            np.array([1.0, 1e-6, 1e-40, 7e4, 1e38], dtype=np.float32), n)
    if n > 3:
        values[:3] = [np.inf, -np.inf, 0.0]
    x = torch.from_numpy(values).to(DTYPES[src])
    out = torch.empty(n, dtype=DTYPES[dst])
    _C.cast_(out, x)
    assert torch.equal(out, x.to(DTYPES[dst]))


def test_cast_keeps_nan():
    x = torch.tensor([float("nan"), 1.0, float("nan")] * 11)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(x.numel(), dtype=dtype)
        _C.cast_(out, x)
        assert torch.isnan(out[0::3]).all() and (out[1::3] == 1).all()


def test_traffic_bound_kernel_does_its_arithmetic():
    p, g, m, v = (torch.full((1001,), float(i + 1)) for i in range(4))
    _C.adamw_traffic_bound(p, g, m, v)
    # Whatever trivial arithmetic it does, it must touch all three outputs
    # (else the compiler could drop stores and the bound would be a lie).
    assert not torch.equal(p, torch.full((1001,), 1.0))
    assert not torch.equal(m, torch.full((1001,), 3.0))
    assert not torch.equal(v, torch.full((1001,), 4.0))
    assert torch.equal(g, torch.full((1001,), 2.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.uint8])
@pytest.mark.parametrize("n", [1, 63, 64, 1000, 4099])
def test_traffic_bound_moves_every_byte_of_narrow_moments(dtype, n):
    """Moments of 2 or 1 bytes: every element of both is rewritten, and the
    fp32 tensors around them as for fp32 moments. (The grad's bits have no
    zero byte, so whatever it adds to zeros leaves none.)"""
    grad = torch.tensor(1.2345678)
    assert (grad.view(1).view(torch.uint8) != 0).all()
    p, g = torch.zeros(n), grad.repeat(n)
    m, v = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    _C.adamw_traffic_bound(p, g, m, v)
    assert torch.equal(p, g) and torch.equal(g, grad.repeat(n))
    for moment in (m, v):
        words = moment.view(torch.uint8).view(-1, moment.element_size())
        assert (words != 0).any(dim=1).all()


def test_traffic_bound_refuses_mixed_or_short_moments():
    p, g = torch.zeros(64), torch.zeros(64)
    with pytest.raises(TypeError, match="v must be bfloat16, not int8"):
        _C.adamw_traffic_bound(p, g, torch.zeros(64, dtype=torch.bfloat16),
                               torch.zeros(64, dtype=torch.int8))
    with pytest.raises(ValueError, match="m has 63 elements but p has 64"):
        _C.adamw_traffic_bound(p, g, torch.zeros(63, dtype=torch.uint8),
                               torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(TypeError, match="g must be float32"):
        _C.adamw_traffic_bound(p, torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64),
                               torch.zeros(64))


def test_unsupported_level_is_refused_or_runs():
    """Asking for a wider level than the CPU has is an error, never a crash."""
    master = torch.zeros(8)
    args = (master, torch.zeros(8), torch.zeros(8), torch.ones(8))
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    for level in ("scalar", "avx2", "avx512"):
        if level in AVAILABLE:
            _C.adamw_step(*args, simd=level, **hp)
        else:
            with pytest.raises(RuntimeError, match="not supported"):
                _C.adamw_step(*args, simd=level, **hp)


def test_kernel_threads_release_the_gil():
    """Two Python threads stepping different arrays run at once and agree
    with a one-thread run."""
    import threading
    n = 2_000_000
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3)
    arrays = [[torch.full((n,), 0.5), torch.zeros(n), torch.zeros(n), torch.full((n,), 0.25)]
              for _ in range(2)]
    threads = [threading.Thread(target=lambda a=a: [_C.adamw_step(*a, **hp) for _ in range(5)])
               for a in arrays]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(arrays[0][0], arrays[1][0])
    assert rlhfz.get_num_threads() >= 1


@pytest.mark.parametrize("n", [40_001, 1_000_003, 3 * 1024 * 16384 + 77])
def test_every_thread_count_gives_the_same_bits(n):
    """Threads claim ranges as they come free, and the cut into ranges
    depends on n alone: the sum of squares (one partial per range, added in
    order) and every element of a step are the same with 1, 2, 3 or 7
    threads, odd tails and cuts of more than the range limit included."""
    rng = np.random.default_rng(n)
    x = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=4)
    before = rlhfz.get_num_threads()
    sums, steps = [], []
    try:
        for threads in (1, 2, 3, 7):
            rlhfz.set_num_threads(threads)
            sums.append(_C.sumsq(x))
            arrays = [x.clone(), x.abs(), x.square(), x.flip(0).clone()]
            _C.adamw_step(*arrays, **hp)
            steps.append(arrays[:3])
    finally:
        rlhfz.set_num_threads(before)
    expected = float(np.sum(x.double().numpy() ** 2))
    assert sums[0] == pytest.approx(expected, rel=1e-12)
    assert all(s == sums[0] for s in sums), sums
    for other in steps[1:]:
        assert all(torch.equal(a, b) for a, b in zip(steps[0], other))
    # every element was stepped once: the same as a plain one-pass reference
    ref = [x.clone(), x.abs(), x.square()]
    _C.adamw_step(*ref, x.flip(0).clone(), simd="reference", **hp)
    assert all(torch.equal(a, b) for a, b in zip(ref, steps[0]))


def test_thread_counts_past_the_pool_are_refused_not_clamped():
    before = rlhfz.get_num_threads()
    try:
        with pytest.raises(ValueError, match=r"thread count must be in \[1, 256\], not 257"):
            rlhfz.set_num_threads(257)
        assert rlhfz.get_num_threads() == before
        rlhfz.set_num_threads(256)
        assert rlhfz.get_num_threads() == 256
    finally:
        rlhfz.set_num_threads(before)


class _Interrupting:
    def __float__(self):
        raise KeyboardInterrupt


def test_an_interrupt_while_reading_a_number_is_not_renamed_a_typeerror():
    x = np.ones(8, np.float32)
    with pytest.raises(KeyboardInterrupt):
        _C.scale_(x, _Interrupting())
    with pytest.raises(TypeError, match="scale must be a real number, not str"):
        _C.scale_(x, "2")
    assert x.tolist() == [1.0] * 8
