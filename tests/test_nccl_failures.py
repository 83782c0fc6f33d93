"""How rlhfz._C's native NCCL engine fails, on the simulated build's NCCL
stand-in: libraries that cannot be used, a lost library table, and
communicators that are destroyed, aborted, leaked, used from two threads, or
broken by an error NCCL reports at once or later.

A library loads once per process, so each loading story runs in a child
process of its own, with the environment it needs (RLHFZ_NCCL_LIBRARY, and
RLHFZ_NCCL_SIM_VERSION, with which the stand-in poses as an older NCCL).
Every communicator's shared-memory segment must be gone afterwards.
"""
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import rlhfz
from rlhfz import _C

CHILD_TIMEOUT_S = 60
UNIQUE_ID_BYTES = 128


def _stand_in():
    info = rlhfz.build_info()
    path = info["nccl_library"] or ""
    return path if info["cuda"] == "sim" and path.endswith("_sim/libnccl.so.2") else None


STAND_IN = _stand_in()
pytestmark = pytest.mark.skipif(STAND_IN is None,
                                reason="needs the simulated build with its NCCL stand-in "
                                       "(python3 tools/sim/run.py)")

# What every child runs first.
PRELUDE = r'''
import ctypes, gc, json, os, sys, time
import numpy as np
from rlhfz import _C

def raised(call):
    try:
        call()
    except Exception as error:
        return [type(error).__name__, str(error)]
    return None

def segment(unique_id):
    return "/dev/shm" + unique_id[16:80].split(b"\0", 1)[0].decode()

def floats(buffer):
    raw = (ctypes.c_char * buffer.nbytes).from_address(
        _C.cuda_host_alias(buffer.address, buffer.nbytes))
    return np.frombuffer(raw, dtype=np.float32)
'''


def run_child(code, *args, env=None):
    child_env = dict(os.environ)
    child_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
                          env=child_env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- loading the library ---------------------------------------------------------------------

LOAD_SEQUENCE = r'''
import rlhfz
stand_in, cudasim = sys.argv[1], sys.argv[2]
out = {"rlhfz": rlhfz.__file__}

def attempt(*args):
    try:
        return {"loaded": _C.nccl_load(*args)}
    except RuntimeError as error:
        return {"error": str(error)}

# no RLHFZ_NCCL_LIBRARY: the path given, then the linker's search
long_path = "/nonexistent" + ("/" + "d" * 250) * 10 + "/libnccl.so.2"
out["long_path"] = long_path
out["long"] = attempt(long_path)
out["missing"] = attempt("/nonexistent/libnccl.so.2")
# a library without NCCL's symbols
os.environ["RLHFZ_NCCL_LIBRARY"] = cudasim
out["no_symbols"] = attempt()
out["no_symbols_version"] = raised(_C.nccl_version)
# the stand-in, posing as NCCL 2.9.3
os.environ["RLHFZ_NCCL_LIBRARY"] = stand_in
os.environ["RLHFZ_NCCL_SIM_VERSION"] = "20903"
out["old"] = attempt()
out["old_unique_id"] = raised(_C.nccl_unique_id)
# nothing of the failed loads stuck: the same library, now new enough, loads
del os.environ["RLHFZ_NCCL_SIM_VERSION"]
out["fixed"] = attempt()
out["version"] = _C.nccl_version()
print(json.dumps(out))
'''


