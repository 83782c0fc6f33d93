"""The CUDA entry points' argument checks, which run before any CUDA call.

Every check (hyperparameters, streams, where arrays live, dtypes, sizes,
overlap, devices, device scalars) happens on the host, so it is tested here
on hand-built kDLCUDA capsules: without a usable device the call then stops
at the CUDA check, with the reason. With a device (a GPU, or the simulated
runtime: tests/device_support.py) the stream handshake is tested on capsules
of real device memory, and on the simulator valid arguments over host
memory go as far as the launch, which faults and loses the device's context,
as a GPU's kernel would. The kernels themselves are tested in
test_cuda_kernels.py.
"""
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import rlhfz
from device_support import needs_device, needs_real_gpu, needs_simulator, synchronize, zeros
from dlpack_handmade import Handmade
from rlhfz import _C

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
KDLCUDA = 2
NO_CUDA = not rlhfz.build_info()["cuda"]
without_cuda = pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is usable here")


def cuda_array(n=4, *, device_id=0, bits=32, code=2, data=None):
    """A Handmade capsule that claims to be CUDA memory (host bytes behind it,
    never touched: the calls stop before any launch)."""
    backing = data if data is not None else np.zeros(max(n, 1) * 2, dtype=np.float32)
    return Handmade(backing, shape=(n,), code=code, bits=bits, device=(KDLCUDA, device_id))


def adamw_args(n=4, **sizes):
    made = [cuda_array(sizes.get(name, n)) for name in ("master", "exp_avg", "exp_avg_sq", "grad")]
    return made, [m.capsule for m in made]


def device_capsule(buffer, n, *, bits=32, code=2):
    """A Handmade kDLCUDA capsule over the real device memory of a Buffer
    (the Handmade keeps the Buffer alive)."""
    made = Handmade(np.zeros(1, dtype=np.float32), shape=(n,), code=code, bits=bits,
                    device=(KDLCUDA, buffer.device))
    made.managed.dl_tensor.data = buffer.address
    made.buffer = buffer
    return made


@without_cuda
def test_valid_arguments_stop_at_the_cuda_check_with_the_reason():
    keep, arrays = adamw_args()
    with pytest.raises(RuntimeError, match="cuda_adamw_step: .*(CUDA|driver)"):
        _C.cuda_adamw_step(*arrays, **HP)
    x, y = cuda_array(), cuda_array()     # a capsule's memory lives as long as its Handmade
    with pytest.raises(RuntimeError, match="cuda_cast_: "):
        _C.cuda_cast_(y.capsule, x.capsule)
    with pytest.raises(RuntimeError, match="cuda_scale_: "):
        _C.cuda_scale_(y.capsule, 2.0)
    with pytest.raises(RuntimeError, match="CudaStream: "):
        _C.CudaStream()
    with pytest.raises(RuntimeError, match="CudaEvent: "):
        _C.CudaEvent(0)
    with pytest.raises(RuntimeError, match="cuda_fetch: "):
        _C.cuda_fetch(_C.Buffer(8), 0, 8)
    with pytest.raises(RuntimeError, match="cuda_store: "):
        _C.cuda_store(_C.Buffer(8), 0, b"\0" * 8)


# One child process per call: the fault loses the device's context, as on a GPU.
HOST_ADDRESS_CHILD = """
import sys
sys.path.insert(0, TESTS)
import numpy as np, torch
from device_support import zeros
from test_cuda_ops_args import HP, cuda_array
from rlhfz import _C

backings, kept = [], []

def fake(n=8, bits=32):
    dtype = np.float32 if bits == 32 else np.float16
    if MEMORY == "host":
        backing = np.full(n, 1.5, dtype=dtype)
    else:      # the alias, as numpy sees it: the tensor behind it keeps it alive
        backing = zeros(n, torch.float32 if bits == 32 else torch.float16).numpy()
        backing[:] = 1.5
    backings.append(backing)
    made = cuda_array(n, bits=bits, data=backing)
    kept.append(made)          # a capsule's struct lives as long as its Handmade
    return made

out = _C.Buffer(8, "device")
workspace = _C.Buffer(_C.cuda_sumsq_workspace_bytes(), "device")
found = _C.Buffer(4, "device")
calls = {
    "cuda_adamw_step": lambda: _C.cuda_adamw_step(*(fake().capsule for _ in range(5)), **HP),
    "cuda_sumsq": lambda: _C.cuda_sumsq(fake().capsule, out, workspace),
    "cuda_unscale_": lambda: _C.cuda_unscale_(fake().capsule, 0.5, found),
    "cuda_scale_": lambda: _C.cuda_scale_(fake().capsule, 2.0),
    "cuda_cast_": lambda: _C.cuda_cast_(fake().capsule, fake(bits=16).capsule),
}
try:
    calls[CALL]()
except RuntimeError as error:
    print("raised:", error)
print("untouched:", all((backing == 1.5).all() for backing in backings))
try:
    _C.cuda_fetch(out, 0, 8)
except RuntimeError as error:
    print("later:", error)
"""


