"""A broadcast channel over a group the caller made: one sender, receivers.

Weight sync runs over a process group of the sending trainer and the
generation processes (OpenRLHF's model-update group), which rlhfz did not
make and does not own. The channel keeps the sync's collectives in one
place: small objects from the sender, every rank's verdict, and flat byte
buckets, asynchronously. On gloo a bucket goes in pieces down chains that
take turns (src, then each receiver, each passing a piece on as the next
arrives; each piece led by the next receiver), a broadcast pipelined as
NCCL's rings pipeline theirs: gloo's own broadcast is a binomial tree of
whole buffers, from which src sends every byte to each of its children.
Every wait is cut off at rlhfz's timeout: the group is the caller's, under
its own (often 30-minute) timeout, and a side that failed before it took
part must not leave the other waiting that long.
"""
from __future__ import annotations

import datetime
import json
import threading

import torch
import torch.distributed as dist

from .control import CollectiveError, collective_timeout

# A value whose encoding fits one frame goes in a single broadcast. 64 KiB holds
# the manifest of a model of several hundred tensors and costs a broadcast
# hardly more than a few bytes do.
FRAME_BYTES = 64 << 10
_LENGTH_BYTES = 8
# far above any manifest: a larger length is not an rlhfz sender's
MAX_OBJECT_BYTES = 1 << 30
# a verdict's message is cut to this many bytes
MESSAGE_BYTES = 4096
# A chained bucket moves in pieces of this size: small enough that a receiver
# passes on its first piece soon, large enough that a send's fixed cost
# (tens of microseconds) stays under 1% of its time on the wire.
CHAIN_PIECE_BYTES = 4 << 20
# (group, pieces, receives, sends) of each chained bucket cut off by a
# failure: gloo may still write or read those pieces, and a later transfer
# over the group would be matched with the receives still posted on it
_ABANDONED: list = []


def _as_tensor(data: bytes) -> torch.Tensor:
    """bytes as a uint8 tensor of its own."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


def in_group(group) -> bool:
    """Whether this rank is a member of `group` (None: not)."""
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return False
    return dist.get_rank() in dist.get_process_group_ranks(group)


def _wait(work, what: str) -> None:
    """work.wait() cut off at rlhfz's timeout, as a CollectiveError."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=max(collective_timeout(), 1e-3)))
    except RuntimeError as error:
        raise CollectiveError(
            f"rank {dist.get_rank()}: {what} did not complete: a rank of the group died, "
            f"hangs, or is in another call (RLHFZ_COLLECTIVE_TIMEOUT "
            f"{collective_timeout():.0f} s). ({error})") from error


