"""The simulated CUDA runtime (sim/) that CI's GPU tests run on, held to what
makes it a useful GPU: device memory the host cannot touch, exact memory
accounting, capacity and injected failures that surface as Python
exceptions, streams that really run apart from the host and from each other
unless an event orders them, and errors wherever a GPU would give one.

Runs only in the simulated build (make test-sim); the C++ half of the checks
is sim/tests/runtime_selftest.cpp, compiled and run here.
"""
import ctypes
import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import rlhfz
from rlhfz import _C

pytestmark = pytest.mark.skipif(rlhfz.build_info()["cuda"] != "sim",
                                reason="needs the simulated build (make test-sim)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(code: str, **env):
    """Runs code in a fresh interpreter of this environment, with env added."""
    child_env = dict(os.environ, **{k: str(v) for k, v in env.items()})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                          capture_output=True, text=True, timeout=120)


def device_tensor(numel, dtype=torch.float32, device=0, zero=True):
    buffer = _C.Buffer(numel * torch.empty((), dtype=dtype).element_size(), "device",
                       device=device, zero=zero)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    return buffer, torch.from_dlpack(buffer.view(name))


def test_build_info_reports_the_simulator():
    info = rlhfz.build_info()
    assert info["cuda"] == "sim" and info["cuda_devices"] >= 1
    assert "simulated device" in info["cuda_simulator"]
    # with the NCCL stand-in built, it is the NCCL loaded (RLHFZ_NCCL_LIBRARY)
    stand_in = os.environ.get("RLHFZ_NCCL_LIBRARY")
    if stand_in:
        assert info["nccl_library"] == os.path.realpath(stand_in)


def test_device_memory_faults_on_a_host_read_and_its_alias_does_not():
    buffer, tensor = device_tensor(16)
    tensor.copy_(torch.arange(16.0))
    alias = _C.cuda_host_alias(buffer.address, 64)
    assert alias == tensor.data_ptr() != buffer.address
    assert ctypes.string_at(alias, 8) == torch.arange(2.0).numpy().tobytes()
    child = run_child("""
        import ctypes
        from rlhfz import _C
        buffer = _C.Buffer(64, "device")
        print("read", flush=True)
        ctypes.string_at(buffer.address, 8)
        print("survived", flush=True)
    """)
    assert child.returncode == -signal.SIGSEGV, child
    assert "read" in child.stdout and "survived" not in child.stdout


def test_the_alias_maps_back_to_the_device_pointer_and_nothing_else_does():
    buffer, tensor = device_tensor(64)
    assert _C.cuda_device_pointer(tensor[8:].data_ptr(), 4 * 56) == (buffer.address + 32, 0)
    with pytest.raises(ValueError, match="not the host alias"):
        _C.cuda_device_pointer(torch.zeros(4).data_ptr(), 16)
    with pytest.raises(ValueError, match="not the host alias"):
        _C.cuda_device_pointer(tensor.data_ptr(), 4 * 64 + 4096)     # runs past its end


def test_new_device_memory_is_garbage_until_written():
    _, fresh = device_tensor(1000, zero=False)
    assert bool(fresh.isnan().all())            # 0xFF bytes: reading it first shows
    _, zeroed = device_tensor(1000)
    assert not bool(zeroed.any())


def test_kernels_take_the_alias_as_device_memory_and_cpu_kernels_refuse_it():
    _, tensor = device_tensor(1001)
    tensor.fill_(2.0)
    out = _C.Buffer(8, "device")
    workspace = _C.Buffer(_C.cuda_sumsq_workspace_bytes(), "device")
    _C.cuda_sumsq(tensor, out, workspace)
    assert torch.from_dlpack(out.view("float32"))[:2].view(torch.float64).item() == 4004.0
    with pytest.raises(BufferError, match="needs host memory"):
        _C.sumsq(tensor)
    with pytest.raises(BufferError, match="needs CUDA device memory"):
        _C.cuda_sumsq(torch.ones(4), out, workspace)


def test_memory_accounting_is_exact():
    free, total = _C.cuda_mem_get_info(0)
    held = []
    for nbytes, charged in ((1000, 1024), (1, 512), (4096, 4096), (5000, 5120)):
        held.append(_C.Buffer(nbytes, "device", zero=False))
        now, _ = _C.cuda_mem_get_info(0)
        assert free - now == charged, (nbytes, free - now)
        free = now
    del held
    after, total_after = _C.cuda_mem_get_info(0)
    assert after == free + 1024 + 512 + 4096 + 5120 and total_after == total


def test_capacity_out_of_memory_and_recovery():
    child = run_child("""
        from rlhfz import _C
        a = _C.Buffer(600_000, "device")
        try:
            _C.Buffer(600_000, "device")
        except MemoryError as error:
            print("refused:", error)
        del a
        b = _C.Buffer(900_000, "device")
        print("free", _C.cuda_mem_get_info(0))
    """, RLHFZ_SIM_DEVICE_BYTES=1 << 20)
    assert child.returncode == 0, child.stderr
    assert "refused: could not allocate 600000 bytes on CUDA device 0: out of memory" in child.stdout
    assert f"free ({(1 << 20) - 900_096}, {1 << 20})" in child.stdout


