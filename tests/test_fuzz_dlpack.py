"""Fuzzing rlhfz's DLPack importer: hand-built capsules with any field value,
and producers that misbehave, fed to every entry point that imports DLPack.

Each case runs a slow reference of the importer's rules beside rlhfz: both
refuse (with the same exception type) or both accept, and then rlhfz read
and wrote the right bytes and nothing else. Every tensor's deleter runs
exactly once, whoever ends up owning it, and no call leaves a reference to
a capsule behind. Case counts: RLHFZ_FUZZ_EXAMPLES (see fuzz_support)."""
import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlhfz
from dlpack_handmade import (CALLBACK_ERRORS, FLAG_READ_ONLY, ITEMSIZE, LEGACY, STRAY_DELETES,
                             USED, VERSIONED, Produced)
from fuzz_support import Tally, fuzz_settings, outcome, watchdog
from rlhfz import _C

CUDA = bool(rlhfz.build_info()["cuda"])
MAX_NDIM = 8
PTRDIFF_MAX = (1 << 63) - 1
ADDRESS_END = 1 << 64
GUARD = 64                      # sentinel bytes on each side of a tensor's memory
REAL_LIMIT = 1 << 15            # bytes a case backs with real memory, at most
DTYPE_NAMES = {(2, 32): "float32", (4, 16): "bfloat16", (2, 16): "float16"}
KERNEL_ARRAYS = ("master", "exp_avg", "exp_avg_sq", "grad", "param_out")


# ---- the reference: what the importer must decide ------------------------------------------

def visible_shape(spec):
    return spec["dims"][:spec["ndim"]] if 0 <= spec["ndim"] <= MAX_NDIM else None


def itemsize(spec):
    code, bits, lanes = spec["dtype"]
    return ITEMSIZE.get((code, bits)) if lanes == 1 else None


