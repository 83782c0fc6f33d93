"""The NCCL stand-in of the simulated build (sim/nccl/ -> rlhfz/_sim/libnccl.so.2),
driven through rlhfz._C.NcclComm as rlhfz drives a real NCCL.

Every rank is a process of its own (the same interpreter, so the same
installed rlhfz), meeting the others through a unique id that rank 0 writes
to a file. Device memory is an rlhfz device Buffer, filled and read through
numpy's view of the simulator's host alias of it (no torch: the children
start in a tenth of a second, and share the cores without torch's thread
pool spinning). Each child has a timeout, and every test checks that the
communicator's shared-memory segment, whose name the unique id carries, is
gone from /dev/shm afterwards.

Covered: every collective x float32/bfloat16/float16 x sum/avg/max/min, in
and out of place, 1, 1023 and 100_003 elements, at world sizes 2 and 3,
against a float64 reference (bitwise for all-gather, broadcast, max and
min; the same bits on every rank where every rank gets the same result);
stream order against a copy, kernels and an event; groups; argument errors;
a rank killed mid-collective (the others hang until they abort); and the
matrix again under RLHFZ_SIM_CHAOS with a staging area of one page.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import rlhfz


def _stand_in_loaded() -> bool:
    info = rlhfz.build_info()
    return info["cuda"] == "sim" and (info["nccl_library"] or "").endswith("_sim/libnccl.so.2")


pytestmark = pytest.mark.skipif(not _stand_in_loaded(),
                                reason="needs the simulated build with its NCCL stand-in "
                                       "(python3 tools/sim/run.py)")

CHILD_TIMEOUT_S = 50
# children that build DLPack capsules by hand import tests/dlpack_handmade.py
WITH_TEST_HELPERS = {"PYTHONPATH": os.pathsep.join(
    [os.path.dirname(os.path.abspath(__file__))] +
    ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
UNIQUE_ID_BYTES = 128
# The stand-in's unique id: "rlhfzsim", then at byte 16 the segment's name (sim/nccl/nccl.h).
ID_MAGIC = b"rlhfzsim"
ID_NAME_OFFSET = 16

# What every rank runs first: argv is rank, world size, the unique id's file, params (JSON).
PRELUDE = r'''
import ctypes, json, os, sys, time
import numpy as np
import rlhfz
from rlhfz import _C

RANK, WORLD, ID_PATH = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
# each rank on a device of its own, as NCCL needs (the children get RLHFZ_SIM_DEVICES >= WORLD)
DEVICE = RANK
PARAMS = json.loads(sys.argv[4])
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def unique_id():
    # rank 0 makes it and publishes it atomically; the others wait for the file
    if RANK == 0:
        uid = _C.nccl_unique_id()
        with open(ID_PATH + ".part", "wb") as f:
            f.write(uid)
        os.replace(ID_PATH + ".part", ID_PATH)
        return uid
    while not os.path.exists(ID_PATH):
        time.sleep(0.005)
    with open(ID_PATH, "rb") as f:
        return f.read()


def connect(device=DEVICE):
    _C.cuda_set_device(device)
    return _C.NcclComm(unique_id(), WORLD, RANK, device)


def device_buffer(numel, dtype="float32", device=DEVICE):
    return _C.Buffer(max(numel, 1) * ITEMSIZE[dtype], "device", device=device)


def host_array(buf, dtype="float32", fill=None):
    # numpy's view of a device Buffer, through the simulator's host alias
    raw = (ctypes.c_char * buf.nbytes).from_address(_C.cuda_host_alias(buf.address, buf.nbytes))
    array = np.frombuffer(raw, dtype=dtype)
    if fill is not None:
        array[:] = fill
    return array


def report(result):
    print(json.dumps(result), flush=True)
'''


def _segment_name(unique_id: bytes) -> str:
    assert len(unique_id) == UNIQUE_ID_BYTES and unique_id.startswith(ID_MAGIC)
    return unique_id[ID_NAME_OFFSET:].split(b"\0", 1)[0].decode()


def _run_ranks(tmp_path, world, body, params=None, env=None, timeout=CHILD_TIMEOUT_S):
    """Runs body on `world` ranks at once; returns [(returncode, last JSON line or None,
    stderr)] by rank. Fails the test on a timeout, and if the segment outlived them."""
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"world{world}-", dir=tmp_path))
    id_path = run_dir / "unique_id"
    # a device per rank, as on a GPU machine: NCCL refuses two ranks on one
    child_env = dict(os.environ, RLHFZ_SIM_DEVICES=str(world))
    child_env.update(env or {})
    code = PRELUDE + textwrap.dedent(body)
    procs, outputs = [], []
    for rank in range(world):
        out = open(run_dir / f"rank{rank}.out", "w+")
        err = open(run_dir / f"rank{rank}.err", "w+")
        outputs.append((out, err))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", code, str(rank), str(world), str(id_path),
             json.dumps(params or {})],
            stdout=out, stderr=err, env=child_env, cwd=run_dir))
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for proc, (out, err) in zip(procs, outputs):
        out.seek(0)
        err.seek(0)
        lines = out.read().strip().splitlines()
        stderr = err.read()
        out.close()
        err.close()
        try:
            last = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            last = None
        results.append((proc.returncode, last, stderr))
    if timed_out:
        pytest.fail(f"ranks still running after {timeout} s:\n" + "\n".join(
            f"rank {r} (rc {rc}): {stderr[-3000:]}" for r, (rc, _, stderr) in enumerate(results)))
    if id_path.exists():
        name = _segment_name(id_path.read_bytes())
        assert not os.path.exists("/dev/shm" + name), f"{name} was left in /dev/shm"
    return results


def _all_ok(results):
    """The JSON each rank reported, after checking that every rank exited cleanly."""
    for rank, (rc, result, stderr) in enumerate(results):
        assert rc == 0 and result is not None, f"rank {rank} failed ({rc}):\n{stderr[-5000:]}"
    return [result for _, result, _ in results]


# ---- every collective x dtype x op, against a float64 reference ---------------------------------

MATRIX = r'''
import hashlib

EPS = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
STORED = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}
NAN = {"float32": np.float32("nan"), "bfloat16": np.uint16(0x7FC0), "float16": np.float16("nan")}
SIZES = PARAMS.get("sizes", [1, 1023, 100_003])
DTYPES = PARAMS.get("dtypes", ["float32", "bfloat16", "float16"])
OPS = PARAMS.get("ops", ["sum", "avg", "max", "min"])
COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]

comm = connect()
stream = _C.CudaStream(DEVICE)
failures, digests = [], {}


def encode(x, dtype):
    # float64 -> the stored elements (bfloat16: fp32's top half, rounded to nearest even)
    if dtype != "bfloat16":
        return x.astype(STORED[dtype])
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def decode(stored, dtype):
    if dtype != "bfloat16":
        return stored.astype(np.float64)
    return (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def device_array(numel, dtype):
    # a device view of numel elements and numpy's view of them, NaN until written
    buf = device_buffer(numel, dtype)
    return buf.view(dtype, 0, (numel,)), host_array(buf, STORED[dtype], fill=NAN[dtype])[:numel]


def inputs(case, numel, dtype):
    # every rank's input of a case, the same on every rank: rounded to dtype, as float64
    return [decode(encode(np.random.default_rng(case * 131 + r).random(numel) * 4 - 2, dtype),
                   dtype) for r in range(WORLD)]


def reference(op, xs):
    stacked = np.stack(xs)
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0) / WORLD
    if op == "max":
        return stacked.max(0)
    return stacked.min(0)


def check(name, out, want, dtype, exact):
    got = decode(out, dtype)
    if exact:
        bad = int((got != want).sum())
        if bad:
            failures.append(f"{name}: {bad} of {want.size} elements differ")
        return
    # inputs in [-2, 2]: partial sums within 2 * WORLD, each of WORLD + 1 steps
    # (the avg factor included) rounded to the type
    tol = (WORLD + 2) * EPS[dtype] * 2 * WORLD
    err = float(np.abs(got - want).max())
    if not err <= tol:
        failures.append(f"{name}: max error {err} > {tol}")


def run(case, collective, dtype, op, numel, in_place):
    name = f"{collective}/{dtype}/{op}/{numel}/{'in' if in_place else 'out'}-place"
    per_rank = numel * WORLD if collective == "reduce_scatter" else numel
    xs = inputs(case, per_rank, dtype)
    # every other case on the legacy default stream, which runs it inline
    on = stream if case % 2 == 0 else None
    mine = encode(xs[RANK], dtype)
    root = case % WORLD
    mine_part = (dtype, RANK * numel, (numel,))      # this rank's part of a whole-world view
    if collective == "all_reduce":
        send_view, send = device_array(numel, dtype)
        send[:] = mine
        recv_view, recv = (send_view, send) if in_place else device_array(numel, dtype)
        comm.all_reduce(send_view, recv_view, op, stream=on)
        out, want, exact = recv, reference(op, xs), op in ("max", "min")
    elif collective == "reduce_scatter":
        send_view, send = device_array(numel * WORLD, dtype)
        send[:] = mine
        if in_place:
            recv_view = send_view.buffer.view(*mine_part)
            recv = send[RANK * numel:(RANK + 1) * numel]
        else:
            recv_view, recv = device_array(numel, dtype)
        comm.reduce_scatter(send_view, recv_view, op, stream=on)
        out = recv
        want = reference(op, xs)[RANK * numel:(RANK + 1) * numel]
        exact = op in ("max", "min")
    elif collective == "all_gather":
        recv_view, recv = device_array(numel * WORLD, dtype)
        if in_place:
            send = recv[RANK * numel:(RANK + 1) * numel]
            send_view = recv_view.buffer.view(*mine_part)
        else:
            send_view, send = device_array(numel, dtype)
        send[:] = mine
        comm.all_gather(send_view, recv_view, stream=on)
        out, want, exact = recv, np.concatenate(xs), True
    else:
        send_view, send = device_array(numel, dtype)
        if RANK == root:
            send[:] = mine
        recv_view, recv = (send_view, send) if in_place else device_array(numel, dtype)
        # send is read on the root only: elsewhere every other case passes None
        given = send_view if RANK == root or case % 4 < 2 else None
        comm.broadcast(given, recv_view, root, stream=on)
        out, want, exact = recv, xs[root], True
    stream.synchronize()
    check(name, out, want, dtype, exact)
    if not in_place and collective != "broadcast" and not np.array_equal(send, mine):
        failures.append(f"{name}: the send buffer changed")
    digests[name] = hashlib.sha256(out.tobytes()).hexdigest()


case = 0
for collective in COLLECTIVES:
    for dtype in DTYPES:
        for op in (OPS if collective in ("all_reduce", "reduce_scatter") else ["none"]):
            for numel in SIZES:
                for in_place in (False, True):
                    run(case, collective, dtype, op, numel, in_place)
                    case += 1
comm.check()
comm.destroy()
report({"failures": failures, "digests": digests, "cases": case, "alive": comm.alive})
'''


def _check_matrix(results):
    reports = _all_ok(results)
    for rank, result in enumerate(reports):
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:20]}"
        assert result["alive"] is False
    # where every rank gets the same result, it gets the same bits
    for name, digest in reports[0]["digests"].items():
        if not name.startswith("reduce_scatter"):
            assert all(r["digests"][name] == digest for r in reports), name
    return reports[0]["cases"]


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_dtype_and_op_against_float64(tmp_path, world):
    cases = _check_matrix(_run_ranks(tmp_path, world, MATRIX))
    # 3 dtypes x 3 sizes x 2 placements x (4 ops x 2 reductions + all_gather + broadcast)
    assert cases == 3 * 3 * 2 * (4 * 2 + 2)


LIBRARY_TYPES = r'''
# the types and ops the binding does not offer, through the library's C API
nccl = ctypes.CDLL(rlhfz.build_info()["nccl_library"])
nccl.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


uid = UniqueId.from_buffer_copy(unique_id())
comm = ctypes.c_void_p()
_C.cuda_set_device(DEVICE)
assert nccl.ncclCommInitRank(ctypes.byref(comm), WORLD, uid, RANK) == 0
TYPES = {"int8": (0, np.int8), "uint8": (1, np.uint8), "int32": (2, np.int32),
         "uint32": (3, np.uint32), "int64": (4, np.int64), "uint64": (5, np.uint64),
         "float64": (8, np.float64)}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
failures = []
for name, (code, np_type) in TYPES.items():
    info = np.iinfo(np_type) if name != "float64" else None
    for op, op_code in OPS.items():
        rng = np.random.default_rng(code * 10 + op_code)
        if info is not None:
            # the extremes too, so sums and products wrap
            xs = [rng.integers(info.min, info.max, 257, dtype=np_type, endpoint=True)
                  for _ in range(WORLD)]
            for x in xs:
                x[:2] = (info.max, info.min)
        else:
            xs = [rng.random(257) * 4 - 2 for _ in range(WORLD)]
        buf = _C.Buffer(257 * np.dtype(np_type).itemsize, "device", device=DEVICE)
        got = host_array(buf, np_type)
        got[:] = xs[RANK]
        rc = nccl.ncclAllReduce(buf.address, buf.address, 257, code, op_code, comm, None)
        # the expected bits: rank order, wrapping integers, avg as NCCL computes it
        with np.errstate(over="ignore"):
            if op == "avg" and info is None:
                factor = 1.0 / WORLD
                want = xs[0] * factor
                for x in xs[1:]:
                    want = want + x * factor
            else:
                want = xs[0].copy()
                for x in xs[1:]:
                    want = {"sum": np.add, "avg": np.add, "prod": np.multiply,
                            "max": np.maximum, "min": np.minimum}[op](want, x)
                if op == "avg":   # the wrapped sum, divided toward zero
                    want = np.array([v // WORLD if v >= 0 else -((-v) // WORLD)
                                     for v in want.tolist()]).astype(np_type)
        if rc != 0 or not np.array_equal(got, want):
            failures.append(f"{name}/{op}: rc {rc}, {int((got != want).sum())} elements differ")
report({"failures": failures, "destroy": nccl.ncclCommDestroy(comm)})
'''


def test_library_reduces_integer_and_float64_types_with_every_op(tmp_path):
    for result in _all_ok(_run_ranks(tmp_path, 3, LIBRARY_TYPES)):
        assert result == {"failures": [], "destroy": 0}


# ---- stream order --------------------------------------------------------------------------------

STREAM_ORDER = r'''
comm = connect()
stream = _C.CudaStream(DEVICE)
n = 4099
src_buf, x_buf, y_buf = (device_buffer(n) for _ in range(3))
src, x, y = host_array(src_buf), host_array(x_buf, fill=np.nan), host_array(y_buf, fill=np.nan)
base = np.arange(n, dtype=np.float64)
src[:] = base + RANK

# nothing runs until the stream is released; then the copy, a kernel, the
# collective and another kernel must run in that order
token = _C.cuda_sim_hold(stream)
done = _C.CudaEvent(DEVICE)
x_buf.copy_from(src_buf, stream=stream.handle, non_blocking=True)
_C.cuda_scale_(x_buf.view("float32"), 2.0, stream=stream)
comm.all_reduce(x_buf.view("float32"), y_buf.view("float32"), "sum", stream=stream)
_C.cuda_scale_(y_buf.view("float32"), 0.5, stream=stream)
done.record(stream)
time.sleep(0.3)
held = {"query": done.query(), "y_untouched": bool(np.isnan(y).all())}
_C.cuda_sim_release(token)
done.synchronize()
ok_x = bool((x == 2 * (base + RANK)).all())
ok_y = bool((y == sum(base + r for r in range(WORLD))).all())   # 0.5 * sum of 2 * (base + r)

# a collective waits for work on another stream that an event orders it after
other = _C.CudaStream(DEVICE)
token = _C.cuda_sim_hold(other)
_C.cuda_scale_(x_buf.view("float32"), 3.0, stream=other)
ready = _C.CudaEvent(DEVICE)
ready.record(other)
ready.wait(stream)
comm.all_reduce(x_buf.view("float32"), x_buf.view("float32"), "max", stream=stream)
time.sleep(0.1)
_C.cuda_sim_release(token)
stream.synchronize()
ok_event = bool((x == 6 * (base + WORLD - 1)).all())
comm.destroy()
report({"held": held, "ok_x": ok_x, "ok_y": ok_y, "ok_event": ok_event})
'''


def test_collectives_run_in_stream_order(tmp_path):
    for result in _all_ok(_run_ranks(tmp_path, 2, STREAM_ORDER)):
        assert result == {"held": {"query": False, "y_untouched": True}, "ok_x": True,
                          "ok_y": True, "ok_event": True}


# ---- groups --------------------------------------------------------------------------------------

GROUPS = r'''
nccl = ctypes.CDLL(rlhfz.build_info()["nccl_library"])
comm = connect()
stream = _C.CudaStream(DEVICE)
n = 513
a_buf, b_buf, g_buf = device_buffer(n), device_buffer(n), device_buffer(n * WORLD)
a, b, g = host_array(a_buf, fill=RANK + 1), host_array(b_buf, fill=RANK + 1), host_array(g_buf)
launches = lambda: _C.cuda_sim_calls("cudaLaunchHostFunc")
out = {}

before = launches()
assert nccl.ncclGroupStart() == 0
a_view, b_view, g_view = a_buf.view("float32"), b_buf.view("float32"), g_buf.view("float32")
comm.all_reduce(a_view, a_view, "sum", stream=stream)
assert nccl.ncclGroupStart() == 0                     # nested: only the outer end queues
comm.all_gather(b_view, g_view, stream=stream)
assert nccl.ncclGroupEnd() == 0
out["queued_inside"] = launches() - before
# the communicator is non-blocking: the end says ncclInProgress, and the
# calls settle a moment later (NcclComm queues no groups, so it never polls)
assert nccl.ncclGroupEnd() == 7
time.sleep(0.05)
out["queued_at_end"] = launches() - before
stream.synchronize()
out["ok"] = bool((a == WORLD * (WORLD + 1) / 2).all()) and bool(
    (g == np.repeat(np.arange(1, WORLD + 1), n)).all())

# an invalid call inside a group raises, and the end queues nothing: host
# memory in a capsule that claims to be CUDA memory, which only NCCL can tell
from dlpack_handmade import Handmade
host = Handmade(np.ones(n, dtype=np.float32), shape=(n,), device=(2, DEVICE))
before = launches()
assert nccl.ncclGroupStart() == 0
comm.all_reduce(a_view, a_view, "sum", stream=stream)
try:
    comm.all_reduce(host.capsule, a_view, "sum", stream=stream)
    out["raised"] = None
except RuntimeError as error:
    out["raised"] = str(error)
out["group_end"] = nccl.ncclGroupEnd()
out["queued_after_error"] = launches() - before
out["unmatched_end"] = nccl.ncclGroupEnd()
out["alive"] = comm.alive
report(out)
'''


def test_group_queues_its_calls_at_the_end_in_order(tmp_path):
    for result in _all_ok(_run_ranks(tmp_path, 2, GROUPS, env=WITH_TEST_HELPERS)):
        assert result["queued_inside"] == 0 and result["queued_at_end"] == 2
        assert result["ok"] is True
        assert result["raised"] is not None and "not live device memory" in result["raised"]
        assert result["group_end"] == 4                  # ncclInvalidArgument
        assert result["queued_after_error"] == 0
        assert result["unmatched_end"] == 5               # ncclInvalidUsage
        assert result["alive"] is False                   # the binding aborts after an error


GROUP_STREAMS = r'''
nccl = ctypes.CDLL(rlhfz.build_info()["nccl_library"])
comm = connect()
first, second = _C.CudaStream(DEVICE), _C.CudaStream(DEVICE)
n = 257
a_buf = device_buffer(n)
a = host_array(a_buf, fill=RANK + 1)
a_view = a_buf.view("float32")
launches = lambda: _C.cuda_sim_calls("cudaLaunchHostFunc")
out = {}

# outside a group, a collective on another stream waits for the one before
# it on the communicator, nothing else ordering them (as NCCL orders them)
token = _C.cuda_sim_hold(first)
comm.all_reduce(a_view, a_view, "sum", stream=first)
comm.all_reduce(a_view, a_view, "sum", stream=second)
done = _C.CudaEvent(DEVICE)
done.record(second)
time.sleep(0.2)
out["second_waited"] = not done.query()
_C.cuda_sim_release(token)
done.synchronize()
out["in_issue_order"] = bool((a == WORLD * WORLD * (WORLD + 1) / 2).all())

# inside a group, one communicator's calls on two streams are refused
before = launches()
assert nccl.ncclGroupStart() == 0
comm.all_reduce(a_view, a_view, "sum", stream=first)
try:
    comm.all_reduce(a_view, a_view, "sum", stream=second)
    out["raised"] = None
except RuntimeError as error:
    out["raised"] = str(error)
out["group_end"] = nccl.ncclGroupEnd()
out["queued"] = launches() - before
out["alive"] = comm.alive
report(out)
'''


def test_one_communicators_collectives_run_in_issue_order_across_streams(tmp_path):
    """NCCL makes a collective on a stream other than the communicator's
    last one wait for that one, and so does the stand-in; within a group,
    a second stream for one communicator is refused (ncclInvalidUsage), as
    NCCL 2.10 and 2.11 refuse it: nothing of the group is queued."""
    for result in _all_ok(_run_ranks(tmp_path, 2, GROUP_STREAMS)):
        assert result["second_waited"] is True and result["in_issue_order"] is True, result
        assert result["raised"] is not None and "ncclInvalidUsage" in result["raised"], result
        assert "mixing different streams within a group call" in result["raised"], result
        assert result["group_end"] == 5 and result["queued"] == 0, result    # ncclInvalidUsage
        assert result["alive"] is False, result       # the binding aborts after an error


# ---- argument errors -----------------------------------------------------------------------------

ARGUMENTS = r'''
from dlpack_handmade import Handmade
n = 64
results = {}
launches = lambda: _C.cuda_sim_calls("cudaLaunchHostFunc")


def attempt(name, call):
    # call(comm, stream) on a fresh communicator of one rank: what it raised
    comm = _C.NcclComm(_C.nccl_unique_id(), 1, 0, 0)
    stream = _C.CudaStream(0)
    before = launches()
    try:
        call(comm, stream)
        stream.synchronize()
        results[name] = {"raised": None}
    except Exception as error:
        results[name] = {"raised": type(error).__name__, "text": str(error)}
    results[name]["queued"] = launches() - before
    results[name]["alive"] = comm.alive
    if comm.alive:
        comm.destroy()


_C.cuda_set_device(0)
dev_buf, big_buf, other_buf = device_buffer(n), device_buffer(4 * n), device_buffer(n, device=1)
dev, big, other = dev_buf.view("float32"), big_buf.view("float32"), other_buf.view("float32")
host = _C.Buffer(n * 4, "host")
pinned = _C.Buffer(n * 4, "pinned")
freed = _C.Buffer(n * 4, "device", device=0)
freed_address = freed.address
del freed
alias = _C.cuda_host_alias(dev_buf.address, n * 4)
claims = []


def claimed(address, count=n):
    # a capsule that claims count float32 of CUDA memory at address: what the
    # binding cannot tell from a device pointer, NCCL must
    made = Handmade(np.zeros(1, dtype=np.float32), shape=(count,), device=(2, 0))
    made.managed.dl_tensor.data = address
    claims.append(made)
    return made.capsule


def all_reduce(send, recv):
    return lambda c, st: c.all_reduce(send, recv, "sum", stream=st)


# refused by the binding: nothing queued, the communicator still alive
attempt("host_send", all_reduce(host.view("float32"), dev))
attempt("pinned_recv", all_reduce(dev, pinned.view("float32")))
attempt("other_device_recv", all_reduce(dev, other))
attempt("count_mismatch", all_reduce(dev, big))
attempt("scatter_other_device_recv", lambda c, st: c.reduce_scatter(dev, other, "sum", stream=st))
attempt("gather_sizes", lambda c, st: c.all_gather(dev, big, stream=st))
attempt("bad_root_binding", lambda c, st: c.broadcast(dev, dev, 1, stream=st))
# numpy's view of the host alias (as torch's are on the simulator): the device memory it is
alias_array = host_array(dev_buf, fill=1.0)
attempt("alias_array", all_reduce(alias_array, alias_array))
attempt("valid", all_reduce(dev, dev))

# what only NCCL can tell: the stand-in refuses, the binding aborts the communicator
attempt("host_send_claimed", all_reduce(claimed(host.address), dev))
attempt("pinned_recv_claimed", all_reduce(dev, claimed(pinned.address)))
attempt("alias_send_claimed", all_reduce(claimed(alias), dev))
attempt("other_device_recv_claimed", all_reduce(dev, claimed(other_buf.address)))
attempt("freed_send_claimed", all_reduce(claimed(freed_address), dev))
past = claimed(dev_buf.address, n + 1)
attempt("past_the_end_claimed", all_reduce(past, past))
other_stream = _C.CudaStream(1)
attempt("other_device_stream", lambda c, st: c.all_reduce(dev, dev, "sum", stream=other_stream))
closed_stream = _C.CudaStream(0)
closed_handle = closed_stream.handle
closed_stream.close()
attempt("closed_stream", lambda c, st: c.all_reduce(dev, dev, "sum", stream=closed_handle))
attempt("scatter_other_device_recv_claimed", lambda c, st: c.reduce_scatter(
    dev, claimed(other_buf.address), "sum", stream=st))
attempt("gather_send_past_the_end_claimed", lambda c, st: c.all_gather(
    claimed(dev_buf.address, n + 3), claimed(big_buf.address, n + 3), stream=st))

# the library's own checks, without the binding's in front of them
nccl = ctypes.CDLL(rlhfz.build_info()["nccl_library"])
nccl.ncclGetLastError.restype = ctypes.c_char_p



class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


uid = UniqueId()
assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
comm = ctypes.c_void_p()
assert nccl.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0     # the id goes by value
stream = _C.CudaStream(0)
ptr, count = ctypes.c_void_p(dev_buf.address), ctypes.c_size_t(n)
handle = ctypes.c_void_p(stream.handle)
FLOAT32, SUM = 7, 0
calls = {
    "bad_root": lambda: nccl.ncclBroadcast(ptr, ptr, count, FLOAT32, 1, comm, handle),
    "bad_op": lambda: nccl.ncclAllReduce(ptr, ptr, count, FLOAT32, 9, comm, handle),
    "bad_dtype": lambda: nccl.ncclAllReduce(ptr, ptr, count, 42, SUM, comm, handle),
    "overlap": lambda: nccl.ncclAllReduce(ptr, ctypes.c_void_p(dev_buf.address + 4),
                                          ctypes.c_size_t(n // 2), FLOAT32, SUM, comm, handle),
}
for name, call in calls.items():
    rc = call()
    results["library_" + name] = {"rc": rc, "text": nccl.ncclGetLastError(comm).decode()}
device = ctypes.c_int(-1)
results["cu_device"] = [nccl.ncclCommCuDevice(comm, ctypes.byref(device)), device.value]
results["destroy"] = nccl.ncclCommDestroy(comm)
results["destroyed_handle"] = nccl.ncclCommDestroy(comm)
report(results)
'''


def test_argument_errors_are_refused_before_anything_is_queued(tmp_path):
    (rc, results, stderr), = _run_ranks(tmp_path, 1, ARGUMENTS,
                                        env={"RLHFZ_SIM_DEVICES": "2", **WITH_TEST_HELPERS})
    assert rc == 0 and results is not None, stderr[-5000:]
    # the binding's checks: the communicator stays usable
    refused = {
        "host_send": ("BufferError", "send is in host memory; this kernel needs CUDA device memory"),
        "pinned_recv": ("BufferError", "recv is in pinned memory"),
        "other_device_recv": ("ValueError", "recv is on cuda:1 but the communicator is on cuda:0"),
        "count_mismatch": ("ValueError", "send has 64 elements but recv has 256"),
        "scatter_other_device_recv": ("ValueError", "recv is on cuda:1"),
        "gather_sizes": ("ValueError", "recv has 256 elements but must have world_size (1) times "
                                       "send's 64"),
        "bad_root_binding": ("ValueError", "root must be in [0, world_size) = [0, 1), not 1"),
    }
    for name, (kind, text) in refused.items():
        got = results[name]
        assert got["raised"] == kind and text in got["text"], (name, got)
        assert got["queued"] == 0 and got["alive"] is True, (name, got)
    assert results["alias_array"] == {"raised": None, "queued": 1, "alive": True}
    assert results["valid"] == {"raised": None, "queued": 1, "alive": True}
    # what only NCCL can tell: refused there, and the communicator aborted
    expected_text = {
        "host_send_claimed": "not live device memory",
        "pinned_recv_claimed": "not live device memory",
        "alias_send_claimed": "host alias of device memory",
        "other_device_recv_claimed": "memory of device 1",
        "freed_send_claimed": "not live device memory",
        "past_the_end_claimed": "run past the end",
        "other_device_stream": "belongs to device 1",
        "closed_stream": "not a live CUDA stream",
        "scatter_other_device_recv_claimed": "memory of device 1",
        "gather_send_past_the_end_claimed": "run past the end",
    }
    for name, text in expected_text.items():
        got = results[name]
        assert got["raised"] == "RuntimeError", (name, got)
        assert "ncclInvalidArgument" in got["text"] and text in got["text"], (name, got)
        assert got["queued"] == 0 and got["alive"] is False, (name, got)
    for name, text in [("bad_root", "root 1"), ("bad_op", "op 9"), ("bad_dtype", "datatype 42"),
                       ("overlap", "overlap")]:
        got = results["library_" + name]
        assert got["rc"] == 4 and text in got["text"], (name, got)
    assert results["cu_device"] == [0, 0]
    assert results["destroy"] == 0 and results["destroyed_handle"] == 4


MISMATCH = r'''
comm = connect()
stream = _C.CudaStream(DEVICE)
buf = device_buffer(1024)
host_array(buf, fill=1.0)
# rank 0 reduces 1024 elements, rank 1 only 512: NCCL would hang or mix them up
count = 1024 if RANK == 0 else 512
part = buf.view("float32", 0, (count,))
# the error is asynchronous: the next call that polls the non-blocking
# communicator (the second all_reduce) or check() reports it
try:
    comm.all_reduce(part, part, "sum", stream=stream)
    comm.all_reduce(part, part, "sum", stream=stream)
    stream.synchronize()
    comm.check()
    raised = None
except RuntimeError as error:
    raised = str(error)
report({"raised": raised, "alive": comm.alive})
'''


def test_ranks_calling_different_collectives_break_the_communicator(tmp_path):
    results = _run_ranks(tmp_path, 2, MISMATCH)
    for (_, _, stderr), result in zip(results, _all_ok(results)):
        assert result["raised"] is not None and "ncclInvalidUsage" in result["raised"]
        assert result["alive"] is False
        assert "called different collectives" in stderr


INIT_FAILURES = r'''
try:
    if RANK == 0:
        connect()                           # its peer never joins: it gives up
    else:
        _C.cuda_set_device(DEVICE)
        _C.NcclComm(unique_id(), WORLD + 1, RANK, DEVICE)      # disagrees on the world size
    raised = None
except RuntimeError as error:
    raised = str(error)
report({"raised": raised})
'''


def test_a_failed_init_leaves_nothing_behind(tmp_path):
    start = time.monotonic()
    results = _all_ok(_run_ranks(tmp_path, 2, INIT_FAILURES,
                                 env={"RLHFZ_NCCL_SIM_INIT_TIMEOUT": "1"}))
    assert time.monotonic() - start < 15
    assert "ncclSystemError" in results[0]["raised"] and "timed out" in results[0]["raised"]
    assert "ncclInvalidUsage" in results[1]["raised"] and "nranks=3" in results[1]["raised"]


SHARED_DEVICE = r'''
# PARAMS["devices"][RANK]: the device each rank makes current
started = time.monotonic()
try:
    connect(PARAMS["devices"][RANK])
    raised = None
except RuntimeError as error:
    raised = str(error)
report({"raised": raised, "after_s": time.monotonic() - started})
'''


@pytest.mark.parametrize("devices", [[0, 0], [1, 0, 1]])
def test_two_ranks_on_one_device_are_refused(tmp_path, devices):
    """NCCL's init refuses two ranks on one CUDA device (ncclInvalidUsage,
    "Duplicate GPU detected"); the stand-in refuses it on every rank, at
    once, so none goes on to wait for a peer that has given up."""
    results = _all_ok(_run_ranks(tmp_path, len(devices), SHARED_DEVICE,
                                 params={"devices": devices}))
    for rank, result in enumerate(results):
        raised = result["raised"]
        assert raised is not None and "ncclInvalidUsage" in raised, (rank, result)
        assert result["after_s"] < 10, (rank, result)
        sharing = [r for r, d in enumerate(devices) if d == devices[rank] and r != rank]
        if sharing:
            assert (f"Duplicate GPU detected : rank {rank} and rank {sharing[0]} both on CUDA "
                    f"device {devices[rank]}") in raised, (rank, raised)
        else:     # a bystander names the pair that broke the communicator
            assert ("Duplicate GPU detected : rank 0 and rank 2 both on CUDA device 1 (this "
                    "rank, 1, is on device 0)") in raised, (rank, raised)


# ---- a rank that dies ----------------------------------------------------------------------------

DEATH = r'''
import signal, threading
comm = connect()
stream = _C.CudaStream(DEVICE)
n = 100_003
buf = device_buffer(n)
x = host_array(buf, fill=1.0)
data = buf.view("float32")
comm.all_reduce(data, data, "sum", stream=stream)
stream.synchronize()
assert (x == WORLD).all()
if RANK == WORLD - 1:
    os.kill(os.getpid(), signal.SIGKILL)           # before the collective the others are in

out = {}
if RANK == 0:
    # two collectives queued on a stream: the first waits for the dead rank for good
    gathered = device_buffer(n * WORLD)              # alive until the work is over
    comm.all_reduce(data, data, "sum", stream=stream)
    comm.all_gather(data, gathered.view("float32"), stream=stream)
    done = _C.CudaEvent(DEVICE)
    done.record(stream)
    start = time.monotonic()
    while time.monotonic() - start < 2.0 and not done.query():
        time.sleep(0.05)
    out["finished_alone"] = done.query()
    out["async_error_clean"] = True
    try:
        comm.check()                                 # a hang is no error, as with NCCL
    except RuntimeError:
        out["async_error_clean"] = False
    start = time.monotonic()
    comm.abort()
    done.synchronize()
    out["abort_to_done_s"] = time.monotonic() - start
else:
    # the default stream runs the collective in the calling thread: abort from another
    aborted = {}

    def abort_later():
        time.sleep(2.0)
        aborted["at"] = time.monotonic()
        comm.abort()

    start = time.monotonic()
    threading.Thread(target=abort_later).start()
    try:
        comm.all_reduce(data, data, "sum")
        out["raised"] = None
    except RuntimeError as error:
        out["raised"] = str(error)
    end = time.monotonic()
    out["blocked_s"] = end - start
    out["abort_to_done_s"] = end - aborted.get("at", end)
    out["finished_alone"] = "at" not in aborted
out["alive"] = comm.alive
out["state"] = comm.state
report(out)
'''


def test_a_dead_rank_hangs_the_others_until_they_abort(tmp_path):
    results = _run_ranks(tmp_path, 3, DEATH)
    assert results[2][0] == -9, results[2][2][-3000:]
    first, second = _all_ok(results[:2])
    assert first["finished_alone"] is False and first["async_error_clean"] is True, first
    assert first["abort_to_done_s"] < 5.0, first
    assert second["finished_alone"] is False and second["blocked_s"] >= 2.0, second
    assert second["abort_to_done_s"] < 5.0, second
    for result in (first, second):
        assert result["alive"] is False and result["state"] == "aborted"


# ---- chaos ---------------------------------------------------------------------------------------

def test_under_chaos_with_small_chunks(tmp_path):
    """Random delays on every stream and inside the collectives, and a staging
    area of one page, so that even 1023 elements go in several chunks."""
    env = {"RLHFZ_SIM_CHAOS": os.environ.get("RLHFZ_SIM_CHAOS", "20240611"),
           "RLHFZ_NCCL_SIM_STAGING_BYTES": "4096"}
    params = {"sizes": [1, 1023, 5003], "dtypes": ["float32", "bfloat16"], "ops": ["sum", "avg"]}
    cases = _check_matrix(_run_ranks(tmp_path, 3, MATRIX, params=params, env=env))
    assert cases == 2 * 3 * 2 * (2 * 2 + 2)
    for result in _all_ok(_run_ranks(tmp_path, 2, STREAM_ORDER, env=env)):
        assert result["ok_x"] and result["ok_y"] and result["ok_event"]


NONBLOCKING = r'''
nccl = ctypes.CDLL(rlhfz.build_info()["nccl_library"])
nccl.ncclGetLastError.restype = ctypes.c_char_p


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):     # ncclConfig_t as NCCL 2.14 had it
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int),
                ("minCTAs", ctypes.c_int), ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p)]


UNDEF = -2**31


def config(**fields):
    values = dict(size=ctypes.sizeof(Config), magic=0xcafebeef, version=21400, blocking=0,
                  cgaClusterSize=UNDEF, minCTAs=UNDEF, maxCTAs=UNDEF, netName=None)
    values.update(fields)
    return Config(**values)


def init(uid, cfg, world=1, rank=0):
    comm = ctypes.c_void_p()
    rc = nccl.ncclCommInitRankConfig(ctypes.byref(comm), world, uid, rank, ctypes.byref(cfg))
    return rc, comm


def poll(comm, limit_s=10):
    state = ctypes.c_int(7)
    start = time.monotonic()
    polls = 0
    while time.monotonic() - start < limit_s:
        assert nccl.ncclCommGetAsyncError(comm, ctypes.byref(state)) == 0
        polls += 1
        if state.value != 7:
            break
    return state.value, polls


_C.cuda_set_device(0)
results = {}
uid = UniqueId()
for name, cfg in {"bad_magic": config(magic=1), "old_version": config(version=21300),
                  "short": config(size=16), "blocking_2": config(blocking=2)}.items():
    assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    rc, comm = init(uid, cfg)
    results[name] = [rc, comm.value is None, nccl.ncclGetLastError(None).decode()]

dev_buf = _C.Buffer(4 * 64, "device", device=0)
ptr, count = ctypes.c_void_p(dev_buf.address), ctypes.c_size_t(64)
stream = _C.CudaStream(0)
handle = ctypes.c_void_p(stream.handle)
FLOAT32, SUM = 7, 0
assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
rc, comm = init(uid, config())
results["init"] = rc
results["settled"] = poll(comm)[0]
results["first_call"] = nccl.ncclAllReduce(ptr, ptr, count, FLOAT32, SUM, comm, handle)
results["call_before_settling"] = [
    nccl.ncclAllReduce(ptr, ptr, count, FLOAT32, SUM, comm, handle),
    nccl.ncclGetLastError(None).decode()]
results["call_settled"] = poll(comm)[0]
results["second_call"] = nccl.ncclAllReduce(ptr, ptr, count, FLOAT32, SUM, comm, handle)
poll(comm)
results["destroy"] = nccl.ncclCommDestroy(comm)

# a world of two whose other rank never comes: polled, then aborted at once
assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
rc, comm = init(uid, config(), world=2)
results["call_during_init"] = [nccl.ncclAllReduce(ptr, ptr, count, FLOAT32, SUM, comm, handle),
                               nccl.ncclGetLastError(None).decode()]
state, polls = poll(comm, limit_s=0.5)
started = time.monotonic()
results["lonely"] = [rc, state, polls > 1, nccl.ncclCommAbort(comm)]
results["abort_s"] = time.monotonic() - started
name = ctypes.string_at(ctypes.addressof(uid), 128)[16:].split(b"\0", 1)[0].decode()
results["segment_left"] = [name.startswith("/rlhfz-nccl-"), os.path.exists("/dev/shm" + name)]

# blocking = 1 through the config is ncclCommInitRank's init
assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
rc, comm = init(uid, config(blocking=1))
results["blocking"] = [rc, nccl.ncclAllReduce(ptr, ptr, count, FLOAT32, SUM, comm, handle),
                       nccl.ncclCommDestroy(comm)]
stream.synchronize()
report(results)
'''


def test_a_non_blocking_communicator_must_be_polled_between_calls(tmp_path):
    """ncclCommInitRankConfig with blocking = 0: the config is read as NCCL
    reads it, init and every call return ncclInProgress, and a call before
    ncclCommGetAsyncError has said ncclSuccess is refused; an init whose
    peer never comes is aborted without waiting for it."""
    (rc, results, stderr), = _run_ranks(tmp_path, 1, NONBLOCKING)
    assert rc == 0 and results is not None, stderr[-5000:]
    INVALID_ARGUMENT, INVALID_USAGE, IN_PROGRESS = 4, 5, 7
    assert results["bad_magic"][:2] == [INVALID_ARGUMENT, True]
    assert "NCCL_CONFIG_INITIALIZER" in results["bad_magic"][2]
    assert results["old_version"][:2] == [INVALID_ARGUMENT, True]
    assert results["short"][:2] == [INVALID_ARGUMENT, True]
    assert results["blocking_2"][:2] == [INVALID_ARGUMENT, True]
    assert "blocking must be 0 or 1" in results["blocking_2"][2]
    assert results["init"] == IN_PROGRESS
    assert results["call_during_init"][0] == INVALID_USAGE
    assert "init is still in progress" in results["call_during_init"][1]
    assert results["settled"] == 0
    assert results["first_call"] == IN_PROGRESS
    assert results["call_before_settling"][0] == INVALID_USAGE
    assert "last call is still in progress" in results["call_before_settling"][1]
    assert results["call_settled"] == 0 and results["second_call"] == IN_PROGRESS
    assert results["destroy"] == 0
    assert results["lonely"] == [IN_PROGRESS, IN_PROGRESS, True, 0]
    assert results["abort_s"] < 2 and results["segment_left"] == [True, False]
    assert results["blocking"] == [0, 0, 0]