def test_failed_loads_say_why_and_leave_nothing_loaded(tmp_path):
    # rlhfz._C finds the stand-in beside it (its run path holds rlhfz/_sim), so
    # the child imports a copy of the package without it: a machine with no NCCL
    package = tmp_path / "rlhfz"
    shutil.copytree(os.path.dirname(rlhfz.__file__), package,
                    ignore=shutil.ignore_patterns("__pycache__", "libnccl.so*"))
    cudasim = str(package / "_sim" / "libcudasim.so")      # the runtime the copy runs on
    out = run_child(LOAD_SEQUENCE, STAND_IN, cudasim,
                    env={"RLHFZ_NCCL_LIBRARY": "", "PYTHONPATH": str(tmp_path)})
    assert out["rlhfz"] == str(package / "__init__.py")
    # every attempt is named, the dlerror text bounded: a path of 2.5 kB fills it
    long_error = out["long"]["error"]
    assert long_error.startswith("NCCL (libnccl.so.2) could not be loaded: ")
    assert out["long_path"][:1500] in long_error
    assert "libnccl.so.2: cannot open" not in long_error and len(long_error) < 2048 + 200
    assert long_error.endswith("or set RLHFZ_NCCL_LIBRARY to the path of a libnccl.so.2")
    missing = out["missing"]["error"]
    assert "/nonexistent/libnccl.so.2: cannot open shared object file" in missing
    assert "; libnccl.so.2: cannot open shared object file" in missing
    assert "Install the nvidia-nccl-cu13 (or -cu12) wheel" in missing
    for key in ("no_symbols", "no_symbols_version"):
        text = out[key]["error"] if key == "no_symbols" else out[key][1]
        assert text == ("the NCCL library libnccl.so.2 has no symbol ncclGetVersion (rlhfz needs "
                        "NCCL >= 2.10)"), key
    assert out["old"]["error"] == (f"the NCCL library {os.path.realpath(STAND_IN)} is version "
                                   "20903: rlhfz needs NCCL >= 2.10 (21000), for bfloat16 and "
                                   "the average reduction")
    kind, text = out["old_unique_id"]
    assert kind == "RuntimeError" and "is version 20903" in text
    assert out["fixed"] == {"loaded": os.path.realpath(STAND_IN)}
    assert out["version"] == _C.nccl_version() >= 21000


PRELOADED = r'''
import shutil, tempfile
stand_in = sys.argv[1]
# a copy of the stand-in loaded before rlhfz looks, then deleted from disk
folder = tempfile.mkdtemp()
copy = os.path.join(folder, "libnccl.so.2")
shutil.copy(stand_in, copy)
ctypes.CDLL(copy)
os.remove(copy)
os.rmdir(folder)
out = {"copy": copy, "loaded": _C.nccl_load("/also/not/there/libnccl.so.2")}
out["version"] = _C.nccl_version()
out["unique_id"] = len(_C.nccl_unique_id())
print(json.dumps(out))
'''


def test_a_copy_already_in_the_process_wins_even_once_deleted():
    # RLHFZ_NCCL_LIBRARY and the path both name files that do not exist: the
    # copy in the process is taken before either is tried
    out = run_child(PRELOADED, STAND_IN,
                    env={"RLHFZ_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"})
    assert out["loaded"] == out["copy"] and not os.path.exists(out["copy"])
    assert out["version"] >= 21000 and out["unique_id"] == UNIQUE_ID_BYTES