@pytest.mark.gpu
@needs_simulator
@pytest.mark.parametrize("call", ["cuda_adamw_step", "cuda_sumsq", "cuda_unscale_",
                                  "cuda_scale_", "cuda_cast_"])
@pytest.mark.parametrize("memory", ["host", "alias"])
def test_a_host_address_never_reaches_a_kernel(memory, call):
    """The simulator's side of the test above: valid arguments claimed to be
    CUDA memory but over memory the host can touch (its own, or the host
    alias of device memory) pass every check and stop at the launch, where
    a GPU's kernel would fault: nothing is written, and the device's context
    is lost, so the next call fails too."""
    code = f"TESTS = {os.path.dirname(os.path.abspath(__file__))!r}\n" \
           f"MEMORY = {memory!r}\nCALL = {call!r}\n" + HOST_ADDRESS_CHILD
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert lines[0].startswith(f"raised: {call}: CUDA error: an illegal memory access"), lines
    assert lines[1] == "untouched: True", lines
    assert lines[2] == "later: cuda_fetch: CUDA error: an illegal memory access was encountered", \
        lines


@pytest.mark.parametrize("change, error, message", [
    (dict(lr=-1.0), ValueError, "invalid lr"),
    (dict(beta1=1.0), ValueError, "invalid beta1"),
    (dict(eps=float("nan")), ValueError, "invalid eps"),
    (dict(step=0), ValueError, "step must be >= 1"),
    (dict(step=None), TypeError, "missing required argument 'step'"),
    (dict(grad_scale=float("inf")), ValueError, "invalid grad_scale"),
    (dict(stream="default"), TypeError, "stream must be None, a stream handle"),
    (dict(stream=-3), ValueError, "stream handle must be an address"),
    (dict(stream=object()), TypeError, "cuda_stream or handle attribute"),
])
def test_scalar_arguments_are_checked_first(change, error, message):
    keep, arrays = adamw_args()
    kwargs = {**HP, **change}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    with pytest.raises(error, match=message):
        _C.cuda_adamw_step(*arrays, **kwargs)


def test_host_memory_is_refused_by_name():
    keep, arrays = adamw_args()
    host = torch.zeros(4)
    with pytest.raises(BufferError, match="grad is on device cpu:0; this kernel needs CUDA"):
        _C.cuda_adamw_step(*arrays[:3], host, **HP)
    view = _C.Buffer(16).view("float32")
    with pytest.raises(BufferError, match="master is in host memory; this kernel needs CUDA"):
        _C.cuda_adamw_step(view, *arrays[1:], **HP)
    pinned_like = Handmade(np.zeros(4, dtype=np.float32), device=(3, 0))   # kDLCUDAHost
    with pytest.raises(BufferError, match="x is on device cuda_host:0"):
        _C.cuda_sumsq(pinned_like.capsule, _C.Buffer(8), _C.Buffer(8))


