"""The native NCCL communicator, rlhfz._C.NcclComm.

Three layers, each skipped only where it must be:
- argument checking, which never touches NCCL (it fails before the library is
  loaded, or runs on a communicator from NcclComm._unconnected, with
  hand-made DLPack capsules that claim to be CUDA memory): always runs;
- loading libnccl.so.2, its version and unique ids (no GPU needed): skipped if
  no libnccl.so.2 can be found;
- collectives on CUDA tensors, world size 1, and 2 processes on 2 GPUs: marked
  gpu and skipped without torch.cuda.

Anything that could hang or abort a process (NCCL initialisation without a
GPU, a leaked communicator, an NCCL error) runs in a child process with a
timeout, so no outcome can take the test session down.
"""
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import rlhfz
from dlpack_handmade import FLAG_READ_ONLY, Handmade
from rlhfz import _C
from rlhfz.comm.nccl_library import wheel_library

UNIQUE_ID_BYTES = 128
DTYPES = ("float32", "bfloat16", "float16")
OPS = ("sum", "avg", "max", "min")
CHILD_TIMEOUT_S = 180


def _torch_cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_torch_cuda = pytest.mark.skipif(_torch_cuda_devices() < 1,
                                      reason="needs torch with a CUDA device")
needs_two_gpus = pytest.mark.skipif(_torch_cuda_devices() < 2, reason="needs 2 CUDA devices")


@pytest.fixture(scope="module")
def nccl():
    """The loaded library's path; skips the test if no libnccl.so.2 loads."""
    try:
        import torch  # noqa: F401  (a torch built with NCCL loads its copy, which rlhfz prefers)
    except ImportError:
        pass
    try:
        return _C.nccl_load(wheel_library())
    except RuntimeError as error:
        pytest.skip(f"libnccl.so.2 not found: {error}")


