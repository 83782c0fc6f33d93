"""Where the optimizer's memory lives and which kernels step it.

A backend allocates Buffers in its tier and runs the C kernels on them:
HostBackend on the CPU (SIMD kernels, host memory), CudaBackend on one
GPU (CUDA kernels on device memory, queued on torch's current stream, so
they order with the forward and backward around them as torch's own ops
do). The optimizer, buckets, reducer, migration and the native NCCL engine
only talk to this interface: every use of torch.cuda goes through it.

SimulatedCudaBackend is CudaBackend on the simulated CUDA runtime of a
RLHFZ_CUDA=sim build (CI's GPU). torch's CPU build stands in for the GPU
side of the program there: device memory reaches torch as CPU tensors over
the simulator's host alias, and "torch's current stream" is the default
stream, whose work runs inline, since torch's CPU ops are synchronous.
rlhfz's own streams (copies, collectives) stay asynchronous. It is chosen
by one explicit switch, RLHFZ_SIM_DEVICE=<ordinal>: params on the CPU then
get their buckets on that simulated device (RLHFZ_SIM_DEVICE=local_rank: each
rank on its own, LOCAL_RANK).
"""
from __future__ import annotations

import contextlib
import os
import struct

import torch

from .. import _C

SIM_DEVICE_ENV = "RLHFZ_SIM_DEVICE"
# The param dtypes rlhfz steps, by the names the C core gives them.
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def torch_view(view) -> torch.Tensor:
    """A torch tensor over an rlhfz BufferView, without a copy. Pinned
    memory goes over as CPU memory, since torch takes no kDLCUDAHost
    tensors; it stays pinned, so torch's copies from it are asynchronous."""
    if view.buffer.tier == "pinned":
        return torch.from_dlpack(view.__dlpack__(dl_device=(1, 0)))
    return torch.from_dlpack(view)


