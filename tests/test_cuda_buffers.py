"""Device and pinned Buffers: device memory really returns to the driver,
and DLPack views are zero-copy tensors of device memory. On a GPU those are
CUDA tensors; on the simulated CUDA runtime (tests/device_support.py) they
are CPU tensors over the host alias of device memory, and the driver's count
of free bytes is exact. Skipped without either."""
import pytest
import torch

from device_support import (DEVICE, REAL, SIMULATED, mem_get_info, needs_device, needs_real_gpu,
                            needs_simulator, on_device, synchronize, to_device, to_host,
                            torch_address)
from rlhfz import _C

pytestmark = [pytest.mark.gpu, needs_device]

GIB = 1 << 30
# The simulator charges whole units of this many bytes, as the driver rounds.
SIM_CHARGE_UNIT = 512


def test_device_memory_goes_back_to_the_driver():
    # A GPU's figure moves with other processes; the simulator's is exact,
    # so a smaller, odd size says as much there.
    nbytes = GIB if REAL else (64 << 20) + 1
    slack = 0 if SIMULATED else 64 * (1 << 20)
    synchronize()
    free_before, total = mem_get_info()
    buf = _C.Buffer(nbytes, "device", device=0, zero=False)
    free_held, _ = mem_get_info()
    assert free_before - free_held >= nbytes
    if SIMULATED:
        assert free_before - free_held < nbytes + SIM_CHARGE_UNIT
    del buf
    free_after, _ = mem_get_info()
    # the driver has it back
    assert free_after >= free_before - slack
    assert 0 < free_after <= total


def test_a_torch_view_holds_device_memory_until_it_goes():
    nbytes = 16 << 20
    slack = 0 if SIMULATED else 8 << 20
    synchronize()
    free_before, _ = mem_get_info()
    buf = _C.Buffer(nbytes, "device", zero=False)
    tensor = torch.from_dlpack(buf.view("float32"))
    del buf
    assert mem_get_info()[0] <= free_before - nbytes + slack
    del tensor
    assert mem_get_info()[0] >= free_before - slack


def test_device_views_are_device_tensors_sharing_memory():
    buf = _C.Buffer(4096, "device")
    assert (buf.tier, buf.device) == ("device", _C.cuda_get_device())
    view = buf.view("float32", 16, (8, 4))
    # the simulator hands device memory over as host memory at its alias
    assert view.__dlpack_device__() == ((1, 0) if SIMULATED else (2, buf.device))
    tensor = torch.from_dlpack(view)
    assert tensor.device.type == DEVICE.type and on_device(tensor)
    assert tensor.data_ptr() == torch_address(buf.address + 64, 128)
    assert torch.count_nonzero(tensor).item() == 0          # zeroed at allocation
    tensor.fill_(3.0)
    again = torch.from_dlpack(buf.view("float32", 16, (32,)))
    assert torch.equal(to_host(again), torch.full((32,), 3.0))
    buf.zero_()
    assert torch.count_nonzero(again).item() == 0


@needs_real_gpu
def test_stream_arguments_of_device_exports():
    buf = _C.Buffer(256, "device")
    view = buf.view("float32")
    stream = torch.cuda.Stream()
    for ok in (None, -1, 1, 2, stream.cuda_stream):
        capsule = view.__dlpack__(stream=ok)
        assert capsule is not None
    with pytest.raises(BufferError, match="stream 0 is not valid"):
        view.__dlpack__(stream=0)
    with pytest.raises(TypeError, match="stream must be None or an int"):
        view.__dlpack__(stream="default")
    with pytest.raises(BufferError, match="without a copy across devices"):
        view.__dlpack__(dl_device=(1, 0))


@needs_simulator
def test_device_exports_on_the_simulator_are_host_memory_at_the_alias():
    """What a consumer sees on the simulator: host memory (kDLCPU), so no
    stream to order, and no CUDA tensor without a copy; rlhfz's importer
    maps the alias back to the device memory it stands for."""
    buf = _C.Buffer(256, "device")
    view = buf.view("float32")
    assert view.__dlpack__(stream=None) is not None
    assert view.__dlpack__(dl_device=(1, 0)) is not None
    for handle in (-1, 1, 2, _C.CudaStream().handle):
        with pytest.raises(BufferError, match="stream must be None for host memory"):
            view.__dlpack__(stream=handle)
    with pytest.raises(BufferError, match="without a copy across devices"):
        view.__dlpack__(dl_device=(2, 0))
    tensor = torch.from_dlpack(view)
    assert _C.cuda_device_pointer(tensor.data_ptr(), 256) == (buf.address, buf.device)


def test_copied_device_export_is_a_new_device_buffer():
    buf = _C.Buffer(1024, "device")
    original = torch.from_dlpack(buf.view("float32"))
    original.copy_(to_device(torch.arange(256.0)))
    copied = torch.from_dlpack(buf.view("float32").__dlpack__(copy=True,
                                                              max_version=(1, 0)))
    assert copied.data_ptr() != original.data_ptr() == torch_address(buf.address, 1024)
    assert on_device(copied)
    assert torch.equal(to_host(copied), torch.arange(256.0))


def test_cpu_kernels_refuse_device_views_but_take_pinned_ones():
    device = _C.Buffer(64, "device")
    with pytest.raises(BufferError, match="needs host memory"):
        _C.sumsq(device.view("float32"))
    pinned = _C.Buffer(64, "pinned")
    assert pinned.tier == "pinned"
    assert pinned.view("float32").__dlpack_device__() == (3, 0)
    assert _C.sumsq(pinned.view("float32")) == 0.0


def test_bad_device_ordinal_raises():
    with pytest.raises(RuntimeError, match="CUDA device 4096: invalid device ordinal"):
        _C.Buffer(64, "device", device=4096)


def test_pinned_memory_reaches_torch_as_pinned_cpu_memory():
    """torch takes no kDLCUDAHost tensors: pinned views go over as kDLCPU on
    request (dl_device), still pinned, so torch's copies from them are async.
    (torch's CPU build, on the simulator, cannot say whether memory is
    pinned: there the runtime's count of cudaHostAlloc calls does.)"""
    from rlhfz.engine import torch_view
    host_allocs = _C.cuda_sim_calls("cudaHostAlloc") if SIMULATED else 0
    buffer = _C.Buffer(4096, "pinned")
    assert buffer.tier == "pinned"
    view = buffer.view("float32")
    assert view.__dlpack_device__() == (3, 0)
    tensor = torch_view(view)
    assert tensor.device.type == "cpu" and tensor.data_ptr() == view.address
    if SIMULATED:
        assert _C.cuda_sim_calls("cudaHostAlloc") == host_allocs + 1
    else:
        assert tensor.is_pinned()
    with pytest.raises(BufferError, match="without a copy across devices"):
        view.__dlpack__(dl_device=(2, 0))