def _run_child(code, env=None, timeout=CHILD_TIMEOUT_S):
    """Runs `code` in a fresh interpreter that imports this same rlhfz."""
    child_env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(rlhfz.__file__)))
    child_env["PYTHONPATH"] = os.pathsep.join(
        [root] + ([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH") else []))
    child_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                          capture_output=True, text=True, timeout=timeout)


def _child_result(proc):
    """The JSON object a child printed on its last line."""
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- argument checking: no library, no GPU ------------------------------------------------

GOOD_ID = bytes(UNIQUE_ID_BYTES)


@pytest.mark.parametrize("args, error, match", [
    ((GOOD_ID[:127], 1, 0, 0), ValueError, "128 bytes"),
    ((GOOD_ID + b"x", 1, 0, 0), ValueError, "128 bytes"),
    ((b"", 1, 0, 0), ValueError, "128 bytes"),
    (("x" * 128, 1, 0, 0), TypeError, "unique_id must be bytes"),
    ((None, 1, 0, 0), TypeError, "unique_id must be bytes"),
    ((GOOD_ID, 0, 0, 0), ValueError, "world_size"),
    ((GOOD_ID, -3, 0, 0), ValueError, "world_size"),
    ((GOOD_ID, 2**31, 0, 0), ValueError, "world_size"),
    ((GOOD_ID, 2**70, 0, 0), ValueError, "world_size"),
    ((GOOD_ID, 2, 2, 0), ValueError, "rank must be in"),
    ((GOOD_ID, 2, -1, 0), ValueError, "rank must be in"),
    ((GOOD_ID, 1, 0, -1), ValueError, "device"),
    ((GOOD_ID, 1.0, 0, 0), TypeError, "world_size must be an integer"),
    ((GOOD_ID, 1, "0", 0), TypeError, "rank must be an integer"),
    ((GOOD_ID, 1, 0, None), TypeError, "device must be an integer"),
], ids=["short-id", "long-id", "empty-id", "str-id", "none-id", "world-0", "world-negative",
        "world-over-int", "world-over-int64", "rank-too-big", "rank-negative", "device-negative",
        "world-float", "rank-str", "device-none"])
def test_constructor_rejects_bad_arguments_before_touching_nccl(args, error, match):
    with pytest.raises(error, match=match):
        _C.NcclComm(*args)


def test_constructor_argument_binding():
    with pytest.raises(TypeError):
        _C.NcclComm(GOOD_ID, 1, 0)                       # device is required
    with pytest.raises(TypeError):
        _C.NcclComm(GOOD_ID, 1, 0, 0, 5)
    with pytest.raises(TypeError):
        _C.NcclComm(unique_id=GOOD_ID, world_size=1, rank=0, device=0, stream=0)
    with pytest.raises(ValueError, match="rank must be in"):
        _C.NcclComm(unique_id=GOOD_ID, world_size=1, rank=1, device=0)


@pytest.mark.parametrize("timeout, error", [(0, ValueError), (-1.0, ValueError),
                                            (float("nan"), ValueError), ("5", TypeError)])
def test_a_bad_timeout_is_refused_before_touching_nccl(timeout, error):
    with pytest.raises(error, match="timeout"):
        _C.NcclComm(GOOD_ID, 1, 0, 0, timeout=timeout)


def test_unconnected_comm_properties_and_teardown():
    comm = _C.NcclComm._unconnected(4, 3, 1)
    assert (comm.rank, comm.world_size, comm.device) == (3, 4, 1)
    assert comm.alive is False and comm.state == "unconnected"
    assert "rank 3 of 4" in repr(comm)
    with pytest.raises(RuntimeError, match="never connected"):
        comm.check()
    for _ in range(2):                     # idempotent, and no-ops on a comm that never lived
        assert comm.destroy() is None
        assert comm.abort() is None
    assert comm.state == "unconnected"
    with pytest.raises(AttributeError):
        comm.rank = 0
    with pytest.raises(ValueError, match="rank must be in"):
        _C.NcclComm._unconnected(2, 2)
    with pytest.raises(TypeError):
        _C.NcclComm._unconnected(2)


def test_unconnected_comm_is_freed_without_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = _C.NcclComm._unconnected(1, 0)
        del comm
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


# ---- collective arguments: rlhfz borrows, checked before NCCL ----------------------------------
#
# The arrays are hand-made DLPack capsules that claim to be CUDA memory (host
# bytes behind them, never touched: an unconnected communicator stops at its
# alive check), world size 2, rank 1, device 0: 16 float32 elements per rank.

KDLCUDA, KDLCPU, KDLCUDAHOST = 2, 1, 3
PER_RANK = 16
# elements of send and recv per method (world size 2)
SIZES = {"all_reduce": (16, 16), "reduce_scatter": (32, 16), "all_gather": (16, 32),
         "broadcast": (16, 16)}
SCALARS = {"all_reduce": {"op": "sum"}, "reduce_scatter": {"op": "sum"}, "all_gather": {},
           "broadcast": {"root": 1}}
BITS = {"float32": (2, 32), "bfloat16": (4, 16), "float16": (2, 16)}


def cuda_array(n, *, dtype="float32", device_id=0, backing=None, byte_offset=0, **fields):
    """A capsule claiming n elements of CUDA memory on device_id; keep the
    returned Handmade alive while its capsule is in use."""
    code, bits = BITS[dtype]
    if backing is None:
        backing = np.zeros(max(n, 1), dtype=np.float32)
    return Handmade(backing, shape=(n,), code=code, bits=bits, device=(KDLCUDA, device_id),
                    byte_offset=byte_offset, **fields)


def _arrays(method, dtype="float32", sizes=None):
    send_n, recv_n = sizes or SIZES[method]
    return cuda_array(send_n, dtype=dtype), cuda_array(recv_n, dtype=dtype)


def _call(comm, method, send, recv, **changes):
    """Calls method with the Handmade arrays (or other objects) and the scalars."""
    def capsule(obj):
        return obj.capsule if isinstance(obj, Handmade) else obj
    kwargs = dict(SCALARS[method], **changes)
    return getattr(comm, method)(capsule(send), capsule(recv), **kwargs)


def _unconnected():
    return _C.NcclComm._unconnected(2, 1)


NEVER_CONNECTED = "never connected"


@pytest.mark.parametrize("method", sorted(SIZES))
def test_valid_arguments_reach_the_alive_check(method):
    comm = _unconnected()
    send, recv = _arrays(method)
    with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
        _call(comm, method, send, recv)
    # positionally too, in the documented order; stream by keyword only
    with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
        getattr(comm, method)(send.capsule, recv.capsule, *SCALARS[method].values(), stream=None)
    for dtype in DTYPES:
        send, recv = _arrays(method, dtype)
        with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
            _call(comm, method, send, recv)
    if "op" in SCALARS[method]:
        for op in OPS:
            with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
                _call(comm, method, send, recv, op=op)

    class Torchlike:
        cuda_stream = 0x7F00DEAD0000
    for stream in (None, 0, 1, 2, 0x1234, Torchlike()):
        with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
            _call(comm, method, send, recv, stream=stream)
    # nothing to do: empty arrays, a null data pointer too
    empty = [cuda_array(0), Handmade(data=False, shape=(0,), device=(KDLCUDA, 0))]
    for send_empty in empty:
        for recv_empty in empty:
            with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
                _call(comm, method, send_empty, recv_empty)


@pytest.mark.parametrize("method", sorted(SIZES))
def test_arrays_must_be_float_cuda_memory_of_the_communicators_device(method):
    comm = _unconnected()
    send, recv = _arrays(method)
    send_n, recv_n = SIZES[method]
    cases = [
        # what the DLPack importer refuses, naming the argument
        (dict(recv=Handmade(np.zeros(recv_n, dtype=np.int8), shape=(recv_n,), code=0, bits=8,
                            device=(KDLCUDA, 0))),
         BufferError, "recv has dtype int8; supported dtypes are float32, bfloat16 and float16"),
        (dict(send=Handmade(np.zeros(send_n, dtype=np.float64), shape=(send_n,), bits=64,
                            device=(KDLCUDA, 0))),
         BufferError, "send has dtype float64"),
        (dict(recv=np.zeros(recv_n, dtype=np.float32)),
         BufferError, "recv is on device cpu:0; this kernel needs CUDA device memory"),
        (dict(send=Handmade(np.zeros(send_n, dtype=np.float32), shape=(send_n,),
                            device=(KDLCUDAHOST, 0))),
         BufferError, "send is on device cuda_host:0"),
        (dict(send=_C.Buffer(4 * send_n).view("float32")),
         BufferError, "send is in host memory; this kernel needs CUDA device memory"),
        (dict(recv=Handmade(np.zeros(2 * recv_n, dtype=np.float32), shape=(recv_n,),
                            strides=(2,), device=(KDLCUDA, 0))),
         BufferError, "recv is not contiguous"),
        (dict(recv=cuda_array(recv_n, versioned=True, flags=FLAG_READ_ONLY)),
         BufferError, "recv is read-only"),
        # rlhfz's own checks
        (dict(send=cuda_array(send_n, dtype="float16")),
         TypeError, "send must be float32, not float16"),
        (dict(send=cuda_array(send_n, device_id=1)),
         ValueError, "NcclComm: send is on cuda:1 but the communicator is on cuda:0"),
        (dict(recv=cuda_array(recv_n, device_id=3)),
         ValueError, "NcclComm: recv is on cuda:3 but the communicator is on cuda:0"),
        (dict(recv=None), TypeError, "recv must be a tensor or array supporting DLPack"),
        (dict(send=b"\0" * 64), TypeError, "send must be a tensor or array supporting DLPack"),
    ]
    if method != "broadcast":     # a broadcast off the root reads no send (below)
        cases.append((dict(send=None), TypeError, f"NcclComm.{method}: send must be an array"))
    for change, error, match in cases:
        arrays = {"send": send, "recv": recv, **change}
        with pytest.raises(error, match=re.escape(match)):
            _call(comm, method, arrays["send"], arrays["recv"])
    # a read-only send is fine: it is only read
    with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
        _call(comm, method, cuda_array(send_n, versioned=True, flags=FLAG_READ_ONLY), recv)


@pytest.mark.parametrize("method, send_n, recv_n, match", [
    ("all_reduce", 16, 15, "send has 16 elements but recv has 15"),
    ("all_reduce", 0, 1, "send has 0 elements but recv has 1"),
    ("broadcast", 17, 16, "send has 17 elements but recv has 16"),
    ("reduce_scatter", 16, 16, "send has 16 elements but must have world_size (2) times recv's 16"),
    ("reduce_scatter", 33, 16, "send has 33 elements but must have world_size (2) times recv's 16"),
    ("all_gather", 16, 16, "recv has 16 elements but must have world_size (2) times send's 16"),
    ("all_gather", 16, 31, "recv has 31 elements but must have world_size (2) times send's 16"),
])
def test_sizes_must_fit_the_collective(method, send_n, recv_n, match):
    comm = _unconnected()
    send, recv = _arrays(method, sizes=(send_n, recv_n))
    with pytest.raises(ValueError, match=re.escape(match)):
        _call(comm, method, send, recv)


@pytest.mark.parametrize("method", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("op, error", [("prod", ValueError), ("SUM", ValueError), ("", ValueError),
                                       (0, TypeError), (None, TypeError)])
def test_bad_ops_raise(method, op, error):
    comm = _unconnected()
    send, recv = _arrays(method)
    with pytest.raises(error, match="'sum', 'avg', 'max' or 'min'"):
        _call(comm, method, send, recv, op=op)


@pytest.mark.parametrize("method", sorted(SIZES))
@pytest.mark.parametrize("stream, error, match", [
    ("default", TypeError, "stream must be None, a stream handle"),
    (-1, ValueError, "stream handle must be an address"),
    (object(), TypeError, "cuda_stream or handle attribute"),
])
def test_bad_streams_raise(method, stream, error, match):
    comm = _unconnected()
    send, recv = _arrays(method)
    with pytest.raises(error, match=match):
        _call(comm, method, send, recv, stream=stream)


def test_broadcast_root_and_send_rules():
    comm = _unconnected()                 # rank 1
    send, recv = _arrays("broadcast")
    for root in (-1, 2, 2**40):
        with pytest.raises(ValueError, match="root must be in"):
            _call(comm, "broadcast", send, recv, root=root)
    with pytest.raises(TypeError, match="root must be an integer"):
        _call(comm, "broadcast", send, recv, root="0")
    # send is read only on the root: elsewhere it may be None, or overlap recv
    with pytest.raises(TypeError, match=r"send is None, but this rank \(1\) is the root"):
        _call(comm, "broadcast", None, recv, root=1)
    with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
        _call(comm, "broadcast", None, recv, root=0)
    backing = np.zeros(64, dtype=np.float32)
    shifted = cuda_array(16, backing=backing, byte_offset=4)
    base = cuda_array(16, backing=backing)
    with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
        _call(comm, "broadcast", shifted, base, root=0)
    with pytest.raises(ValueError, match="overlap"):
        _call(comm, "broadcast", shifted, base, root=1)
    # ... but a send that is given is checked as on the root
    with pytest.raises(ValueError, match="send has 8 elements but recv has 16"):
        _call(comm, "broadcast", cuda_array(8), recv, root=0)


@pytest.mark.parametrize("method, send_at, recv_at, ok", [
    # byte offsets into one backing; in place is the only overlap allowed
    # (rank 1, 16 float32 = 64 bytes per rank)
    ("all_reduce", 256, 256, True),
    ("all_reduce", 260, 256, False),
    ("all_reduce", 256, 316, False),
    ("all_reduce", 320, 256, True),                # adjacent, not overlapping
    ("broadcast", 256, 256, True),
    ("broadcast", 264, 256, False),
    ("reduce_scatter", 256, 320, True),            # recv = send + rank * chunk
    ("reduce_scatter", 256, 256, False),
    ("reduce_scatter", 256, 352, False),
    ("reduce_scatter", 256, 384, True),            # just past the 128-byte send
    ("all_gather", 320, 256, True),                # send = recv + rank * chunk
    ("all_gather", 256, 256, False),
    ("all_gather", 288, 256, False),
    ("all_gather", 192, 256, True),
    ("all_gather", 196, 256, False),
])
def test_overlapping_arrays_must_be_exactly_in_place(method, send_at, recv_at, ok):
    comm = _unconnected()
    backing = np.zeros(256, dtype=np.float32)
    send_n, recv_n = SIZES[method]
    send = cuda_array(send_n, backing=backing, byte_offset=send_at)
    recv = cuda_array(recv_n, backing=backing, byte_offset=recv_at)
    expected = (RuntimeError, NEVER_CONNECTED) if ok else (ValueError, "overlap; the only overlap "
                                                                      "allowed is in place")
    with pytest.raises(expected[0], match=expected[1]):
        _call(comm, method, send, recv)


@pytest.mark.parametrize("method", sorted(SIZES))
def test_collective_argument_binding(method):
    comm = _unconnected()
    send, recv = _arrays(method)
    fn = getattr(comm, method)
    args = [send.capsule, recv.capsule, *SCALARS[method].values()]
    with pytest.raises(TypeError, match="missing required argument"):
        fn(*args[:-1])
    with pytest.raises(TypeError, match="at most"):
        fn(*args, 0)                               # stream is keyword-only
    with pytest.raises(TypeError, match="unexpected keyword"):
        fn(*args, streem=0)
    with pytest.raises(TypeError, match="multiple values"):
        fn(*args, recv=recv.capsule)


class RecordingProducer:
    """A CUDA producer that records the stream its consumer asks for."""

    def __init__(self, made):
        self.made, self.streams = made, []

    def __dlpack_device__(self):
        return (KDLCUDA, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        return self.made.capsule


@pytest.mark.parametrize("stream, expected", [(None, 1), (0, 1), (1, 1), (2, 2),
                                              (0x7F00DEAD0000, 0x7F00DEAD0000)])
def test_the_collectives_stream_goes_to_the_producers(stream, expected):
    # as for a kernel: the producer orders its pending writes before that stream
    comm = _unconnected()
    send, recv = (RecordingProducer(made) for made in _arrays("all_reduce"))
    with pytest.raises(RuntimeError, match=NEVER_CONNECTED):
        comm.all_reduce(send, recv, "sum", stream=stream)
    assert send.streams == recv.streams == [expected]


def test_refused_calls_let_go_of_what_they_borrowed():
    comm = _unconnected()
    send, recv = _arrays("reduce_scatter")
    held = [sys.getrefcount(send.capsule), sys.getrefcount(recv.capsule)]
    for change in (dict(), dict(op="prod"), dict(stream="x")):
        with pytest.raises((RuntimeError, ValueError, TypeError)):
            _call(comm, "reduce_scatter", send, recv, **change)
    small = cuda_array(3)
    with pytest.raises(ValueError):
        _call(comm, "reduce_scatter", send, small)
    assert [sys.getrefcount(send.capsule), sys.getrefcount(recv.capsule)] == held
    assert send.deleted == recv.deleted == []    # borrowed, never consumed


def test_nccl_load_rejects_bad_paths():
    with pytest.raises(ValueError, match="empty"):
        _C.nccl_load("")
    with pytest.raises(ValueError):
        _C.nccl_load("lib\0nccl.so")
    with pytest.raises(TypeError):
        _C.nccl_load(42)
    with pytest.raises(TypeError):
        _C.nccl_load(path="x", other=1)


# ---- the library: no GPU needed ---------------------------------------------------------------

def test_load_is_idempotent_and_names_the_file(nccl):
    assert os.path.isfile(nccl)
    assert os.path.basename(nccl).startswith("libnccl.so")
    assert _C.nccl_load() == nccl
    assert _C.nccl_load(path=nccl) == nccl
    # once loaded, a path (even a bad one) changes nothing
    assert _C.nccl_load("/nonexistent/libnccl.so.2") == nccl


def test_version(nccl):
    version = _C.nccl_version()
    assert isinstance(version, int)
    assert version > 20000 and version >= 21000       # 2.10+: bfloat16 and avg
    reported = ctypes.c_int(0)
    assert ctypes.CDLL(nccl).ncclGetVersion(ctypes.byref(reported)) == 0
    assert reported.value == version


def test_unique_ids(nccl):
    # ncclGetUniqueId needs no GPU: it only opens NCCL's bootstrap socket.
    first, second = _C.nccl_unique_id(), _C.nccl_unique_id()
    assert isinstance(first, bytes) and len(first) == UNIQUE_ID_BYTES
    assert len(second) == UNIQUE_ID_BYTES
    assert first != second
    assert first != bytes(UNIQUE_ID_BYTES)


def test_construction_without_a_gpu_raises_and_names_the_nccl_error(nccl):
    if _torch_cuda_devices() > 0 or rlhfz.build_info()["cuda"]:
        pytest.skip("a CUDA device is visible: construction would succeed")
    proc = _run_child(f"""
        import json
        from rlhfz import _C
        _C.nccl_load({nccl!r})
        uid = _C.nccl_unique_id()
        try:
            _C.NcclComm(uid, 1, 0, 0)
            print(json.dumps({{"raised": None}}))
        except Exception as error:
            print(json.dumps({{"raised": type(error).__name__, "message": str(error)}}))
    """)
    result = _child_result(proc)
    assert result["raised"] == "RuntimeError", result
    message = result["message"]
    assert "nccl_comm.c:" in message                   # file:line of the check
    assert "ncclCommInitRank" in message and "rank 0 of 1" in message
    assert re.search(r"failed: nccl[A-Za-z]+Error \(\d\): ", message), message   # ncclResult_t, named


def test_load_order_in_a_fresh_process(nccl):
    code = """
        import json, os, sys
        from rlhfz import _C
        def preloaded():
            with open("/proc/self/maps") as maps:
                return any("libnccl.so" in line for line in maps)
        before = preloaded()
        try:
            result = {"loaded": _C.nccl_load(*sys.argv[1:])}
        except RuntimeError as error:
            result = {"error": str(error)}
        result["preloaded"] = before
        print(json.dumps(result))
    """
    # RLHFZ_NCCL_LIBRARY names a file that does not exist: an explicit choice
    # that fails is reported, not replaced by another copy.
    bad = _child_result(_run_child(code, env={"RLHFZ_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"}))
    if bad["preloaded"]:
        pytest.skip("libnccl.so.2 is loaded at interpreter start-up here (preferred over all else)")
    assert "RLHFZ_NCCL_LIBRARY=/nonexistent/libnccl.so.2" in bad["error"]
    assert "No such file" in bad["error"]
    # ... and when it names a real one, that one is loaded, whatever path says.
    good = _child_result(_run_child(code + "\n", env={"RLHFZ_NCCL_LIBRARY": nccl}))
    assert os.path.realpath(good["loaded"]) == os.path.realpath(nccl)
    # Without it: path, then the linker's search; if both fail, every dlerror is named.
    env = {"RLHFZ_NCCL_LIBRARY": ""}
    proc = _run_child(code.replace("sys.argv[1:]", "['/nonexistent/libnccl.so.2']"), env=env)
    missing = _child_result(proc)
    if "loaded" in missing:                             # the linker found a system copy
        assert os.path.isfile(missing["loaded"])
    else:
        assert "/nonexistent/libnccl.so.2" in missing["error"]
        assert "libnccl.so.2: cannot open" in missing["error"]
        assert "nvidia-nccl-cu13" in missing["error"]
    explicit = _child_result(_run_child(code.replace("sys.argv[1:]", f"[{nccl!r}]"), env=env))
    assert "loaded" in explicit and os.path.isfile(explicit["loaded"])


# ---- collectives on a GPU ---------------------------------------------------------------------

def _cuda_comm():
    import torch
    torch.cuda.set_device(0)
    return _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0)


@pytest.mark.gpu
@needs_torch_cuda
def test_an_init_whose_peer_never_comes_times_out_and_the_process_goes_on(nccl):
    """NCCL's own init, non-blocking (ncclCommInitRankConfig with the config
    rlhfz lays out itself): a world of two whose rank 1 never calls it is
    polled, aborted at the timeout, and raises TimeoutError; a communicator
    made next in the same process works."""
    proc = _run_child("""
        import json, time, torch
        from rlhfz import _C
        torch.cuda.set_device(0)
        _C.nccl_load()
        out = {"version": _C.nccl_version()}
        started = time.monotonic()
        out["raised"] = None
        try:
            if out["version"] >= 21400:      # before, the init would block for ever
                _C.NcclComm(_C.nccl_unique_id(), 2, 0, 0, timeout=3)
        except Exception as error:
            out["raised"] = [type(error).__name__, str(error)]
        out["after_s"] = time.monotonic() - started
        comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0, timeout=30)
        x = torch.arange(8, device="cuda", dtype=torch.float32)
        y = torch.zeros_like(x)
        comm.all_reduce(x, y, "sum", stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        out["reduced"] = bool(torch.equal(x, y))
        comm.destroy()
        print(json.dumps(out))
    """, timeout=120)
    out = _child_result(proc)
    if out["version"] < 21400:
        assert out["reduced"] is True
        pytest.skip(f"NCCL {out['version']} has no non-blocking init")
    kind, text = out["raised"]
    assert kind == "TimeoutError", out
    assert "ncclCommInitRankConfig (rank 0 of 2, device 0) did not finish within 3 s" in text
    assert 3 <= out["after_s"] < 20, out
    assert out["reduced"] is True


@pytest.mark.gpu
@needs_torch_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_world_size_one_round_trip(nccl, dtype):
    import torch
    comm = _cuda_comm()
    try:
        assert comm.alive and comm.state == "alive"
        assert (comm.rank, comm.world_size, comm.device) == (0, 1, 0)
        torch_dtype = getattr(torch, dtype)
        stream = torch.cuda.current_stream()
        x = torch.arange(1, 33, device="cuda", dtype=torch_dtype)

        for op in OPS:
            y = torch.full_like(x, -7)
            comm.all_reduce(x, y, op, stream=stream)
            torch.cuda.synchronize()
            assert torch.equal(y, x), op

        z = x.clone()                                   # in place
        comm.all_reduce(z, z, "sum", stream=stream.cuda_stream)
        torch.cuda.synchronize()
        assert torch.equal(z, x)

        y = torch.full_like(x, -7)
        comm.reduce_scatter(x, y, "max", stream=stream)
        torch.cuda.synchronize()
        assert torch.equal(y, x)

        y = torch.full_like(x, -7)
        comm.all_gather(x, y, stream=stream)
        torch.cuda.synchronize()
        assert torch.equal(y, x)

        y = torch.full_like(x, -7)
        comm.broadcast(x, y, 0, stream=stream)
        torch.cuda.synchronize()
        assert torch.equal(y, x)

        # on a side stream, with the legacy default stream (None), and with nothing to do
        side = torch.cuda.Stream()
        y = torch.full_like(x, -7)
        torch.cuda.synchronize()
        comm.all_reduce(x, y, "min", stream=side)
        side.synchronize()
        assert torch.equal(y, x)
        y = torch.full_like(x, -7)
        torch.cuda.synchronize()
        comm.all_reduce(x, y, "sum")
        torch.cuda.synchronize()
        assert torch.equal(y, x)
        comm.all_reduce(x[:0], y[:0], "sum", stream=stream)
        # rlhfz device views too
        view = _C.Buffer(4 * 32, "device").view("float32")
        comm.all_reduce(view, view, "sum", stream=stream)

        assert comm.check() is None
    finally:
        comm.destroy()
    assert not comm.alive and comm.state == "destroyed"
    comm.destroy()
    comm.abort()
    assert comm.state == "destroyed"
    with pytest.raises(RuntimeError, match="destroyed"):
        comm.all_reduce(x, x, "sum", stream=stream)
    with pytest.raises(RuntimeError, match="destroyed"):
        comm.check()
    # arguments are still checked first
    with pytest.raises(ValueError, match="send has 32 elements but recv has 31"):
        comm.all_reduce(x, x[:31], "sum", stream=stream)


@pytest.mark.gpu
@needs_torch_cuda
def test_a_torch_tensor_outlives_the_collective_that_reads_it(nccl):
    """A collective queued on a stream reads its tensors after the call
    returns. NcclComm keeps what it borrowed until the collective is done:
    let go at once, x's block could go to y (torch's cache) while NCCL,
    held up here by a sleep, still has to read it. (test_nccl_failures has
    the simulator's twin.)"""
    import torch
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch")
    comm = _cuda_comm()
    try:
        side = torch.cuda.Stream()
        n = 1 << 20
        x = torch.ones(n, device="cuda")
        out = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
        comm.all_reduce(x, out, "sum", stream=side)
        del x
        y = torch.full((n,), 5.0, device="cuda")     # may reuse x's block at once
        side.synchronize()
        torch.cuda.synchronize()
        assert bool((y == 5.0).all()) and bool((out == 1.0).all())
    finally:
        comm.destroy()


@pytest.mark.gpu
@needs_torch_cuda
def test_abort_is_idempotent_and_final(nccl):
    import torch
    comm = _cuda_comm()
    comm.abort()
    assert not comm.alive and comm.state == "aborted"
    comm.abort()
    comm.destroy()
    assert comm.state == "aborted"
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match=r"aborted by abort\(\)"):
        comm.broadcast(x, x, 0)


@pytest.mark.gpu
@needs_torch_cuda
def test_device_must_be_the_current_one(nccl):
    import torch
    torch.cuda.set_device(0)
    with pytest.raises(ValueError, match="torch.cuda.set_device"):
        _C.NcclComm(_C.nccl_unique_id(), 1, 0, 1)       # device 0 is current, not 1


@pytest.mark.gpu
@needs_torch_cuda
def test_leaked_comm_warns_and_does_not_block(nccl):
    proc = _run_child(f"""
        import gc, json, warnings
        import torch
        from rlhfz import _C
        _C.nccl_load({nccl!r})
        torch.cuda.set_device(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0)
            del comm
            gc.collect()
        print(json.dumps([str(w.message) for w in caught if w.category is ResourceWarning]))
    """, timeout=120)
    messages = _child_result(proc)
    assert any("never destroyed" in m for m in messages), messages


@pytest.mark.gpu
@needs_torch_cuda
def test_nccl_error_aborts_the_comm(nccl):
    # With NCCL_CHECK_POINTERS=1 NCCL validates pointers itself: a pageable
    # host pointer is an ncclInvalidArgument, which must abort the
    # communicator. rlhfz refuses host memory itself, so the host pointer
    # comes in a capsule that claims to be CUDA memory.
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = _run_child(f"""
        import json, sys
        import numpy as np
        import torch
        sys.path.insert(0, {tests!r})
        from dlpack_handmade import Handmade
        from rlhfz import _C
        _C.nccl_load({nccl!r})
        torch.cuda.set_device(0)
        comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0)
        host = Handmade(np.ones(64, dtype=np.float32), shape=(64,), device=(2, 0))
        device = torch.zeros(64, device="cuda")
        try:
            comm.all_reduce(host.capsule, device, "sum", stream=torch.cuda.current_stream())
            torch.cuda.synchronize()
            result = {{"raised": None}}
        except RuntimeError as error:
            result = {{"raised": str(error)}}
        result["state"] = comm.state
        try:
            comm.all_reduce(device, device, "sum")
            result["after"] = None
        except RuntimeError as error:
            result["after"] = str(error)
        comm.destroy()
        print(json.dumps(result))
    """, env={"NCCL_CHECK_POINTERS": "1"}, timeout=120)
    result = _child_result(proc)
    if result["raised"] is None:
        pytest.skip("this NCCL accepted a host pointer (no error to provoke)")
    assert "ncclAllReduce" in result["raised"] and "nccl_comm.c:" in result["raised"]
    assert "aborted" in result["raised"]
    assert result["state"] == "aborted"
    assert "aborted after an error (ncclAllReduce" in result["after"]


TWO_RANKS = """
    import json, os, sys, time
    import torch
    from rlhfz import _C
    rank, folder, library = int(sys.argv[1]), sys.argv[2], sys.argv[3] or None
    _C.nccl_load(library)
    torch.cuda.set_device(rank)
    id_file = os.path.join(folder, "uid")
    if rank == 0:                                       # rank 0 hosts the bootstrap root
        uid = _C.nccl_unique_id()
        with open(id_file + ".tmp", "wb") as f:
            f.write(uid)
        os.rename(id_file + ".tmp", id_file)
    else:
        deadline = time.time() + 60
        while not os.path.exists(id_file):
            if time.time() > deadline:
                raise TimeoutError("rank 0 never wrote the unique id")
            time.sleep(0.05)
        uid = open(id_file, "rb").read()
    comm = _C.NcclComm(uid, 2, rank, rank)
    stream = torch.cuda.current_stream()
    checks = {}
    for name in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, name)
        x = torch.full((8,), float(rank + 1), device="cuda", dtype=dtype)
        for op, want in (("sum", 3.0), ("avg", 1.5), ("max", 2.0), ("min", 1.0)):
            y = torch.empty_like(x)
            comm.all_reduce(x, y, op, stream=stream)
            torch.cuda.synchronize()
            checks[f"all_reduce {op} {name}"] = bool((y == want).all())
        send = torch.arange(8, device="cuda", dtype=dtype) + 10 * rank
        y = torch.empty(4, device="cuda", dtype=dtype)
        comm.reduce_scatter(send, y, "sum", stream=stream)
        torch.cuda.synchronize()
        want = (2 * torch.arange(8, dtype=torch.float32) + 10)[4 * rank:4 * rank + 4]
        checks[f"reduce_scatter {name}"] = bool((y.float().cpu() == want).all())
        mine = torch.full((4,), float(rank), device="cuda", dtype=dtype)
        y = torch.empty(8, device="cuda", dtype=dtype)
        comm.all_gather(mine, y, stream=stream)
        torch.cuda.synchronize()
        checks[f"all_gather {name}"] = y.float().cpu().tolist() == [0.0] * 4 + [1.0] * 4
        y = torch.full((8,), -1.0, device="cuda", dtype=dtype)     # in place: this rank's slot
        y[4 * rank:4 * rank + 4] = rank + 5
        comm.all_gather(y[4 * rank:4 * rank + 4], y, stream=stream)
        torch.cuda.synchronize()
        checks[f"all_gather in place {name}"] = y.float().cpu().tolist() == [5.0] * 4 + [6.0] * 4
        y = torch.full((8,), float(rank + 40), device="cuda", dtype=dtype)
        comm.broadcast(y if rank == 1 else None, y, 1, stream=stream)
        torch.cuda.synchronize()
        checks[f"broadcast {name}"] = bool((y == 41).all())
    comm.check()
    comm.destroy()
    print(json.dumps(checks))
"""


@pytest.mark.gpu
@needs_two_gpus
def test_two_processes(nccl, tmp_path):
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(rlhfz.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    code = textwrap.dedent(TWO_RANKS)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(tmp_path),
                               wheel_library() or ""],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=CHILD_TIMEOUT_S))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out}\n{err}"
        checks = json.loads(out.strip().splitlines()[-1])
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


