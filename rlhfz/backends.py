"""Where the optimizer's memory lives and which kernels step it.

A backend allocates Buffers in its tier and runs the C kernels on them:
HostBackend on the CPU (SIMD kernels, host memory), CudaBackend on one
GPU (CUDA kernels on device memory, queued on torch's current stream, so
they order with the forward and backward around them as torch's own ops
do). The optimizer, buckets and reducer only talk to this interface.
"""
from __future__ import annotations

import struct

import torch

from . import _C


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

    def adamw_step(self, views, step: int, hparams: dict) -> None:
        _C.adamw_step(*views, step=step, **hparams)

    def sumsq(self, views) -> float:
        """Sum of squares over every view, in double."""
        return sum(_C.sumsq(view) for view in views)

    def scale_(self, view, factor: float) -> None:
        _C.scale_(view, factor)

    def cast_(self, dst, src) -> None:
        _C.cast_(dst, src)

    def zero_(self, buffer, flat: torch.Tensor) -> None:
        buffer.zero_()


class CudaBackend:
    tier = "device"

    def __init__(self, device: torch.device):
        info = _C.build_info()
        if not info["cuda"]:
            raise RuntimeError(
                f"parameters are on {device}, but rlhfz cannot use CUDA: "
                f"{info['cuda_error'] or 'it was built without CUDA (no nvcc at build time)'}")
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        # One sum-of-squares result and its scratch, reused every step.
        self._sumsq_out = _C.Buffer(8, tier="device", device=self.index)
        self._sumsq_workspace = _C.Buffer(_C.cuda_sumsq_workspace_bytes(), tier="device",
                                          device=self.index)

    def stream(self) -> int:
        return torch.cuda.current_stream(self.index).cuda_stream

    def buffer(self, nbytes: int, zero: bool = True):
        return _C.Buffer(nbytes, tier="device", device=self.index, zero=zero)

    def adamw_step(self, views, step: int, hparams: dict) -> None:
        _C.cuda_adamw_step(*views, step=step, stream=self.stream(), **hparams)

    def sumsq(self, views) -> float:
        """Sum of squares over every view, in double: one launch per view
        into one device scalar, and one host read at the end."""
        stream = self.stream()
        launched = False
        for view in views:
            _C.cuda_sumsq(view, self._sumsq_out, self._sumsq_workspace, accumulate=launched,
                          stream=stream)
            launched = True
        if not launched:
            return 0.0
        return struct.unpack("d", _C.cuda_fetch(self._sumsq_out, 0, 8, stream=stream))[0]

    def scale_(self, view, factor: float) -> None:
        _C.cuda_scale_(view, factor, stream=self.stream())

    def cast_(self, dst, src) -> None:
        _C.cuda_cast_(dst, src, stream=self.stream())

    def zero_(self, buffer, flat: torch.Tensor) -> None:
        flat.zero_()     # in stream order, where Buffer.zero_ would block the host


def backend_for(device: torch.device):
    if device.type == "cpu":
        return HostBackend()
    if device.type == "cuda":
        return CudaBackend(device)
    raise ValueError(f"parameters must be on the CPU or a CUDA device, not {device}")
