"""Collectives the optimizer needs, over torch.distributed.

One small interface: reduce-scatter, all-gather and all-reduce on flat
tensors (views of rlhfz buffers), plus `agree`, which checks that every rank
entered the same collective with the same arguments. Agreement runs on a
dedicated gloo group with rlhfz's own timeout (RLHFZ_COLLECTIVE_TIMEOUT
seconds, default 300), so a rank that never arrives, or arrives at another
call, makes the others fail with an error that names the mismatch instead
of hanging until the default group's 30-minute timeout.

The data collectives are bounded by the same timeout: on gloo they run on a
group of their own created with it (so a stalled transfer ends and frees
gloo's threads, and the process can exit), and every wait is cut off at it.
A rank that died, or is alive but elsewhere, makes the others raise
CollectiveError naming the collective, instead of hanging.

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
import hashlib
import os
import time

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
GLOO_PIECE_BYTES = 4 << 20

# torch 2.11+ names the flat-tensor collectives *_single; older ones do not.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# Async gloo collectives issued and not yet waited for (a prefetch left by an
# exception, say). A gloo thread that finishes one during interpreter shutdown
# drops its tensors there, needs the GIL to, and aborts the process; so at
# exit they are waited for first, for at most EXIT_DRAIN_S seconds.
_IN_FLIGHT: set = set()
EXIT_DRAIN_S = 10.0


def _track(pending: "_Pending") -> None:
    done = [p for p in list(_IN_FLIGHT) if all(w.is_completed() for w in p.works)]
    _IN_FLIGHT.difference_update(done)
    _IN_FLIGHT.add(pending)


@atexit.register
def _drain_at_exit() -> None:
    deadline = time.monotonic() + min(EXIT_DRAIN_S, collective_timeout())
    works = [w for pending in list(_IN_FLIGHT) for w in pending.works]
    _IN_FLIGHT.clear()
    for work in works:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(left, 1e-3)))
        except RuntimeError:
            pass


class _Pending:
    """Collectives in flight, and what to do once they are all done."""

    def __init__(self, works, then, comm: "Communicator", call: str):
        self.works, self.then = works, then
        self.comm, self.call = comm, call

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
            raise self.comm._failed(self.call, error) from error
        if self.then is not None:
            then, self.then = self.then, None
            then()


def _drain(works) -> None:
    """Lets failed transfers end. The data group's own timeout ends each one
    soon after a failed wait (a closed pair fails the rest at once); a
    process that exits while gloo still runs one is aborted."""
    for work in works:
        try:
            work.wait()
        except RuntimeError:
            pass


def _finish(works, then, async_op: bool, comm: "Communicator", call: str):
    pending = _Pending(works, then, comm, call)
    if async_op:
        if comm._gloo and works:
            _track(pending)
        return pending
    pending.wait()
    return None


class CollectiveError(RuntimeError):
    """A collective failed, or did not complete within rlhfz's timeout
    (RLHFZ_COLLECTIVE_TIMEOUT): another rank died or stopped taking part.
    The ranks cannot go on together; restart them from a checkpoint."""


class CollectiveMismatchError(CollectiveError):
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
        self._global = ranks or list(range(self.world_size))    # group rank -> global rank
        self._gloo = self.backend == "gloo"
        self._calls = 0        # collective entry points this rank has made
        # Every rank constructs the optimizer, so creating the group here
        # keeps the collective order of new_group consistent.
        timeout = datetime.timedelta(seconds=collective_timeout())
        self._control = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        # On gloo the data moves on a group of rlhfz's own too: a transfer
        # that stalls (a rank alive but elsewhere) ends at rlhfz's timeout
        # and frees gloo's threads; on the caller's group it would hold them,
        # and the process's exit, until that group's timeout.
        self._data = (dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
                      if self._gloo else process_group)

    def destroy(self) -> None:
        """Releases the groups rlhfz made (their sockets and gloo threads);
        every rank calls it, and nothing collective works afterwards."""
        own = [self._control] + ([self._data] if self._gloo else [])
        self._control = self._data = None
        for group in own:
            if group is not None:
                dist.destroy_process_group(group)

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                       async_op: bool = False):
        """shard_out = the mean over ranks of this rank's range of full_in.
        full_in is scratch: its contents afterwards are unspecified."""
        if not self._gloo:
            return _reduce_scatter(shard_out, full_in, op=dist.ReduceOp.AVG, group=self.group,
                                   async_op=async_op)
        shard = full_in.numel() // self.world_size
        call = _named("reduce_scatter", shard_out)
        works = self._issue(call, (
            dist.reduce(piece, dst=self._global[owner], op=dist.ReduceOp.SUM,
                        group=self._data, async_op=True)
            for owner, piece in self._pieces(full_in, shard)))
        mine = full_in[self.rank * shard:(self.rank + 1) * shard]
        return _finish(works, lambda: torch.div(mine, self.world_size, out=shard_out), async_op,
                       self, call)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor,
                   async_op: bool = False):
        """full_out = the ranks' shards back to back (shard_in may be a view of it)."""
        if not self._gloo:
            return _all_gather(full_out, shard_in, group=self.group, async_op=async_op)
        shard = shard_in.numel()
        mine = full_out[self.rank * shard:(self.rank + 1) * shard]
        if mine.data_ptr() != shard_in.data_ptr():
            mine.copy_(shard_in)
        call = _named("all_gather", shard_in)
        works = self._issue(call, (
            dist.broadcast(piece, src=self._global[owner], group=self._data, async_op=True)
            for owner, piece in self._pieces(full_out, shard)))
        return _finish(works, None, async_op, self, call)

    def all_reduce_avg(self, tensor: torch.Tensor, async_op: bool = False):
        """tensor = its mean over ranks, in place."""
        if not self._gloo:
            return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group,
                                   async_op=async_op)
        step = max(1, GLOO_PIECE_BYTES // tensor.element_size())
        call = _named("all_reduce", tensor)
        works = self._issue(call, (
            dist.all_reduce(tensor[i:i + step], op=dist.ReduceOp.AVG, group=self._data,
                            async_op=True) for i in range(0, tensor.numel(), step)))
        return _finish(works, None, async_op, self, call)

    def _issue(self, call: str, launches) -> list:
        """The works of `launches` (a generator that issues one per item)."""
        works = []
        try:
            for work in launches:
                works.append(work)
        except RuntimeError as error:     # a peer already gone
            _drain(works)
            raise self._failed(call, error) from error
        return works

    def _pieces(self, full: torch.Tensor, shard: int):
        """(owner rank, view) over every rank's range of full, cut into
        pieces of about GLOO_PIECE_BYTES, in the same order on every rank."""
        step = max(1, GLOO_PIECE_BYTES // (full.element_size() * self.world_size))
        for lo in range(0, shard, step):
            hi = min(lo + step, shard)
            for owner in range(self.world_size):
                yield owner, full[owner * shard + lo:owner * shard + hi]

    def all_reduce_sum_host(self, value: float) -> float:
        """The sum over ranks of a host float, in double, on the control group
        (whatever the data engine: nccl takes no CPU tensors)."""
        summed = torch.tensor([value], dtype=torch.float64)
        try:
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self._control)
        except RuntimeError as error:
            raise self._absent("the grad-norm all-reduce", error) from error
        return summed.item()

    def all_reduce_max_control(self, tensor: torch.Tensor, call: str) -> None:
        """A MAX all-reduce of a small CPU tensor under rlhfz's timeout."""
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control)
        except RuntimeError as error:
            raise self._absent(call, error) from error

    def agree(self, call: str, signature=None) -> None:
        """Checks that every rank is in `call` with an equal `signature`.

        Every collective entry point of rlhfz starts here, so ranks that
        disagree meet in the same small exchange: a fixed-size header (the
        call, a digest of the signature, and how many calls this rank has
        made). Only when the headers differ do ranks exchange the details,
        to name what each one is doing."""
        self._calls += 1
        header = torch.tensor([_digest(call), _digest(signature), self._calls],
                              dtype=torch.int64)
        headers = torch.empty(self.world_size * 3, dtype=torch.int64)
        try:
            _all_gather(headers, header, group=self._control)
        except RuntimeError as error:
            raise self._absent(call, error) from error
        if bool((headers.view(self.world_size, 3) == header).all()):
            return
        mine = (call, signature, self._calls)
        everyone = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, mine, group=self._control)
        except RuntimeError as error:
            raise self._absent(call, error) from error
        rank, theirs = next((r, t) for r, t in enumerate(everyone) if t != mine)
        raise CollectiveMismatchError(
            f"ranks disagree: rank {self.rank} is in {call} with {signature!r} (its "
            f"collective call #{self._calls}), rank {rank} is in {theirs[0]} with "
            f"{theirs[1]!r} (its call #{theirs[2]}); every rank must make the same "
            f"collective calls in the same order")

    def exchange(self, value, call: str) -> list:
        """Every rank's small picklable value, in rank order, over the control
        group under rlhfz's timeout (checkpoint bookkeeping, error status)."""
        everyone = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, value, group=self._control)
        except RuntimeError as error:
            raise self._absent(call, error) from error
        return everyone

    def _absent(self, call: str, error: Exception) -> CollectiveError:
        """The error for a control collective that failed."""
        where = f"rank {self.rank} entered {call} (its collective call #{self._calls}) but"
        if _timed_out(error):
            return CollectiveMismatchError(
                f"{where} not every rank of the {self.world_size} did within "
                f"{collective_timeout():.0f} s (RLHFZ_COLLECTIVE_TIMEOUT): {error}")
        return CollectiveError(f"{where} {_LOST.format(n=self.world_size)}: {error}")

    def _failed(self, call: str, error: Exception) -> CollectiveError:
        """The error for a data collective that failed or timed out."""
        if _timed_out(error):
            what = (f"did not complete within {collective_timeout():.0f} s "
                    f"(RLHFZ_COLLECTIVE_TIMEOUT): not every rank of the {self.world_size} took "
                    f"part (one died, hangs, or is in another call)")
        else:
            what = f"failed: it {_LOST.format(n=self.world_size)}"
        return CollectiveError(f"rank {self.rank}: {call} {what}. The ranks cannot go on "
                               f"together: restart them and resume from the last checkpoint. "
                               f"({error})")


_LOST = "lost contact with another of the {n} ranks, whose process ended or failed"


def _timed_out(error: Exception) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _named(call: str, tensor: torch.Tensor) -> str:
    return f"{call} of {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} elements"


def _digest(value) -> int:
    """A stable 63-bit digest of a value's repr (the same on every rank)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(),
                          "little") >> 1


def communicator_for(process_group, collectives: str = "torch",
                     backend=None) -> Communicator | None:
    """None in a single process (no collectives at all). collectives="nccl"
    gives rlhfz's own NCCL communicator on the device backend's device (see
    nccl.py)."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) == 1:
        return None
    if collectives == "nccl":
        from .nccl import NativeNcclCommunicator
        return NativeNcclCommunicator(process_group, backend)
    return Communicator(process_group)