_CONFIG_FIELDS = ("size", "magic", "version", "blocking", "cgaClusterSize", "minCTAs", "maxCTAs",
                  "netName")
_LAYOUT_PROGRAM = r"""
#include <stddef.h>
#include <stdio.h>
#include HEADER
int main(void)
{
    printf("%zu %u %d\n", sizeof(CONFIG), (unsigned)MAGIC, (int)UNDEF);
    FIELDS
    return 0;
}
"""


def _nccl_header() -> str | None:
    import importlib.util
    spec = importlib.util.find_spec("nvidia.nccl")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "include", "nccl.h")
        if os.path.isfile(path):
            return path
    return None


def _layout(tmp_path, name, header, config, magic, undef, includes=()):
    import shutil
    import sysconfig
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    fields = "\n    ".join(f'printf("%zu\\n", offsetof({config}, {field}));'
                           for field in _CONFIG_FIELDS)
    source = tmp_path / f"{name}.c"
    source.write_text(_LAYOUT_PROGRAM.replace("HEADER", f'"{header}"').replace("CONFIG", config)
                      .replace("MAGIC", magic).replace("UNDEF", undef).replace("FIELDS", fields))
    binary = tmp_path / name
    # nccl.h's CUDA headers: only the stream and event handles are needed
    stubs = tmp_path / "cuda_stubs"
    stubs.mkdir(exist_ok=True)
    (stubs / "cuda_runtime.h").write_text(
        "typedef struct CUstream_st *cudaStream_t;\ntypedef struct CUevent_st *cudaEvent_t;\n")
    for empty in ("cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"):
        (stubs / empty).write_text("")
    flags = [f"-I{sysconfig.get_paths()['include']}", f"-I{stubs}"] + \
        [f"-I{folder}" for folder in includes]
    subprocess.run([compiler, *flags, "-o", str(binary), str(source)], check=True)
    return subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.split()


def test_the_config_rlhfz_hands_nccl_is_laid_out_as_ncclConfig_t(tmp_path):
    """rlhfz declares NCCL 2.14's fields of ncclConfig_t itself (no nccl.h
    at build time); against the nccl.h of the wheel: each field at NCCL's
    offset, the same magic and unset value, and no bigger than NCCL's
    struct (NCCL reads `size` bytes of it and keeps its defaults past them)."""
    header = _nccl_header()
    if header is None:
        pytest.skip("needs nvidia-nccl-cu13's include/nccl.h")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    theirs = _layout(tmp_path, "theirs", header, "ncclConfig_t", "NCCL_API_MAGIC",
                     "NCCL_CONFIG_UNDEF_INT")
    ours = _layout(tmp_path, "ours", os.path.join(root, "csrc", "nccl_library.h"),
                   "rlhfz_nccl_config", "RLHFZ_NCCL_API_MAGIC", "RLHFZ_NCCL_CONFIG_UNDEF_INT",
                   includes=[os.path.join(root, "csrc"), os.path.join(root, "kernels")])
    assert ours[1:3] == theirs[1:3]                      # magic, unset int
    assert ours[3:] == theirs[3:]                        # every field's offset
    assert int(ours[0]) <= int(theirs[0])