def test_sizes_dtypes_overlap_and_devices_are_checked():
    keep, arrays = adamw_args(4, grad=5)
    with pytest.raises(ValueError, match="grad has 5 elements but master has 4"):
        _C.cuda_adamw_step(*arrays, **HP)
    half = cuda_array(4, bits=16)
    keep, arrays = adamw_args()
    with pytest.raises(TypeError, match="exp_avg must be float32, not float16"):
        _C.cuda_adamw_step(arrays[0], half.capsule, *arrays[2:], **HP)
    shared = np.zeros(8, dtype=np.float32)
    a, b = cuda_array(4, data=shared), cuda_array(4, data=shared)
    with pytest.raises(ValueError, match="master and exp_avg overlap in memory"):
        _C.cuda_adamw_step(a.capsule, b.capsule, *arrays[2:], **HP)
    other = cuda_array(4, device_id=1)
    with pytest.raises(ValueError, match="exp_avg_sq is on cuda:1 but master is on cuda:0"):
        _C.cuda_adamw_step(*arrays[:2], other.capsule, arrays[3], **HP)
    keep2, arrays2 = adamw_args()
    out = cuda_array(5)
    with pytest.raises(ValueError, match="param_out has 5 elements"):
        _C.cuda_adamw_step(*arrays2, out.capsule, **HP)
    dst, src = cuda_array(4), cuda_array(3)
    with pytest.raises(ValueError, match="src has 3 elements but dst has 4"):
        _C.cuda_cast_(dst.capsule, src.capsule)


def test_device_scalars_must_be_device_buffers():
    keep, arrays = adamw_args()
    with pytest.raises(BufferError, match="skip_if is a host Buffer; it must be in the device tier"):
        _C.cuda_adamw_step(*arrays, skip_if=_C.Buffer(4), **HP)
    keep, arrays = adamw_args()
    with pytest.raises(TypeError, match="device_hparams must be an rlhfz Buffer"):
        _C.cuda_adamw_step(*arrays, device_hparams=b"\0" * 36, **HP)
    x = cuda_array()
    with pytest.raises(BufferError, match="out is a host Buffer"):
        _C.cuda_sumsq(x.capsule, _C.Buffer(8), _C.Buffer(8))
    x = cuda_array()
    with pytest.raises(BufferError, match="found_inf is a host Buffer"):
        _C.cuda_unscale_(x.capsule, 0.5, _C.Buffer(4))
    x = cuda_array()
    with pytest.raises(TypeError, match="needs scale or scale_device"):
        _C.cuda_scale_(x.capsule)


def test_transfers_check_their_byte_range():
    for offset, nbytes in ((0, 9), (8, 1), (-1, 4), (0, -1)):
        with pytest.raises(ValueError, match="outside the Buffer's 8"):
            _C.cuda_fetch(_C.Buffer(8), offset, nbytes)
    with pytest.raises(ValueError, match="outside the Buffer's 8"):
        _C.cuda_store(_C.Buffer(8), 4, b"\0" * 5)
    with pytest.raises(TypeError, match="data must be bytes"):
        _C.cuda_store(_C.Buffer(8), 0, bytearray(4))
    with pytest.raises(TypeError, match="buffer must be an rlhfz Buffer"):
        _C.cuda_fetch(np.zeros(2), 0, 8)


class RecordingProducer:
    """A CUDA producer that records the stream its consumer asks for."""

    def __init__(self, made=None):
        self.made = made if made is not None else cuda_array()
        self.streams = []

    def __dlpack_device__(self):
        return (KDLCUDA, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        return self.made.capsule


@without_cuda    # with a device the fake memory would reach a launch
@pytest.mark.parametrize("stream, expected", [
    (None, 1), (0, 1), (1, 1), (2, 2), (0x7F00DEAD0000, 0x7F00DEAD0000),
])
def test_the_kernel_stream_goes_to_the_producer(stream, expected):
    class Torchlike:
        cuda_stream = stream
    for given in (stream,) if stream is None else (stream, Torchlike()):
        producer, src = RecordingProducer(), cuda_array()
        with pytest.raises(RuntimeError, match="cuda_cast_: "):
            _C.cuda_cast_(producer, src.capsule, stream=given)
        assert producer.streams == [expected]


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize("stream", [None, 0, 1, 2, "rlhfz"])
def test_the_kernel_stream_goes_to_a_device_producer(stream):
    """The handshake above with device memory behind the capsule: the
    producer is asked for the kernel's stream, and the kernel writes the
    memory it handed over. ("rlhfz": a stream of rlhfz's own, given as the
    object and as its handle; a made-up handle would reach the runtime here.)"""
    n = 1029
    side = _C.CudaStream() if stream == "rlhfz" else None
    expected = side.handle if side else {None: 1, 0: 1, 1: 1, 2: 2}[stream]
    values = torch.arange(n, dtype=torch.float32).to(torch.bfloat16)
    source = _C.Buffer(2 * n, "device")
    _C.cuda_store(source, 0, values.view(torch.int16).numpy().tobytes())

    class Torchlike:
        cuda_stream = side.handle if side else stream
    for given in (stream,) if stream is None else (side or stream, Torchlike()):
        target = _C.Buffer(4 * n, "device")
        producer = RecordingProducer(device_capsule(target, n))
        _C.cuda_cast_(producer, source.view("bfloat16"), stream=given)
        assert producer.streams == [expected]
        synchronize()
        got = np.frombuffer(_C.cuda_fetch(target, 0, 4 * n), dtype=np.float32)
        assert (got == values.float().numpy()).all()


def test_host_producers_are_not_given_a_stream():
    seen = []

    class HostProducer:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kwargs):
            seen.append(kwargs.get("stream"))
            return torch.zeros(4).__dlpack__()
    keep, arrays = adamw_args()
    with pytest.raises(BufferError, match="on device cpu"):
        _C.cuda_adamw_step(*arrays[:3], HostProducer(), **HP)
    assert seen == [None]


