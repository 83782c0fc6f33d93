"""Collectives across ranks: a control plane, and engines that move data.

    control.py        timeouts, agreement between ranks, mismatch detection, the errors
    torch_engine.py   data over torch.distributed (gloo pieces on the CPU, nccl on GPUs)
    nccl_engine.py    data over rlhfz's own NCCL communicator (collectives="nccl")
    nccl_library.py   finding libnccl.so.2

A Communicator puts a control plane and an engine together behind one small
interface: agree / exchange on the control plane; reduce-scatter,
all-gather and all-reduce on flat tensors (views of rlhfz buffers) on the
engine; and the first rank's values to every rank at start. Every collective
rlhfz makes goes through it. A single process has none (communicator_for
gives None), so nothing there waits on anyone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .control import CollectiveError, CollectiveMismatchError, ControlPlane, collective_timeout
from .torch_engine import TorchEngine

__all__ = ["CollectiveError", "CollectiveMismatchError", "Communicator",
           "NativeNcclCommunicator", "collective_timeout", "communicator_for"]


class Communicator:
    """Collectives over a torch.distributed process group (gloo or nccl)."""

    def __init__(self, process_group=None):
        self.group = process_group
        self.control = ControlPlane(process_group)
        self.rank, self.world_size = self.control.rank, self.control.world_size
        # torch.distributed moves the first rank's values at start, whatever
        # engine moves the data afterwards
        self.torch = TorchEngine(self.control, process_group)
        self.data = self.torch

    def destroy(self) -> None:
        """Releases the groups rlhfz made (their sockets and gloo threads);
        every rank calls it, and nothing collective works afterwards."""
        if self.data is not self.torch:
            self.data.destroy()
        self.torch.destroy()
        self.control.destroy()

    # ---- the control plane -----------------------------------------------------------

    def agree(self, call: str, signature=None) -> None:
        """Checks that every rank is in `call` with an equal `signature`."""
        self.control.agree(call, signature)

    def exchange(self, value, call: str) -> list:
        """Every rank's small picklable value, in rank order."""
        return self.control.exchange(value, call)

    def all_reduce_sum_host(self, value: float) -> float:
        return self.control.all_reduce_sum_host(value)

    def all_reduce_max_control(self, tensor: torch.Tensor, call: str) -> None:
        self.control.all_reduce_max(tensor, call)

    def start_from_first_rank(self, tensors: list, call: str) -> None:
        """Every rank starts from the first rank's values, as DDP and DeepSpeed
        do: ranks that initialized differently would otherwise train a mix of
        models without a word. Ranks whose tensors differ in number, shape or
        dtype fail here, naming the difference, instead of later, in a hang."""
        self.agree(call, [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in tensors])
        self.torch.broadcast_from_first(tensors)

    # ---- the data engine -------------------------------------------------------------

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                       async_op: bool = False):
        """shard_out = the mean over ranks of this rank's range of full_in."""
        return self.data.reduce_scatter(shard_out, full_in, async_op=async_op)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor,
                   async_op: bool = False):
        """full_out = the ranks' shards back to back."""
        return self.data.all_gather(full_out, shard_in, async_op=async_op)

    def all_reduce_avg(self, tensor: torch.Tensor, async_op: bool = False):
        """tensor = its mean over ranks, in place."""
        return self.data.all_reduce_avg(tensor, async_op=async_op)


class NativeNcclCommunicator(Communicator):
    """A Communicator whose data moves on rlhfz's own NCCL communicator, on
    the device of `backend` (a CUDA or simulated CUDA backend)."""

    def __init__(self, process_group, backend):
        from .nccl_engine import NcclEngine
        super().__init__(process_group)
        try:
            self.data = NcclEngine(self.control, backend)
        except BaseException:
            super().destroy()
            raise
        self.backend = backend

    @property
    def nccl(self):
        return self.data.nccl

    def raise_if_failed(self) -> None:
        self.data.raise_if_failed()


def communicator_for(process_group, collectives: str = "torch",
                     backend=None) -> Communicator | None:
    """None in a single process (no collectives at all). collectives="nccl"
    gives rlhfz's own NCCL communicator on the device backend's device."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) == 1:
        return None
    if collectives == "nccl":
        return NativeNcclCommunicator(process_group, backend)
    return Communicator(process_group)
