"""The native NCCL communicator, rlhfz._C.NcclComm.

Three layers, each skipped only where it must be:
- argument checking, which never touches NCCL (it fails before the library is
  loaded, or runs on a communicator from NcclComm._unconnected): always runs;
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

import pytest

import rlhfz
from rlhfz import _C
from rlhfz.nccl_library import wheel_library

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


# Arguments that pass every check, per method: 16 float32 elements per rank,
# world size 2, rank 1, buffers far apart.
SEND, RECV, STREAM = 0x10000, 0x20000, 0x1234
VALID = {
    "all_reduce": dict(send_ptr=SEND, recv_ptr=RECV, count=16, dtype="float32", op="sum", stream=STREAM),
    "reduce_scatter": dict(send_ptr=SEND, recv_ptr=RECV, recv_count=16, dtype="float32", op="sum",
                           stream=STREAM),
    "all_gather": dict(send_ptr=SEND, recv_ptr=RECV, send_count=16, dtype="float32", stream=STREAM),
    "broadcast": dict(send_ptr=SEND, recv_ptr=RECV, count=16, dtype="float32", root=1, stream=STREAM),
}
COUNT_NAME = {"all_reduce": "count", "reduce_scatter": "recv_count", "all_gather": "send_count",
              "broadcast": "count"}


def _call(comm, method, **changes):
    kwargs = dict(VALID[method], **changes)
    return getattr(comm, method)(**kwargs)


@pytest.mark.parametrize("method", sorted(VALID))
def test_valid_arguments_reach_the_alive_check(method):
    comm = _C.NcclComm._unconnected(2, 1)
    with pytest.raises(RuntimeError, match="never connected"):
        _call(comm, method)
    # positionally too, in the documented order
    with pytest.raises(RuntimeError, match="never connected"):
        getattr(comm, method)(*VALID[method].values())
    # dtypes by name and as torch names; every op; count 0 with null pointers
    for dtype in DTYPES + ("torch.bfloat16",):
        with pytest.raises(RuntimeError, match="never connected"):
            _call(comm, method, dtype=dtype)
    if "op" in VALID[method]:
        for op in OPS:
            with pytest.raises(RuntimeError, match="never connected"):
                _call(comm, method, op=op)
    with pytest.raises(RuntimeError, match="never connected"):
        _call(comm, method, send_ptr=0, recv_ptr=0, **{COUNT_NAME[method]: 0})


BAD_COMMON = [
    (dict(dtype="int8"), TypeError, "float32, bfloat16 or float16"),
    (dict(dtype="float64"), TypeError, "float32, bfloat16 or float16"),
    (dict(dtype=7), TypeError, "float32, bfloat16 or float16"),
    (dict(send_ptr=0), ValueError, "send_ptr is 0"),
    (dict(recv_ptr=0), ValueError, "recv_ptr is 0"),
    (dict(send_ptr=-8), ValueError, "non-negative address"),
    (dict(recv_ptr=-(2**70)), ValueError, "non-negative address"),
    (dict(send_ptr=2**64), OverflowError, "64-bit address"),
    (dict(send_ptr=1.5), TypeError, "send_ptr must be an int"),
    (dict(recv_ptr="0x10"), TypeError, "recv_ptr must be an int"),
    (dict(recv_ptr=None), TypeError, "recv_ptr must be an int"),
    (dict(stream=None), TypeError, "stream must be an int"),
    (dict(stream=-1), ValueError, "non-negative address"),
    (dict(recv_ptr=2**64 - 16), OverflowError, "past the end of the address space"),
]


@pytest.mark.parametrize("method", sorted(VALID))
@pytest.mark.parametrize("change, error, match", BAD_COMMON,
                         ids=[f"{next(iter(c))}={next(iter(c.values()))!r}" for c, _, _ in BAD_COMMON])
def test_bad_common_arguments_raise(method, change, error, match):
    comm = _C.NcclComm._unconnected(2, 1)
    with pytest.raises(error, match=match):
        _call(comm, method, **change)


@pytest.mark.parametrize("method", sorted(VALID))
def test_bad_counts_raise(method):
    comm = _C.NcclComm._unconnected(2, 1)
    name = COUNT_NAME[method]
    with pytest.raises(ValueError, match=f"{name} must be >= 0"):
        _call(comm, method, **{name: -1})
    with pytest.raises(TypeError, match=f"{name} must be an integer"):
        _call(comm, method, **{name: 4.0})
    with pytest.raises(ValueError, match="int64"):
        _call(comm, method, **{name: 2**64})
    with pytest.raises(OverflowError, match="overflow the address space"):
        _call(comm, method, **{name: 2**62})


@pytest.mark.parametrize("method", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("op, error", [("prod", ValueError), ("SUM", ValueError), ("", ValueError),
                                       (0, TypeError), (None, TypeError)])
def test_bad_ops_raise(method, op, error):
    comm = _C.NcclComm._unconnected(2, 1)
    with pytest.raises(error, match="'sum', 'avg', 'max' or 'min'"):
        _call(comm, method, op=op)


def test_broadcast_root_and_send_rules():
    root_comm = _C.NcclComm._unconnected(2, 1)        # rank 1
    for root in (-1, 2, 2**40):
        with pytest.raises(ValueError, match="root must be in"):
            _call(root_comm, "broadcast", root=root)
    with pytest.raises(TypeError, match="root must be an integer"):
        _call(root_comm, "broadcast", root="0")
    # send is read only on the root: elsewhere it may be NULL or anything
    with pytest.raises(ValueError, match="send_ptr is 0"):
        _call(root_comm, "broadcast", root=1, send_ptr=0)
    with pytest.raises(RuntimeError, match="never connected"):
        _call(root_comm, "broadcast", root=0, send_ptr=0)
    with pytest.raises(RuntimeError, match="never connected"):
        _call(root_comm, "broadcast", root=0, send_ptr=RECV + 4)


@pytest.mark.parametrize("method, send, recv, ok", [
    # in place is the only overlap allowed (rank 1, 16 float32 = 64 bytes per rank)
    ("all_reduce", RECV, RECV, True),
    ("all_reduce", RECV + 4, RECV, False),
    ("all_reduce", RECV, RECV + 60, False),
    ("all_reduce", RECV + 64, RECV, True),             # adjacent, not overlapping
    ("broadcast", RECV, RECV, True),
    ("broadcast", RECV + 8, RECV, False),
    ("reduce_scatter", SEND, SEND + 64, True),         # recv = send + rank * chunk
    ("reduce_scatter", SEND, SEND, False),
    ("reduce_scatter", SEND, SEND + 96, False),
    ("reduce_scatter", SEND, SEND + 128, True),        # just past the 128-byte send buffer
    ("all_gather", RECV + 64, RECV, True),             # send = recv + rank * chunk
    ("all_gather", RECV, RECV, False),
    ("all_gather", RECV + 32, RECV, False),
    ("all_gather", RECV - 64, RECV, True),
    ("all_gather", RECV - 60, RECV, False),
])
def test_overlapping_buffers_must_be_exactly_in_place(method, send, recv, ok):
    comm = _C.NcclComm._unconnected(2, 1)
    expected = (RuntimeError, "never connected") if ok else (ValueError, "overlap")
    with pytest.raises(expected[0], match=expected[1]):
        _call(comm, method, send_ptr=send, recv_ptr=recv)


@pytest.mark.parametrize("method", sorted(VALID))
def test_collective_argument_binding(method):
    comm = _C.NcclComm._unconnected(2, 1)
    fn = getattr(comm, method)
    args = list(VALID[method].values())
    with pytest.raises(TypeError, match="missing required argument"):
        fn(*args[:-1])
    with pytest.raises(TypeError, match="at most"):
        fn(*args, 0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fn(*args[:-1], streem=0)
    with pytest.raises(TypeError, match="multiple values"):
        fn(*args, stream=0)


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
@pytest.mark.parametrize("dtype", DTYPES)
def test_world_size_one_round_trip(nccl, dtype):
    import torch
    comm = _cuda_comm()
    try:
        assert comm.alive and comm.state == "alive"
        assert (comm.rank, comm.world_size, comm.device) == (0, 1, 0)
        torch_dtype = getattr(torch, dtype)
        stream = torch.cuda.current_stream().cuda_stream
        x = torch.arange(1, 33, device="cuda", dtype=torch_dtype)
        n = x.numel()

        for op in OPS:
            y = torch.full_like(x, -7)
            comm.all_reduce(x.data_ptr(), y.data_ptr(), n, dtype, op, stream)
            torch.cuda.synchronize()
            assert torch.equal(y, x), op

        z = x.clone()                                   # in place
        comm.all_reduce(z.data_ptr(), z.data_ptr(), n, dtype, "sum", stream)
        torch.cuda.synchronize()
        assert torch.equal(z, x)

        y = torch.full_like(x, -7)
        comm.reduce_scatter(x.data_ptr(), y.data_ptr(), n, dtype, "max", stream)
        torch.cuda.synchronize()
        assert torch.equal(y, x)

        y = torch.full_like(x, -7)
        comm.all_gather(x.data_ptr(), y.data_ptr(), n, dtype, stream)
        torch.cuda.synchronize()
        assert torch.equal(y, x)

        y = torch.full_like(x, -7)
        comm.broadcast(x.data_ptr(), y.data_ptr(), n, dtype, 0, stream)
        torch.cuda.synchronize()
        assert torch.equal(y, x)

        # on a side stream, with the legacy default stream (0), and with nothing to do
        side = torch.cuda.Stream()
        y = torch.full_like(x, -7)
        torch.cuda.synchronize()
        comm.all_reduce(x.data_ptr(), y.data_ptr(), n, dtype, "min", side.cuda_stream)
        side.synchronize()
        assert torch.equal(y, x)
        y = torch.full_like(x, -7)
        torch.cuda.synchronize()
        comm.all_reduce(x.data_ptr(), y.data_ptr(), n, dtype, "sum", 0)
        torch.cuda.synchronize()
        assert torch.equal(y, x)
        comm.all_reduce(x.data_ptr(), y.data_ptr(), 0, dtype, "sum", stream)

        assert comm.check() is None
    finally:
        comm.destroy()
    assert not comm.alive and comm.state == "destroyed"
    comm.destroy()
    comm.abort()
    assert comm.state == "destroyed"
    with pytest.raises(RuntimeError, match="destroyed"):
        comm.all_reduce(x.data_ptr(), x.data_ptr(), n, dtype, "sum", stream)
    with pytest.raises(RuntimeError, match="destroyed"):
        comm.check()
    # arguments are still checked first
    with pytest.raises(ValueError, match="count must be >= 0"):
        comm.all_reduce(x.data_ptr(), x.data_ptr(), -1, dtype, "sum", stream)


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
        comm.broadcast(x.data_ptr(), x.data_ptr(), 4, "float32", 0, 0)


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
    # host pointer is an ncclInvalidArgument, which must abort the communicator.
    proc = _run_child(f"""
        import json
        import torch
        from rlhfz import _C
        _C.nccl_load({nccl!r})
        torch.cuda.set_device(0)
        comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0)
        host = torch.ones(64)
        device = torch.zeros(64, device="cuda")
        try:
            comm.all_reduce(host.data_ptr(), device.data_ptr(), 64, "float32", "sum",
                            torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            result = {{"raised": None}}
        except RuntimeError as error:
            result = {{"raised": str(error)}}
        result["state"] = comm.state
        try:
            comm.all_reduce(device.data_ptr(), device.data_ptr(), 64, "float32", "sum", 0)
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
    stream = torch.cuda.current_stream().cuda_stream
    checks = {}
    for name in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, name)
        x = torch.full((8,), float(rank + 1), device="cuda", dtype=dtype)
        for op, want in (("sum", 3.0), ("avg", 1.5), ("max", 2.0), ("min", 1.0)):
            y = torch.empty_like(x)
            comm.all_reduce(x.data_ptr(), y.data_ptr(), 8, name, op, stream)
            torch.cuda.synchronize()
            checks[f"all_reduce {op} {name}"] = bool((y == want).all())
        send = torch.arange(8, device="cuda", dtype=dtype) + 10 * rank
        y = torch.empty(4, device="cuda", dtype=dtype)
        comm.reduce_scatter(send.data_ptr(), y.data_ptr(), 4, name, "sum", stream)
        torch.cuda.synchronize()
        want = (2 * torch.arange(8, dtype=torch.float32) + 10)[4 * rank:4 * rank + 4]
        checks[f"reduce_scatter {name}"] = bool((y.float().cpu() == want).all())
        mine = torch.full((4,), float(rank), device="cuda", dtype=dtype)
        y = torch.empty(8, device="cuda", dtype=dtype)
        comm.all_gather(mine.data_ptr(), y.data_ptr(), 4, name, stream)
        torch.cuda.synchronize()
        checks[f"all_gather {name}"] = y.float().cpu().tolist() == [0.0] * 4 + [1.0] * 4
        y = torch.full((8,), -1.0, device="cuda", dtype=dtype)     # in place: this rank's slot
        y[4 * rank:4 * rank + 4] = rank + 5
        comm.all_gather(y[4 * rank:].data_ptr(), y.data_ptr(), 4, name, stream)
        torch.cuda.synchronize()
        checks[f"all_gather in place {name}"] = y.float().cpu().tolist() == [5.0] * 4 + [6.0] * 4
        y = torch.full((8,), float(rank + 40), device="cuda", dtype=dtype)
        comm.broadcast(y.data_ptr(), y.data_ptr(), 8, name, 1, stream)
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
