"""A broadcast channel over a group the caller made: one sender, receivers.

Weight sync runs over a process group of the sending trainer and the
generation processes (OpenRLHF's model-update group), which rlhfz did not
make and does not own. The channel keeps the sync's collectives in one
place: small objects from the sender, every rank's verdict, and flat byte
buckets, asynchronously, whose waits are cut off at rlhfz's timeout.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .control import CollectiveError, collective_timeout


def in_group(group) -> bool:
    """Whether this rank is a member of `group` (None: not)."""
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return False
    return dist.get_rank() in dist.get_process_group_ranks(group)


class _Sent:
    """A broadcast in flight; wait() raises CollectiveError at the timeout."""

    def __init__(self, work, what: str):
        self.work, self.what = work, what

    def wait(self) -> None:
        work, self.work = self.work, None
        if work is None:
            return
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(collective_timeout(), 1e-3)))
        except RuntimeError as error:
            raise CollectiveError(
                f"rank {dist.get_rank()}: {self.what} did not complete: a rank of the group "
                f"died, hangs, or is in another call (RLHFZ_COLLECTIVE_TIMEOUT "
                f"{collective_timeout():.0f} s). ({error})") from error


class BroadcastChannel:
    """Broadcasts from global rank `src` over `group`, on the device the
    group's backend takes tensors on (CUDA for nccl, else the CPU)."""

    def __init__(self, group, src: int):
        self.group, self.src = group, src
        self.ranks = dist.get_process_group_ranks(group)
        backend = str(dist.get_backend(group))
        cuda = "nccl" in backend and ("gloo" not in backend or torch.cuda.is_available())
        self.device = (torch.device("cuda", torch.cuda.current_device()) if cuda
                       else torch.device("cpu"))

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def object(self, value=None):
        """The sender's small picklable value, on every rank of the group."""
        box = [value]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def verdict(self, message: str | None) -> str | None:
        """Every rank's error message (or None): the first, with its rank."""
        everyone = [None] * len(self.ranks)
        dist.all_gather_object(everyone, message, group=self.group)
        return next((f"rank {self.ranks[i]}: {m}" for i, m in enumerate(everyone)
                     if m is not None), None)

    def bytes(self, flat: torch.Tensor, what: str) -> _Sent:
        """Broadcasts flat (sent on src, received elsewhere), asynchronously."""
        work = dist.broadcast(flat, src=self.src, group=self.group, async_op=True)
        return _Sent(work, f"{what} of {flat.numel()} bytes from rank {self.src}")
