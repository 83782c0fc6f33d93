"""The device the GPU tests run on, and how they reach it.

Either a CUDA GPU, seen through torch's CUDA build, or the simulated CUDA
runtime of a RLHFZ_CUDA=sim build (make test-sim). torch's CPU build stands
in for the GPU side of a program there: device memory is a CPU tensor over
the simulator's host alias, torch's ops on it run at once (so work rlhfz
queues on "torch's current stream", the default stream, runs inline), and
rlhfz's own streams run apart. Tests written with these helpers run
unchanged on both; the few that need something only a GPU has (torch's
caching allocator, torch's CUDA streams) are marked needs_real_gpu.
"""
from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

import rlhfz
from rlhfz import _C

_INFO = rlhfz.build_info()
SIMULATED = _INFO["cuda"] == "sim"
REAL = bool(_INFO["cuda"]) and not SIMULATED and torch.cuda.is_available()
AVAILABLE = SIMULATED or REAL

needs_device = pytest.mark.skipif(
    not AVAILABLE, reason="needs a CUDA device, or the simulated build (make test-sim)")
needs_real_gpu = pytest.mark.skipif(
    not REAL, reason="needs a real GPU (torch's CUDA build: its caching allocator or streams)")
needs_simulator = pytest.mark.skipif(not SIMULATED,
                                     reason="needs the simulated build (make test-sim)")

# Where torch's tensors of device memory are.
DEVICE = torch.device("cpu") if SIMULATED else torch.device("cuda")
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def empty(shape, dtype=torch.float32) -> torch.Tensor:
    """Uninitialized device memory (garbage on the simulator: 0xFF bytes)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not SIMULATED:
        return torch.empty(shape, dtype=dtype, device="cuda")
    numel = 1
    for dim in shape:
        numel *= dim
    name = NAMES.get(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(numel, 1) * itemsize
    # other dtypes are the bytes of a float16 view, reinterpreted: an odd
    # count of bytes (of int8, say) takes one more
    buffer = _C.Buffer(nbytes + (nbytes % 2 if name is None else 0), "device", zero=False)
    if name is None:
        raw = torch.from_dlpack(buffer.view("float16")).view(torch.uint8)
        return raw[:numel * itemsize].view(dtype).view(shape)
    return torch.from_dlpack(buffer.view(name, 0, (numel,))).view(shape)


def zeros(shape, dtype=torch.float32) -> torch.Tensor:
    return empty(shape, dtype).zero_()


def full(shape, value, dtype=torch.float32) -> torch.Tensor:
    return empty(shape, dtype).fill_(value)


def to_device(values: torch.Tensor) -> torch.Tensor:
    """A copy of a host tensor in device memory."""
    out = empty(values.shape, values.dtype)
    out.copy_(values)
    return out


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory (after the default stream's work)."""
    return tensor.detach().clone() if SIMULATED else tensor.detach().cpu()


# Guarded arrays: the bits of each dtype, and a pattern between arrays that
# no kernel writes. Signalling NaNs for floats (every kernel's conversions
# quiet NaNs); -128 for int8 codes (they stop at -127); for uint8 codes,
# which take every value, a pattern an overrun would have to write exactly.
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
        torch.int8: torch.int8, torch.uint8: torch.uint8}
SENTINEL = {torch.float32: 0x7FA5A5A5, torch.bfloat16: 0x7FA5, torch.float16: 0x7DA5,
            torch.int8: -128, torch.uint8: 0xA5}
# 16 elements: 64, 32 or 16 bytes, so an array at offset 0 keeps the
# allocation's 16-byte alignment and takes the vector path.
GUARD = 16