def test_injected_failures_surface_as_exceptions():
    try:
        _C.cuda_sim_inject("cudaMalloc:2")
        _C.Buffer(64, "device")
        with pytest.raises(MemoryError, match="out of memory"):
            _C.Buffer(64, "device")
        _C.Buffer(64, "device")
        _C.cuda_sim_inject("cudaMemcpyAsync:1")      # one a GPU recovers from
        a, b = _C.Buffer(64, "device"), _C.Buffer(64, "device")
        with pytest.raises(RuntimeError, match="invalid argument"):
            a.copy_from(b)
        a.copy_from(b)
        with pytest.raises(ValueError, match="call:n"):
            _C.cuda_sim_inject("cudaMalloc")
    finally:
        _C.cuda_sim_inject("")
    child = run_child("""
        from rlhfz import _C
        try:
            _C.Buffer(64, "pinned")
        except MemoryError as error:
            print("pinning:", error)
        print(_C.Buffer(64, "pinned").tier)
    """, RLHFZ_SIM_FAIL="cudaHostAlloc:1")
    assert child.returncode == 0, child.stderr
    assert "pinning: could not pin 64 bytes" in child.stdout and "pinned" in child.stdout


def test_an_injected_failure_a_gpu_makes_sticky_is_sticky():
    """After an illegal address or a launch failure a GPU's context is lost:
    every later call fails with it, so nothing can pass by recovering."""
    child = run_child("""
        from rlhfz import _C
        a, b = _C.Buffer(64, "device"), _C.Buffer(64, "device")
        for attempt in range(3):
            try:
                a.copy_from(b)
                print("copied")
            except RuntimeError as error:
                print("failed:", error)
        try:
            _C.Buffer(64, "device")
            print("allocated")
        except (RuntimeError, MemoryError) as error:
            print("allocation failed:", error)
    """, RLHFZ_SIM_FAIL="cudaMemcpyAsync:1:cudaErrorLaunchFailure")
    assert child.returncode == 0, child.stderr
    assert "copied" not in child.stdout and "allocated" not in child.stdout, child.stdout
    assert child.stdout.count("unspecified launch failure") == 4, child.stdout
    assert "every later call on it fails" in child.stderr


def test_calls_are_counted():
    before = _C.cuda_sim_calls("cudaHostAlloc")
    _C.Buffer(64, "pinned")
    assert _C.cuda_sim_calls("cudaHostAlloc") == before + 1
    assert _C.cuda_sim_calls("no such call") == 0


def test_stream_work_runs_apart_from_the_host_until_synchronized():
    stream = _C.CudaStream()
    source, source_values = device_tensor(4096)
    source_values.copy_(torch.arange(4096.0))
    target = _C.Buffer(4 * 4096, "pinned")
    target_values = torch.from_dlpack(target.view("float32").__dlpack__(dl_device=(1, 0)))
    target_values.zero_()
    token = _C.cuda_sim_hold(stream)
    target.copy_from(source, stream=stream, non_blocking=True)
    done = _C.CudaEvent()
    done.record(stream)
    assert not done.query()
    assert not bool(target_values.any())        # a host read before the sync sees old data
    _C.cuda_sim_release(token)
    done.synchronize()
    assert done.query() and torch.equal(target_values, torch.arange(4096.0))
    stream.close()


def test_only_an_event_orders_two_streams():
    first, second = _C.CudaStream(), _C.CudaStream()
    a, a_values = device_tensor(256)
    b, b_values = device_tensor(256)
    c, c_values = device_tensor(256)
    a_values.fill_(7.0)
    for ordered in (False, True):
        b_values.zero_()
        c_values.zero_()
        token = _C.cuda_sim_hold(first)
        b.copy_from(a, stream=first, non_blocking=True)        # b = 7, once first runs
        if ordered:
            written = _C.CudaEvent()
            written.record(first)
            written.wait(second)
        c.copy_from(b, stream=second, non_blocking=True)       # c = b
        if not ordered:
            second.synchronize()               # ran at once: it read b before first wrote it
        _C.cuda_sim_release(token)
        first.synchronize()
        second.synchronize()
        assert float(c_values[0]) == (7.0 if ordered else 0.0)


def test_default_streams_run_inline_and_held_ones_cannot_be_default():
    a, a_values = device_tensor(64)
    b, b_values = device_tensor(64)
    a_values.fill_(3.0)
    b.copy_from(a, stream=None, non_blocking=True)
    assert bool((b_values == 3.0).all())        # no sync needed: it ran in this thread
    with pytest.raises(ValueError, match="cannot be held"):
        _C.cuda_sim_hold(0)


