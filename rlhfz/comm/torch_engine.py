"""The data engine over torch.distributed: gloo on the CPU, nccl on GPUs.

On gloo the data collectives run on a group of rlhfz's own created with
rlhfz's timeout (so a stalled transfer ends and frees gloo's threads, and
the process can exit), and every wait is cut off at it. A rank that died,
or is alive but elsewhere, makes the others raise CollectiveError naming
the collective, instead of hanging.

On gloo the flat collectives are composed from point-to-root ones, issued
asynchronously in pieces of about GLOO_PIECE_BYTES so that gloo's worker
threads pipeline them: gloo's own reduce-scatter and all-gather copy through
temporaries and run at half the speed (measured on 50 MB, 2 ranks: 75 ms
reduce-scatter against 39 ms as reduces to each owner; 65 ms all-gather
against 20 ms as broadcasts from each owner).
"""
from __future__ import annotations

import atexit
import datetime
import time

import torch
import torch.distributed as dist

from ..engine.layout import rank_range, shard_size
from .control import (RELEASED, CollectiveError, ControlPlane, all_gather_flat,
                      collective_timeout, reduce_scatter_flat)

GLOO_PIECE_BYTES = 4 << 20

# Async gloo collectives issued and not yet waited for (a prefetch left by an
# exception, say). A gloo thread that finishes one during interpreter shutdown
# drops its tensors there, needs the GIL to, and aborts the process; so at
# exit they are waited for first, for at most EXIT_DRAIN_S seconds.
_IN_FLIGHT: set = set()
EXIT_DRAIN_S = 10.0
# A gloo worker drops its reference to a finished collective's tensors just
# after the waiting thread wakes. The Python objects of those tensors then
# die on the worker, which takes the GIL to free them; during interpreter
# shutdown that ends the thread by pthread_exit, which aborts a C++ thread
# ("terminate called without an active exception") and the process with it.
# So a process that used gloo gives its workers this long, the GIL free, at
# exit, after the drain.
EXIT_SETTLE_S = 0.2
_USED_GLOO = []


def _track(pending: "Pending") -> None:
    done = [p for p in list(_IN_FLIGHT) if all(w.is_completed() for w in p.works)]
    _IN_FLIGHT.difference_update(done)
    _IN_FLIGHT.add(pending)


def in_flight() -> int:
    """Async gloo collectives issued and not yet waited for."""
    return len(_IN_FLIGHT)


@atexit.register
def drain_at_exit() -> None:
    """Waits for what in_flight() counts (at most EXIT_DRAIN_S seconds), then
    gives gloo's workers EXIT_SETTLE_S to let go of what they hold."""
    deadline = time.monotonic() + min(EXIT_DRAIN_S, collective_timeout())
    works = [w for pending in list(_IN_FLIGHT) for w in pending.works]
    _IN_FLIGHT.clear()
    for work in works:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(left, 1e-3)))
        except RuntimeError:
            pass
    if _USED_GLOO:
        time.sleep(EXIT_SETTLE_S)


def _drain(works) -> None:
    """Lets failed transfers end. The data group's own timeout ends each one
    soon after a failed wait (a closed pair fails the rest at once); a
    process that exits while gloo still runs one is aborted."""
    for work in works:
        try:
            work.wait()
        except RuntimeError:
            pass


class Pending:
    """Collectives in flight, and what to do once they are all done."""

    def __init__(self, works, then, control: ControlPlane, call: str):
        self.works, self.then = works, then
        self.control, self.call = control, call

    def is_completed(self) -> bool:
        """Every collective is done (what follows them may not have run yet)."""
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        """Raises CollectiveError if they fail or are not all done within
        rlhfz's timeout (a failed wait leaves nothing in flight)."""
        deadline = time.monotonic() + collective_timeout()
        _IN_FLIGHT.discard(self)
        try:
            while self.works:
                # timedelta(0) would mean no limit: wait at least 1 ms
                left = max(deadline - time.monotonic(), 1e-3)
                self.works[0].wait(timeout=datetime.timedelta(seconds=left))
                self.works.pop(0)
        except RuntimeError as error:
            works, self.works, self.then = self.works, [], None
            _drain(works)
            raise self.control.failed(self.call, error) from error
        if self.then is not None:
            then, self.then = self.then, None
            then()


def _named(call: str, tensor: torch.Tensor) -> str:
    return f"{call} of {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} elements"