def numel_or_none(spec):
    """The element count, or None where the importer must refuse the shape."""
    size, shape = itemsize(spec), visible_shape(spec)
    if size is None or shape is None or (spec["ndim"] > 0 and spec["null_shape"]):
        return None
    limit, numel = PTRDIFF_MAX // size, 1
    for dim in shape:
        if dim < 0 or (dim != 0 and numel > limit // dim):
            return None
        numel *= dim
    return numel


def compact(spec):
    shape = visible_shape(spec)
    if spec["strides"] is None or numel_or_none(spec) == 0:
        return True
    expected = 1
    for dim, stride in reversed(list(zip(shape, spec["strides"]))):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def predict(spec, place, writable, data):
    """None if the importer must accept the capsule whose data pointer is
    `data`, else the exception type."""
    if spec["name"] != "proper":
        return BufferError
    if spec["versioned"] and spec["major"] != 1:
        return BufferError
    device = spec["device"][0]
    if place == "host" and device not in (1, 3) or place == "cuda" and device != 2:
        return BufferError
    numel = numel_or_none(spec)
    if numel is None or not compact(spec):
        return BufferError
    size = itemsize(spec)
    if numel > 0 and data is None:
        return BufferError
    start = (data or 0) + spec["byte_offset"]
    if start + numel * size > ADDRESS_END - 1 or start % size:
        return BufferError
    readonly = spec["versioned"] and spec["flags"] & FLAG_READ_ONLY
    if writable and readonly:
        return BufferError
    return None


# ---- cases: specs, and memory behind them ---------------------------------------------------

small_dims = st.integers(0, 4)
dims = st.one_of(small_dims, small_dims, small_dims, small_dims, st.just(1),
                 st.sampled_from([2**31, 2**32 + 1, 2**40, 2**61, 2**62, 2**63 - 1]),
                 st.sampled_from([-1, -2, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
int64s = st.integers(-(2**63), 2**63 - 1)


@st.composite
def specs(draw):
    """Half the time any field values; else a valid tensor with at most one
    field taken from such a wild spec, so that near misses are common."""
    wild = draw(wild_specs())
    if draw(st.booleans()):
        return wild
    dtype = draw(st.sampled_from([(2, 32, 1), (4, 16, 1), (2, 16, 1)]))
    ndim = draw(st.integers(0, 4))
    dims = draw(st.lists(st.integers(0, 5), min_size=MAX_NDIM, max_size=MAX_NDIM))
    strides = None
    if draw(st.booleans()):
        strides, step = [0] * MAX_NDIM, 1
        for i in reversed(range(ndim)):
            strides[i] = step if dims[i] != 1 or draw(st.booleans()) else draw(int64s)
            step *= max(dims[i], 1)
    tame = dict(wild, dtype=dtype, dims=dims, ndim=ndim, strides=strides, name="proper",
                major=1, device=draw(st.sampled_from([(1, 0), (3, 0), (1, 5)])),
                flags=draw(st.sampled_from([0, 0, 1, 2])), null_shape=False,
                byte_offset=draw(st.integers(0, 8)) * ITEMSIZE[dtype[:2]], data_mode="real",
                misalign=0)
    field = draw(st.sampled_from([None, None] + sorted(tame)))
    if field is not None:
        tame[field] = wild[field]
    if field == "ndim" or field == "dims":
        tame["strides"] = None
    return tame


@st.composite
def wild_specs(draw):
    dtype = draw(st.one_of(
        st.sampled_from([(2, 32, 1), (4, 16, 1), (2, 16, 1)]),
        st.sampled_from([(2, 32, 1), (4, 16, 1), (2, 16, 1)]),
        st.sampled_from([(2, 64, 1), (0, 32, 1), (1, 16, 1), (4, 32, 1), (2, 32, 2), (2, 32, 0),
                         (5, 64, 1), (6, 8, 1), (3, 64, 1), (2, 8, 1)]),
        st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 65535))))
    shape_dims = draw(st.lists(dims, min_size=MAX_NDIM, max_size=MAX_NDIM))
    ndim = draw(st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(4, MAX_NDIM),
                          st.sampled_from([-1, 9, 64, -(2**31), 2**31 - 1]),
                          st.integers(-(2**31), 2**31 - 1)))
    spec = {"dtype": dtype, "dims": shape_dims, "ndim": ndim,
            "versioned": draw(st.booleans()),
            "name": draw(st.sampled_from(["proper"] * 12 + ["used", "other", "null"])),
            "major": draw(st.one_of(st.just(1), st.just(1), st.just(1),
                                    st.integers(0, 2**32 - 1))),
            "minor": draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1))),
            "flags": draw(st.one_of(st.sampled_from([0, 0, 0, 1, 2, 3]),
                                    st.integers(0, 2**64 - 1))),
            "device": (draw(st.one_of(st.just(1), st.just(1), st.just(1), st.just(1),
                                      st.sampled_from([2, 3, 13, 4, 7, 8, 10, 14, 0, 99]),
                                      st.integers(-(2**31), 2**31 - 1))),
                       draw(st.one_of(st.sampled_from([0, 0, 1, -1]),
                                      st.integers(-(2**31), 2**31 - 1)))),
            "null_shape": draw(st.integers(0, 15)) == 0,
            "deleter": draw(st.integers(0, 15)) != 0}
    shape = visible_shape(spec) or []
    mode = draw(st.sampled_from(["null", "null", "compact", "compact", "perturbed", "random"]))
    strides = None
    if mode != "null":
        strides, step = [0] * MAX_NDIM, 1
        for i in reversed(range(len(shape))):
            strides[i] = step
            step = step * max(shape[i], 1) % 2**63
        if mode == "perturbed" and shape:
            strides[draw(st.integers(0, len(shape) - 1))] = draw(
                st.one_of(st.sampled_from([0, -1, 2, 2**62]), int64s))
        elif mode == "random":
            strides = draw(st.lists(int64s, min_size=MAX_NDIM, max_size=MAX_NDIM))
    spec["strides"] = strides
    spec["byte_offset"] = draw(st.one_of(st.just(0), st.just(0), st.just(0),
                                         st.integers(0, 64),
                                         st.sampled_from([2**62, 2**63, 2**64 - 4, 2**64 - 1])))
    # data: real memory (maybe misaligned), null, or an address nobody owns
    spec["data_mode"] = draw(st.sampled_from(["real"] * 8 + ["null", "wild"]))
    spec["misalign"] = draw(st.one_of(st.just(0), st.just(0), st.integers(0, 3)))
    spec["wild"] = draw(st.sampled_from([16, 4096, 2**47, 2**64 - 64, 2**64 - 2]))
    return spec