class _Sent:
    """A transfer in flight; wait() raises CollectiveError at the timeout."""

    def __init__(self, work, what: str):
        self.work, self.what = work, what

    def wait(self) -> None:
        self._finish()

    def _finish(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            _wait(work, self.what)


class _Chained(_Sent):
    """A bucket on its way down chains of the group's ranks, in pieces. Each
    piece goes from src first to the receiver that has led the fewest bytes
    of the sync so far (led: their counts, kept alike on every rank), then
    on through the other receivers in the group's order, wrapping around.
    So src sends each byte once, and each of R receivers, first for about
    1/R of the bytes, sends on about (R - 1)/R of them: a broadcast as a
    scatter and an all-gather, pipelined. A receiver sends its pieces on as
    they arrive, from a thread of its own: the caller unpacks the bucket
    before while this one moves on (as gloo's threads receive the next
    meanwhile), and the thread waits for the bucket before's, so that
    between any two ranks the pieces go in order. wait() returns once this
    rank holds every piece and the ranks after it have theirs, so the
    bucket's memory is free to be read or reused."""

    def __init__(self, views: list, chain: list[int], group, what: str, led: list[int],
                 before: _Chained | None):
        super().__init__(None, what)
        me, src, receivers = dist.get_rank(), chain[0], chain[1:]
        self.pieces = [p for v in views if v.numel() for p in v.split(CHAIN_PIECE_BYTES)]
        self.routes = []            # each piece's (rank before this one, rank after)
        for piece in self.pieces:
            lead = led.index(min(led))
            led[lead] += piece.numel()
            order = [src] + receivers[lead:] + receivers[:lead]
            at = order.index(me)
            self.routes.append((order[at - 1] if at else None,
                                order[at + 1] if at + 1 < len(order) else None))
        self.group, self.sends, self.receives = group, [], []
        self.thread, self.error = None, None
        if me == src:
            self.sends = [dist.isend(p, to, group=group)
                          for p, (_, to) in zip(self.pieces, self.routes)]
            return
        self.receives = [dist.irecv(p, came, group=group)
                         for p, (came, _) in zip(self.pieces, self.routes)]
        if any(to is not None for _, to in self.routes):
            self.thread = threading.Thread(target=self._pass_on, args=(before,), daemon=True,
                                           name="rlhfz-weight-sync-chain")
            self.thread.start()

    def _pass_on(self, before: _Chained | None) -> None:
        try:
            if before is not None and before.thread is not None:
                before.thread.join()
                if before.error is not None:
                    raise CollectiveError(f"{self.what} was not sent on: the bucket before "
                                          f"it failed ({before.error})")
            for piece, work, (_, to) in zip(self.pieces, self.receives, self.routes):
                if to is not None:
                    _wait(work, f"{self.what} (a piece received)")
                    self.sends.append(dist.isend(piece, to, group=self.group))
        except BaseException as error:      # noqa: BLE001 - raised again by wait()
            self.error = error

    def _finish(self) -> None:
        try:
            if self.thread is not None:
                self.thread.join()
                if self.error is not None:
                    raise self.error
            for work, (_, to) in zip(self.receives, self.routes):
                if to is None:          # the thread waited for those it sent on
                    _wait(work, f"{self.what} (a piece received)")
            self.receives = []
            for work in self.sends:
                _wait(work, f"{self.what} (a piece sent on)")
        except BaseException:
            _ABANDONED.append((self.group, self.pieces, self.receives, self.sends))
            raise
        finally:
            self.pieces, self.receives, self.sends = [], [], []


class BroadcastChannel:
    """Broadcasts from global rank `src` over `group`, on the device the
    group's backend takes tensors on (CUDA for nccl, else the CPU)."""

    def __init__(self, group, src: int):
        if any(entry[0] is group for entry in _ABANDONED):
            raise CollectiveError(
                f"rank {dist.get_rank()}: a weight sync over this group was cut off while "
                f"its buckets moved, and its sends and receives may still be pending on it: "
                f"sync over a new group (dist.new_group) of the same ranks")
        self.group, self.src = group, src
        self.ranks = dist.get_process_group_ranks(group)
        backend = str(dist.get_backend(group))
        cuda = "nccl" in backend and ("gloo" not in backend or torch.cuda.is_available())
        self.device = (torch.device("cuda", torch.cuda.current_device()) if cuda
                       else torch.device("cpu"))
        # src, then the receivers in the group's order; None: buckets go as
        # the backend's own broadcast
        self.chain = ([src] + [r for r in self.ranks if r != src]
                      if self.device.type == "cpu" and "gloo" in backend
                      and len(self.ranks) > 1 else None)
        self._chained = None                     # the last bucket sent down it
        self._led = [0] * (len(self.ranks) - 1)  # bytes each receiver led so far

    @property
    def chained(self) -> bool:
        """Whether buckets go down chains, where src hears from each piece's
        first receiver alone: a sync then ends with every rank's verdict."""
        return self.chain is not None

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def object(self, value=None):
        """The sender's small value, JSON's kinds only (a manifest, a
        checksum), on every rank of the group: one broadcast of a frame of
        FRAME_BYTES, the encoding's length and as much of it as fits, and a
        second for the rest only where it does not fit. Each collective is
        a round trip that every sync waits for (torch's object broadcast
        takes two for any value), and JSON, unlike a pickle, runs nothing
        a sender sends."""
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        room = FRAME_BYTES - _LENGTH_BYTES
        sender = dist.get_rank() == self.src
        if sender:
            data = json.dumps(value, separators=(",", ":")).encode()
            head = len(data).to_bytes(_LENGTH_BYTES, "little") + data[:room]
            frame[:len(head)] = _as_tensor(head)
        frame = self._broadcast(frame, "a weight-sync value")
        length = int.from_bytes(frame[:_LENGTH_BYTES].numpy().tobytes(), "little")
        if length > MAX_OBJECT_BYTES:
            raise CollectiveError(f"rank {dist.get_rank()}: rank {self.src} announced a "
                                  f"{length}-byte value: it is not an rlhfz weight-sync sender")
        tail = (_as_tensor(data[room:]) if sender else
                torch.empty(max(0, length - room), dtype=torch.uint8))
        if tail.numel():
            tail = self._broadcast(tail, "the rest of a weight-sync value")
        if sender:
            return value
        data = frame[_LENGTH_BYTES:_LENGTH_BYTES + min(length, room)].numpy().tobytes()
        return json.loads(data + tail.numpy().tobytes())

    def _broadcast(self, host: torch.Tensor, what: str) -> torch.Tensor:
        """host's bytes from src, in host memory on every rank (through the
        group's device where that is not the CPU)."""
        moved = host if self.device.type == "cpu" else host.to(self.device)
        _wait(dist.broadcast(moved, src=self.src, group=self.group, async_op=True),
              f"{what} from rank {self.src}")
        return moved.cpu()

    def verdict(self, message: str | None) -> str | None:
        """Every rank's error message (or None): the first, with its rank.
        One all-reduce of a flag when no rank has one; the messages go only
        where some rank does."""
        flag = torch.tensor([0 if message is None else 1], dtype=torch.int32, device=self.device)
        _wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
              "the weight-sync verdict")
        if not int(flag.item()):
            return None
        # each rank's message as UTF-8 text in a frame (cut at MESSAGE_BYTES),
        # never a pickle: a verdict runs nothing another rank sends
        frame = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        if message is not None:
            text = message.encode()[:MESSAGE_BYTES - 1].decode(errors="ignore").encode()
            frame[0] = 1
            frame[1:1 + len(text)] = _as_tensor(text)
        frame = frame.to(self.device)
        everyone = [torch.empty_like(frame) for _ in self.ranks]
        _wait(dist.all_gather(everyone, frame, group=self.group, async_op=True),
              "the weight-sync verdict's messages")
        for rank, theirs in zip(self.ranks, everyone):
            theirs = theirs.cpu().numpy().tobytes()
            if theirs[0]:
                return f"rank {rank}: " + theirs[1:].rstrip(b"\0").decode(errors="replace")
        return None

    def bytes(self, flat: torch.Tensor | None, what: str, views: list | None = None) -> _Sent:
        """Broadcasts flat (sent on src, received elsewhere), asynchronously:
        down the chain on gloo, else the backend's broadcast. Down a chain,
        views (byte tensors, cut alike on every rank) go in flat's place:
        ranges of it on src, wherever each lands on a receiver."""
        if self.chain is not None:
            views = [flat] if views is None else views
            what = f"{what} of {sum(v.numel() for v in views)} bytes from rank {self.src}"
            self._chained = _Chained(views, self.chain, self.group, what, self._led,
                                     self._chained)
            return self._chained
        what = f"{what} of {flat.numel()} bytes from rank {self.src}"
        return _Sent(dist.broadcast(flat, src=self.src, group=self.group, async_op=True), what)