class Guarded:
    """n device elements between GUARD sentinel elements on each side; `arg`
    is what the kernel gets: a torch slice, or with buffer=True an rlhfz
    BufferView of a device Buffer (float dtypes only)."""

    def __init__(self, values: torch.Tensor | None, offset: int = 0, *, n: int | None = None,
                 dtype: torch.dtype | None = None, buffer: bool = False):
        dtype = values.dtype if values is not None else dtype
        n = values.numel() if values is not None else n
        self.dtype, self.lo, self.hi = dtype, GUARD + offset, GUARD + offset + n
        total = self.hi + GUARD
        if buffer:
            self.owner = _C.Buffer(total * torch.empty((), dtype=dtype).element_size(), "device")
            self.full = torch.from_dlpack(self.owner.view(NAMES[dtype]))
            self.arg = self.owner.view(NAMES[dtype], self.lo, (n,))
        else:
            self.full = empty(total, dtype)
            self.arg = self.full[self.lo:self.hi]
        self.full.view(BITS[dtype]).fill_(SENTINEL[dtype])
        self.values = self.full[self.lo:self.hi]
        if values is not None:
            self.values.copy_(values)

    def guards_intact(self) -> bool:
        bits = self.full.view(BITS[self.dtype])
        sentinel = SENTINEL[self.dtype]
        return bool((bits[:self.lo] == sentinel).all()) and bool((bits[self.hi:] == sentinel).all())

    def host(self) -> torch.Tensor:
        return to_host(self.values)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A host copy of t's bits, as integers."""
    return to_host(t).view(BITS[t.dtype])


def assert_same_bits(actual, expected, what):
    """Bitwise equality (the sign of zero included); on failure, how many
    elements differ and by how many ulps at most."""
    a, e = bits(actual).long(), bits(expected).long()
    diff = (a - e).abs()     # the distance in ulps, for values of one sign
    if bool(diff.any()):
        i = int(torch.nonzero(diff)[0])
        raise AssertionError(
            f"{what}: {int((diff > 0).sum())} of {diff.numel()} elements differ, by up to "
            f"{int(diff.max())} ulp; first at {i}: {actual.reshape(-1)[i].item()!r} vs "
            f"{expected.reshape(-1)[i].item()!r}")


def stream() -> int:
    """The stream torch's ops run on, as a handle (the default stream on the
    simulator, whose work runs inline)."""
    return 0 if SIMULATED else torch.cuda.current_stream().cuda_stream


def synchronize(device: int = 0) -> None:
    if SIMULATED:
        _C.cuda_synchronize(device)
    else:
        torch.cuda.synchronize(device)


def mem_get_info(device: int = 0) -> tuple[int, int]:
    """(free, total) bytes of the device, as the driver (or simulator) counts them."""
    return _C.cuda_mem_get_info(device)


@contextlib.contextmanager
def params_on_device(monkeypatch=None):
    """Within it, ZeroAdamW puts params' buckets on device 0: on a GPU the
    model must be there already (model.to(DEVICE) is a no-op on the
    simulator), on the simulator the switch RLHFZ_SIM_DEVICE does it."""
    if not SIMULATED:
        yield
        return
    patch = monkeypatch or pytest.MonkeyPatch()
    patch.setenv("RLHFZ_SIM_DEVICE", "0")
    try:
        yield
    finally:
        if monkeypatch is None:
            patch.undo()


def on_device(tensor: torch.Tensor) -> bool:
    """Whether a tensor's memory is device memory."""
    if not SIMULATED:
        return tensor.is_cuda
    try:
        _C.cuda_device_pointer(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    except ValueError:
        return False
    return True


def torch_address(address: int, nbytes: int) -> int:
    """Where torch sees the nbytes of device memory at address: the address
    itself on a GPU, its host alias on the simulator."""
    return _C.cuda_host_alias(address, nbytes) if SIMULATED else address


@contextlib.contextmanager
def held(stream, limit_s: float = 60.0):
    """Simulator only: work queued on `stream` (an rlhfz CudaStream) inside
    the block waits until the block ends, so a test sees it in flight. A
    call that waits for that work would wait for good: a timer releases the
    stream after limit_s, and the block then fails rather than hangs.
    Memory freed while the stream is held waits for it (cudaFree
    synchronizes the device), so the borrows kernels of earlier tests still
    hold are let go first, and no garbage is collected inside the block."""
    _C.cuda_synchronize(stream.device)
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    token = _C.cuda_sim_hold(stream)
    lock = threading.Lock()
    released = []

    def release(late: bool) -> None:
        with lock:
            if not released:
                released.append(late)
                _C.cuda_sim_release(token)

    timer = threading.Timer(limit_s, release, (True,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        release(False)
        if collecting:
            gc.enable()
    if released[0]:
        raise AssertionError(f"something waited for the work held on {stream!r}: the stream "
                             f"was let go only after {limit_s} s")
