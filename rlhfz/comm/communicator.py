"""A Communicator: a control plane and a data engine over one process group.

agree / exchange / statuses on the control plane; reduce-scatter,
all-gather, gather to one rank and all-reduce on flat tensors (views of
rlhfz buffers) on the engine, each counted in bytes by collective; and the
first rank's values to every rank at start.
"""
from __future__ import annotations

import torch

from .control import ControlPlane
from .torch_engine import TorchEngine


class Communicator:
    """Collectives over a torch.distributed process group (gloo or nccl).

    rows: the ranks of every group of its kind when each rank's group
    differs (a mesh dimension's); see ControlPlane."""

    # this rank's place across replicas of the sharded state (hybrid.py)
    replica, replicas = 0, 1
    mesh = None              # the DeviceMesh it was made from, if any

    def __init__(self, process_group=None, rows=None):
        self.group = process_group
        self.control = ControlPlane(process_group, rows=rows)
        self.rank, self.world_size = self.control.rank, self.control.world_size
        # torch.distributed moves the first rank's values at start, whatever
        # engine moves the data afterwards
        self.torch = TorchEngine(self.control, process_group)
        self.data = self.torch
        # bytes handed to each data collective: what this rank puts on the wire
        self.traffic = {"reduce_scatter": 0, "all_gather": 0, "gather": 0, "all_reduce": 0}

    @property
    def leads(self) -> bool:
        """This rank writes what one rank writes for all (an index, a
        consolidated file) and keeps what rank0_only keeps."""
        return self.rank == 0 and self.replica == 0

    @property
    def members(self) -> list[int]:
        """Global ranks of every rank in rlhfz's collective calls, replicas too."""
        return list(self.control.global_ranks)

    @property
    def shard_ranks(self) -> list[int]:
        """Global ranks of this rank's shard group (whose shards it gathers)."""
        return list(self.control.global_ranks)

    @property
    def writes_shards(self) -> bool:
        """This rank writes its shard of a checkpoint (one replica does)."""
        return self.replica == 0

    def traffic_by_dimension(self) -> dict[str, dict[str, int]]:
        """{dimension: {collective: bytes}} this rank has sent so far."""
        return {"shard": dict(self.traffic)}

    def destroy(self) -> None:
        """Releases the groups rlhfz made (their sockets and gloo threads);
        every rank calls it, and nothing collective works afterwards."""
        # each part goes even when one before it fails (its error is raised)
        try:
            if self.data is not self.torch:
                self.data.destroy()
        finally:
            try:
                self.torch.destroy()
            finally:
                self.control.destroy()

    # ---- the control plane -----------------------------------------------------------

    def agree(self, call: str, signature=None, within=None) -> None:
        """Checks that every rank is in `call` with an equal `signature`, and
        `within` (a value only the shard group's ranks share) too."""
        self.control.agree(call, signature if within is None else (signature, within))

    def exchange(self, value, call: str) -> list:
        """Every rank's small picklable value, in rank order."""
        return self.control.exchange(value, call)

    def statuses(self, value, call: str) -> list:
        """Every rank's value, over every rank that takes part in rlhfz's
        collective calls (replicas too), the leading rank's first: how every
        rank learns that one failed."""
        return self.control.exchange(value, call)

    def explain_failures(self, hint: str) -> None:
        """Adds `hint` to the error of every collective that fails or times
        out from now on (what a user may have done to get there)."""
        if hint not in self.control.hints:
            self.control.hints.append(hint)

    def all_reduce_sum_host(self, value: float | torch.Tensor) -> float | torch.Tensor:
        return self.control.all_reduce_sum_host(value)

    def all_reduce_max_control(self, tensor: torch.Tensor, call: str) -> None:
        self.control.all_reduce_max(tensor, call)

    def count_control(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over every rank of the job's layout (replicas too, where
        there are any) of a small CPU tensor."""
        return self.control.all_reduce_sum_host(tensor)

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
        self.traffic["reduce_scatter"] += _nbytes(full_in)
        return self.data.reduce_scatter(shard_out, full_in, async_op=async_op)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor,
                   async_op: bool = False):
        """full_out = the ranks' shards back to back."""
        self.traffic["all_gather"] += _nbytes(shard_in)
        return self.data.all_gather(full_out, shard_in, async_op=async_op)

    @property
    def gathers_to_one(self) -> bool:
        """gather_to moves only what one rank needs (gloo). Elsewhere callers
        all-gather: on GPUs the gather runs on the fast link within a node."""
        return self.data is self.torch and self.torch.gloo

    def gather_to(self, root: int, full_out: torch.Tensor | None, shard_in: torch.Tensor,
                  async_op: bool = False):
        """full_out on rank `root` = the ranks' shards back to back; the others
        only send theirs. Only where gathers_to_one."""
        if self.rank != root:
            self.traffic["gather"] += _nbytes(shard_in)
        return self.data.gather_to(root, full_out, shard_in, async_op=async_op)

    def all_reduce_avg(self, tensor: torch.Tensor, async_op: bool = False):
        """tensor = its mean over ranks, in place."""
        self.traffic["all_reduce"] += _nbytes(tensor)
        return self.data.all_reduce_avg(tensor, async_op=async_op)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
