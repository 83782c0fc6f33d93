"""The control plane: small exchanges between ranks, under rlhfz's timeout.

Every collective entry point of rlhfz starts with `agree`, which checks that
every rank entered the same call with the same arguments. It runs on a gloo
group of rlhfz's own created with rlhfz's timeout (RLHFZ_COLLECTIVE_TIMEOUT
seconds, default 300), so a rank that never arrives, or arrives at another
call, makes the others fail with an error that names the mismatch instead of
hanging until the default group's 30-minute timeout. Presence masks, norms
and checkpoint bookkeeping travel here too, whatever engine moves the data.
"""
from __future__ import annotations

import datetime
import hashlib
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0

# torch 2.11+ names the flat-tensor collectives *_single; older ones do not.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed, or did not complete within rlhfz's timeout
    (RLHFZ_COLLECTIVE_TIMEOUT): another rank died or stopped taking part.
    The ranks cannot go on together; restart them from a checkpoint."""


class CollectiveMismatchError(CollectiveError):
    """Ranks entered collectives inconsistently (or one never arrived)."""


# Raised from rlhfz.comm, whichever module defines them: tracebacks and
# pickles name them where users import them.
CollectiveError.__module__ = CollectiveMismatchError.__module__ = "rlhfz.comm"


def collective_timeout() -> float:
    return float(os.environ.get("RLHFZ_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S))


def timeout_delta() -> datetime.timedelta:
    return datetime.timedelta(seconds=collective_timeout())


_LOST = "lost contact with another of the {n} ranks, whose process ended or failed"
# a group released by ZeroAdamW.close(): torch reads a None group as the
# whole world's, so a released one must not become None
RELEASED = ("rank {rank}: this collective runs on process groups that ZeroAdamW.close() "
            "released; the closed optimizer's ranks can take no more collective steps "
            "through it (a new ZeroAdamW, or shard_model, makes groups of its own)")


def _timed_out(error: Exception) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def own_group(rows: list[list[int]], timeout_s: float):
    """A gloo group over the row of `rows` (global ranks, one list per group,
    together every rank of the job) that holds this rank. torch's new_group
    wants every rank of the job in every call, member or not, in the same
    order: each row's group is made on every rank, and this rank keeps its own."""
    me, mine = dist.get_rank(), None
    for row in rows:
        group = made_group(list(row), timeout_s)
        if me in row:
            mine = group
    return mine


