"""rlhfz._C's Buffer, BufferView and DLPack importer.

Zero-copy export to numpy and torch, both capsule kinds, lifetimes (deleters
from other threads, without the GIL, at interpreter exit), copy/device/stream
arguments, the importer's validation (every rejection a BufferError naming what
was wrong), Buffer.from_dlpack, and the kernels' argument checks.

Inputs no real producer makes (a CUDA device, lanes, a null data pointer) are
hand-built DLPack capsules, made with ctypes.
"""
import ctypes
import gc
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlhfz
from dlpack_handmade import (
    FLAG_IS_COPIED, FLAG_READ_ONLY, LEGACY, USED, VERSIONED, _DELETER, Handmade, _capsule_new,
    capsule_name, managed_of, strides_of, take)
from rlhfz import _C

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Same-width integer dtypes, to compare bit patterns exactly (NaNs included).
BITS_DTYPE = {"float32": torch.int32, "bfloat16": torch.int16, "float16": torch.int16}
HPARAMS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)


def filled_buffer(nbytes=256):
    """A Buffer whose 16-bit words hold 0, 1, 2, ... (distinct bits for every element)."""
    buf = _C.Buffer(nbytes)
    words = torch.from_dlpack(buf.view("float16")).view(torch.int16)
    words.copy_(torch.arange(words.numel(), dtype=torch.int16))
    del words
    return buf


def bits(tensor):
    return tensor.view(BITS_DTYPE[str(tensor.dtype).removeprefix("torch.")])


# ---- 1. zero-copy ----------------------------------------------------------


def test_numpy_and_torch_views_share_the_buffer_memory():
    buf = _C.Buffer(64)
    view = buf.view("float32", 2, (3, 4))
    array = np.from_dlpack(view)
    tensor = torch.from_dlpack(view)
    assert view.address == buf.address + 8
    assert array.ctypes.data == tensor.data_ptr() == view.address
    assert array.shape == tuple(tensor.shape) == view.shape == (3, 4)
    assert array.flags.writeable and array.flags.c_contiguous
    array[1, 2] = 7.5
    assert tensor[1, 2].item() == 7.5
    tensor[2, 3] = -1.0
    assert array[2, 3] == -1.0
    assert np.from_dlpack(buf.view("float32"))[2 + 11] == -1.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_views_through_torch(dtype):
    buf = filled_buffer(64)
    view = buf.view(TORCH_DTYPE[dtype], 5, (3, 3))
    tensor = torch.from_dlpack(view)
    assert view.dtype == dtype and tensor.dtype == TORCH_DTYPE[dtype]
    assert tensor.data_ptr() == buf.address + 10
    assert bits(tensor).flatten().tolist() == list(range(5, 14))
    tensor[0, 0] = 1.5
    assert torch.from_dlpack(buf.view(dtype))[5].item() == 1.5


def test_view_attributes():
    buf = _C.Buffer(100)
    view = buf.view("float32", offset=3, shape=[2, 5])
    assert (view.dtype, view.offset, view.numel, view.nbytes, view.shape) == \
        ("float32", 3, 10, 40, (2, 5))
    assert view.buffer is buf
    assert view.address == buf.address + 12
    whole = buf.view("float16")
    assert whole.shape == (50,) and whole.offset == 0 and whole.numel == 50
    assert buf.view("float32", 5).shape == (20,)  # 100 bytes hold 25 floats
    assert view.__dlpack_device__() == (1, 0)


def test_zero_element_and_end_views_export():
    buf = _C.Buffer(64)
    end = buf.view("float32", 16)
    assert end.shape == (0,) and end.address == buf.address + 64
    for view in (end, buf.view("float32", 16, (0,)), buf.view("bfloat16", 10, (3, 0, 2)),
                 _C.Buffer(0).view("float32")):
        tensor = torch.from_dlpack(view)
        assert tensor.numel() == 0 and tuple(tensor.shape) == view.shape
        if view.dtype != "bfloat16":  # numpy has no bfloat16
            assert np.from_dlpack(view).size == 0
    tail = buf.view("float32", 12, (2, 2))
    torch.from_dlpack(tail).fill_(3.0)
    assert np.from_dlpack(buf.view("float32")).tolist() == [0.0] * 12 + [3.0] * 4


def test_scalar_view():
    buf = _C.Buffer(8)
    view = buf.view("float32", 1, ())
    assert view.shape == () and view.numel == 1
    torch.from_dlpack(view).fill_(2.0)
    assert np.from_dlpack(buf.view("float32")).tolist() == [0.0, 2.0]


# ---- 2. both capsule kinds ----------------------------------------------------


@pytest.mark.parametrize("max_version, name", [
    (None, LEGACY), ((0, 8), LEGACY), ((1, 0), VERSIONED), ((1, 7), VERSIONED), ((2, 0), VERSIONED),
])
def test_capsule_kind_follows_max_version(max_version, name):
    view = _C.Buffer(64).view("float32", 1, (3, 5))
    capsule = view.__dlpack__() if max_version is None else view.__dlpack__(max_version=max_version)
    assert capsule_name(capsule) == name
    assert f'"{name.decode()}"' in repr(capsule)
    tensor = managed_of(capsule).dl_tensor
    assert tensor.data == view.buffer.address and tensor.byte_offset == 4
    assert (tensor.device.device_type, tensor.device.device_id, tensor.ndim) == (1, 0, 2)
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (2, 32, 1)
    assert strides_of(capsule) == (5, 1)
    if name == VERSIONED:
        managed = managed_of(capsule)
        assert (managed.major, managed.minor, managed.flags) == (1, 0, 0)


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_torch_consumes_both_capsule_kinds(max_version):
    buf = filled_buffer(64)
    view = buf.view("bfloat16", 4, (6,))
    for convert in (torch.from_dlpack, torch.utils.dlpack.from_dlpack):
        capsule = view.__dlpack__(max_version=max_version)
        tensor = convert(capsule)
        assert capsule_name(capsule) == USED[LEGACY if max_version is None else VERSIONED]
        assert tensor.data_ptr() == view.address
        assert bits(tensor).tolist() == [4, 5, 6, 7, 8, 9]
        assert buf.exports == 1
        del tensor
        assert buf.exports == 0