class HostBackend:
    tier = "host"
    device = torch.device("cpu")

    def buffer(self, nbytes: int, zero: bool = True):
        return _C.Buffer(nbytes, zero=zero)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Transient memory (a gather's, say)."""
        return torch.empty(numel, dtype=dtype)

    def adamw_step(self, views, lowp: dict | None, step: int, hparams: dict) -> None:
        """One step over a part's views; lowp: the low-precision step's
        further keywords (Bucket.kernel_views), None for fp32 moments."""
        if lowp is None:
            _C.adamw_step(*views, step=step, **hparams)
        else:
            _C.adamw_step_lowp(*views, step=step, **lowp, **hparams)

    def sumsq(self, views) -> float:
        """Sum of squares over every view, in double. Last view first (and
        each view's ranges last first), so what the step or scale after it
        reads first is what this pass left in the cache."""
        return sum(_C.sumsq(view) for view in reversed(views))

    def sumsq_each(self, views) -> list[float]:
        """Each view's sum of squares, in double."""
        return [_C.sumsq(view) for view in views]

    def scale_(self, view, factor: float) -> None:
        _C.scale_(view, factor)

    def cast_(self, dst, src) -> None:
        _C.cast_(dst, src)

    def zero_(self, buffer, flat: torch.Tensor) -> None:
        buffer.zero_()


class CudaBackend:
    tier = "device"
    simulated = False

    def __init__(self, device: torch.device):
        info = _C.build_info()
        if not info["cuda"]:
            raise RuntimeError(
                f"parameters are on {device}, but rlhfz cannot use CUDA: "
                f"{info['cuda_error'] or 'it was built without CUDA (no nvcc at build time)'}")
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        # the device torch's tensors of this memory are on
        self.device = torch.device("cuda", self.index)
        self._init_state()

    def _init_state(self) -> None:
        self._sumsq_scalars = None
        self._sumsq_slots = None      # sumsq_each's results, kept to the most views yet
        self._copy_stream = None
        self._pending_frees: list[tuple] = []     # (event, buffers)

    def _sumsq_buffers(self):
        """One sum-of-squares result and its scratch, made once, reused every step."""
        if self._sumsq_scalars is None:
            self._sumsq_scalars = (
                _C.Buffer(8, tier="device", device=self.index),
                _C.Buffer(_C.cuda_sumsq_workspace_bytes(), tier="device", device=self.index))
        return self._sumsq_scalars

    # ---- the runtime, as torch shares it ------------------------------------------

    def stream(self) -> int:
        """torch's current stream on this device, as a handle."""
        return torch.cuda.current_stream(self.index).cuda_stream

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        self.reap()

    def empty_cache(self) -> None:
        """Hands torch's cached blocks back to the driver."""
        torch.cuda.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as the driver sees them."""
        return _C.cuda_mem_get_info(self.index)

    def device_guard(self):
        """A context in which this device is the current one."""
        return torch.cuda.device(self.index)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Transient device memory from torch's caching allocator: it hands
        the same blocks back in stream order, where cudaMalloc and cudaFree
        would synchronize the device every time."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def device_address(self, tensor: torch.Tensor) -> int:
        """The device pointer of a tensor's first element (for NCCL)."""
        if not tensor.is_cuda or tensor.device.index != self.index:
            raise ValueError(f"expected a tensor on cuda:{self.index}, not on {tensor.device}")
        return tensor.data_ptr()

    # ---- rlhfz's own stream, and memory freed behind events ------------------------

    def copy_stream(self):
        """rlhfz's stream for moving memory: copies run apart from torch's work."""
        if self._copy_stream is None:
            self._copy_stream = _C.CudaStream(self.index)
        return self._copy_stream

    def record(self, stream):
        """An event marking the work queued on stream so far."""
        event = _C.CudaEvent(self.index)
        event.record(stream)
        return event

    def release_after(self, buffers, event) -> None:
        """Drops the buffers once the event is done: work queued before it
        may still read them, and freeing device memory synchronizes the
        device, which a non-blocking move must not wait for."""
        self._pending_frees.append((event, list(buffers)))
        self.reap()

    def reap(self) -> None:
        """Frees what release_after held whose events are done."""
        if self._pending_frees:
            self._pending_frees = [(e, b) for e, b in self._pending_frees if not e.query()]

    # ---- kernels --------------------------------------------------------------------

    def buffer(self, nbytes: int, zero: bool = True):
        return _C.Buffer(nbytes, tier="device", device=self.index, zero=zero)

    def adamw_step(self, views, lowp: dict | None, step: int, hparams: dict) -> None:
        if lowp is None:
            _C.cuda_adamw_step(*views, step=step, stream=self.stream(), **hparams)
        else:
            _C.cuda_adamw_step_lowp(*views, step=step, stream=self.stream(), **lowp, **hparams)

    def sumsq(self, views) -> float:
        """Sum of squares over every view, in double: one launch per view
        into one device scalar, and one host read at the end."""
        stream = self.stream()
        out, workspace = self._sumsq_buffers()
        launched = False
        for view in views:
            _C.cuda_sumsq(view, out, workspace, accumulate=launched, stream=stream)
            launched = True
        if not launched:
            return 0.0
        return struct.unpack("d", _C.cuda_fetch(out, 0, 8, stream=stream))[0]

    def sumsq_each(self, views) -> list[float]:
        """Each view's sum of squares, in double: one launch per view, each
        into its own slot of one device buffer, and one host read of them all."""
        views = list(views)
        if not views:
            return []
        stream = self.stream()
        _, workspace = self._sumsq_buffers()
        if self._sumsq_slots is None or self._sumsq_slots.nbytes < 8 * len(views):
            self._sumsq_slots = _C.Buffer(8 * len(views), tier="device", device=self.index,
                                          zero=False)
        out = self._sumsq_slots
        for index, view in enumerate(views):
            _C.cuda_sumsq(view, out, workspace, index=index, stream=stream)
        sums = _C.cuda_fetch(out, 0, 8 * len(views), stream=stream)
        return list(struct.unpack(f"{len(views)}d", sums))

    def scale_(self, view, factor: float) -> None:
        _C.cuda_scale_(view, factor, stream=self.stream())

    def cast_(self, dst, src) -> None:
        _C.cuda_cast_(dst, src, stream=self.stream())

    def zero_(self, buffer, flat: torch.Tensor) -> None:
        flat.zero_()     # in stream order, where Buffer.zero_ would block the host


class SimulatedCudaBackend(CudaBackend):
    """CudaBackend on the simulated CUDA runtime (see the module's notes)."""

    simulated = True

    def __init__(self, index: int):
        if _C.build_info()["cuda"] != "sim":
            raise RuntimeError(f"{SIM_DEVICE_ENV} is set, but this rlhfz was not built against "
                               f"the simulated CUDA runtime (RLHFZ_CUDA=sim): unset it")
        devices = _C.build_info()["cuda_devices"]
        if not 0 <= index < devices:
            raise ValueError(f"{SIM_DEVICE_ENV}={index}, but the simulator has {devices} "
                             f"device(s) (RLHFZ_SIM_DEVICES)")
        self.index = index
        self.device = torch.device("cpu")     # torch sees device memory through its alias
        self._init_state()

    def stream(self) -> int:
        return 0        # the default stream: inline, as torch's CPU ops are

    def synchronize(self) -> None:
        _C.cuda_synchronize(self.index)
        self.reap()

    def empty_cache(self) -> None:
        pass            # no caching allocator stands between torch and the simulator

    @contextlib.contextmanager
    def device_guard(self):
        previous = _C.cuda_get_device()
        _C.cuda_set_device(self.index)
        try:
            yield
        finally:
            _C.cuda_set_device(previous)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Simulated device memory of its own (torch allocates host memory)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        buffer = _C.Buffer(numel * itemsize, tier="device", device=self.index, zero=False)
        return torch_view(buffer.view(DTYPE_NAMES[dtype]))

    def device_address(self, tensor: torch.Tensor) -> int:
        """The device pointer a CPU tensor over the host alias stands for; a
        tensor of plain host memory is refused, as a CPU tensor is on a GPU."""
        nbytes = tensor.numel() * tensor.element_size()
        address, device = _C.cuda_device_pointer(tensor.data_ptr(), nbytes)
        if device != self.index:
            raise ValueError(f"the tensor is memory of simulated device {device}, not "
                             f"{self.index}")
        return address



def simulated_device() -> int | None:
    """The simulated device RLHFZ_SIM_DEVICE places CPU params' buckets on,
    or None. "local_rank" is the rank's own device, LOCAL_RANK (which
    torchrun and rlhfz.launch.run_ranks set), as a GPU program makes
    cuda:LOCAL_RANK current: NCCL takes no two ranks on one device."""
    text = os.environ.get(SIM_DEVICE_ENV, "").strip()
    if not text:
        return None
    if text == "local_rank":
        local = os.environ.get("LOCAL_RANK", "").strip()
        if not local.isdigit():
            raise ValueError(f"{SIM_DEVICE_ENV}=local_rank needs LOCAL_RANK, the rank's index on "
                             f"its machine (torchrun and rlhfz.launch.run_ranks set it), not "
                             f"{local!r}: set it, or give {SIM_DEVICE_ENV} a device ordinal")
        return int(local)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{SIM_DEVICE_ENV} must be a device ordinal or 'local_rank', not "
                         f"{text!r}") from None


def backend_for(device: torch.device):
    if device.type == "cpu":
        index = simulated_device()
        return HostBackend() if index is None else SimulatedCudaBackend(index)
    if device.type == "cuda":
        return CudaBackend(device)
    raise ValueError(f"parameters must be on the CPU or a CUDA device, not {device}")