def element_values(n, seed):
    """Small whole numbers, exact in every dtype rlhfz takes (sums too)."""
    return (np.random.default_rng(seed).integers(-8, 9, n)).astype(np.float32)


def encode(values, dtype):
    if dtype == (2, 32):
        return values.astype(np.float32).tobytes()
    if dtype == (2, 16):
        return values.astype(np.float16).tobytes()
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


class Memory:
    """The bytes a spec's data pointer points at: real, guarded memory when
    its extent is small, else a small block (then only entry points that
    read nothing may see an accepting capsule)."""

    def __init__(self, spec, seed):
        numel, size = numel_or_none(spec), itemsize(spec)
        extent = spec["byte_offset"] + (numel * size if numel is not None else 0)
        self.real = spec["data_mode"] == "real" and numel is not None and extent <= REAL_LIMIT
        # an empty tensor reads nothing, wherever it points
        self.safe = self.real or numel == 0
        body = extent if self.real else 256
        self.block = np.full(2 * GUARD + 64 + body + 8, 0xA5, dtype=np.uint8)
        base = self.block.ctypes.data
        self.start = (base + GUARD + 63) // 64 * 64 + spec["misalign"]
        self.spec = spec
        self.values = np.zeros(0, np.float32)
        if self.real and numel:
            self.values = element_values(numel, seed)
            lo = self.start - base + spec["byte_offset"]
            raw = encode(self.values, spec["dtype"][:2])
            self.block[lo:lo + len(raw)] = np.frombuffer(raw, np.uint8)
        self.pristine = self.block.copy()
        self.data = {"real": self.start, "null": None, "wild": spec["wild"]}[spec["data_mode"]]

    def tensor_bytes(self):
        base = self.block.ctypes.data
        lo = self.start - base + self.spec["byte_offset"]
        return lo, lo + self.values.size * itemsize(self.spec)

    def produce(self):
        s = self.spec
        name = {"proper": Produced._UNSET, "used": USED[VERSIONED if s["versioned"] else LEGACY],
                "other": b"dltensor_v2", "null": None}[s["name"]]
        return Produced(self.data, s["dims"], s["strides"], ndim=s["ndim"], code=s["dtype"][0],
                        bits=s["dtype"][1], lanes=s["dtype"][2], device=s["device"],
                        byte_offset=s["byte_offset"], versioned=s["versioned"],
                        major=s["major"], minor=s["minor"], flags=s["flags"],
                        null_shape=s["null_shape"], deleter=s["deleter"], name=name, keep=self)


def settle(*produced, taken=()):
    """After a call, with its consumers gone: no capsule reference left
    behind, and each deleter run exactly once (never for a tensor a consumer
    had taken before: that consumer frees it)."""
    for p in produced:
        adopted = p in taken
        assert p.taken() == adopted, "a capsule renamed although nobody kept its tensor"
        assert p.finish() == 0, "a capsule reference was left behind"
        owner_frees = p.name == p.proper and p.has_deleter
        assert p.deleted == (1 if owner_frees else 0), f"deleter ran {p.deleted} times"
        p.close()
    assert not CALLBACK_ERRORS and not STRAY_DELETES, (CALLBACK_ERRORS, STRAY_DELETES)


def check(expected, result):
    kind, value = result
    if expected is None:
        assert kind == "ok", f"a valid tensor was refused: {value!r}"
    else:
        assert kind == "raised" and type(value) is expected, \
            f"expected {expected.__name__}, got {kind} {value!r}"
    return kind


# ---- the entry points, each with a fresh tensor from the same spec ----------------------------

def run_describe(spec, seed):
    mem = Memory(spec, seed)
    p = mem.produce()
    result = outcome(lambda: _C.describe_dlpack(p.capsule()), (BufferError, TypeError))
    kind = check(predict(spec, "host", False, mem.data), result)
    if kind == "ok":
        info, shape = result[1], tuple(visible_shape(spec))
        assert info["address"] == (mem.data or 0) + spec["byte_offset"]
        assert info["dtype"] == DTYPE_NAMES[spec["dtype"][:2]]
        assert info["shape"] == shape and info["numel"] == math.prod(shape)
        assert info["device"] == tuple(spec["device"])
        assert info["readonly"] == bool(spec["versioned"] and spec["flags"] & FLAG_READ_ONLY)
    del result
    settle(p)
    return kind