def other_capsule():
    """A capsule, but not one of rlhfz's."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.c_void_p(8), b"someone.else", None)


def test_a_lost_or_replaced_library_table_is_named():
    version = _C.nccl_version()
    saved = _C._nccl_library
    calls = [_C.nccl_version, _C.nccl_unique_id, _C.nccl_load,
             lambda: _C.NcclComm(bytes(UNIQUE_ID_BYTES), 1, 0, 0)]
    try:
        del _C._nccl_library
        for call in calls:
            with pytest.raises(RuntimeError, match=r"rlhfz._C has lost its NCCL library table "
                                                   r"\(_nccl_library was deleted\)"):
                call()
        for impostor in (object(), other_capsule()):
            _C._nccl_library = impostor
            for call in calls:
                with pytest.raises(RuntimeError, match=r"rlhfz._C._nccl_library is not rlhfz's "
                                                       r"NCCL library table \(it was replaced\)"):
                    call()
    finally:
        _C._nccl_library = saved
    assert _C.nccl_version() == version


# ---- arguments that never reach NCCL ---------------------------------------------------------

def test_unusual_argument_objects_are_refused():
    strided = memoryview(bytes(2 * UNIQUE_ID_BYTES))[::2]
    with pytest.raises(BufferError, match="not C-contiguous"):
        _C.NcclComm(strided, 1, 0, 0)
    with pytest.raises(TypeError, match=r"_unconnected\(\) missing required argument 'rank'"):
        _C.NcclComm._unconnected(2)

    class BadProducer:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kwargs):
            raise ArithmeticError("no tensor here")

    class BadStream:
        @property
        def cuda_stream(self):
            raise ArithmeticError("no stream here")
    comm = _C.NcclComm._unconnected(2, 1)
    view = _C.Buffer(64, "device").view("float32")
    # what the objects raise goes through unchanged
    with pytest.raises(ArithmeticError, match="no tensor here"):
        comm.all_reduce(BadProducer(), view, "sum")
    with pytest.raises(ArithmeticError, match="no tensor here"):
        comm.broadcast(view, BadProducer(), 0)
    with pytest.raises(ArithmeticError, match="no stream here"):
        comm.broadcast(view, view, 0, stream=BadStream())
    assert comm.state == "unconnected"


# ---- communicators ------------------------------------------------------------------------------

LIFECYCLE = r'''
out = {}
buf = _C.Buffer(4 * 64, "device")
args = (buf.view("float32"), buf.view("float32"))

def connect(device=0):
    return _C.NcclComm(_C.nccl_unique_id(), 1, 0, device)

# destroy, then everything else
comm = connect()
out["alive"] = comm.state
comm.all_reduce(*args, "sum", stream=0)
comm.check()
comm.destroy()
out["destroyed"] = comm.state
out["reduce_after_destroy"] = raised(lambda: comm.all_reduce(*args, "sum", stream=0))
out["check_after_destroy"] = raised(comm.check)
comm.abort()
comm.destroy()
out["destroyed_still"] = comm.state

# abort, then everything else
comm = connect()
comm.abort()
out["aborted"] = comm.state
out["broadcast_after_abort"] = raised(lambda: comm.broadcast(*args, 0, stream=0))
comm.destroy()
comm.abort()
out["aborted_still"] = comm.state

# the runtime refuses to queue the collective: NCCL reports it, the comm is aborted
comm = connect()
stream = _C.CudaStream(0)
_C.cuda_sim_inject("cudaLaunchHostFunc:1")
out["queue_failure"] = raised(lambda: comm.all_reduce(*args, "sum", stream=stream))
_C.cuda_sim_inject("")
out["queue_failure_state"] = comm.state
out["after_queue_failure"] = raised(lambda: comm.all_reduce(*args, "sum", stream=stream))
stream.synchronize()

# init cannot ask the runtime for the current device
uid = _C.nccl_unique_id()
_C.cuda_sim_inject("cudaGetDevice:1")
out["init_failure"] = raised(lambda: _C.NcclComm(uid, 1, 0, 0))
_C.cuda_sim_inject("")
out["init_failure_segment_left"] = os.path.exists(segment(uid))

# device 1 named, device 0 current: NCCL bound it to device 0, so it is refused and aborted
uid = _C.nccl_unique_id()
out["wrong_device"] = raised(lambda: _C.NcclComm(uid, 1, 0, 1))
out["wrong_device_segment_left"] = os.path.exists(segment(uid))
_C.cuda_set_device(1)
comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 1)
out["right_device"] = [comm.device, comm.state]
comm.destroy()
_C.cuda_set_device(0)

# a live communicator freed: leaked with a ResourceWarning, never waited for
import warnings
comm = connect()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start = time.monotonic()
    del comm
    gc.collect()
    out["leak_seconds"] = time.monotonic() - start
out["leak_warnings"] = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
# ... and where warnings are errors, the error goes to sys.unraisablehook
comm = connect()
unraisable = []
sys.unraisablehook = lambda u: unraisable.append([type(u.exc_value).__name__, str(u.exc_value)])
with warnings.catch_warnings():
    warnings.simplefilter("error")
    del comm
    gc.collect()
sys.unraisablehook = sys.__unraisablehook__
out["leak_unraisable"] = unraisable
print(json.dumps(out))
'''


def test_communicator_lifecycle_and_errors():
    out = run_child(LIFECYCLE, env={"RLHFZ_SIM_DEVICES": "2"})
    assert out["alive"] == "alive" and out["destroyed"] == "destroyed"
    assert out["reduce_after_destroy"] == [
        "RuntimeError", "NcclComm.all_reduce: the communicator (rank 0 of 1) was destroyed"]
    assert out["check_after_destroy"] == [
        "RuntimeError", "NcclComm.check: the communicator (rank 0 of 1) was destroyed"]
    assert out["destroyed_still"] == "destroyed"
    assert out["aborted"] == "aborted" and out["aborted_still"] == "aborted"
    assert out["broadcast_after_abort"] == [
        "RuntimeError", "NcclComm.broadcast: the communicator (rank 0 of 1) was aborted by abort()"]

    kind, text = out["queue_failure"]
    assert kind == "RuntimeError" and "nccl_comm.c:" in text
    assert ("ncclAllReduce (NcclComm.all_reduce, rank 0 of 1; the communicator is aborted) failed: "
            "ncclUnhandledCudaError (1): unhandled cuda error") in text
    assert "last error: ncclAllReduce: cudaLaunchHostFunc failed: invalid argument" in text
    assert out["queue_failure_state"] == "aborted"
    assert out["after_queue_failure"] == [
        "RuntimeError", "NcclComm.all_reduce: the communicator (rank 0 of 1) was aborted after an "
                        "error (ncclAllReduce: ncclUnhandledCudaError)"]

    kind, text = out["init_failure"]
    assert kind == "RuntimeError"
    assert ("ncclCommInitRankConfig (rank 0 of 1, device 0) failed: ncclUnhandledCudaError (1)"
            in text)
    assert "cudaGetDevice failed: invalid argument" in text
    assert out["init_failure_segment_left"] is False

    assert out["wrong_device"] == [
        "ValueError", "NcclComm: device=1 was given, but CUDA device 0 was current, and NCCL bound "
                      "the communicator to it: make the device current first "
                      "(torch.cuda.set_device(1))"]
    assert out["wrong_device_segment_left"] is False
    assert out["right_device"] == [1, "alive"]

    assert out["leak_warnings"] == ["NcclComm (rank 0 of 1, device 0) was never destroyed: its "
                                    "NCCL communicator is leaked; call destroy() or abort()"]
    assert out["leak_seconds"] < 5
    assert len(out["leak_unraisable"]) == 1
    kind, text = out["leak_unraisable"][0]
    assert kind == "ResourceWarning" and "was never destroyed" in text


KEPT_BORROWS = r"""
import torch
comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0)
stream = _C.CudaStream(0)
n = 1024
buf, out_buf = _C.Buffer(4 * n, "device"), _C.Buffer(4 * n, "device")
floats(buf)[:] = 2.0
views = (out_buf.view("float32"), out_buf.view("float32"))
out = {}