class TorchEngine:
    """Reduce-scatter, all-gather and all-reduce on flat tensors over a
    torch.distributed process group (gloo or nccl)."""

    def __init__(self, control: ControlPlane, process_group=None):
        self.control = control
        self.group = process_group
        self.rank, self.world_size = control.rank, control.world_size
        self.gloo = dist.get_backend(process_group) == "gloo"
        if self.gloo and not _USED_GLOO:
            _USED_GLOO.append(True)
        # On gloo the data moves on a group of rlhfz's own too: a transfer
        # that stalls (a rank alive but elsewhere) ends at rlhfz's timeout
        # and frees gloo's threads; on the caller's group it would hold them,
        # and the process's exit, until that group's timeout.
        self._data = control.new_group() if self.gloo else process_group
        self._released = False

    @property
    def data(self):
        if self._released:
            raise CollectiveError(RELEASED.format(rank=self.rank))
        return self._data

    def destroy(self) -> None:
        own = self._data if self.gloo and not self.control.shared else None
        # the group object holds its sockets until the last reference goes
        self._data, self._released = None, True
        if own is not None:
            dist.destroy_process_group(own)

    def _finish(self, works, then, async_op: bool, call: str):
        pending = Pending(works, then, self.control, call)
        if async_op:
            if self.gloo and works:
                _track(pending)
            return pending
        pending.wait()
        return None

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                       async_op: bool = False):
        """shard_out = the mean over ranks of this rank's range of full_in.
        full_in is scratch: its contents afterwards are unspecified."""
        if not self.gloo:
            return reduce_scatter_flat(shard_out, full_in, op=dist.ReduceOp.AVG,
                                       group=self.group, async_op=async_op)
        shard = shard_size(full_in.numel(), self.world_size)
        call = _named("reduce_scatter", shard_out)
        works = self._issue(call, (
            dist.reduce(piece, dst=self.control.global_ranks[owner], op=dist.ReduceOp.SUM,
                        group=self.data, async_op=True)
            for owner, piece in self._pieces(full_in, shard)))
        lo, hi = rank_range(self.rank, shard)
        mine = full_in[lo:hi]
        return self._finish(works, lambda: torch.div(mine, self.world_size, out=shard_out),
                            async_op, call)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor,
                   async_op: bool = False):
        """full_out = the ranks' shards back to back (shard_in may be a view of it)."""
        if not self.gloo:
            return all_gather_flat(full_out, shard_in, group=self.group, async_op=async_op)
        shard = shard_in.numel()
        lo, hi = rank_range(self.rank, shard)
        mine = full_out[lo:hi]
        if mine.data_ptr() != shard_in.data_ptr():
            mine.copy_(shard_in)
        call = _named("all_gather", shard_in)
        works = self._issue(call, (
            dist.broadcast(piece, src=self.control.global_ranks[owner], group=self.data,
                           async_op=True)
            for owner, piece in self._pieces(full_out, shard)))
        return self._finish(works, None, async_op, call)

    def gather_to(self, root: int, full_out: torch.Tensor | None, shard_in: torch.Tensor,
                  async_op: bool = False):
        """full_out on rank `root` = the ranks' shards back to back; every
        other rank only sends its shard (full_out None there). On gloo:
        point-to-point, in pieces of about GLOO_PIECE_BYTES, half the bytes
        of an all-gather on the wire and no whole copy off the root."""
        if not self.gloo:
            raise NotImplementedError("gather_to runs on gloo; other engines all-gather")
        shard = shard_in.numel()
        step = max(1, GLOO_PIECE_BYTES // shard_in.element_size())
        call = _named("gather", shard_in)

        def pieces(t):          # one cut on both ends of every pair
            return (t[lo:lo + step] for lo in range(0, shard, step))
        if self.rank != root:
            to = self.control.global_ranks[root]
            works = self._issue(call, (dist.isend(piece, dst=to, group=self.data)
                                       for piece in pieces(shard_in)))
            return self._finish(works, None, async_op, call)
        ranges = [rank_range(owner, shard) for owner in range(self.world_size)]
        mine = full_out[slice(*ranges[root])]
        if mine.data_ptr() != shard_in.data_ptr():
            mine.copy_(shard_in)
        works = self._issue(call, (
            dist.irecv(piece, src=self.control.global_ranks[owner], group=self.data)
            for owner, (lo, hi) in enumerate(ranges) if owner != root
            for piece in pieces(full_out[lo:hi])))
        return self._finish(works, None, async_op, call)

    def all_reduce_avg(self, tensor: torch.Tensor, async_op: bool = False):
        """tensor = its mean over ranks, in place."""
        if not self.gloo:
            return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group,
                                   async_op=async_op)
        step = max(1, GLOO_PIECE_BYTES // tensor.element_size())
        call = _named("all_reduce", tensor)
        works = self._issue(call, (
            dist.all_reduce(tensor[i:i + step], op=dist.ReduceOp.AVG, group=self.data,
                            async_op=True) for i in range(0, tensor.numel(), step)))
        return self._finish(works, None, async_op, call)

    def broadcast_from_first(self, tensors: list) -> None:
        """Every tensor set to the first rank's values (staged through host
        memory on gloo, which takes no device tensors)."""
        with torch.no_grad():
            for t in tensors:
                staged = t.detach().cpu() if self.gloo and t.device.type != "cpu" else t.detach()
                dist.broadcast(staged, src=self.control.global_ranks[0], group=self.data)
                if staged.data_ptr() != t.data_ptr():
                    t.copy_(staged)

    def _issue(self, call: str, launches) -> list:
        """The works of `launches` (a generator that issues one per item)."""
        works = []
        try:
            for work in launches:
                works.append(work)
        except RuntimeError as error:     # a peer already gone
            _drain(works)
            raise self.control.failed(call, error) from error
        return works

    def _pieces(self, full: torch.Tensor, shard: int):
        """(owner rank, view) over every rank's range of full, cut into
        pieces of about GLOO_PIECE_BYTES, in the same order on every rank."""
        step = max(1, GLOO_PIECE_BYTES // (full.element_size() * self.world_size))
        for lo in range(0, shard, step):
            hi = min(lo + step, shard)
            for owner in range(self.world_size):
                start = rank_range(owner, shard)[0]
                yield owner, full[start + lo:start + hi]