def test_hparams_bytes_hold_what_the_kernels_use():
    packed = _C.adamw_hparams_bytes(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                    weight_decay=0.1, step=3, maximize=True, grad_scale=0.5)
    decay, beta1_weight, beta2, beta2_weight, eps, step_size, bc2_rsqrt, grad_scale, maximize = \
        struct.unpack("8fi", packed)
    f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]   # noqa: E731
    assert decay == f32(1 - 1e-3 * 0.1)
    assert beta1_weight == f32(1 - 0.9) and beta2 == f32(0.999) and beta2_weight == f32(1 - 0.999)
    assert eps == f32(1e-8)
    assert step_size == f32(1e-3 / (1 - 0.9 ** 3))
    assert bc2_rsqrt == f32(1 / math.sqrt(1 - 0.999 ** 3))
    assert grad_scale == 0.5 and maximize == 1
    with pytest.raises(TypeError, match="missing required argument 'lr'"):
        _C.adamw_hparams_bytes(beta1=0.9)


@pytest.mark.parametrize("device", [-1, 1 << 20, "0"])
def test_stream_and_event_devices_are_checked(device):
    with pytest.raises((ValueError, TypeError)):
        _C.CudaStream(device)
    with pytest.raises((ValueError, TypeError)):
        _C.CudaEvent(device=device)


@pytest.mark.gpu
@needs_real_gpu
def test_a_torch_tensor_outlives_the_kernel_that_reads_it():
    """A kernel queued on rlhfz's stream reads its arrays after the call
    returns. The torch tensor it borrowed is kept until the kernel is done:
    let go at once, torch's cache could hand its block to a new tensor on
    another stream while the kernel (held up here by a sleep) still works on
    it. (test_sim_runtime has the simulator's twin.)"""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch")
    side = _C.CudaStream()
    n = 1 << 20
    x = torch.ones(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(side.handle)):
        torch.cuda._sleep(200_000_000)
    _C.cuda_scale_(x, 2.0, stream=side)
    del x
    y = torch.full((n,), 5.0, device="cuda")     # may reuse x's block at once
    side.synchronize()
    torch.cuda.synchronize()
    assert bool((y == 5.0).all())


@needs_simulator
def test_a_refused_call_leaves_a_capsule_lent_to_a_queued_kernel():
    """A capsule stays lent while a kernel that borrowed it is queued. A
    second call on it that is refused ends only its own borrow: the capsule
    must not become consumable (and its memory freeable) under the kernel."""
    from device_support import held
    device = _C.Buffer(1 << 16, "device")
    capsule = device.view("float32").__dlpack__(max_version=(1, 0))
    stream = _C.CudaStream()
    with held(stream):
        _C.cuda_scale_(capsule, 3.0, stream=stream)
        with pytest.raises(Exception):
            _C.cuda_scale_(capsule, scale_device=np.zeros(1, np.float32), stream=stream)
        with pytest.raises(BufferError, match="lent to an rlhfz call"):
            _C.Buffer.from_dlpack(capsule)
    stream.synchronize()