def run_adopt(spec, seed):
    mem = Memory(spec, seed)
    p = mem.produce()
    result = outcome(lambda: _C.Buffer.from_dlpack(p.capsule()), (BufferError, TypeError))
    kind = check(predict(spec, "host", True, mem.data), result)
    if kind == "ok":
        buf, numel = result[1], numel_or_none(spec)
        assert buf.tier == "external" and buf.nbytes == numel * itemsize(spec)
        assert buf.address == (mem.data or 0) + spec["byte_offset"]
        assert p.taken() and p.deleted == 0
        if mem.real and numel:
            name = DTYPE_NAMES[spec["dtype"][:2]]
            assert _C.sumsq(buf.view(name)) == float(np.sum(mem.values.astype(np.float64) ** 2))
        del buf
    del result
    settle(p, taken=(p,) if kind == "ok" else ())
    return kind


def run_sumsq(spec, seed):
    mem = Memory(spec, seed)
    expected = predict(spec, "host", False, mem.data)
    if expected is None and not mem.safe:
        return None                        # it would read memory that is not there
    p = mem.produce()
    result = outcome(lambda: _C.sumsq(p.capsule()), (BufferError, TypeError))
    if check(expected, result) == "ok":
        assert result[1] == float(np.sum(mem.values.astype(np.float64) ** 2))
    settle(p)
    assert np.array_equal(mem.block, mem.pristine), "a read-only kernel wrote"
    return result[0]


def run_scale(spec, seed, cuda=False):
    mem = Memory(spec, seed)
    expected = predict(spec, "cuda" if cuda else "host", True, mem.data)
    if expected is None and (cuda and CUDA or not cuda and not mem.safe):
        return None          # a launch on memory that is not there
    if expected is None and cuda:
        expected = RuntimeError            # accepted, then: no usable CUDA device
    p = mem.produce()
    fn = _C.cuda_scale_ if cuda else _C.scale_
    result = outcome(lambda: fn(p.capsule(), 2.0), (BufferError, TypeError, RuntimeError))
    kind = check(expected, result)
    settle(p)
    want = mem.pristine.copy()
    if kind == "ok":
        lo, hi = mem.tensor_bytes()
        want[lo:hi] = np.frombuffer(encode(mem.values * 2, spec["dtype"][:2]), np.uint8)
    assert np.array_equal(mem.block, want), "wrong bytes written, or bytes outside the tensor"
    return kind


def tensor_bytes(t):
    same_size = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(same_size).numpy().tobytes()


def run_adamw(spec, seed, slot):
    """The spec in one of adamw_step's five arrays, valid float32 ones in the
    others: the arrays borrowed before a refused one are released too."""
    mem = Memory(spec, seed)
    expected = predict(spec, "host", slot != "grad", mem.data)
    if expected is None and not mem.safe:
        return None
    numel = numel_or_none(spec) if expected is None else 4
    if expected is None and slot in ("master", "exp_avg", "exp_avg_sq") \
            and spec["dtype"][:2] != (2, 32):
        expected = TypeError
    others, arrays, partners = {}, {}, []
    for i, name in enumerate(KERNEL_ARRAYS):
        if name == slot:
            continue
        values = np.abs(element_values(numel, seed + i)) if name == "exp_avg_sq" else \
            element_values(numel, seed + i)
        others[name] = values.copy()
        partner = Produced(others[name].ctypes.data, (numel,), keep=others[name],
                           versioned=bool(i % 2))
        partners.append(partner)
        arrays[name] = partner
    originals = {n: v.copy() for n, v in others.items()}
    p = mem.produce()
    arrays[slot] = p
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3)
    result = outcome(lambda: _C.adamw_step(*(arrays[n].capsule() for n in KERNEL_ARRAYS), **hp),
                     (BufferError, TypeError, ValueError))
    kind = check(expected, result)
    settle(p, *partners)
    if kind == "ok":
        # The same step on torch tensors holding the same values, imported by torch's producer.
        dtype = {(2, 32): torch.float32, (4, 16): torch.bfloat16,
                 (2, 16): torch.float16}[spec["dtype"][:2]]
        ref = {n: torch.from_numpy(v) for n, v in originals.items()}
        ref[slot] = torch.from_numpy(mem.values.copy()).to(dtype)
        lo, hi = mem.tensor_bytes()
        assert mem.pristine[lo:hi].tobytes() == tensor_bytes(ref[slot])
        _C.adamw_step(*(ref[n] for n in KERNEL_ARRAYS), **hp)
        for name, values in others.items():
            assert values.tobytes() == ref[name].numpy().tobytes(), name
        got = mem.block[lo:hi].tobytes()
        assert got == tensor_bytes(ref[slot]), slot
        mem.block[lo:hi] = mem.pristine[lo:hi]
    assert np.array_equal(mem.block, mem.pristine), "bytes outside the tensor changed"
    return kind


