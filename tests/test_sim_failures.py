"""Every way a CUDA entry point of rlhfz._C can fail, on the simulated runtime.

Two kinds of failure, each held to its outcome:
- bad arguments, refused with the right exception before any CUDA call;
- a runtime call that fails (injected with cuda_sim_inject or RLHFZ_SIM_FAIL),
  which must surface as an exception naming the runtime's error, and leave
  what the call was given as it was: no device memory leaked, no bytes
  written, streams and events still usable.

A failure is injected at the call that the path under test makes; where the
number of that call depends on what came before, it is counted first with a
call that succeeds. Whatever needs several devices, a failure at start-up or
the simulator's per-process caches runs in a child process.
"""
import contextlib
import gc
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from device_support import needs_simulator
from rlhfz import _C

pytestmark = needs_simulator

CHILD_TIMEOUT_S = 60


@contextlib.contextmanager
def failing(spec):
    """The failures of `spec` (RLHFZ_SIM_FAIL's syntax), counted from here.
    Calls are counted per process: a thread of rlhfz's polling the runtime
    meanwhile (a collective's watchdog) could take the failure instead."""
    pollers = [t.name for t in threading.enumerate() if t.name.startswith("rlhfz-")]
    assert not pollers, f"threads that call the runtime are running: {pollers}"
    _C.cuda_sim_inject(spec)
    try:
        yield
    finally:
        _C.cuda_sim_inject("")


def calls_made(name, action):
    """How many times `action()` calls the runtime function `name`."""
    before = _C.cuda_sim_calls(name)
    action()
    return _C.cuda_sim_calls(name) - before


def device_free(device=0):
    gc.collect()
    _C.cuda_synchronize(device)
    return _C.cuda_mem_get_info(device)[0]


def device_floats(values, device=0):
    values = np.asarray(values, dtype=np.float32)
    buffer = _C.Buffer(values.nbytes, "device", device=device, zero=False)
    _C.cuda_store(buffer, 0, values.tobytes())
    return buffer


def floats(buffer, n=None):
    n = buffer.nbytes // 4 if n is None else n
    return np.frombuffer(_C.cuda_fetch(buffer, 0, 4 * n), dtype=np.float32)


def run_child(code, **env):
    """code in a fresh interpreter of this environment; its last line of output, as JSON."""
    child_env = dict(os.environ, **{k: str(v) for k, v in env.items()})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


class BadBool:
    def __bool__(self):
        raise ZeroDivisionError("no truth here")


# ---- argument errors of the kernel and transfer entry points ------------------------------------