def test_malformed_version_and_device_arguments_raise_typeerror():
    view = _C.Buffer(16).view("float32")
    for kwargs in (dict(max_version=(1,)), dict(max_version=(1, 0, 0)), dict(max_version=(1.0, 0)),
                   dict(dl_device=(1,)), dict(dl_device=("cpu", 0))):
        with pytest.raises(TypeError):
            view.__dlpack__(**kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'device'"):
        view.__dlpack__(device=(1, 0))
    with pytest.raises(TypeError, match="positional"):
        view.__dlpack__(None)
    assert view.buffer.exports == 0


@pytest.mark.parametrize("kwargs", [dict(max_version=[1, 0]), dict(max_version="1.0"),
                                    dict(dl_device=[1, 0])], ids=["version-list", "version-str", "device-list"])
def test_version_and_device_given_as_lists_raise_typeerror(kwargs):
    view = _C.Buffer(16).view("float32")
    with pytest.raises(TypeError):
        view.__dlpack__(**kwargs)


# ---- 3. lifetimes ------------------------------------------------------------


def test_tensor_keeps_buffer_alive_after_buffer_and_view_are_gone():
    buf = _C.Buffer(4096)
    view = buf.view("float32", 10, (100,))
    torch.from_dlpack(buf.view("float32")).copy_(torch.arange(1024, dtype=torch.float32))
    tensor = torch.from_dlpack(view)
    dead = weakref.ref(buf)
    del buf, view
    gc.collect()
    assert dead() is not None
    _C.Buffer(4096).zero_()  # a fresh allocation must not land on the old memory
    assert tensor.tolist() == [float(i) for i in range(10, 110)]
    del tensor
    gc.collect()
    assert dead() is None


def test_exports_count_live_consumers():
    buf = _C.Buffer(64)
    view = buf.view("float32")
    assert buf.exports == 0
    tensor = torch.from_dlpack(view)
    assert buf.exports == 1
    array = np.from_dlpack(view)
    assert buf.exports == 2
    capsule = view.__dlpack__(max_version=(1, 0))
    assert buf.exports == 3
    part = tensor[3:5]  # shares the storage: the export lives while any slice does
    del tensor
    assert buf.exports == 3
    del part
    assert buf.exports == 2
    del array
    assert buf.exports == 1
    del capsule
    assert buf.exports == 0
    assert "exports=0" in repr(buf)


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_dropped_unconsumed_capsule_releases_its_export(max_version):
    buf = _C.Buffer(64)
    dead = weakref.ref(buf)
    capsules = [buf.view("float16", i).__dlpack__(max_version=max_version) for i in range(5)]
    assert buf.exports == 5
    del capsules[::2]
    assert buf.exports == 2
    del buf
    gc.collect()
    assert dead() is not None
    capsules.clear()
    assert dead() is None


def test_weakref_dies_only_after_every_consumer():
    buf = _C.Buffer(64)
    dead = weakref.ref(buf)
    consumers = [torch.from_dlpack(buf.view("float32")), np.from_dlpack(buf.view("float16")),
                 buf.view("float32", 4).__dlpack__(), _C.Buffer.from_dlpack(buf.view("float32"))]
    del buf
    gc.collect()
    while consumers:
        assert dead() is not None
        consumers.pop()
        gc.collect()
    assert dead() is None


# ---- 4. deleters on other threads, without the GIL, at exit -----------------


def test_tensors_dropped_on_many_threads():
    buf = _C.Buffer(1 << 16)
    dead = weakref.ref(buf)
    batches = [[torch.from_dlpack(buf.view("float32", 64 * i + j, (8,))) for j in range(50)]
               for i in range(16)]
    assert buf.exports == 800

    def drop(batch):
        while batch:
            batch.pop()

    def make_and_drop(view):
        for _ in range(50):
            tensor = torch.from_dlpack(view)
            tensor += 1.0
            del tensor

    threads = [threading.Thread(target=drop, args=(batch,)) for batch in batches]
    threads += [threading.Thread(target=make_and_drop, args=(buf.view("float32", 1000 + 8 * i, (8,)),))
                for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert buf.exports == 0
    assert np.from_dlpack(buf.view("float32", 1000, (64,))).tolist() == [50.0] * 64
    del buf, batches, threads
    gc.collect()
    assert dead() is None


def test_deleters_run_without_the_gil_from_python_threads():
    buf = _C.Buffer(1 << 12)
    taken = [take(buf.view("float32", i, (4,)).__dlpack__(max_version=(1, 0) if i % 2 else None))
             for i in range(400)]
    assert buf.exports == 400

    def run(chunk):
        for pointer, deleter in chunk:
            _DELETER(deleter)(pointer)  # ctypes drops the GIL around the call

    threads = [threading.Thread(target=run, args=(taken[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert buf.exports == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses pthreads through ctypes")
def test_deleters_run_on_threads_python_never_saw():
    libc = ctypes.CDLL(None)
    create, join = libc.pthread_create, libc.pthread_join
    create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
    buf = _C.Buffer(256)
    dead = weakref.ref(buf)
    taken = [take(buf.view("float32", i, (2,)).__dlpack__(max_version=(1, 0) if i % 2 else None))
             for i in range(16)]
    del buf
    gc.collect()
    # Each deleter is the start routine of a bare pthread (its void return is
    # harmless on the platforms CPython runs on); join releases the GIL.
    threads = []
    for pointer, deleter in taken:
        thread = ctypes.c_ulong()
        assert create(ctypes.byref(thread), None, deleter, pointer) == 0
        threads.append(thread)
    for thread in threads:
        assert join(thread, None) == 0
    gc.collect()
    assert dead() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses pthreads through ctypes")
def test_a_foreign_thread_releases_without_waiting_for_the_gil():
    """A thread without the GIL (a gloo worker finishing a collective) must
    never wait for it: while the interpreter shuts down, a thread that gets
    the GIL is ended by pthread_exit, which aborts a C++ thread. So its
    release counts at once, and the Buffer goes once Python runs again."""
    held = ctypes.PyDLL(None)                 # calls through it keep the GIL
    held.pthread_create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p]
    join = ctypes.CDLL(None).pthread_join     # releases it
    join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
    buf = _C.Buffer(256)
    dead = weakref.ref(buf)
    pointer, deleter = take(buf.view("float32").__dlpack__(max_version=(1, 0)))
    del buf
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)             # no thread gets the GIL from this one
    try:
        thread = ctypes.c_ulong()
        assert held.pthread_create(ctypes.byref(thread), None, deleter, pointer) == 0
        end = time.monotonic() + 10
        while dead().exports and time.monotonic() < end:
            pass
        released = dead().exports == 0
    finally:
        sys.setswitchinterval(interval)
        assert join(thread, None) == 0
    assert released, "the thread waited for the GIL"
    for _ in range(3):
        gc.collect()
    assert dead() is None


SUBINTERPRETER_SCRIPT = textwrap.dedent("""
    import sys, weakref
    sys.path.insert(0, sys.argv[1])
    import _xxsubinterpreters as subinterpreters
    from dlpack_handmade import take, _DELETER
    from rlhfz import _C

    # once a subinterpreter has existed, PyGILState_Check answers yes to
    # every thread, the GIL's holder or not
    subinterpreters.destroy(subinterpreters.create())
    seen = []
    buf = _C.Buffer(4096)
    dead = weakref.ref(buf, lambda ref: seen.append(ref))
    pointer, deleter = take(buf.view("float32").__dlpack__(max_version=(1, 0)))
    del buf
    _DELETER(deleter)(pointer)      # the GIL is released around the call
    for _ in range(3):
        pass                        # pending calls run between bytecodes
    assert dead() is None and len(seen) == 1, (dead(), seen)
""")


def test_a_release_without_the_gil_waits_for_it_after_a_subinterpreter():
    pytest.importorskip("_xxsubinterpreters")
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SUBINTERPRETER_SCRIPT,
                             os.path.dirname(__file__)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


EXIT_SCRIPT = textwrap.dedent("""
    import threading
    import numpy as np
    import torch
    from rlhfz import _C

    BUFFER = _C.Buffer(1 << 14)
    TENSORS = [torch.from_dlpack(BUFFER.view("float32", 16 * i, (16,))) for i in range(64)]
    ARRAYS = [np.from_dlpack(BUFFER.view("float16", 8 * i, (8,))) for i in range(16)]
    CAPSULES = [BUFFER.view("bfloat16").__dlpack__(), BUFFER.view("float32").__dlpack__(max_version=(1, 0))]
    ADOPTED = _C.Buffer.from_dlpack(torch.arange(64, dtype=torch.float32))
    FROM_ADOPTED = torch.from_dlpack(ADOPTED.view("float32"))
    CYCLE = [BUFFER.view("float32")]
    CYCLE.append(CYCLE)
    del BUFFER
    for tensor in TENSORS:
        tensor += 1.0
    threading.Thread(target=lambda: TENSORS.pop()).start()
""")


def test_interpreter_exits_cleanly_with_live_exports():
    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


# ---- 5. copy, device and stream -------------------------------------------


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_copy_true_exports_an_independent_copy(max_version):
    buf = filled_buffer(64)
    view = buf.view("float16", 3, (2, 4))
    capsule = view.__dlpack__(copy=True, max_version=max_version)
    assert buf.exports == 0  # the copy owns its own buffer
    if max_version is not None:
        assert managed_of(capsule).flags == FLAG_IS_COPIED
    tensor = torch.from_dlpack(capsule)
    assert tensor.data_ptr() != view.address
    assert not buf.address <= tensor.data_ptr() < buf.address + buf.nbytes
    assert bits(tensor).flatten().tolist() == list(range(3, 11))
    tensor.fill_(0.0)
    torch.from_dlpack(view).fill_(1.0)
    assert tensor.sum().item() == 0.0
    assert bits(torch.from_dlpack(buf.view("float16")))[:3].tolist() == [0, 1, 2]


def test_copy_false_and_cpu_device_share_memory():
    buf = _C.Buffer(64)
    view = buf.view("float32", 4)
    for kwargs in (dict(copy=False), dict(dl_device=(1, 0)), dict(stream=None, dl_device=None, copy=None),
                   dict(dl_device=(1, 0), copy=False, max_version=(1, 0))):
        tensor = torch.from_dlpack(view.__dlpack__(**kwargs))
        assert tensor.data_ptr() == view.address
    assert np.from_dlpack(view, device="cpu").ctypes.data == view.address
    assert np.from_dlpack(view, copy=True).ctypes.data != view.address


@pytest.mark.parametrize("device", [(2, 0), (3, 0), (13, 1)])
def test_export_to_another_device_is_a_buffererror(device):
    buf = _C.Buffer(64)
    with pytest.raises(BufferError, match=rf"device type {device[0]}\b"):
        buf.view("float32").__dlpack__(dl_device=device)
    assert buf.exports == 0


@pytest.mark.parametrize("stream", [0, 1, -1])
def test_a_stream_for_host_memory_is_a_buffererror(stream):
    buf = _C.Buffer(64)
    with pytest.raises(BufferError, match="stream must be None"):
        buf.view("float32").__dlpack__(stream=stream)
    assert buf.exports == 0


# ---- 6. the importer's validation ---------------------------------------------


def test_describe_dlpack_of_views_tensors_arrays_and_capsules():
    buf = _C.Buffer(64)
    view = buf.view("bfloat16", 6, (2, 3))
    expected = dict(address=view.address, dtype="bfloat16", shape=(2, 3), numel=6, device=(1, 0),
                    readonly=False)
    assert _C.describe_dlpack(view) == expected
    assert _C.describe_dlpack(torch.from_dlpack(view)) == expected
    assert _C.describe_dlpack(view.__dlpack__()) == expected
    assert _C.describe_dlpack(view.__dlpack__(max_version=(1, 0))) == expected
    array = np.zeros((2, 2, 2), np.float16)
    assert _C.describe_dlpack(array)["address"] == array.ctypes.data
    assert _C.describe_dlpack(torch.tensor(3.0))["shape"] == ()
    assert buf.exports == 0  # every borrow released its capsule


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(3, 4).t(),
    lambda: torch.zeros(12)[::2],
    lambda: torch.zeros(4, 6)[:, 1:5],
    lambda: np.zeros((4, 4), np.float32)[:, ::2],
    lambda: torch.zeros(1, 4).expand(3, 4),
    lambda: torch.zeros(4, 1).expand(4, 5),
], ids=["transposed", "step-sliced", "column-slice", "numpy-strided", "expanded-rows", "expanded-cols"])
def test_non_contiguous_input_is_a_buffererror(make):
    tensor = make()
    with pytest.raises(BufferError, match="tensor is not contiguous: stride"):
        _C.describe_dlpack(tensor)
    with pytest.raises(BufferError, match="x is not contiguous"):
        _C.sumsq(tensor)


@pytest.mark.parametrize("tensor, name", [
    (torch.zeros(3, dtype=torch.int32), "int32"), (torch.zeros(3, dtype=torch.int64), "int64"),
    (torch.zeros(3, dtype=torch.float64), "float64"), (torch.zeros(3, dtype=torch.complex64), "complex64"),
    (torch.zeros(3, dtype=torch.bool), "bool8"), (torch.zeros(3, dtype=torch.uint8), "uint8"),
    (np.zeros(3, np.int16), "int16"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_dtype_is_a_buffererror_naming_it(tensor, name):
    with pytest.raises(BufferError, match=rf"tensor has dtype {name}; supported dtypes are"):
        _C.describe_dlpack(tensor)
    with pytest.raises(BufferError, match=rf"x has dtype {name}\b"):
        _C.sumsq(tensor)
    with pytest.raises(BufferError, match=name):
        _C.Buffer.from_dlpack(tensor)


def test_size_one_dims_with_any_stride_are_accepted():
    base = torch.arange(12, dtype=torch.float32)
    for tensor in (base.view(3, 4).unsqueeze(1), base.view(3, 4)[:, None, :].expand(3, 1, 4),
                   base.as_strided((3, 1, 4), (4, 99, 1)), base.as_strided((1, 12), (0, 1)),
                   base.as_strided((1, 1, 1), (7, 0, 5)), base.view(12, 1)[:, :1]):
        info = _C.describe_dlpack(tensor)
        assert info["shape"] == tuple(tensor.shape) and info["address"] == base.data_ptr()
        assert _C.sumsq(tensor) == float((tensor.double() ** 2).sum())


def test_zero_element_tensors_are_accepted_whatever_their_strides():
    for tensor in (torch.zeros(0, 4).t(), torch.zeros(5, 0)[::2], torch.zeros(1, 4).expand(0, 4)):
        assert _C.describe_dlpack(tensor)["numel"] == 0
        assert _C.sumsq(tensor) == 0.0


def test_read_only_array_is_fine_to_read_but_not_to_write():
    array = np.arange(4, dtype=np.float32)
    array.flags.writeable = False
    assert _C.describe_dlpack(array)["readonly"] is True
    assert _C.sumsq(array) == 14.0
    with pytest.raises(BufferError, match="x is read-only, but this kernel writes to it"):
        _C.scale_(array, 2.0)
    with pytest.raises(BufferError, match="dst is read-only"):
        _C.cast_(array, np.zeros(4, np.float16))
    with pytest.raises(BufferError, match="read-only; a Buffer must be writable"):
        _C.Buffer.from_dlpack(array)
    assert array.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_raw_capsule_is_borrowed_not_consumed_then_consumed_capsule_is_rejected():
    buf = _C.Buffer(64)
    for max_version in (None, (1, 0)):
        capsule = buf.view("float32").__dlpack__(max_version=max_version)
        assert _C.sumsq(capsule) == 0.0
        name = capsule_name(capsule)
        assert name in (LEGACY, VERSIONED)
        tensor = torch.from_dlpack(capsule)
        assert capsule_name(capsule) == USED[name]
        for call in (_C.describe_dlpack, _C.sumsq, lambda c: _C.scale_(c, 2.0), _C.Buffer.from_dlpack):
            with pytest.raises(BufferError, match="capsule that was already consumed"):
                call(capsule)
        assert tensor.data_ptr() == buf.address
        del tensor
    assert buf.exports == 0


def test_a_capsule_a_kernel_borrows_is_no_one_elses_until_the_kernel_returns():
    # The next argument's __dlpack__ runs while the first is lent: a second
    # consumer, as another thread would be while the kernel runs without the GIL.
    array = np.ones(16, np.float32)
    capsule = array.__dlpack__(max_version=(1, 0))
    refused = []

    def consume(**kwargs):
        try:
            _C.Buffer.from_dlpack(capsule)
        except BufferError as error:
            refused.append(str(error))
        return np.zeros(16, np.float32).__dlpack__(**kwargs)

    _C.adamw_step(capsule, Producer(consume), np.zeros(16, np.float32),
                  np.ones(16, np.float32), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.0, step=1)
    assert len(refused) == 1 and "capsule lent to an rlhfz call right now" in refused[0]
    assert capsule_name(capsule) == VERSIONED       # given back when the call ended
    assert np.from_dlpack(_C.Buffer.from_dlpack(capsule).view("float32")).shape == (16,)
    assert capsule_name(capsule) == USED[VERSIONED]


def test_a_nested_borrow_keeps_the_capsule_lent_to_the_outer_call():
    # sumsq inside the second argument's __dlpack__ borrows the capsule the
    # outer cast_ holds: when it returns, the capsule is still the outer's.
    capsule = np.ones(16, np.float32).__dlpack__(max_version=(1, 0))
    names, refused = [], []

    def nested(**kwargs):
        _C.sumsq(capsule)
        names.append(capsule_name(capsule))
        try:
            _C.Buffer.from_dlpack(capsule)
        except BufferError as error:
            refused.append(str(error))
        return np.full(16, 2.0, np.float32).__dlpack__(**kwargs)

    _C.cast_(capsule, Producer(nested))
    assert names == [b"rlhfz_lent_dltensor_versioned"]
    assert len(refused) == 1 and "capsule lent to an rlhfz call right now" in refused[0]
    assert capsule_name(capsule) == VERSIONED       # given back when the outer call ended
    assert np.from_dlpack(_C.Buffer.from_dlpack(capsule).view("float32")).tolist() == [2.0] * 16


CAPSULE_RACE_SCRIPT = textwrap.dedent("""
    import threading, time
    import numpy as np
    from rlhfz import _C

    _C.set_num_threads(1)
    refused = 0
    for attempt in range(4):
        array = np.ones(32 << 20, np.float32)
        capsule = array.__dlpack__(max_version=(1, 0))
        del array                                   # the capsule alone owns the memory
        started = threading.Event()

        def kernel():
            started.set()
            for _ in range(3):
                _C.scale_(capsule, 1.0001)          # the GIL is released meanwhile

        thread = threading.Thread(target=kernel)
        thread.start()
        started.wait()
        time.sleep(0.01)
        try:
            taken = _C.Buffer.from_dlpack(capsule)  # would free the memory under the kernel
            del taken
        except BufferError as error:
            assert "lent to an rlhfz call" in str(error), error
            refused += 1
        thread.join()
    print(refused)
""")


def test_a_capsule_is_not_freed_under_a_kernel_by_another_thread():
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CAPSULE_RACE_SCRIPT],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_copy_between_overlapping_buffers_is_refused():
    array = np.arange(1 << 16, dtype=np.float32)
    low, high = _C.Buffer.from_dlpack(array[: 3 << 14]), _C.Buffer.from_dlpack(array[1 << 14:])
    with pytest.raises(ValueError, match="overlap in memory"):
        high.copy_from(low)
    assert np.array_equal(array, np.arange(1 << 16, dtype=np.float32))
    same = _C.Buffer.from_dlpack(array[: 3 << 14])
    same.copy_from(low)                               # the same memory: nothing to move
    assert np.array_equal(array, np.arange(1 << 16, dtype=np.float32))


def test_a_typed_view_of_misaligned_memory_is_refused():
    halves = np.zeros(64, np.float16)
    buf = _C.Buffer.from_dlpack(halves[1:])           # starts 2 bytes past a 4-byte boundary
    with pytest.raises(ValueError, match="not aligned to 4 bytes"):
        buf.view("float32")
    assert np.from_dlpack(buf.view("float16")).shape == (63,)


@pytest.mark.parametrize("obj", [[1.0, 2.0], 3.0, None, np.float32(1.0), object()])
def test_object_without_dlpack_is_a_typeerror(obj):
    with pytest.raises(TypeError, match="supporting DLPack"):
        _C.describe_dlpack(obj)
    with pytest.raises(TypeError, match="x must be a tensor or array supporting DLPack"):
        _C.sumsq(obj)


class Producer:
    """An object with a __dlpack__ given per test."""

    def __init__(self, dlpack):
        self.calls = 0
        self._dlpack = dlpack

    def __dlpack__(self, **kwargs):
        self.calls += 1
        return self._dlpack(**kwargs)


class LegacyProducer:
    """A producer from before max_version: __dlpack__ takes no keywords at all."""

    def __init__(self, view):
        self.view = view

    def __dlpack__(self):
        return self.view.__dlpack__()


def test_exception_raised_by_dlpack_propagates():
    class Boom(RuntimeError):
        pass

    def fail(**kwargs):
        raise Boom("producer failed")

    producer = Producer(fail)
    with pytest.raises(Boom, match="producer failed"):
        _C.describe_dlpack(producer)
    assert producer.calls == 1
    with pytest.raises(BufferError, match="cannot export"):
        _C.sumsq(Producer(lambda **kw: (_ for _ in ()).throw(BufferError("cannot export"))))


@pytest.mark.parametrize("returned", [42, b"dltensor", torch.zeros(2)],
                         ids=["int", "bytes", "tensor"])
def test_dlpack_returning_a_non_capsule_is_a_buffererror(returned):
    with pytest.raises(BufferError, match=rf"__dlpack__ returned {type(returned).__name__}, not a DLPack"):
        _C.describe_dlpack(Producer(lambda **kw: returned))


def test_capsule_of_another_kind_is_a_buffererror():
    other = _capsule_new(ctypes.addressof(ctypes.c_int(0)), b"not_a_dltensor", None)
    with pytest.raises(BufferError, match="not a DLPack capsule"):
        _C.describe_dlpack(Producer(lambda **kw: other))
    with pytest.raises(BufferError, match="not a DLPack capsule"):
        _C.sumsq(other)


def test_legacy_producer_without_keywords_still_works():
    buf = _C.Buffer(32)
    torch.from_dlpack(buf.view("float32")).fill_(2.0)
    producer = LegacyProducer(buf.view("float32", 2))
    assert _C.sumsq(producer) == 24.0
    _C.scale_(producer, 0.5)
    assert np.from_dlpack(buf.view("float32")).tolist() == [2.0, 2.0] + [1.0] * 6
    assert _C.describe_dlpack(producer)["address"] == buf.address + 8
    assert buf.exports == 0


def test_misaligned_data_is_a_buffererror():
    raw = bytearray(64)
    misaligned = [torch.frombuffer(raw, dtype=torch.float32, offset=1, count=4)]
    try:
        misaligned.append(np.frombuffer(raw, dtype=np.float32, offset=1, count=4))
    except ValueError:  # a numpy that refuses unaligned arrays
        pass
    for tensor in misaligned:
        with pytest.raises(BufferError, match="not aligned to its 4-byte elements"):
            _C.describe_dlpack(tensor)
        with pytest.raises(BufferError, match="x data at 0x[0-9a-f]+ is not aligned"):
            _C.sumsq(tensor)
    handmade = Handmade(byte_offset=2)
    with pytest.raises(BufferError, match="not aligned"):
        _C.describe_dlpack(handmade.capsule)
    aligned = Handmade(byte_offset=4, shape=(3,))  # held: it owns the struct memory
    assert _C.describe_dlpack(aligned.capsule)["numel"] == 3


def test_too_many_dimensions_is_a_buffererror():
    with pytest.raises(BufferError, match="9 dimensions; 0 to 8 are supported"):
        _C.describe_dlpack(np.zeros((1,) * 9, np.float32))
    assert _C.describe_dlpack(torch.zeros((1,) * 8))["shape"] == (1,) * 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(device=(2, 0)), "tensor is on device cuda:0; this kernel needs host memory"),
    (dict(device=(10, 3)), "device rocm:3"),
    (dict(device=(99, 0)), "device unknown:0"),
    (dict(lanes=4), "dtype float32 x4 lanes"),
    (dict(code=3, bits=64), "dtype code64"),
    (dict(ndim=-1), "-1 dimensions"),
    (dict(shape=(2, -3)), "negative dimension -3 at axis 1"),
    (dict(shape=(1 << 40, 1 << 40)), "tensor is too large"),
    (dict(null_shape=True), "2 dimensions but no shape"),
    (dict(data=False), "4 elements but a null data pointer"),
    (dict(versioned=True, major=2), "DLPack version 2.0; rlhfz reads major version 1"),
    (dict(versioned=True, major=0), "DLPack version 0.0"),
    (dict(shape=(2, 2), strides=(1, 2)), "stride 2 at axis 1 of a dimension of size 2"),
], ids=["cuda", "rocm", "unknown-device", "lanes", "opaque", "negative-ndim", "negative-dim",
        "overflow", "no-shape", "null-data", "version-2", "version-0", "fortran"])
def test_handmade_capsule_rejections_name_the_problem(kwargs, message):
    if kwargs.get("null_shape"):
        kwargs = dict(kwargs, shape=(2, 2))
    handmade = Handmade(**kwargs)
    with pytest.raises(BufferError, match=message.replace("(", r"\(")):
        _C.describe_dlpack(handmade.capsule)
    with pytest.raises(BufferError, match=message.replace("(", r"\(").replace("tensor", "x")):
        _C.sumsq(handmade.capsule)
    with pytest.raises(BufferError):
        _C.Buffer.from_dlpack(handmade.capsule)
    assert capsule_name(handmade.capsule) in (LEGACY, VERSIONED)  # never consumed


def test_handmade_capsules_the_importer_accepts():
    no_strides = Handmade(shape=(2, 3))
    assert _C.describe_dlpack(no_strides.capsule)["shape"] == (2, 3)
    assert _C.sumsq(no_strides.capsule) == float(sum(i * i for i in range(6)))
    pinned = Handmade(device=(3, 0), versioned=True)
    assert _C.describe_dlpack(pinned.capsule)["device"] == (3, 0)
    empty = Handmade(data=False, shape=(0, 5))
    assert _C.describe_dlpack(empty.capsule)["numel"] == 0
    scalar = Handmade(shape=(), ndim=0, null_shape=True)
    assert _C.sumsq(scalar.capsule) == 0.0
    readonly = Handmade(versioned=True, flags=FLAG_READ_ONLY)
    assert _C.describe_dlpack(readonly.capsule)["readonly"] is True
    assert _C.sumsq(readonly.capsule) == 14.0
    with pytest.raises(BufferError, match="x is read-only"):
        _C.scale_(readonly.capsule, 3.0)
    with pytest.raises(BufferError, match="read-only"):
        _C.Buffer.from_dlpack(readonly.capsule)
    assert capsule_name(readonly.capsule) == VERSIONED
    assert readonly.array[:4].tolist() == [0.0, 1.0, 2.0, 3.0]


# ---- 7. Buffer and view argument errors ------------------------------------------


def test_buffer_attributes_and_pinned_fallback():
    buf = _C.Buffer(100, alignment=4096)
    assert (buf.nbytes, buf.alignment, buf.tier, buf.exports) == (100, 4096, "host", 0)
    assert buf.address % 4096 == 0
    assert _C.Buffer(10).alignment == 64 and _C.Buffer(10).address % 64 == 0
    assert _C.Buffer(64, "pinned").tier == "host"  # no CUDA runtime in a CPU build
    assert _C.Buffer(0).address != 0
    dirty = _C.Buffer(64, zero=False)
    torch.from_dlpack(dirty.view("float32")).fill_(5.0)
    dirty.zero_()
    assert _C.sumsq(dirty.view("float32")) == 0.0


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((-1,), {}, ValueError, "nbytes must be >= 0, not -1"),
    ((64,), dict(alignment=3), ValueError, "power of two in \[8, 1073741824\], not 3"),
    ((64,), dict(alignment=4), ValueError, "power of two in \[8, 1073741824\], not 4"),
    ((64,), dict(alignment=0), ValueError, "alignment must be positive, not 0"),
    ((64,), dict(alignment=-64), ValueError, "alignment must be positive, not -64"),
    ((64, "nvme"), {}, ValueError, "tier must be 'host', 'pinned', 'device' or 'disk', not 'nvme'"),
    ((64, "disk"), {}, ValueError, "the disk tier needs path="),
    ((64, "disk"), dict(path=""), ValueError, "path must name a directory, not be empty"),
    ((64,), dict(alignment=1 << 40), ValueError, "power of two in .*, not 1099511627776"),
    ((64,), dict(path="/tmp"), ValueError, "path is for the disk tier only"),
    ((64, "host"), dict(device=0), ValueError, "device must be -1 .* for the device tier"),
    ((64, "device"), dict(device=-2), ValueError, "device must be -1"),
    ((64, None), {}, TypeError, "must be str"),
    ((64.0,), {}, TypeError, "integer"),
    ((64, "host", 64), {}, TypeError, "positional"),
])
def test_buffer_constructor_rejections(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        _C.Buffer(*args, **kwargs)


@pytest.mark.skipif(rlhfz.build_info()["cuda"], reason="a CUDA device is usable here")
def test_device_tier_without_a_cuda_device_says_why():
    with pytest.raises(RuntimeError, match="device tier needs"):
        _C.Buffer(64, "device")
    with pytest.raises(RuntimeError, match="cuda_mem_get_info"):
        _C.cuda_mem_get_info(0)
    assert _C.Buffer(64, "pinned").tier == "host"     # pinned falls back to pageable


def test_huge_buffer_is_a_memoryerror():
    with pytest.raises(MemoryError, match="could not allocate"):
        _C.Buffer(1 << 62)
    with pytest.raises(MemoryError):
        _C.Buffer(sys.maxsize, alignment=1 << 20)


@pytest.mark.parametrize("args, error, message", [
    (("float32", 17), ValueError, "offset 17 is past the end of a buffer of 16 float32 elements"),
    (("float16", 33), ValueError, "past the end of a buffer of 32 float16"),
    (("float32", -1), ValueError, "offset must be >= 0, not -1"),
    (("float32", 0, (17,)), ValueError, "a view of 17 float32 elements at offset 0 does not fit in 64 bytes"),
    (("float32", 10, (2, 4)), ValueError, "a view of 8 float32 elements at offset 10"),
    (("float32", 16, ()), ValueError, "does not fit"),
    (("float32", 0, (2, -2)), ValueError, "shape entries must be >= 0, not -2"),
    (("float32", 0, (1 << 40, 1 << 40)), ValueError, "shape is too large"),
    (("float32", 0, (1,) * 9), ValueError, "shape has 9 dimensions; at most 8"),
    (("float64",), TypeError, "unsupported dtype 'float64': expected float32, bfloat16 or float16"),
    ((torch.int32,), TypeError, "unsupported dtype 'torch.int32'"),
    ((np.float32,), TypeError, "unsupported dtype"),
    (("float32", 1.0), TypeError, "offset must be an integer, not float"),
    (("float32", 0, 4), TypeError, "shape must be a sequence of integers"),
    (("float32", 0, (2.0,)), TypeError, "shape entry must be an integer, not float"),
], ids=lambda v: None)
def test_view_rejections(args, error, message):
    buf = _C.Buffer(64)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        buf.view(*args)
    assert buf.exports == 0


def test_view_argument_binding():
    buf = _C.Buffer(64)
    assert buf.view(dtype="float32", shape=(2,), offset=np.int64(3)).address == buf.address + 12
    assert buf.view(np.dtype("float32"), None, None).shape == (16,)
    with pytest.raises(TypeError, match="missing required argument 'dtype'"):
        buf.view()
    with pytest.raises(TypeError, match="multiple values for argument 'dtype'"):
        buf.view("float32", dtype="float16")
    with pytest.raises(TypeError, match="unexpected keyword argument 'size'"):
        buf.view("float32", size=3)
    with pytest.raises(TypeError):
        _C.BufferView()


# ---- 8. Buffer.from_dlpack ----------------------------------------------------------


def test_from_dlpack_adopts_tensor_memory():
    tensor = torch.arange(32, dtype=torch.float32)
    expected = tensor.clone()
    buf = _C.Buffer.from_dlpack(tensor)
    assert (buf.tier, buf.nbytes, buf.address, buf.alignment) == ("external", 128, tensor.data_ptr(), 1)
    torch.from_dlpack(buf.view("float32", 4, (2,))).fill_(-1.0)
    assert tensor[4:6].tolist() == [-1.0, -1.0]
    expected[4:6] = -1.0
    del tensor
    gc.collect()
    _C.Buffer(128).zero_()
    assert torch.equal(torch.from_dlpack(buf.view("float32")), expected)
    assert _C.sumsq(buf.view("float32")) == float((expected.double() ** 2).sum())


def test_from_dlpack_of_half_tensor_and_offset_slice():
    source = torch.arange(20, dtype=torch.bfloat16)
    buf = _C.Buffer.from_dlpack(source[3:13])
    assert buf.address == source.data_ptr() + 6 and buf.nbytes == 20
    assert torch.equal(torch.from_dlpack(buf.view("bfloat16")), source[3:13])
    with pytest.raises(ValueError, match="not aligned to 4 bytes"):
        buf.view("float32")                       # it starts 6 bytes past an aligned address


def test_from_dlpack_rejection_leaves_the_source_unconsumed():
    tensor = torch.zeros(4, 4).t()
    with pytest.raises(BufferError, match="not contiguous"):
        _C.Buffer.from_dlpack(tensor)
    tensor.add_(1.0)
    assert tensor.sum().item() == 16.0
    capsule = torch.zeros(4, 4, dtype=torch.float64).__dlpack__()
    with pytest.raises(BufferError, match="float64"):
        _C.Buffer.from_dlpack(capsule)
    assert capsule_name(capsule) == LEGACY
    assert torch.from_dlpack(capsule).shape == (4, 4)
    with pytest.raises(TypeError, match="supporting DLPack"):
        _C.Buffer.from_dlpack([1.0])


@pytest.mark.parametrize("versioned", [False, True])
def test_from_dlpack_runs_the_producers_deleter_once_when_the_buffer_dies(versioned):
    handmade = Handmade(shape=(16,), versioned=versioned, deleter=True)
    buf = _C.Buffer.from_dlpack(handmade.capsule)
    assert capsule_name(handmade.capsule) == USED[VERSIONED if versioned else LEGACY]
    assert (buf.address, buf.nbytes, buf.tier) == (handmade.array.ctypes.data, 64, "external")
    tensor = torch.from_dlpack(buf.view("float32", 8))
    assert tensor.tolist() == [float(i) for i in range(8, 16)]
    del buf
    gc.collect()
    assert handmade.deleted == []  # the view's export holds the Buffer
    del tensor
    assert handmade.deleted == [ctypes.addressof(handmade.managed)]
    del handmade.capsule
    assert len(handmade.deleted) == 1


def test_from_dlpack_of_an_rlhfz_view_holds_an_export():
    source = _C.Buffer(64)
    view = source.view("float16", 8, (8,))
    adopted = _C.Buffer.from_dlpack(view)
    assert source.exports == 1 and adopted.exports == 0
    assert adopted.address == view.address and adopted.nbytes == 16
    torch.from_dlpack(adopted.view("float16")).fill_(1.0)
    assert _C.sumsq(source.view("float16")) == 8.0
    del adopted
    assert source.exports == 0


# ---- 9. random views --------------------------------------------------------------


@st.composite
def views(draw):
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    nbytes = draw(st.integers(0, 160))
    capacity = nbytes // ITEMSIZE[dtype]
    offset = draw(st.integers(0, capacity))
    if draw(st.booleans()):
        return dtype, nbytes, offset, None
    shape, room = [], capacity - offset
    for _ in range(draw(st.integers(0 if room else 1, 4))):
        dim = draw(st.integers(0, min(room, 6)))
        shape.append(dim)
        room = room // dim if dim else 6
    return dtype, nbytes, offset, tuple(shape)


@settings(max_examples=200, deadline=None, database=None)
@given(views(), st.sampled_from([None, (1, 0)]))
def test_random_views_round_trip_through_torch(spec, max_version):
    dtype, nbytes, offset, shape = spec
    buf = filled_buffer(nbytes)
    view = buf.view(dtype, offset, shape)
    capacity = nbytes // ITEMSIZE[dtype]
    expect_shape = (capacity - offset,) if shape is None else shape
    numel = math.prod(expect_shape)
    assert (view.shape, view.numel, view.nbytes) == (expect_shape, numel, numel * ITEMSIZE[dtype])
    assert view.address == buf.address + offset * ITEMSIZE[dtype]
    tensor = torch.from_dlpack(view.__dlpack__(max_version=max_version))
    assert tensor.dtype == TORCH_DTYPE[dtype] and tuple(tensor.shape) == expect_shape
    assert tensor.is_contiguous()
    if numel:
        assert tensor.data_ptr() == view.address
        whole = bits(torch.from_dlpack(buf.view(dtype)))
        assert torch.equal(bits(tensor).flatten(), whole[offset:offset + numel])
        del whole
    assert _C.describe_dlpack(tensor)["shape"] == expect_shape
    assert buf.exports == 1
    del tensor
    assert buf.exports == 0


int64s = st.one_of(st.integers(-3, 40), st.integers(-(1 << 63), (1 << 63) - 1))


@settings(max_examples=200, deadline=None, database=None)
@given(st.sampled_from(sorted(ITEMSIZE)), st.integers(0, 128), int64s,
       st.none() | st.lists(int64s, max_size=10))
def test_random_offsets_and_shapes_fail_cleanly(dtype, nbytes, offset, shape):
    buf = _C.Buffer(nbytes)
    capacity = nbytes // ITEMSIZE[dtype]
    fits = 0 <= offset <= capacity and (shape is None or (
        len(shape) <= 8 and min(shape, default=0) >= 0 and math.prod(shape) <= capacity - offset))
    huge = shape is not None and any(d > capacity for d in shape)
    try:
        view = buf.view(dtype, offset, shape)
    except ValueError:
        # A zero-element shape with huge extents may be refused as "too large".
        assert not fits or (huge and math.prod(shape) == 0)
        return
    assert fits
    if not huge:
        tensor = torch.from_dlpack(view)
        assert tensor.numel() == view.numel
        assert torch.from_dlpack(buf.view(dtype)).sum().item() == 0.0


# A zero-element view whose extents would overflow int64 strides must be
# refused: torch, failing on such strides, runs the deleter without renaming
# the capsule, a double free. So this test only reads the strides, with ctypes.
def test_zero_element_view_never_exports_overflowed_strides():
    buf = _C.Buffer(64)
    for shape in [(1, 0, 1 << 62, 3), (0, 1 << 40, 1 << 40), (3, 1 << 62, 0)]:
        try:
            view = buf.view("float32", 0, shape)
        except ValueError:
            continue
        expected, stride = [], 1
        for dim in reversed(shape):
            expected.insert(0, stride)
            stride *= max(dim, 1)
        assert all(s < 1 << 63 for s in expected), f"{shape} is accepted but its strides overflow"
        assert strides_of(view.__dlpack__()) == tuple(expected)


OVERFLOW_SCRIPT = textwrap.dedent("""
    import torch
    from rlhfz import _C

    buf = _C.Buffer(64)
    try:
        view = buf.view("float32", 0, (1, 0, 1 << 62, 3))
    except ValueError:
        raise SystemExit(0)
    try:
        torch.from_dlpack(view)
    except RuntimeError:
        pass
    assert buf.exports == 0
""")


def test_zero_element_view_with_huge_extents_does_not_kill_the_process():
    result = subprocess.run([sys.executable, "-c", OVERFLOW_SCRIPT], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# ---- 10. kernel argument checks through the importer ------------------------------


def test_kernels_borrow_tensors_arrays_and_views_alike():
    buf = _C.Buffer(4 * 32)
    master, exp_avg = buf.view("float32", 0, (16,)), torch.zeros(16)
    exp_avg_sq = np.zeros(16, np.float32)
    grad = torch.full((4, 4), 0.5, dtype=torch.bfloat16)
    param_out = buf.view("float16", 32, (16,))  # adjacent to master, not overlapping
    torch.from_dlpack(master).fill_(1.0)
    _C.adamw_step(master, exp_avg, exp_avg_sq, grad, param_out, **HPARAMS)
    assert torch.from_dlpack(master).lt(1.0).all()
    assert torch.equal(torch.from_dlpack(param_out), torch.from_dlpack(master).half())
    assert exp_avg.gt(0).all() and (exp_avg_sq > 0).all()
    assert buf.exports == 0


def _adamw_arrays():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, generator=gen) for _ in range(4)]


