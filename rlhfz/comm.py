"""Collectives the optimizer needs, over torch.distributed.

One small interface: reduce-scatter, all-gather and all-reduce on flat
tensors (views of rlhfz buffers), plus `agree`, which checks that every rank
entered the same collective with the same arguments. Agreement runs on a
dedicated gloo group with rlhfz's own timeout (RLHFZ_COLLECTIVE_TIMEOUT
seconds, default 300), so a rank that never arrives, or arrives at another
call, makes the others fail with an error that names the mismatch instead
of hanging until the default group's 30-minute timeout.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0

# torch 2.11+ names the flat-tensor collectives *_single; older ones do not.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveMismatchError(RuntimeError):
    """Ranks entered collectives inconsistently (or one never arrived)."""


def collective_timeout() -> float:
    return float(os.environ.get("RLHFZ_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S))


class Communicator:
    """Collectives over a torch.distributed process group (gloo or nccl)."""

    def __init__(self, process_group=None):
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.backend = dist.get_backend(process_group)
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        # Every rank constructs the optimizer, so creating the group here
        # keeps the collective order of new_group consistent.
        self._control = dist.new_group(
            ranks=ranks, backend="gloo",
            timeout=datetime.timedelta(seconds=collective_timeout()))

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                       async_op: bool = False):
        """shard_out = the mean over ranks of this rank's range of full_in."""
        return _reduce_scatter(shard_out, full_in, op=dist.ReduceOp.AVG, group=self.group,
                               async_op=async_op)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor,
                   async_op: bool = False):
        """full_out = the ranks' shards back to back (shard_in may be a view of it)."""
        return _all_gather(full_out, shard_in, group=self.group, async_op=async_op)

    def all_reduce_sum(self, tensor: torch.Tensor):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce_max(self, tensor: torch.Tensor):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def all_reduce_max_control(self, tensor: torch.Tensor, call: str) -> None:
        """A MAX all-reduce of a small CPU tensor under rlhfz's timeout."""
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control)
        except RuntimeError as error:
            raise CollectiveMismatchError(
                f"rank {self.rank} entered {call} but not every rank of the "
                f"{self.world_size} did within {collective_timeout():.0f} s "
                f"(RLHFZ_COLLECTIVE_TIMEOUT): {error}") from error

    def agree(self, call: str, signature) -> None:
        """Checks that every rank is in `call` with an equal `signature`."""
        mine = (call, signature)
        gathered = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, mine, group=self._control)
        except RuntimeError as error:
            raise CollectiveMismatchError(
                f"rank {self.rank} entered {call} but not every rank of the "
                f"{self.world_size} did within {collective_timeout():.0f} s "
                f"(RLHFZ_COLLECTIVE_TIMEOUT): {error}") from error
        for rank, theirs in enumerate(gathered):
            if theirs != mine:
                raise CollectiveMismatchError(
                    f"ranks disagree: rank {self.rank} is in {call} with {signature!r}, "
                    f"rank {rank} is in {theirs[0]} with {theirs[1]!r}; every rank must "
                    f"make the same collective calls in the same order")


def communicator_for(process_group) -> Communicator | None:
    """None in a single process (no collectives at all)."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) == 1:
        return None
    return Communicator(process_group)