def test_kernel_entry_points_refuse_bad_arguments_before_any_cuda_call():
    x = device_floats([1.0, -2.0, 3.0, 4.0])
    out = _C.Buffer(8, "device")
    workspace = _C.Buffer(_C.cuda_sumsq_workspace_bytes(), "device")
    found = _C.Buffer(4, "device")
    view = x.view("float32")
    launches = _C.cuda_sim_calls("kernel launch")
    cases = [
        (lambda: _C.cuda_adamw_step(view, view, view, view, view, view), TypeError,
         r"cuda_adamw_step\(\) takes at most 5 positional arguments"),
        (lambda: _C.cuda_sumsq(view, out), TypeError,
         r"cuda_sumsq\(\) missing required argument 'workspace'"),
        (lambda: _C.cuda_sumsq(view, out, workspace, accumulate=BadBool()), ZeroDivisionError,
         "no truth here"),
        (lambda: _C.cuda_sumsq(view, out, workspace, stream="s"), TypeError,
         "stream must be None, a stream handle"),
        (lambda: _C.cuda_unscale_(view, 0.5), TypeError,
         r"cuda_unscale_\(\) missing required argument 'found_inf'"),
        (lambda: _C.cuda_unscale_(view, "half", found), TypeError,
         "inv_scale must be a real number, not str"),
        (lambda: _C.cuda_unscale_(view, 0.5, None), TypeError,
         "found_inf must be an rlhfz Buffer in the device tier, not None"),
        (lambda: _C.cuda_scale_(view, 2.0, 3.0), TypeError,
         r"cuda_scale_\(\) takes at most 2 positional arguments"),
        (lambda: _C.cuda_scale_(view, "twice"), TypeError, "scale must be a real number, not str"),
        (lambda: _C.cuda_cast_(view), TypeError, r"cuda_cast_\(\) missing required argument 'src'"),
        (lambda: _C.cuda_cast_(view, view, stream=-1), ValueError,
         "stream handle must be an address"),
        (lambda: _C.cuda_fetch(x, 0), TypeError,
         r"cuda_fetch\(\) missing required argument 'nbytes'"),
        (lambda: _C.cuda_fetch(x, "0", 4), TypeError, "offset must be an integer, not str"),
        (lambda: _C.cuda_store(x, 0), TypeError,
         r"cuda_store\(\) missing required argument 'data'"),
        (lambda: _C.cuda_store(x, 0.5, b"1234"), TypeError, "offset must be an integer, not float"),
        (lambda: _C.cuda_store(view, 0, b"1234"), TypeError, "buffer must be an rlhfz Buffer"),
        (lambda: _C.adamw_hparams_bytes(1e-3), TypeError,
         r"adamw_hparams_bytes\(\) takes at most 0 positional arguments"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert _C.cuda_sim_calls("kernel launch") == launches
    assert list(floats(x)) == [1.0, -2.0, 3.0, 4.0]


def test_device_scalars_may_not_overlap_the_arrays_or_each_other():
    x = _C.Buffer(4096, "device")
    workspace = _C.Buffer(_C.cuda_sumsq_workspace_bytes(), "device")
    _C.cuda_store(workspace, 0, struct.pack("d", 7.0))
    launches = _C.cuda_sim_calls("kernel launch")
    # out is the very memory the kernel would read x from
    with pytest.raises(ValueError, match="out and an array of the call overlap in memory"):
        _C.cuda_sumsq(x.view("float32"), x, workspace)
    # out is the workspace: the first pass's partials would land on the result
    with pytest.raises(ValueError, match="out and workspace overlap in memory"):
        _C.cuda_sumsq(x.view("float32"), workspace, workspace)
    assert _C.cuda_sim_calls("kernel launch") == launches
    assert struct.unpack("d", _C.cuda_fetch(workspace, 0, 8))[0] == 7.0


def test_empty_arrays_launch_nothing_and_touch_nothing():
    buffer = device_floats([5.0] * 16)
    found = _C.Buffer(4, "device")
    empty = buffer.view("float32", 0, (0,))
    launches = _C.cuda_sim_calls("kernel launch")
    _C.cuda_scale_(empty, 3.0)
    _C.cuda_unscale_(empty, 0.5, found)
    _C.cuda_synchronize(0)
    assert _C.cuda_sim_calls("kernel launch") == launches
    assert list(floats(buffer)) == [5.0] * 16
    assert _C.cuda_fetch(found, 0, 4) == b"\0" * 4
    # nothing to copy is no copy at all, nothing to zero no memset
    copies = _C.cuda_sim_calls("cudaMemcpyAsync")
    assert _C.cuda_fetch(buffer, 16, 0) == b""
    assert _C.cuda_sim_calls("cudaMemcpyAsync") == copies
    nothing = _C.Buffer(0, "device")
    memsets = _C.cuda_sim_calls("cudaMemsetAsync")
    nothing.zero_()
    assert _C.cuda_sim_calls("cudaMemsetAsync") == memsets


# ---- the runtime failing under the kernel entry points ------------------------------------------

def test_a_launch_with_no_usable_cuda_raises_and_writes_nothing():
    x = device_floats([1.0, 2.0, 3.0])
    view = x.view("float32")
    n = calls_made("cudaGetDeviceCount", lambda: _C.cuda_scale_(view, 1.0))
    assert n >= 1
    launches = _C.cuda_sim_calls("kernel launch")
    with failing(f"cudaGetDeviceCount:{n}:cudaErrorNoDevice"):
        with pytest.raises(RuntimeError,
                           match="cuda_scale_: no CUDA-capable device is detected"):
            _C.cuda_scale_(view, 10.0)
    assert _C.cuda_sim_calls("kernel launch") == launches
    assert list(floats(x)) == [1.0, 2.0, 3.0]
    with failing("cudaGetDeviceCount:1:cudaErrorInitializationError"):
        with pytest.raises(RuntimeError, match="cuda_sumsq_workspace_bytes: initialization error"):
            _C.cuda_sumsq_workspace_bytes()
    with failing("cudaGetDeviceCount:1:cudaErrorNoDevice"):
        with pytest.raises(RuntimeError, match="cuda_fetch: no CUDA-capable device"):
            _C.cuda_fetch(x, 0, 4)
    # the failures were one call each
    assert _C.cuda_sumsq_workspace_bytes() > 0
    assert list(floats(x)) == [1.0, 2.0, 3.0]


def test_a_failed_launch_is_reported_and_leaves_the_data():
    x = device_floats([1.0, 2.0, 3.0, 4.0])
    with failing("kernel_launch:1"):
        with pytest.raises(RuntimeError, match="cuda_scale_: .*too many resources requested"):
            _C.cuda_scale_(x.view("float32"), 2.0)
    assert list(floats(x)) == [1.0, 2.0, 3.0, 4.0]
    _C.cuda_scale_(x.view("float32"), 2.0)
    _C.cuda_synchronize(0)
    assert list(floats(x)) == [2.0, 4.0, 6.0, 8.0]


def test_the_launch_grid_falls_back_when_the_device_cannot_be_asked():
    x = device_floats(np.arange(1000))
    view = x.view("float32")
    n = calls_made("cudaGetDevice", lambda: _C.cuda_scale_(view, 1.0))
    assert n >= 2        # the launch's device, then the grid's
    with failing(f"cudaGetDevice:{n}"):
        _C.cuda_scale_(view, 3.0)
    _C.cuda_synchronize(0)
    assert (floats(x) == np.arange(1000, dtype=np.float32) * 3).all()


def test_a_torch_tensor_is_waited_for_when_no_event_can_fence_it():
    """A borrowed torch tensor is kept behind an event until the kernel is
    done. With no event to record, the call waits for the kernel instead:
    when it returns, the work is finished (and nothing raised)."""
    buffer = _C.Buffer(4 * 4096, "device", zero=False)
    tensor = torch.from_dlpack(buffer.view("float32"))
    tensor.copy_(torch.arange(4096.0))
    stream = _C.CudaStream()
    waits = _C.cuda_sim_calls("cudaStreamSynchronize")
    with failing("cudaEventRecord:1"):
        _C.cuda_scale_(tensor, 2.0, stream=stream)
        assert _C.cuda_sim_calls("cudaEventRecord") > 0
    assert _C.cuda_sim_calls("cudaStreamSynchronize") == waits + 1
    assert torch.equal(tensor, torch.arange(4096.0) * 2)
    stream.close()


def test_transfers_that_fail_leave_both_sides_as_they_were():
    x = device_floats([1.0, 2.0])
    with failing("cudaMemcpyAsync:1"):
        with pytest.raises(RuntimeError, match="cuda_fetch: .*invalid argument"):
            _C.cuda_fetch(x, 0, 8)
    # a named error (one a GPU recovers from: sticky ones lose the device)
    with failing("cudaMemcpyAsync:1:cudaErrorInvalidDevicePointer"):
        with pytest.raises(RuntimeError, match="cuda_store: .*invalid device pointer"):
            _C.cuda_store(x, 0, np.float32([9.0, 9.0]).tobytes())
    # the first runtime call of a transfer asks which device is current
    for spec, call in (("cudaGetDevice:1", lambda: _C.cuda_fetch(x, 0, 8)),
                       ("cudaGetDevice:1", lambda: _C.cuda_store(x, 0, b"\0" * 8))):
        with failing(spec):
            with pytest.raises(RuntimeError, match="invalid argument"):
                call()
    assert list(floats(x)) == [1.0, 2.0]


# ---- streams and events ------------------------------------------------------------------------

def test_stream_and_event_constructors():
    with pytest.raises(TypeError, match="takes at most 1 argument"):
        _C.CudaStream(0, 1)
    with pytest.raises(TypeError, match="takes at most 1 keyword argument"):
        _C.CudaEvent(device=0, flags=1)
    # a device that does not exist: refused by the runtime, the current one kept
    with pytest.raises(RuntimeError, match="CudaStream: CUDA error: invalid device ordinal"):
        _C.CudaStream(device=7)
    assert _C.cuda_get_device() == 0
    with failing("cudaGetDevice:1"):
        with pytest.raises(RuntimeError, match="CudaEvent: CUDA error: invalid argument"):
            _C.CudaEvent()
    with failing("cudaStreamCreateWithFlags:1"):
        with pytest.raises(RuntimeError, match="CudaStream: CUDA error: out of memory"):
            _C.CudaStream()
    with failing("cudaEventCreateWithFlags:1:cudaErrorInitializationError"):
        with pytest.raises(RuntimeError, match="CudaEvent: CUDA error: initialization error"):
            _C.CudaEvent(0)
    stream = _C.CudaStream(0)
    assert repr(stream) == f"CudaStream(device=0, handle={hex(stream.handle)})"
    stream.close()
    assert repr(stream).endswith(", closed)") and stream.handle == 0


def test_stream_and_event_methods_refuse_bad_use_and_survive_failures():
    stream, event = _C.CudaStream(), _C.CudaEvent()
    for method in (event.record, event.wait):
        with pytest.raises(TypeError, match=r"\(\) takes at most 1 positional arguments"):
            method(stream, 1)
        with pytest.raises(TypeError, match="stream must be None"):
            method("default")
    failures = [
        ("cudaStreamSynchronize", stream.synchronize, "CudaStream.synchronize"),
        ("cudaEventRecord", lambda: event.record(stream), "CudaEvent.record"),
        ("cudaStreamWaitEvent", lambda: event.wait(stream), "CudaEvent.wait"),
        ("cudaEventSynchronize", event.synchronize, "CudaEvent.synchronize"),
        ("cudaEventQuery", event.query, "CudaEvent.query"),
    ]
    for call, method, name in failures:
        with failing(f"{call}:1"):
            with pytest.raises(RuntimeError,
                               match=f"{name}: CUDA error: invalid argument"):
                method()
        method()            # the failure was the call's, not the handle's
    assert event.query() is True
    event.close()
    for method in (event.record, event.wait, event.synchronize, event.query):
        with pytest.raises(ValueError, match="the CudaEvent is closed"):
            method()
    stream.close()
    with pytest.raises(ValueError, match="the CudaStream is closed"):
        stream.synchronize()


# ---- the simulator's own entry points ----------------------------------------------------------

def test_simulator_entry_points_check_their_arguments():
    assert _C.cuda_simulated() is True
    buffer = _C.Buffer(64, "device")
    alias = _C.cuda_host_alias(buffer.address, 64)
    assert _C.cuda_device_pointer(alias, 64) == (buffer.address, 0)
    with pytest.raises(TypeError, match=r"cuda_host_alias\(\) missing required argument 'address'"):
        _C.cuda_host_alias()
    with pytest.raises(TypeError, match="an integer is required"):
        _C.cuda_host_alias("0x1000")
    with pytest.raises(TypeError, match="nbytes must be an integer, not str"):
        _C.cuda_host_alias(buffer.address, "64")
    with pytest.raises(ValueError, match="cuda_host_alias: nbytes must be >= 0, not -1"):
        _C.cuda_host_alias(buffer.address, -1)
    with pytest.raises(ValueError, match="is not live simulated device memory"):
        _C.cuda_host_alias(buffer.address, 65)           # one byte past the allocation
    with pytest.raises(ValueError, match="is not live simulated device memory"):
        _C.cuda_host_alias(alias, 4)                     # the alias is no device pointer
    with pytest.raises(TypeError, match=r"cuda_device_pointer\(\) takes at most 2 positional"):
        _C.cuda_device_pointer(alias, 4, 5)
    with pytest.raises(TypeError, match="cuda_sim_calls: name must be a str, not int"):
        _C.cuda_sim_calls(3)
    with pytest.raises(TypeError, match="cuda_sim_inject: spec must be a str, not bytes"):
        _C.cuda_sim_inject(b"cudaMalloc:1")
    with pytest.raises(ValueError, match="call:n"):
        _C.cuda_sim_inject("cudaMalloc:0")
    with pytest.raises(TypeError, match="stream must be None"):
        _C.cuda_sim_hold("stream")
    with pytest.raises(TypeError, match="an integer is required"):
        _C.cuda_sim_release("1")
    with pytest.raises(ValueError,
                       match="cuda_sim_release: 123456789 is not a held stream's token"):
        _C.cuda_sim_release(123456789)
    # none of it injected anything: allocations still work
    assert _C.Buffer(64, "device").tier == "device"


def test_module_cuda_functions_check_arguments_and_report_failures():
    with pytest.raises(TypeError, match="'str' object cannot be interpreted as an integer"):
        _C.cuda_mem_get_info("0")
    with pytest.raises(ValueError, match="device must be a CUDA ordinal >= 0, not -1"):
        _C.cuda_mem_get_info(-1)
    with pytest.raises(ValueError, match="cuda_synchronize: device must be a CUDA ordinal"):
        _C.cuda_synchronize(-2)
    with pytest.raises(TypeError, match="'NoneType' object cannot be interpreted as an integer"):
        _C.cuda_set_device(None)
    with pytest.raises(RuntimeError, match="cuda_set_device: CUDA error: invalid device ordinal"):
        _C.cuda_set_device(3)
    with pytest.raises(RuntimeError, match="cuda_synchronize: CUDA error: invalid device ordinal"):
        _C.cuda_synchronize(3)
    assert _C.cuda_get_device() == 0
    for spec, call, name in [
        ("cudaGetDevice:1", _C.cuda_get_device, "cuda_get_device"),
        ("cudaDeviceSynchronize:1", lambda: _C.cuda_synchronize(0), "cuda_synchronize"),
        ("cudaMemGetInfo:1", lambda: _C.cuda_mem_get_info(0), "cuda_mem_get_info"),
    ]:
        with failing(spec):
            with pytest.raises(RuntimeError, match=f"{name}: CUDA error: invalid argument"):
                call()
    with failing("cudaGetDeviceCount:1:cudaErrorNoDevice"):
        with pytest.raises(RuntimeError, match="cuda_get_device: no CUDA-capable device"):
            _C.cuda_get_device()
    with failing("cudaGetDeviceCount:1:cudaErrorNoDevice"):
        with pytest.raises(RuntimeError, match="cuda_mem_get_info: no CUDA-capable device"):
            _C.cuda_mem_get_info(0)
    assert _C.cuda_get_device() == 0 and _C.cuda_mem_get_info(0)[1] > 0


# ---- memory tiers -------------------------------------------------------------------------------

def test_tier_names_and_sizes_no_allocator_can_give(tmp_path):
    with pytest.raises(ValueError, match="tier must be 'host', 'pinned', 'device' or 'disk', "
                                         "not 'tape'"):
        _C.Buffer(64, "tape")
    disk = _C.Buffer(64, "disk", path=str(tmp_path))
    assert disk.tier == "disk" and repr(disk).count("disk") >= 1
    external = _C.Buffer.from_dlpack(np.zeros(4, dtype=np.float32))
    assert external.tier == "external"
    with pytest.raises(MemoryError, match="more than any object can hold"):
        _C.Buffer(sys.maxsize, "host")
    with pytest.raises(MemoryError, match=f"could not allocate {1 << 62} bytes of host memory"):
        _C.Buffer(1 << 62, "host", zero=False)
    for tier in ("device", "pinned"):
        with pytest.raises(ValueError, match="alignment 512 is more than CUDA allocations give"):
            _C.Buffer(64, tier, alignment=512)


def test_host_buffers_zero_and_copy_on_the_cpu():
    src, dst = _C.Buffer(256), _C.Buffer(256)
    np.from_dlpack(src.view("float32"))[:] = np.arange(64)
    copies = _C.cuda_sim_calls("cudaMemcpyAsync")
    dst.copy_from(src)
    assert (np.from_dlpack(dst.view("float32")) == np.arange(64)).all()
    src.zero_()
    assert not np.from_dlpack(src.view("float32")).any()
    assert (np.from_dlpack(dst.view("float32")) == np.arange(64)).all()
    assert _C.cuda_sim_calls("cudaMemcpyAsync") == copies      # no CUDA copy on the way


def test_without_a_usable_device_pinned_falls_back_and_device_raises():
    with failing("cudaGetDeviceCount:1:cudaErrorNoDevice"):
        pinned = _C.Buffer(64, "pinned")
    assert pinned.tier == "host" and pinned.device == -1
    free = device_free()
    with failing("cudaGetDeviceCount:1:cudaErrorNoDevice"):
        with pytest.raises(RuntimeError, match="the device tier needs a CUDA device: "
                                               "no CUDA-capable device is detected"):
            _C.Buffer(64, "device")
    assert device_free() == free


def test_device_allocations_that_fail_part_way_give_everything_back():
    free = device_free()
    # the current device cannot be asked
    with failing("cudaGetDevice:1"):
        with pytest.raises(RuntimeError, match="Buffer: CUDA error: invalid argument"):
            _C.Buffer(4096, "device")
    # allocated, then the zeroing fails: the memory goes back
    for call in ("cudaMemsetAsync", "cudaStreamSynchronize", "cudaGetDevice"):
        kept = []
        n = calls_made(call, lambda: kept.append(_C.Buffer(4096, "device")))
        assert n >= 1, call
        del kept
        mallocs, frees = _C.cuda_sim_calls("cudaMalloc"), _C.cuda_sim_calls("cudaFree")
        with failing(f"{call}:{n}"):
            # a runtime that fails is no shortage of memory
            with pytest.raises(RuntimeError, match="could not allocate 4096 bytes on CUDA device 0: "
                                                   "invalid argument"):
                _C.Buffer(4096, "device")
        assert _C.cuda_sim_calls("cudaMalloc") == mallocs + 1, call
        assert _C.cuda_sim_calls("cudaFree") == frees + 1, call
        assert device_free() == free, call


def test_zeroing_device_memory_that_fails_leaves_the_bytes():
    x = device_floats([1.0, 2.0, 3.0])
    with failing("cudaMemsetAsync:1"):
        with pytest.raises(RuntimeError, match="zero_: CUDA error: invalid argument"):
            x.zero_()
    assert list(floats(x)) == [1.0, 2.0, 3.0]
    x.zero_()
    assert list(floats(x)) == [0.0, 0.0, 0.0]


# ---- in child processes: several devices, start-up, fresh caches ------------------------------

def test_build_info_reports_a_runtime_that_fails_to_start():
    result = run_child("""
        import json
        from rlhfz import _C
        first = _C.build_info()
        second = _C.build_info()
        print(json.dumps({"first": [first["cuda"], first["cuda_devices"], first["cuda_error"]],
                          "second": [second["cuda"], second["cuda_error"]]}))
    """, RLHFZ_SIM_FAIL="cudaGetDeviceCount:1:cudaErrorInitializationError")
    assert result["first"] == [False, 0, "initialization error"]
    assert result["second"] == ["sim", None]


TWO_DEVICES = r"""
import json, struct
import numpy as np
from rlhfz import _C

out = {}

def on_device_1(call):
    # cuda_store and cuda_fetch copy on the current device's default stream
    _C.cuda_set_device(1)
    try:
        return call()
    finally:
        _C.cuda_set_device(0)

def floats(buffer):
    data = on_device_1(lambda: _C.cuda_fetch(buffer, 0, buffer.nbytes))
    return np.frombuffer(data, dtype=np.float32).tolist()

# allocated on device 1, then device 0 cannot be made current again: the
# allocation fails, and its memory goes back
free1 = _C.cuda_mem_get_info(1)[0]
_C.cuda_sim_inject("cudaSetDevice:2")
try:
    _C.Buffer(4096, "device", device=1, zero=False)
    out["alloc"] = None
except RuntimeError as error:      # no shortage of memory: not a MemoryError
    out["alloc"] = str(error)
_C.cuda_sim_inject("")
out["current_after_failed_restore"] = _C.cuda_get_device()
_C.cuda_set_device(0)
out["free1_kept"] = _C.cuda_mem_get_info(1)[0] == free1

# a kernel on device 1 while device 0 is current; the first launch there
# finds no multiprocessor count and falls back to a plain grid
x = _C.Buffer(4 * 1000, "device", device=1, zero=False)
on_device_1(lambda: _C.cuda_store(x, 0, np.arange(1000, dtype=np.float32).tobytes()))
attributes = _C.cuda_sim_calls("cudaDeviceGetAttribute")
_C.cuda_sim_inject("cudaDeviceGetAttribute:1")
_C.cuda_scale_(x.view("float32"), 2.0)
_C.cuda_sim_inject("")
out["attribute_asked"] = _C.cuda_sim_calls("cudaDeviceGetAttribute") - attributes
_C.cuda_synchronize(1)
out["scaled"] = floats(x) == (np.arange(1000, dtype=np.float32) * 2).tolist()
out["current_after_launch"] = _C.cuda_get_device()

# device scalars must be on the arrays' device
workspace = _C.Buffer(_C.cuda_sumsq_workspace_bytes(), "device", device=1)
try:
    _C.cuda_sumsq(x.view("float32"), _C.Buffer(8, "device", device=0), workspace)
    out["scalar_device"] = None
except ValueError as error:
    out["scalar_device"] = str(error)
print(json.dumps(out))
"""


def test_two_devices_restore_the_current_one_and_check_where_scalars_live():
    result = run_child(TWO_DEVICES, RLHFZ_SIM_DEVICES=2, RLHFZ_SIM_DEVICE_BYTES=1 << 24)
    assert result["alloc"] == ("could not allocate 4096 bytes on CUDA device 1: "
                               "invalid argument")
    assert result["free1_kept"] is True
    # the restore is what failed, so device 1 is still current: the runtime's state, reported
    assert result["current_after_failed_restore"] == 1
    assert result["attribute_asked"] >= 1
    assert result["scaled"] is True and result["current_after_launch"] == 0
    assert result["scalar_device"] == "out is on cuda:0 but the arrays are on cuda:1"


EXIT_WITH_BORROWS = r"""
import ctypes, json, sys
import numpy as np
from rlhfz import _C

def host_view(buffer):
    # numpy's own view of device memory (through its host alias): borrowed over DLPack
    raw = (ctypes.c_char * buffer.nbytes).from_address(
        _C.cuda_host_alias(buffer.address, buffer.nbytes))
    return np.frombuffer(raw, dtype=np.float32)

stream = _C.CudaStream()
buffer = _C.Buffer(4 * 1024, "device")
x = host_view(buffer)
x[:] = 1.0
refs = sys.getrefcount(x)
_C.cuda_scale_(x, 2.0, stream=stream)
kept = sys.getrefcount(x) - refs            # the kernel's borrow, kept behind an event
stream.synchronize()
still_kept = sys.getrefcount(x) - refs      # until rlhfz next looks
_C.cuda_synchronize(0)
released = sys.getrefcount(x) - refs
_C.cuda_scale_(x, 2.0, stream=stream)       # kept again, and the process ends with it
stream.synchronize()
print(json.dumps({"kept": kept, "still_kept": still_kept, "released": released,
                  "values": sorted(set(x.tolist()))}))
"""


def test_a_borrow_kept_for_a_kernel_is_let_go_after_it_and_at_exit():
    """A DLPack borrow (here numpy's) stays referenced until the kernel is
    known to be done; a process that ends with one still kept exits cleanly,
    its event given back to the runtime."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(EXIT_WITH_BORROWS)],
                          env=dict(os.environ), capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert "cudasim" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"kept": 1, "still_kept": 1, "released": 0, "values": [4.0]}


RESTORES = r"""
import json
from rlhfz import _C

out = {}

def attempt(name, call):
    # making device 1 current works; putting device 0 back is what fails
    _C.cuda_sim_inject("cudaSetDevice:2")
    try:
        call()
        out[name] = None
    except RuntimeError as error:
        out[name] = str(error)
    _C.cuda_sim_inject("")
    _C.cuda_set_device(0)

attempt("stream", lambda: _C.CudaStream(device=1))
attempt("event", lambda: _C.CudaEvent(device=1))
x = _C.Buffer(4096, "device", device=1)
attempt("kernel", lambda: _C.cuda_scale_(x.view("float32"), 2.0))
# device 0 current: a transfer of device 1's memory runs on device 1
_C.cuda_store(x, 0, bytes.fromhex("0000803f"))
out["fetched"] = _C.cuda_fetch(x, 0, 4).hex()
out["current"] = _C.cuda_get_device()
print(json.dumps(out))
"""


def test_a_call_that_cannot_give_the_callers_device_back_fails():
    """Streams, events and kernels made or run on another device put the
    caller's device back, and a failure to is an error, not a device left
    silently current; cuda_store and cuda_fetch run on their Buffer's device."""
    result = run_child(RESTORES, RLHFZ_SIM_DEVICES=2)
    for name, what in (("stream", "CudaStream"), ("event", "CudaEvent"),
                       ("kernel", "cuda_scale_")):
        assert result[name] == f"{what}: CUDA error: invalid argument", name
    assert result["fetched"] == "0000803f" and result["current"] == 0