def test_fuzz_handmade_capsules():
    tally = Tally("dlpack capsules")

    @fuzz_settings()
    @given(spec=specs(), seed=st.integers(0, 2**32 - 1),
           slot=st.sampled_from(KERNEL_ARRAYS))
    def case(spec, seed, slot):
        with watchdog():
            kinds = [run_describe(spec, seed), run_adopt(spec, seed), run_sumsq(spec, seed),
                     run_scale(spec, seed), run_scale(spec, seed, cuda=True),
                     run_adamw(spec, seed, slot)]
        tally.case("accepted" if kinds[0] == "ok" else "refused")

    case()
    tally.report()


# ---- producers: objects with __dlpack__ that misbehave, and real ones --------------------------

class Raised(Exception):
    """What a fake producer raises: it must come back out unchanged."""


class Fake:
    """A producer whose __dlpack__ and __dlpack_device__ do what the case says."""

    def __init__(self, case, make_spec_tensor):
        self.case = case
        self.calls = []
        self.produced = []
        self.make = make_spec_tensor
        self.error = None

    def _answer(self, answer):
        if answer == "capsule":
            p = self.make()
            self.produced.append(p)
            return p.capsule()
        if answer == "raise":
            self.error = self.case["raise"]("from the producer")
            raise self.error
        if answer == "type_error":
            raise TypeError("unexpected keyword argument")
        return {"none": None, "int": 7, "str": "dltensor", "list": [1],
                "bytes": b"dltensor"}[answer]


def fake_class(case):
    """A class whose methods have the signature the case asks for."""
    signature = case["signature"]

    def dlpack(self, *args, **kwargs):
        self.calls.append(kwargs)
        if signature == "none" and (args or kwargs):
            raise TypeError("__dlpack__() takes no arguments")
        if signature == "legacy" and set(kwargs) - {"stream"}:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self._answer(case["answers"][min(len(self.calls), 2) - 1])

    def device(self):
        d = case["device"]
        if d == "raise_attribute":
            raise AttributeError("no device")
        if d == "raise_value":
            self.error = Raised("device")
            raise self.error
        return d

    namespace = {}
    if case["has_dlpack"] == "method":
        namespace["__dlpack__"] = dlpack
    elif case["has_dlpack"] == "not_callable":
        namespace["__dlpack__"] = 3
    elif case["has_dlpack"] == "property_raises":
        namespace["__dlpack__"] = property(lambda self: (_ for _ in ()).throw(
            AttributeError("no")))
    if case["device"] != "absent":
        namespace["__dlpack_device__"] = device
    return type("Fake", (Fake,), namespace)


def predict_fake(case, spec, place, writable, data):
    """(expected exception type or "producer" (its own) or None, expected kwargs list)."""
    if case["has_dlpack"] in ("absent", "property_raises"):
        return TypeError, []
    stream = {}
    if place == "cuda":
        d = case["device"]
        if d == "raise_value":
            return "producer", []
        if isinstance(d, tuple) and len(d) == 2:
            if not isinstance(d[0], int):
                return TypeError, []
            if not -(2**63) <= d[0] < 2**63:
                return OverflowError, []
            if d[0] == 2:
                stream = {"stream": 1}
    if case["has_dlpack"] == "not_callable":
        return TypeError, []
    calls = [dict(max_version=(1, 0), **stream)]
    first = case["answers"][0]
    sig_refuses = case["signature"] == "none" or case["signature"] == "legacy"
    if sig_refuses or first == "type_error":
        calls.append(dict(stream))
        refused = case["signature"] == "none" and stream
        answer = "type_error" if refused else case["answers"][1]
    else:
        answer = first
    if answer == "type_error":
        return TypeError, calls
    if answer == "raise":
        return "producer", calls
    if answer != "capsule":
        return BufferError, calls
    return predict(spec, place, writable, data), calls