def collective_on_a_tensor(**kwargs):
    # torch's CPU tensor over the host alias: device memory on the simulator,
    # borrowed through DLPack; its exports count says whether it is still held
    tensor = torch.from_dlpack(buf.view("float32"))
    comm.all_reduce(tensor, out_buf.view("float32"), "sum", **kwargs)

# the stream is held: the collective waits, and so does the borrowed tensor
token = _C.cuda_sim_hold(stream)
collective_on_a_tensor(stream=stream)
gc.collect()
out["held_while_queued"] = buf.exports
_C.cuda_sim_release(token)
stream.synchronize()
comm.all_reduce(*views, "sum", stream=stream)        # the next call lets go of what is done
out["after_the_next_call"] = buf.exports
out["result"] = bool((floats(out_buf) == 2.0).all())

# the same, let go by cuda_synchronize
token = _C.cuda_sim_hold(stream)
collective_on_a_tensor(stream=stream)
_C.cuda_sim_release(token)
_C.cuda_synchronize(0)
out["after_synchronize"] = buf.exports

# refused by NCCL: nothing is queued, so nothing is kept
_C.cuda_sim_inject("cudaLaunchHostFunc:1")
out["refused"] = raised(lambda: collective_on_a_tensor(stream=stream))
_C.cuda_sim_inject("")
gc.collect()
out["after_refusal"] = buf.exports
out["state"] = comm.state
print(json.dumps(out))
"""


def test_a_borrowed_tensor_is_kept_until_its_collective_is_done():
    """The simulator's twin of test_nccl's GPU test: a tensor NcclComm
    borrowed through DLPack stays alive (its producer's export is not
    released) until the event recorded after the collective is done, and is
    let go at the next call or synchronize; a refused collective keeps
    nothing."""
    out = run_child(KEPT_BORROWS)
    assert out["held_while_queued"] == 1
    assert out["after_the_next_call"] == 0 and out["result"] is True
    assert out["after_synchronize"] == 0
    kind, text = out["refused"]
    assert kind == "RuntimeError" and "ncclAllReduce (NcclComm.all_reduce" in text
    assert out["after_refusal"] == 0 and out["state"] == "aborted"


TWO_RANKS = r'''
import threading
rank, folder = int(sys.argv[1]), sys.argv[2]

def publish(name, data=b""):
    with open(os.path.join(folder, name + ".part"), "wb") as f:
        f.write(data)
    os.replace(os.path.join(folder, name + ".part"), os.path.join(folder, name))

def wait_for(name):
    path, deadline = os.path.join(folder, name), time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(name)
        time.sleep(0.005)
    with open(path, "rb") as f:
        return f.read()

if rank == 0:
    uid = _C.nccl_unique_id()
    publish("uid", uid)
else:
    uid = wait_for("uid")
_C.cuda_set_device(rank)          # a device per rank: NCCL takes no two ranks on one
comm = _C.NcclComm(uid, 2, rank, rank)
n = 256
buf = _C.Buffer(4 * n, "device", device=rank)
data, nothing = buf.view("float32"), buf.view("float32", 0, (0,))
x = floats(buf)
x[:] = rank + 1
out = {"segment": segment(uid)}

# one thread inside a collective (on the default stream, so in that thread
# until the peer joins): a second collective or a destroy must not go in
if rank == 0:
    inside = {}

    def reduce():
        # a probe below may be inside for an instant: then try again
        while True:
            try:
                comm.all_reduce(data, data, "sum")
                inside["done"] = True
                return
            except RuntimeError as error:
                if "another thread is inside" not in str(error):
                    inside["error"] = str(error)
                    return
            time.sleep(0.001)

    thread = threading.Thread(target=reduce)
    thread.start()
    refused, deadline = None, time.monotonic() + 20
    while refused is None and time.monotonic() < deadline:
        # a call with nothing to do gets as far as the check, and no further
        refused = raised(lambda: comm.all_reduce(nothing, nothing, "sum"))
        time.sleep(0.01)
    out["second_collective"] = refused
    out["destroy_inside"] = raised(comm.destroy)
    out["state_inside"] = comm.state
    publish("go")
    thread.join(30)
    out["inside"] = inside
else:
    wait_for("go")
    comm.all_reduce(data, data, "sum")
out["reduced"] = bool((x == 3).all())
comm.check()

# the ranks disagree on the count: NCCL notices it on the stream, and destroy
# then aborts instead of waiting, and says why (or the call itself, where
# the non-blocking communicator's poll after it already sees the error)
stream = _C.CudaStream(rank)
part = data if rank == 0 else buf.view("float32", 0, (n // 2,))
failed_call = raised(lambda: comm.all_reduce(part, part, "sum", stream=stream))
stream.synchronize()
out["destroy_after_async_error"] = failed_call or raised(comm.destroy)
out["state"] = comm.state
print(json.dumps(out))
'''


def test_two_threads_and_an_asynchronous_error(tmp_path):
    folder = tempfile.mkdtemp(dir=tmp_path)
    code = PRELUDE + textwrap.dedent(TWO_RANKS)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), folder],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RLHFZ_SIM_DEVICES="2"))
             for rank in range(2)]
    outputs = []
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    results = []
    for rank, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{stdout}\n{stderr[-5000:]}"
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    first = results[0]
    assert first["second_collective"] == [
        "RuntimeError", "NcclComm.all_reduce: another thread is inside a collective on this "
                        "communicator; NCCL communicators must not be used from two threads at "
                        "once"]
    assert first["destroy_inside"] == [
        "RuntimeError", "NcclComm.destroy: another thread is inside a collective on this "
                        "communicator; wait for it, or call abort()"]
    assert first["state_inside"] == "alive" and first["inside"] == {"done": True}
    for rank, result in enumerate(results):
        assert result["reduced"] is True, rank
        kind, text = result["destroy_after_async_error"]
        assert kind == "RuntimeError", rank
        assert (f"an asynchronous NCCL operation (ncclCommGetAsyncError) (NcclComm.destroy, rank "
                f"{rank} of 2; the communicator is aborted) failed: ncclInvalidUsage (5)" in text
                or f"ncclAllReduce (NcclComm.all_reduce, rank {rank} of 2; the communicator is "
                   f"aborted) failed: ncclInvalidUsage (5)" in text), text
        assert result["state"] == "aborted", rank
        assert not os.path.exists(result["segment"]), rank


BEFORE_2_14 = r'''
_C.nccl_load()
out = {"version": _C.nccl_version()}
uid = _C.nccl_unique_id()
_C.cuda_sim_inject("cudaGetDevice:1")
out["init_failure"] = raised(lambda: _C.NcclComm(uid, 1, 0, 0, timeout=5))
_C.cuda_sim_inject("")
out["init_failure_segment_left"] = os.path.exists(segment(uid))
comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0, timeout=5)
buf = _C.Buffer(4 * 8, "device", device=0)
floats(buf)[:] = 3.0
comm.all_reduce(buf.view("float32"), buf.view("float32"), "sum", stream=0)
_C.cuda_synchronize(0)
out["sum"] = floats(buf).tolist()
comm.destroy()
out["state"] = comm.state
print(json.dumps(out))
'''


def test_before_nccl_2_14_init_blocks_through_nccl_comm_init_rank():
    """NCCL 2.10 to 2.13 have no ncclCommInitRankConfig: the communicator is
    made by the blocking ncclCommInitRank, and works as before."""
    out = run_child(BEFORE_2_14, env={"RLHFZ_NCCL_SIM_VERSION": "21305"})
    assert out["version"] == 21305
    kind, text = out["init_failure"]
    assert kind == "RuntimeError"
    assert "ncclCommInitRank (rank 0 of 1, device 0) failed: ncclUnhandledCudaError (1)" in text
    assert out["init_failure_segment_left"] is False
    assert out["sum"] == [3.0] * 8 and out["state"] == "destroyed"


IN_PROGRESS = r'''
import threading
_C.nccl_load()
buf = _C.Buffer(4 * 8, "device", device=0)
data = buf.view("float32")
out = {}

# NCCL leaves the call in progress past the timeout: polled, then aborted
os.environ["RLHFZ_NCCL_SIM_SETTLE_US"] = str(60e6)
comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0, timeout=1)
started = time.monotonic()
out["timed_out"] = raised(lambda: comm.all_reduce(data, data, "sum", stream=0))
out["timed_out_s"] = time.monotonic() - started
out["timed_out_state"] = comm.state
out["after_timeout"] = raised(lambda: comm.all_reduce(data, data, "sum", stream=0))

# abort() from another thread while a call is polled: the poll lets go first
comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0, timeout=60)
result = {}

def reduce():
    result["raised"] = raised(lambda: comm.all_reduce(data, data, "sum", stream=0))
    result["at"] = time.monotonic()

thread = threading.Thread(target=reduce)
thread.start()
time.sleep(0.3)
started = time.monotonic()
comm.abort()
out["abort_s"] = time.monotonic() - started
thread.join(10)
out["poll_ended_s"] = result["at"] - started
out["aborted_call"] = result["raised"]
out["aborted_state"] = comm.state
print(json.dumps(out))
'''


def test_a_call_left_in_progress_times_out_and_an_abort_ends_its_poll():
    """A non-blocking communicator's call stays ncclInProgress (the stand-in
    holds it for a minute): the poll gives up at the timeout, aborting the
    communicator; abort() from another thread (the watchdog's) stops a poll
    before it frees the communicator under it."""
    out = run_child(IN_PROGRESS, env={"RLHFZ_SIM_DEVICES": "1"})
    kind, text = out["timed_out"]
    assert kind == "TimeoutError"
    assert ("ncclAllReduce (NcclComm.all_reduce, rank 0 of 1) was still in progress after 1 s; "
            "the communicator is aborted") in text
    assert 1 <= out["timed_out_s"] < 5 and out["timed_out_state"] == "aborted"
    assert out["after_timeout"][0] == "RuntimeError" and "was aborted" in out["after_timeout"][1]
    assert out["abort_s"] < 2 and out["poll_ended_s"] < 2
    assert out["aborted_call"] == [
        "RuntimeError", "ncclAllReduce (NcclComm.all_reduce, rank 0 of 1) was still in progress "
                        "when the communicator was aborted by abort()"]
    assert out["aborted_state"] == "aborted"