def test_device_allocation_zeroes_on_its_own_device():
    """A zeroed allocation on a device other than the current one: its
    memset runs with that device current (on the simulator, as on a GPU,
    device memory of another device than the current one is off limits)."""
    child = run_child("""
        from rlhfz import _C
        import torch
        assert _C.cuda_get_device() == 0
        buffer = _C.Buffer(4096, "device", device=1)
        assert (buffer.device, _C.cuda_get_device()) == (1, 0)
        assert not torch.from_dlpack(buffer.view("float32")).any()
        buffer.zero_()
        other = _C.Buffer(4096, "device", device=0)
        try:
            other.copy_from(buffer)
        except ValueError as error:
            print("across devices:", error)
        print("ok")
    """, RLHFZ_SIM_DEVICES=2)
    assert child.returncode == 0, child.stderr
    assert "across devices: copy_from: src is on CUDA device 1" in child.stdout
    assert "ok" in child.stdout


def test_an_event_on_the_default_stream_is_its_own_devices():
    """CudaEvent.record and .wait on the default stream (torch's, handle 0)
    mean the event's device's default stream, whichever device is current:
    a rank whose params are on device 1 while device 0 is current records
    its events there (on a GPU, as here, the current device's default
    stream would be another device's, and the call would fail)."""
    child = run_child("""
        from rlhfz import _C
        assert _C.cuda_get_device() == 0
        event = _C.CudaEvent(1)
        event.record(0)
        event.wait(0)
        event.record(None)
        event.synchronize()
        assert event.query() and _C.cuda_get_device() == 0
        stream = _C.CudaStream(0)
        try:
            event.record(stream)
        except RuntimeError as error:
            print("other device's stream:", error)
        print("ok")
    """, RLHFZ_SIM_DEVICES=2)
    assert child.returncode == 0, child.stderr
    assert "other device's stream: CudaEvent.record" in child.stdout
    assert "ok" in child.stdout


def test_chaos_delays_the_order_not_the_results():
    code = """
        import struct, torch
        from rlhfz import _C
        x = _C.Buffer(4 * 300_001, "device")
        torch.from_dlpack(x.view("float32")).copy_(
            torch.randn(300_001, generator=torch.Generator().manual_seed(0)))
        out, ws = _C.Buffer(8, "device"), _C.Buffer(_C.cuda_sumsq_workspace_bytes(), "device")
        stream = _C.CudaStream()
        _C.cuda_scale_(x.view("float32"), 0.5, stream=stream)
        _C.cuda_sumsq(x.view("float32"), out, ws, stream=stream)
        print(struct.unpack("d", _C.cuda_fetch(out, 0, 8, stream=stream))[0].hex())
    """
    plain = run_child(code)
    chaotic = run_child(code, RLHFZ_SIM_CHAOS=12345)
    assert plain.returncode == 0 and chaotic.returncode == 0, (plain.stderr, chaotic.stderr)
    assert plain.stdout == chaotic.stdout


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler")
    library = os.path.join(os.path.dirname(_C.__file__), "_sim")
    program = tmp_path_factory.mktemp("selftest") / "selftest"
    build = subprocess.run(
        ["c++", "-std=c++17", "-O1", "-fsanitize=alignment", "-I",
         os.path.join(ROOT, "sim", "include"),
         os.path.join(ROOT, "sim", "tests", "runtime_selftest.cpp"), f"-L{library}",
         "-lcudasim", f"-Wl,-rpath,{library}", "-pthread", "-o", str(program)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return str(program)


def run_selftest(program, *arguments):
    run = subprocess.run([program, *arguments], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, RLHFZ_SIM_DEVICES="2"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed" in run.stdout
    return run


def test_runtime_selftest(selftest):
    run_selftest(selftest)


@pytest.mark.parametrize("fault, says", [
    ("host-pointer", "host memory that is not page-locked"),
    ("other-device", "memory of another device"),
    ("misaligned", "misaligned address: a member access"),
    ("shared-over-48k", "more than 48 KiB"),
])
def test_a_kernel_fault_loses_the_context(selftest, fault, says):
    """What a GPU's kernel faults on (an address it cannot use, a misaligned
    vector load, more shared memory than a block gets) loses the device's
    context: every later call fails, as on a GPU."""
    run = run_selftest(selftest, fault)
    assert says in run.stderr and "every later call on it fails" in run.stderr, run.stderr


def test_a_borrowed_tensor_outlives_the_kernel_that_reads_it():
    """A kernel queued on a stream reads its arrays after the call returns:
    a tensor borrowed through DLPack is kept until the kernel is done, else
    its memory could be handed out again while the kernel still reads it."""
    stream = _C.CudaStream()
    buffer, tensor = device_tensor(1024)
    tensor.fill_(1.0)
    view = torch.from_dlpack(buffer.view("float32"))
    assert buffer.exports == 2
    # earlier tests' borrows go now: freeing their memory waits for every
    # stream, which must not be held then
    _C.cuda_synchronize(0)
    token = _C.cuda_sim_hold(stream)
    _C.cuda_scale_(tensor, 2.0, stream=stream)          # queued behind the hold
    del tensor
    gc.collect()
    assert buffer.exports == 2                           # still borrowed by the kernel
    _C.cuda_sim_release(token)
    _C.cuda_synchronize(0)
    assert buffer.exports == 1                           # the kernel is done: let go
    assert bool((view == 2.0).all())
