"""Device and pinned Buffers on a GPU: memory really returns to the driver,
and DLPack views are zero-copy CUDA tensors. Skipped without a CUDA device."""
import pytest
import torch

from rlhfz import _C

pytestmark = pytest.mark.gpu

GIB = 1 << 30


def test_device_memory_goes_back_to_the_driver():
    torch.cuda.synchronize()
    free_before, total = _C.cuda_mem_get_info(0)
    buf = _C.Buffer(GIB, "device", device=0, zero=False)
    free_held, _ = _C.cuda_mem_get_info(0)
    assert free_before - free_held >= GIB
    del buf
    free_after, _ = _C.cuda_mem_get_info(0)
    # the driver has it back (other processes may move the figure a little)
    assert free_after >= free_before - 64 * (1 << 20)
    assert 0 < free_after <= total


def test_device_views_are_cuda_tensors_sharing_memory():
    buf = _C.Buffer(4096, "device")
    assert (buf.tier, buf.device) == ("device", torch.cuda.current_device())
    view = buf.view("float32", 16, (8, 4))
    assert view.__dlpack_device__() == (2, buf.device)
    tensor = torch.from_dlpack(view)
    assert tensor.is_cuda and tensor.data_ptr() == buf.address + 64
    assert torch.count_nonzero(tensor).item() == 0          # zeroed at allocation
    tensor.fill_(3.0)
    again = torch.from_dlpack(buf.view("float32", 16, (32,)))
    assert torch.equal(again, torch.full((32,), 3.0, device="cuda"))
    buf.zero_()
    assert torch.count_nonzero(again).item() == 0


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


def test_copied_device_export_is_a_new_device_buffer():
    buf = _C.Buffer(1024, "device")
    torch.from_dlpack(buf.view("float32")).copy_(torch.arange(256.0, device="cuda"))
    copied = torch.from_dlpack(buf.view("float32").__dlpack__(copy=True,
                                                              max_version=(1, 0)))
    assert copied.data_ptr() != buf.address
    assert torch.equal(copied, torch.arange(256.0, device="cuda"))


def test_cpu_kernels_refuse_device_views_but_take_pinned_ones():
    device = _C.Buffer(64, "device")
    with pytest.raises(BufferError, match="needs host memory"):
        _C.sumsq(device.view("float32"))
    pinned = _C.Buffer(64, "pinned")
    assert pinned.tier == "pinned"
    assert pinned.view("float32").__dlpack_device__() == (3, 0)
    assert _C.sumsq(pinned.view("float32")) == 0.0


def test_bad_device_ordinal_raises():
    with pytest.raises(MemoryError, match="CUDA device 4096"):
        _C.Buffer(64, "device", device=4096)


@pytest.mark.gpu
def test_pinned_memory_reaches_torch_as_pinned_cpu_memory():
    """torch takes no kDLCUDAHost tensors: pinned views go over as kDLCPU on
    request (dl_device), still pinned, so torch's copies from them are async."""
    from rlhfz.backends import torch_view
    buffer = _C.Buffer(4096, "pinned")
    assert buffer.tier == "pinned"
    view = buffer.view("float32")
    assert view.__dlpack_device__() == (3, 0)
    tensor = torch_view(view)
    assert tensor.device.type == "cpu" and tensor.data_ptr() == view.address
    assert tensor.is_pinned()
    with pytest.raises(BufferError, match="without a copy across devices"):
        view.__dlpack__(dl_device=(2, 0))