def made_group(ranks: list[int] | None, timeout_s: float):
    """dist.new_group over `ranks` (None: all) on gloo. Every rank of the job
    makes each group in the same order; one that makes other groups (another
    device mesh or process group) is named here, not left to gloo's words."""
    try:
        return dist.new_group(ranks=ranks, backend="gloo",
                              timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise CollectiveMismatchError(
            f"rank {dist.get_rank()} could not make rlhfz's group over "
            f"{'every rank' if ranks is None else f'ranks {ranks}'} of the job within "
            f"{timeout_s:g} s: every rank must build its optimizers and sharded models in "
            f"the same order, with the same process_group or device_mesh (shape and "
            f"dimension names) ({error})") from error


def _check_carries_cpu(process_group) -> None:
    backend = str(dist.get_backend(process_group))
    if "gloo" not in backend:
        raise ValueError(
            f"the process group holds some of the job's ranks and runs on {backend!r}: rlhfz's "
            f"agreement between its ranks needs CPU tensors on it, and torch makes a group of "
            f"rlhfz's own only with every rank of the job taking part. Start the job with "
            f"init_process_group('cpu:gloo,cuda:nccl'), whose groups carry both")


def _digest(value) -> int:
    """A stable 63-bit digest of a value's repr (the same on every rank)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(),
                          "little") >> 1


class ControlPlane:
    """A gloo group of rlhfz's own over the ranks of a process group.

    rows: when every rank of the job makes a plane over a different group
    (a mesh dimension's groups), the ranks of all those groups, so that each
    rank makes every one of them (own_group).

    A process group of some ranks of the job (a model group beside others)
    is built on by its members alone, and torch makes a group only with
    every rank of the job taking part: there the plane, and the data, run on
    that group itself, under its own timeout (new_group(timeout=...)). It
    must carry CPU tensors (gloo, or "cpu:gloo,cuda:nccl")."""

    def __init__(self, process_group=None, timeout_s: float | None = None,
                 timeout_name: str = "RLHFZ_COLLECTIVE_TIMEOUT", rows=None):
        self.process_group = process_group
        # a plane of its own may wait less than the collectives do
        self.timeout_s = collective_timeout() if timeout_s is None else float(timeout_s)
        self.timeout_name = timeout_name
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        self.ranks = ranks                   # global ranks of the group (None: the world)
        self.global_ranks = ranks or list(range(self.world_size))   # group rank -> global
        self.rows = rows
        self.calls = 0                       # collective entry points this rank has made
        self.hints: list[str] = []           # what else a collective's failure may mean
        # some ranks of the job: only they build on it (see the class's doc)
        self.shared = (rows is None and process_group is not None
                       and self.world_size < dist.get_world_size())
        if self.shared:
            _check_carries_cpu(process_group)
            self.timeout_name = "the process group's own timeout"
        self._group = self.new_group()

    @property
    def group(self):
        if self._group is None:
            raise CollectiveError(RELEASED.format(rank=self.rank))
        return self._group

    @property
    def released(self) -> bool:
        """Whether destroy() let the group go."""
        return self._group is None

    def new_group(self):
        """Another gloo group over the plane's ranks, with its timeout (the
        process group itself where it is shared). Every rank constructs the
        optimizer, so creating the groups here keeps the collective order of
        new_group consistent."""
        if self.shared:
            return self.process_group
        if self.rows is not None:
            return own_group(self.rows, self.timeout_s)
        return made_group(self.ranks, self.timeout_s)

    def sibling(self, timeout_s: float, timeout_name: str) -> "ControlPlane":
        """A plane of its own over the same ranks, with another timeout."""
        return ControlPlane(self.process_group, timeout_s=timeout_s, timeout_name=timeout_name,
                            rows=self.rows)

    def destroy(self) -> None:
        group, self._group = self._group, None
        if group is not None and not self.shared:
            dist.destroy_process_group(group)

    def agree(self, call: str, signature=None) -> None:
        """Checks that every rank is in `call` with an equal `signature`.

        Ranks that disagree meet in the same small exchange: a fixed-size
        header (the call, a digest of the signature, and how many calls this
        rank has made). Only when the headers differ do ranks exchange the
        details, to name what each one is doing."""
        self.calls += 1
        header = torch.tensor([_digest(call), _digest(signature), self.calls],
                              dtype=torch.int64)
        headers = torch.empty(self.world_size * 3, dtype=torch.int64)
        try:
            all_gather_flat(headers, header, group=self.group)
        except RuntimeError as error:
            raise self.absent(call, error) from error
        if bool((headers.view(self.world_size, 3) == header).all()):
            return
        mine = (call, signature, self.calls)
        everyone = self.exchange(mine, call)
        rank, theirs = next((r, t) for r, t in enumerate(everyone) if t != mine)
        raise CollectiveMismatchError(
            f"ranks disagree: rank {self.rank} is in {call} with {signature!r} (its "
            f"collective call #{self.calls}), rank {rank} is in {theirs[0]} with "
            f"{theirs[1]!r} (its call #{theirs[2]}); every rank must make the same "
            f"collective calls in the same order")

    def exchange(self, value, call: str) -> list:
        """Every rank's small picklable value, in rank order (checkpoint
        bookkeeping, error status)."""
        everyone = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, value, group=self.group)
        except RuntimeError as error:
            raise self.absent(call, error) from error
        return everyone

    def broadcast_object(self, value, call: str):
        """The first rank's small picklable value, on every rank."""
        box = [value]
        try:
            dist.broadcast_object_list(box, src=self.global_ranks[0], group=self.group)
        except RuntimeError as error:
            raise self.absent(call, error) from error
        return box[0]

    def all_reduce_sum_host(self, value: float | torch.Tensor) -> float | torch.Tensor:
        """The sum over ranks of a host float, or of each value of a CPU
        tensor, in double (whatever the data engine: nccl takes no CPU
        tensors)."""
        many = isinstance(value, torch.Tensor)
        summed = (value.to(torch.float64, copy=True) if many
                  else torch.tensor([value], dtype=torch.float64))
        try:
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
        except RuntimeError as error:
            raise self.absent("the grad-norm all-reduce", error) from error
        return summed if many else summed.item()

    def all_reduce_max(self, tensor: torch.Tensor, call: str) -> None:
        """A MAX all-reduce of a small CPU tensor, in place."""
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as error:
            raise self.absent(call, error) from error

    # ---- the errors ---------------------------------------------------------------

    def absent(self, call: str, error: Exception) -> CollectiveError:
        """The error for a control exchange that failed."""
        where = f"rank {self.rank} entered {call} (its collective call #{self.calls}) but"
        if _timed_out(error):
            return CollectiveMismatchError(
                f"{where} not every rank of the {self.world_size} did within "
                f"{self.timeout_s:.0f} s ({self.timeout_name}).{self._hints()} ({error})")
        return CollectiveError(f"{where} {_LOST.format(n=self.world_size)}: {error}")

    def _hints(self) -> str:
        return "".join(f" {hint}" for hint in self.hints)

    def failed(self, call: str, error: Exception) -> CollectiveError:
        """The error for a data collective that failed or timed out."""
        if _timed_out(error):
            what = (f"did not complete within {collective_timeout():.0f} s "
                    f"(RLHFZ_COLLECTIVE_TIMEOUT): not every rank of the {self.world_size} took "
                    f"part (one died, hangs, or is in another call)")
        else:
            what = f"failed: it {_LOST.format(n=self.world_size)}"
        return CollectiveError(f"rank {self.rank}: {call} {what}. The ranks cannot go on "
                               f"together: restart them and resume from the last checkpoint."
                               f"{self._hints()} ({error})")

    def lost(self, what: str) -> CollectiveError:
        """The error for a data engine's own finding (the NCCL watchdog's)."""
        return CollectiveError(f"rank {self.rank}: {what}. The ranks cannot go on together: "
                               f"restart them and resume from the last checkpoint.")