fake_cases = st.fixed_dictionaries({
    "has_dlpack": st.sampled_from(["method"] * 6 + ["absent", "not_callable", "property_raises"]),
    "signature": st.sampled_from(["any", "any", "legacy", "none"]),
    "answers": st.lists(st.sampled_from(["capsule"] * 6 + ["raise", "type_error", "none", "int",
                                                           "str", "list", "bytes"]),
                        min_size=2, max_size=2),
    "raise": st.sampled_from([Raised, ValueError, RuntimeError, KeyError, BufferError,
                              MemoryError]),
    "device": st.one_of(st.sampled_from(["absent", "raise_attribute", "raise_value", None, (1,),
                                         (2, 0, 0), "cuda", (2.0, 0), (2**70, 0)]),
                        st.tuples(st.sampled_from([1, 2, 3, 13]), st.integers(0, 3))),
})


def run_fake(case, spec, seed, entry):
    place = "cuda" if entry == "cuda_scale_" else "host"
    writable = entry != "describe_dlpack"
    memories = []

    def make():
        memories.append(Memory(spec, seed))
        return memories[-1].produce()

    fake = fake_class(case)(case, make)
    probe = Memory(spec, seed)       # the same layout as the ones make() builds
    expected, calls = predict_fake(case, spec, place, writable, probe.data)
    if expected is None and (not probe.safe and entry != "describe_dlpack"
                             or place == "cuda" and CUDA):
        return None
    if expected is None and place == "cuda":
        expected = RuntimeError
    fn = {"describe_dlpack": _C.describe_dlpack, "from_dlpack": _C.Buffer.from_dlpack,
          "scale_": lambda x: _C.scale_(x, 2.0),
          "cuda_scale_": lambda x: _C.cuda_scale_(x, 2.0)}[entry]
    allowed = (BufferError, TypeError, RuntimeError, OverflowError, Raised, ValueError, KeyError,
               MemoryError)
    try:
        kind, value = "ok", fn(fake)
    except (SystemError, RecursionError):
        raise
    except allowed as error:
        kind, value = "raised", error
    if expected == "producer":
        assert kind == "raised" and value is fake.error, f"{kind} {value!r}"
    else:
        assert type(value) is not MemoryError or value is fake.error
        check(expected, (kind, value))
    assert fake.calls == calls, (fake.calls, calls)
    adopted = kind == "ok" and entry == "from_dlpack"
    if adopted:
        assert fake.produced[-1].deleted == 0
    value = None
    settle(*fake.produced, taken=fake.produced[-1:] if adopted else ())
    for mem in memories:
        if not (kind == "ok" and entry in ("scale_",)):
            assert np.array_equal(mem.block, mem.pristine)
    return kind


def test_fuzz_misbehaving_producers():
    tally = Tally("dlpack producers")

    @fuzz_settings()
    @given(case=fake_cases, spec=specs(), seed=st.integers(0, 2**32 - 1),
           entry=st.sampled_from(["describe_dlpack", "from_dlpack", "scale_", "cuda_scale_"]))
    def run(case, spec, seed, entry):
        with watchdog():
            kind = run_fake(case, spec, seed, entry)
        tally.case(kind or "skipped")

    run()
    tally.report()


# ---- real producers: numpy, torch and rlhfz's own views ---------------------------------------

TORCH_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
                torch.int8, torch.uint8, torch.bool, torch.complex64, torch.int64]