@pytest.mark.parametrize("change, error, message", [
    (lambda a: dict(args=[a[0], a[1][:7], a[2], a[3]]), ValueError, "exp_avg has 7 elements but master has 8"),
    (lambda a: dict(args=[a[0], a[1], a[2], a[3][:4]]), ValueError, "grad has 4 elements"),
    (lambda a: dict(args=[a[0].bfloat16(), a[1], a[2], a[3]]), TypeError, "master must be float32, not bfloat16"),
    (lambda a: dict(args=[a[0], a[1], a[2].half(), a[3]]), TypeError, "exp_avg_sq must be float32, not float16"),
    (lambda a: dict(args=[a[0], a[1], a[2], a[3].double()]), BufferError, "grad has dtype float64"),
    (lambda a: dict(args=[a[0][:6], a[0][2:], a[2][:6], a[3][:6]]), ValueError, "master and exp_avg overlap"),
    (lambda a: dict(args=[a[0], a[1], a[2], a[1]]), ValueError, "exp_avg and grad overlap"),
    (lambda a: dict(args=[a[0], a[1], a[2], a[3], a[3]]), ValueError, "grad and param_out overlap"),
    (lambda a: dict(args=[a[0], a[1], a[2], a[3], torch.zeros(9)]), ValueError, "param_out has 9"),
    (lambda a: dict(lr=-1.0), ValueError, r"invalid lr: -1 \(expected a finite value in \[0, inf\]"),
    (lambda a: dict(beta1=1.0), ValueError, "invalid beta1: 1"),
    (lambda a: dict(beta2=-0.1), ValueError, "invalid beta2"),
    (lambda a: dict(eps=float("nan")), ValueError, "invalid eps: nan"),
    (lambda a: dict(weight_decay=float("inf")), ValueError, "invalid weight_decay"),
    (lambda a: dict(grad_scale=float("-inf")), ValueError, "invalid grad_scale"),
    (lambda a: dict(step=0), ValueError, "step must be >= 1"),
    (lambda a: dict(simd="sse4"), ValueError, "simd must be None, 'reference'"),
    (lambda a: dict(simd=2), ValueError, "not 2"),
    (lambda a: dict(lr="fast"), TypeError, "lr must be a real number, not str"),
    (lambda a: dict(step=1.0), TypeError, "step must be an integer"),
    (lambda a: dict(args=[a[0], a[1], a[2], [0.0] * 8]), TypeError, "grad must be a tensor or array"),
], ids=lambda v: None)
def test_adamw_step_rejections_leave_every_array_unchanged(change, error, message):
    arrays = _adamw_arrays()
    before = [a.clone() for a in arrays]
    call = dict(HPARAMS, args=list(arrays))
    call.update(change(arrays))
    args = call.pop("args")
    with pytest.raises(error, match=message):
        _C.adamw_step(*args, **call)
    for now, then in zip(arrays, before):
        assert torch.equal(now, then)


def test_overlapping_views_of_one_buffer_are_rejected_and_unchanged():
    buf = _C.Buffer(4 * 64)
    torch.from_dlpack(buf.view("float32")).copy_(torch.arange(64, dtype=torch.float32))
    master, exp_avg = buf.view("float32", 0, (16,)), buf.view("float32", 15, (16,))
    others = [buf.view("float32", 32, (16,)), buf.view("float32", 48, (16,))]
    with pytest.raises(ValueError, match="master and exp_avg overlap in memory"):
        _C.adamw_step(master, exp_avg, *others, **HPARAMS)
    with pytest.raises(ValueError, match="dst and src overlap"):
        _C.cast_(buf.view("float16", 0, (16,)), buf.view("float32", 3, (16,)))
    with pytest.raises(ValueError, match="p and m overlap"):
        _C.adamw_traffic_bound(master, others[0], exp_avg, others[1])
    assert torch.equal(torch.from_dlpack(buf.view("float32")), torch.arange(64, dtype=torch.float32))
    assert buf.exports == 0