@st.composite
def real_tensors(draw):
    """A numpy array, torch tensor or rlhfz view, and what the importer must
    make of it: values (float64, None if complex), itemsize, whether its dtype
    is one rlhfz takes, its layout compact, it read-only, and the exception
    its own export raises (None)."""
    kind = draw(st.sampled_from(["torch", "torch", "numpy", "view"]))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=4)))
    values = element_values(math.prod(shape), draw(st.integers(0, 2**16))).reshape(shape)
    out = {"readonly": False, "raises": None}
    if kind == "view":
        dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
        size = 4 if dtype == "float32" else 2
        offset = draw(st.integers(0, 3))
        view = _C.Buffer((values.size + offset) * size).view(dtype, offset=offset, shape=shape)
        torch.from_dlpack(view).copy_(torch.from_numpy(values))
        return dict(out, tensor=view, values=values.astype(np.float64), itemsize=size,
                    ok_dtype=True, compact=True)
    if kind == "torch":
        dtype = draw(st.sampled_from(TORCH_DTYPES))
        t = torch.from_numpy(values).to(dtype)
    else:
        t = values.astype(draw(st.sampled_from([np.float32, np.float16, np.float64, np.int32,
                                                np.bool_, np.complex64])))
    layout = draw(st.sampled_from(["plain", "plain", "transposed", "sliced", "expanded"]))
    if layout == "transposed" and t.ndim >= 2:
        t = t.transpose(0, 1) if kind == "torch" else t.swapaxes(0, 1)
    elif layout == "sliced" and t.ndim >= 1:
        t = t[::2]
    elif layout == "expanded" and t.ndim >= 1 and t.shape[0] >= 1:
        t = t[:1].expand(3, *t.shape[1:]) if kind == "torch" else \
            np.broadcast_to(t[:1], (3,) + t.shape[1:])
    if kind == "torch":
        bf16 = t.dtype == torch.bfloat16
        seen = t.float().numpy() if bf16 else t.numpy()
        out.update(itemsize=t.element_size(), strides=list(t.stride()),
                   ok_dtype=t.dtype in (torch.float32, torch.bfloat16, torch.float16))
    else:
        seen = t
        out.update(itemsize=t.itemsize, strides=[s // t.itemsize for s in t.strides],
                   ok_dtype=t.dtype in (np.float32, np.float16))
        out["readonly"] = not t.flags.writeable or draw(st.booleans())
        if out["readonly"] and t.flags.writeable:
            t = t.view()
            t.flags.writeable = False
    geometry = {"dims": list(seen.shape), "ndim": seen.ndim, "strides": out.pop("strides"),
                "dtype": (2, 32, 1), "null_shape": False}
    out["compact"] = compact(geometry)
    if kind == "torch" and t.is_floating_point() and draw(st.integers(0, 5)) == 0:
        t.requires_grad_(True)
        out["raises"] = BufferError       # torch refuses to export it
    return dict(out, tensor=t, values=None if np.iscomplexobj(seen) else seen.astype(np.float64))


def test_fuzz_real_producers():
    tally = Tally("dlpack real producers")
    entries = {"describe_dlpack": _C.describe_dlpack, "sumsq": _C.sumsq,
               "scale_": lambda x: _C.scale_(x, 2.0), "from_dlpack": _C.Buffer.from_dlpack}

    @fuzz_settings()
    @given(real=real_tensors(), entry=st.sampled_from(sorted(entries)))
    def run(real, entry):
        t, values = real["tensor"], real["values"]
        writable = entry in ("scale_", "from_dlpack")
        expected = real["raises"] or (BufferError if not real["ok_dtype"] or not real["compact"]
                                      or writable and real["readonly"] else None)
        with watchdog():
            result = outcome(lambda: entries[entry](t), (BufferError, TypeError))
        kind = check(expected, result)
        if kind == "ok" and entry == "sumsq":
            assert result[1] == float(np.sum(values ** 2))
        if kind == "ok" and entry == "scale_":
            now = (t.detach().float() if isinstance(t, torch.Tensor) else
                   t if isinstance(t, np.ndarray) else torch.from_dlpack(t).float())
            assert np.array_equal(np.asarray(now, dtype=np.float64), values * 2)
        if kind == "ok" and entry == "describe_dlpack":
            assert result[1]["shape"] == tuple(values.shape)
            assert result[1]["numel"] == values.size
        if kind == "ok" and entry == "from_dlpack":
            assert result[1].nbytes == values.size * real["itemsize"]
        tally.case(kind)

    run()
    tally.report()
