"""Weight sync from a training group to generation processes.

sync_weights(model, group, src=...) runs on every rank of the training
model; receive_weights(model, group, src=...) on every receiver, a process
that holds a plain, unsharded copy of the model (as a vLLM worker does).
`group` is a torch.distributed process group of the sending trainer (`src`,
a global rank) and every receiver, as OpenRLHF's model-update group. The
other trainers stay out of it: they only take part in the gathers, which
make the units whole on src alone where the engine can (gloo: the others
send their shards: 1/n of an all-gather's bytes over n trainers;
Stage3.gathers_onto).

1. A manifest goes over first: every tensor's name, shape and dtype as
   sent, and the plan: each bucket's bytes and where every piece of every
   tensor lies in it. Each receiver checks both against its model (every
   piece inside its bucket and its tensor, every element in exactly one),
   and every rank of the group, then every trainer, learns whether all
   agree, so that a mismatch is an error everywhere, never a hang.
2. Then flat byte buckets, one broadcast each (plan_buckets; on gloo a
   broadcast in pieces down chains that take turns, BroadcastChannel.bytes,
   after which every receiver says it holds them all), sent with as few
   copies as the tensors allow:
   - tensors that lie back to back in one memory (a gathered stage-3 unit,
     a ZeroAdamW bucket) go as ranges of it, as they lie, gaps included;
   - a tensor of half a bucket or more goes alone, in chunks of a bucket,
     from and into its own memory;
   - the rest (cast, LoRA-merged, scattered) are packed back to back.
   A receiver receives a bucket that is one chunk of one tensor into the
   tensor, the others into one of two buffers, unpacked while the next
   arrives. The sender packs into two buffers in turn, and gathers the
   next unit while the current one is on the wire. The buffers are kept
   for the next sync (faulting in fresh pages costs more than filling
   them); release_sync_buffers() frees them. The sender's memory beyond
   the model's: the two buffers where anything is packed, and under stage
   3 the unit being sent and the next, gathered ahead (as a forward
   gathers them).
3. With checksum=True the sender's CRC-32 of every byte it sent is checked
   against one of the receiver's params as loaded, in the same order: a
   verified, bit-exact sync.

dtype= casts floating tensors on the way (e.g. fp32 masters to a bf16
engine), every one that torch's module.to(dtype) casts (float64 buffers
too); integer and bool buffers go as they are. For a PEFT LoRA model,
adapters="merged" sends the base weights with the adapters folded in,
under the base model's names; "only" sends the adapters' params.
"""
from __future__ import annotations

import contextlib
import math
import time
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm.channel import BroadcastChannel, in_group
from .comm.control import CollectiveError
from .lora_export import active_adapter_names, adapter_units, is_peft, merged
from .model_state import unwrapped, whole_shape
from .optim import owning_optimizer
from .pretrained import export_entries

FORMAT = "rlhfz.weight_sync.v4"
# every packed piece starts on this many bytes, so a bucket's bytes view as any dtype
PIECE_ALIGN = 16
# A range of memory sent as it lies may carry this many bytes between two of
# its tensors (alignment, padding) ...
RANGE_GAP_BYTES = 4096
# ... and is sent so only from an eighth of a bucket, or this size: below it,
# one broadcast more costs more than the copies of packing it with others.
RANGE_MIN_BYTES = 4 << 20
# Down a chain (gloo), a piece of this many bytes or more moves as messages of
# its own, straight into its tensor on every receiver; smaller ones go
# together through a buffer, since each message has a fixed cost.
CHAIN_DIRECT_BYTES = 1 << 20
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class WeightSyncError(RuntimeError):
    """A weight sync failed: the manifest did not match a receiver's model,
    or a checksum did not match. Nothing a receiver holds was written when
    the manifest was refused."""

    __module__ = "rlhfz"


# ---- the plan: which bytes go in which bucket --------------------------------------------

class SyncBucket(NamedTuple):
    """One broadcast of nbytes: the (tensor index, first element, elements,
    byte offset) pieces in it, and, on the sender, where its bytes come
    from: None, packed into a buffer; ("tensor", index), a chunk of one
    tensor from its own memory; ("range", home, first byte), bytes of memory
    that already holds the tensors back to back (a gathered stage-3 unit, a
    ZeroAdamW bucket), sent as they lie. The manifest carries the nbytes and
    pieces; the source stays on the sender."""

    nbytes: int
    pieces: list
    source: tuple | None = None


def lands_whole(bucket, specs) -> bool:
    """Whether a bucket is one chunk of one tensor, received straight into
    the tensor's memory."""
    if len(bucket.pieces) != 1:
        return False
    index, _, count, offset = bucket.pieces[0]
    return offset == 0 and count * specs[index][1].itemsize == bucket.nbytes


def chain_cuts(bucket, specs) -> list[tuple[int, int, int | None]]:
    """The byte ranges of a bucket sent down a chain, in order, as (first,
    end, the piece's place in bucket.pieces) where a range is one piece of
    CHAIN_DIRECT_BYTES or more, or the bucket's only one; (first, end,
    None) for neighbouring smaller pieces and the gaps between them. The
    sender and every receiver cut alike, from the plan."""
    cuts, run = [], None
    alone = len(bucket.pieces) == 1
    for place, (index, _, count, offset) in sorted(enumerate(bucket.pieces),
                                                   key=lambda entry: entry[1][3]):
        end = offset + count * specs[index][1].itemsize
        if alone or end - offset >= CHAIN_DIRECT_BYTES:
            if run is not None:
                cuts.append((*run, None))
                run = None
            cuts.append((offset, end, place))
        else:
            run = (offset, end) if run is None else (run[0], end)
    if run is not None:
        cuts.append((*run, None))
    return cuts


def _runs(specs, bucket_bytes: int, direct_bytes: int, homes) -> dict:
    """{first index: [indices]} of the tensors sent in ranges of the memory
    that holds them (homes[i]: (memory, byte offset), or None): tensors in
    one memory, in order, at most RANGE_GAP_BYTES apart, in spans of up to
    a bucket, each span at least an eighth of a bucket or RANGE_MIN_BYTES."""
    runs, run, home, lo, end = {}, [], None, 0, 0
    least = min(RANGE_MIN_BYTES, bucket_bytes // 8)

    def close():
        if run and end - lo >= least:
            runs[run[0]] = list(run)
        run.clear()

    for index, (shape, dtype) in enumerate(specs):
        nbytes = math.prod(shape) * dtype.itemsize
        if homes[index] is None or not nbytes or nbytes >= direct_bytes:
            continue
        memory, offset = homes[index]
        if not (run and memory == home and end <= offset <= end + RANGE_GAP_BYTES
                and offset + nbytes - lo <= bucket_bytes and (offset - lo) % dtype.itemsize == 0):
            close()
            home, lo = memory, offset
        run.append(index)
        end = offset + nbytes
    close()
    return runs


def plan_buckets(specs: list[tuple[tuple[int, ...], torch.dtype]], bucket_bytes: int,
                 direct_bytes: int | None = None, homes: list | None = None) -> list[SyncBucket]:
    """Buckets of at most bucket_bytes for tensors of (shape, dtype), in
    order (a bucket takes the place of its first tensor). A tensor of
    direct_bytes or more (default: half a bucket) goes in buckets of its
    own, in chunks of a bucket, from and into its own memory. Tensors whose
    memory holds them back to back (homes) go as ranges of it: no copy on
    the sender. The rest are packed, each piece on a 16-byte boundary.
    Fewer, larger broadcasts: each has a fixed cost."""
    if direct_bytes is None:
        direct_bytes = bucket_bytes // 2
    runs = _runs(specs, bucket_bytes, direct_bytes, homes or [None] * len(specs))
    in_run = {index for run in runs.values() for index in run}
    buckets, packed = [], None             # packed: [place in buckets, pieces, bytes used]

    def close():
        nonlocal packed
        if packed is not None:
            buckets[packed[0]] = SyncBucket(packed[2], packed[1])
        packed = None

    for index, (shape, dtype) in enumerate(specs):
        itemsize = dtype.itemsize
        numel = math.prod(shape)
        if index in runs:
            memory, lo = homes[index]
            pieces = [(i, 0, math.prod(specs[i][0]), homes[i][1] - lo) for i in runs[index]]
            last = pieces[-1]
            nbytes = last[3] + last[2] * specs[last[0]][1].itemsize
            buckets.append(SyncBucket(nbytes, pieces, ("range", memory, lo)))
            continue
        if index in in_run or not numel:
            continue
        if numel * itemsize >= direct_bytes:
            close()
            per = max(1, bucket_bytes // itemsize)
            for start in range(0, numel, per):
                count = min(per, numel - start)
                buckets.append(SyncBucket(count * itemsize, [(index, start, count, 0)],
                                          ("tensor", index)))
            continue
        offset = -(-packed[2] // PIECE_ALIGN) * PIECE_ALIGN if packed is not None else 0
        if packed is not None and offset + numel * itemsize > bucket_bytes:
            close()
        if packed is None:
            packed, offset = [len(buckets), [], 0], 0
            buckets.append(None)
        packed[1].append((index, 0, numel, offset))
        packed[2] = offset + numel * itemsize
    close()
    return buckets


def check_plan(plan, specs, bucket_bytes) -> tuple[list[SyncBucket], str | None]:
    """A manifest's buckets as SyncBuckets, or what is wrong with them: every
    piece inside its bucket and its tensor, viewable as the tensor's dtype,
    no two overlapping, no more bytes than the pieces and the gaps between
    them, every element of every tensor in exactly one."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        return [], f"the manifest's bucket size {bucket_bytes!r} is not a positive int"
    if not isinstance(plan, (list, tuple)):
        return [], f"the manifest's buckets are a {type(plan).__name__}, not a list"
    numels = [math.prod(shape) for shape, _ in specs]
    covered = [[] for _ in specs]
    buckets = []

    def whole(*values):
        return all(isinstance(v, int) and not isinstance(v, bool) for v in values)

    for k, entry in enumerate(plan):
        try:
            nbytes, pieces = entry
            pieces = [tuple(piece) for piece in pieces]
        except (TypeError, ValueError):
            return [], f"bucket {k} of the manifest is not (bytes, pieces)"
        if not whole(nbytes) or not 0 < nbytes <= bucket_bytes or not pieces:
            return [], f"bucket {k} of the manifest holds {nbytes!r} bytes in {len(pieces)} pieces"
        spans = []
        for piece in pieces:
            if len(piece) != 4 or not whole(*piece):
                return [], f"bucket {k} of the manifest has a malformed piece {piece!r}"
            index, start, count, offset = piece
            if not 0 <= index < len(specs):
                return [], f"bucket {k} of the manifest names tensor {index} of {len(specs)}"
            itemsize = specs[index][1].itemsize
            if (count < 1 or start < 0 or start + count > numels[index] or offset < 0
                    or offset % itemsize or offset + count * itemsize > nbytes):
                return [], (f"bucket {k} of the manifest has a piece {piece!r} outside its "
                            f"{nbytes} bytes or its tensor's {numels[index]} elements")
            spans.append((offset, offset + count * itemsize))
            covered[index].append((start, start + count))
        spans.sort()
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return [], f"bucket {k} of the manifest has pieces that overlap"
        # what a receiver allocates is what the pieces need: no more
        if spans[0][0] != 0 or spans[-1][1] != nbytes or any(
                b[0] - a[1] > RANGE_GAP_BYTES for a, b in zip(spans, spans[1:])):
            return [], (f"bucket {k} of the manifest holds {nbytes} bytes, more than its "
                        f"pieces and the gaps between them")
        buckets.append(SyncBucket(nbytes, pieces))
    for index, ranges in enumerate(covered):
        ranges.sort()
        end = 0
        for start, stop in ranges:
            if start != end:
                return [], (f"the manifest's buckets {'skip' if start > end else 'repeat'} "
                            f"elements of tensor {index}")
            end = stop
        if end != numels[index]:
            return [], f"the manifest's buckets skip elements of tensor {index}"
    return buckets, None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- sending -----------------------------------------------------------------------------

def _check_src(src) -> None:
    if isinstance(src, bool) or not isinstance(src, int) or src < 0:
        raise ValueError(f"src must be a global rank (an int >= 0), not {src!r}")


def _check_send_args(bucket_bytes, dtype, adapters, checksum) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) \
            or bucket_bytes < PIECE_ALIGN:
        raise ValueError(f"bucket_bytes must be an int >= {PIECE_ALIGN}, not {bucket_bytes!r}")
    if dtype is not None and dtype not in _FLOATS:
        raise ValueError(f"dtype must be None or one of {[_dtype_name(d) for d in _FLOATS]}, "
                         f"not {dtype!r}")
    if adapters not in ("merged", "only"):
        raise ValueError(f"adapters must be 'merged' or 'only', not {adapters!r}")
    if not isinstance(checksum, bool):
        raise ValueError(f"checksum must be True or False, not {checksum!r}")


def _entries(record, inner, adapters: str):
    """[(unit or None, name, tensor, merge)] and {id(param): unit}: what is sent."""
    if adapters == "only":
        if not is_peft(inner):
            raise ValueError("adapters='only' sends a PEFT model's adapters, and this is not a "
                             "PEFT model: leave adapters at 'merged'")
        unit_of = ({id(p): u for u, (_, buckets) in enumerate(record.stage3.units)
                    for b in buckets for p in b.params}
                   if record is not None and record.stage3 is not None else {})
        # the active adapters, trained or frozen, and whatever else trains
        adapter = active_adapter_names(inner)
        entries = [(unit_of.get(id(p)), name, p, None)
                   for name, p in inner.named_parameters() if p.requires_grad or name in adapter]
        return sorted(entries, key=lambda e: -1 if e[0] is None else e[0]), unit_of
    _, entries, unit_of = export_entries(record, inner)
    return entries, unit_of


def _check_sendable(name: str, t, sharded: bool) -> None:
    """A tensor src can send as it is: dense, with memory, and not a
    module's extra state of another kind than a tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} is a {type(t).__name__} (a module's extra state): weight "
                         f"sync sends tensors; have get_extra_state return one, or carry it "
                         f"to the receivers another way")
    if t.layout != torch.strided:
        raise ValueError(f"{name} is a {t.layout} tensor: weight sync sends dense tensors; "
                         f"make it dense (to_dense()) in the model first")
    if t.is_meta and not sharded:
        raise ValueError(f"{name} is on the meta device and holds no values to send: load "
                         f"the model's weights first")


class _Sender:
    """What every trainer of the sending side does: the same gathers in the
    same order; the sender alone packs and sends."""

    def __init__(self, model, adapters: str, dtype, bucket_bytes: int):
        self.record, inner = unwrapped(model)
        self.stage3 = self.record.stage3 if self.record is not None else None
        entries, self.unit_of = _entries(self.record if self.stage3 is not None else None,
                                         inner, adapters)
        self.slots = slots = self.record.sharded_slots() if self.stage3 is not None else {}
        self.memory = {}                 # home -> (its gathered bucket or None, a tensor in it)
        planned = []
        for unit, name, t, merge in entries:
            _check_sendable(name, t, id(t) in slots)
            # every floating tensor, as torch's module.to(dtype) casts them
            sent = dtype if dtype is not None and t.is_floating_point() else t.dtype
            shape = tuple(whole_shape(slots, t))
            home = None if merge is not None or sent != t.dtype else self._home(slots, t)
            planned.append(((unit, name, t, merge), (shape, sent), home))
        # within a unit, what lies in memory first, in the memory's order
        first = {}
        for _, _, home in planned:
            if home is not None:
                first.setdefault(home[0], len(first))
        planned.sort(key=lambda e: (-1 if e[0][0] is None else e[0][0], e[2] is None,
                                    (first[e[2][0]], e[2][1]) if e[2] is not None else (0, 0)))
        self.entries = [entry for entry, _, _ in planned]
        self.specs = [spec for _, spec, _ in planned]
        self.bucket_bytes = bucket_bytes
        self.buckets = plan_buckets(self.specs, bucket_bytes,
                                    homes=[home for _, _, home in planned])
        self._last = None

    def _home(self, slots, t) -> tuple | None:
        """(memory, byte offset) of a tensor that lies in memory sent as it
        lies: under stage 3 a unit's gathered bucket, laid out alike on
        every trainer (the plan decides the gathers, so it must not differ
        between them; whole params are packed); else its own storage."""
        slot = slots.get(id(t))
        if slot is not None:
            bucket, index = slot
            home = ("gathered", id(bucket))
            self.memory.setdefault(home, (bucket, t))
            return home, bucket.layout.slots[index].offset * bucket.itemsize
        plain = type(t) in (torch.nn.Parameter, torch.Tensor) and t.layout == torch.strided
        # a conjugate or negative view's memory holds other values than it reads
        if self.stage3 is not None or not plain or not t.is_contiguous() or _lazy(t):
            return None
        storage = t.untyped_storage()
        home = ("storage", t.device.type, t.device.index, storage.data_ptr())
        self.memory.setdefault(home, (None, t))
        return home, t.storage_offset() * t.element_size()

    def memory_bytes(self, home) -> torch.Tensor:
        """The bytes of a home, as they lie (a gathered unit: gathered)."""
        bucket, t = self.memory[home]
        if bucket is not None:
            if bucket.gathered is None or bucket.gathered[1] is None:
                raise RuntimeError("sync_weights: a unit to send from is not gathered here")
            return bucket.gathered[1].view(torch.uint8)
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())

    def copies(self, bucket: SyncBucket, device: torch.device) -> bool:
        """Whether a bucket goes through a buffer: packed, cast, merged, or
        held on another device than the group's."""
        if bucket.source is None:
            return True
        if bucket.source[0] == "range":
            t = self.memory[bucket.source[1]][1]
        else:
            index = bucket.source[1]
            _, _, t, merge = self.entries[index]
            if merge is not None or t.dtype != self.specs[index][1]:
                return True
        slot = self.slots.get(id(t))            # a sharded param is whole where its shard is
        return (slot[0].flat_param_shard.device if slot is not None else t.device) != device

    def manifest(self, adapters: str, checksum: bool) -> dict:
        return {"format": FORMAT, "bucket_bytes": self.bucket_bytes, "adapters": adapters,
                "checksum": checksum,
                "tensors": [(name, list(shape), _dtype_name(dtype))
                            for (_, name, _, _), (shape, dtype) in zip(self.entries, self.specs)],
                "buckets": [(b.nbytes, b.pieces) for b in self.buckets]}

    def units_of(self, pieces) -> set:
        units = set()
        for index, _, _, _ in pieces:
            unit, _, _, merge = self.entries[index]
            if unit is not None:
                units.add(unit)
            if merge is not None:
                units |= adapter_units(merge[0], self.unit_of)
        return units

    def run(self, root: int | None = None, pack=None, flush=None,
            before_release=None, start=None) -> None:
        """Walks the buckets piece by piece, holding gathered the units the
        current piece reads and, in flight, the next piece's (a collective
        when the model is sharded, onto the shard group's rank `root`
        alone): pack(k, piece, value_of) fills bucket k, flush(k, value_of)
        sends it; before_release(units) before those units go, and
        before_release(None) at the end. start() runs first and returns
        ready(); ready(), called once the first units are in flight, says
        whether to pack and send, or only gather."""
        if self.stage3 is None:
            return self._walk(pack, flush, before_release, start)
        with self.stage3.gathers_onto(root):
            return self._walk(pack, flush, before_release, start)

    def _walk(self, pack, flush, before_release, start) -> None:
        pieces = [(k, piece) for k, bucket in enumerate(self.buckets)
                  for piece in bucket.pieces]
        needs = [self.units_of([piece]) for _, piece in pieces]
        state = {"held": set(), "leaving": set(), "ahead": None}

        def settle():
            """The units the walk left go once the sends that read them are
            done, and the next ones start to gather. Run once the first
            bucket of the new units is sent (or packed), so that the wire
            has it queued behind the last unit's while src waits for that
            and sets up the next gather: back to back, within two units."""
            if state["leaving"]:
                if before_release is not None:
                    before_release(state["leaving"])
                for unit in sorted(state["leaving"]):
                    self.stage3.release(unit)
                state["leaving"] = set()
            if state["ahead"] is not None:
                held = state["held"]
                following = next((n for n in needs[state["ahead"]:] if not n <= held), set())
                for unit in sorted(following - held):
                    self.stage3.prefetch(unit)     # gathers while these units are sent
                state["ahead"] = None
        try:
            ready = start() if start is not None else None
            if self.stage3 is not None:       # the first units gather meanwhile
                state["ahead"] = 0
                settle()
            if ready is not None and not ready():
                pack = flush = None
            for i, (k, piece) in enumerate(pieces):
                if self.stage3 is not None and not needs[i] <= state["held"]:
                    settle()
                    self.stage3.gather_many(sorted(needs[i] - state["held"]))
                    state["leaving"] = state["held"] - needs[i]
                    state["held"] = set(needs[i])
                    state["ahead"] = i + 1
                if pack is not None:
                    pack(k, piece, self.value_of)
                last = i + 1 == len(pieces) or pieces[i + 1][0] != k
                if flush is not None and last:
                    flush(k, self.value_of)
                # a bucket sent from a unit's memory reads it until flushed
                if self.stage3 is not None and (last or self.buckets[k].source is None):
                    settle()
        finally:
            if before_release is not None:
                before_release(None)
            if self.stage3 is not None:
                self.stage3.release_all()

    def value_of(self, index: int) -> torch.Tensor:
        """The whole tensor (its unit gathered), merged where LoRA asks (once
        for all the chunks of a tensor cut across buckets)."""
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        _, _, t, merge = self.entries[index]
        value = merged(t, *merge) if merge is not None else _resolved(t.detach())
        value = value.reshape(-1)
        self._last = (index, value) if merge is not None else None
        return value


def sync_weights(model, group, *, src: int = 0, bucket_bytes: int = 256 << 20, dtype=None,
                 adapters: str = "merged", checksum: bool = False) -> dict:
    """Sends the model's weights from the trainer `src` (a global rank) to
    every receiver in `group`. Every rank of the training model calls it:
    under stage 3 the gathers need them all; a trainer outside `group` only
    gathers. Returns what was sent: {"tensors", "bytes", "buckets",
    "buffer_bytes", "copied_bytes", "seconds"} (on src; the others' counts are
    the plan's): copied_bytes went through a buffer (packed, cast or moved to
    the group's device), the rest from the memory that holds them.

    A sync src cannot send (a bad argument, a model it cannot send as asked)
    is refused on every trainer and, in place of the manifest, on every
    receiver: all raise WeightSyncError, and the group stays usable."""
    _check_src(src)
    started = time.perf_counter()
    me = dist.get_rank()
    member = in_group(group)
    comm = _trainers(model)
    # src, or a trainer wrongly in the group: it then takes the refusal as a
    # receiver would, so that src's broadcast of it completes
    channel = BroadcastChannel(group, src) if member else None
    sender, refusal = None, None
    try:
        # refused on every trainer alike: one that raised alone here would
        # leave the others waiting, and their collectives out of step after
        if member and me != src:
            raise ValueError(f"rank {me} is in the weight-sync group but is not src ({src}): "
                             f"the other trainers stay out of it, and a receiver calls "
                             f"receive_weights")
        if me == src and not member:
            raise ValueError(f"src (rank {src}) is not in the weight-sync group: the group "
                             f"holds the sending trainer and every receiver")
        _check_send_args(bucket_bytes, dtype, adapters, checksum)
        if comm is not None and src not in comm.members:
            raise ValueError(f"src (rank {src}) is not one of the training model's ranks "
                             f"{comm.members}")
        sender = _Sender(model, adapters, dtype, bucket_bytes)
    except Exception as error:           # the receivers hear of it instead of a manifest
        refusal = error
    disagreed = None
    try:
        if comm is not None:
            comm.agree("sync_weights", {"src": src, "bucket_bytes": bucket_bytes,
                                        "dtype": str(dtype), "adapters": adapters,
                                        "checksum": checksum, "refused": refusal is not None})
    except CollectiveError as error:
        disagreed = error
    failed = refusal if refusal is not None else disagreed
    if failed is not None:
        if channel is not None:
            # what the caller must hear is the refusal, not that no receiver came to hear it
            with contextlib.suppress(CollectiveError):
                channel.object({"format": FORMAT, "refused": str(failed)} if me == src else None)
        if refusal is None:
            raise disagreed
        raise WeightSyncError(f"sync_weights: {refusal}") from refusal
    report = {"tensors": len(sender.entries), "buckets": len(sender.buckets),
              "bytes": sum(math.prod(shape) * d.itemsize
                           for shape, d in sender.specs), "buffer_bytes": 0, "copied_bytes": 0}
    if comm is None and me != src:
        return dict(report, seconds=0.0)        # params are whole on src: nothing to gather
    failure = []

    def handshake():
        """src: the manifest out; then, while the first units gather and the
        receivers check it, the verdict's wait, which says whether to send."""
        channel.object(sender.manifest(adapters, checksum))

        def verdict() -> bool:
            refused = channel.verdict(None)
            if refused is not None:
                failure.append(f"the receivers refused the manifest: {refused}")
            return refused is None
        return verdict
    # only the ranks whose shards src needs gather (under hybrid sharding: src's group)
    gathers = sender.stage3 is not None and src in comm.shard_ranks
    crc = [0]
    root = comm.shard_ranks.index(src) if gathers else None
    if channel is not None:
        report["buffer_bytes"], report["copied_bytes"] = _send_buckets(
            sender, channel, checksum, crc, root, handshake)
    elif gathers:
        sender.run(root)
    if channel is not None and not failure and (checksum or channel.chained):
        if checksum:
            channel.object(crc[0])
        # down chains src has heard only from each piece's first receiver:
        # every receiver says here that it holds every bucket (a message
        # only for a checksum that did not match; a receiver that failed
        # stays away, and the verdict times out)
        verdict = channel.verdict(None)
        if verdict is not None:
            failure.append(f"a receiver's checksum did not match: {verdict}")
    # every trainer learns what src learned
    _agree_failure(comm, failure[0] if failure else None)
    return dict(report, seconds=time.perf_counter() - started)


def _trainers(model):
    """The communicator over the training model's ranks (a sharded model's,
    or its ZeroAdamW's at stages 1-2), or None for one process."""
    record, inner = unwrapped(model)
    if record is not None:
        return record.comm
    optimizer = owning_optimizer(inner)
    return optimizer.comm if optimizer is not None else None


def _agree_failure(comm, failure: str | None) -> None:
    """Every trainer raises if the receivers reported a failure to src. The
    trainers gather regardless (at stage 3), so this is their one agreement
    after the start's, at the end."""
    if comm is not None:
        failure = next((v for v in comm.statuses(failure, "sync_weights") if v is not None),
                       None)
    if failure is not None:
        raise WeightSyncError(f"sync_weights: {failure}")


# The two bucket buffers of each device, kept from one sync to the next: a
# fresh buffer's pages fault in on first touch, which on the CPU costs
# several times the copy into it. release_sync_buffers() frees them.
_BUFFERS: dict[str, list[torch.Tensor]] = {}


def _bucket_buffers(channel: BroadcastChannel, size: int) -> list[torch.Tensor]:
    key = str(channel.device)
    have = _BUFFERS.get(key, [])
    if not have or have[0].numel() < size:
        _BUFFERS.pop(key, None)                  # the old ones go before the new come
        have = _BUFFERS[key] = [channel.buffer(size) for _ in range(2)]
    return have


def release_sync_buffers() -> None:
    """Frees the bucket buffers sync_weights and receive_weights keep for the
    next sync (two buckets per device)."""
    _BUFFERS.clear()


class _Buffers:
    """The two buffers, taken in turn by the buckets that need one (packed,
    cast, or moved to the group's device), each once its last send or
    receive is done; asked for only when a bucket first needs one."""

    def __init__(self, channel: BroadcastChannel, size: int):
        self.channel, self.size = channel, size
        self.buffers, self.works, self.slot, self.used = None, [None, None], {}, 0

    def take(self, k: int, nbytes: int) -> torch.Tensor:
        """Bucket k's buffer, its first nbytes."""
        if nbytes > self.size:
            raise RuntimeError(f"weight sync: bucket {k} of {nbytes} bytes does not fit the "
                               f"{self.size}-byte buffers planned for it")
        if k not in self.slot:
            if self.buffers is None:
                self.buffers = _bucket_buffers(self.channel, self.size)
            self.slot[k] = self.used % 2
            self.used += 1
            slot = self.slot[k]
            if self.works[slot] is not None:
                self.works[slot].wait()
                self.works[slot] = None
        return self.buffers[self.slot[k]][:nbytes]

    def sent(self, k: int, work) -> None:
        self.works[self.slot[k]] = work

    def finish(self) -> None:
        for slot, work in enumerate(self.works):
            if work is not None:
                self.works[slot] = None
                work.wait()

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers) if self.buffers is not None else 0


def _send_buckets(sender: _Sender, channel: BroadcastChannel, checksum: bool,
                  crc: list, root: int | None, start) -> tuple[int, int]:
    """Packs and broadcasts every bucket through two alternating buffers, or
    sends it from the memory that holds it (kept alive, and gathered, until
    it has gone), if start()'s ready() says so (see _Sender.run); returns
    the buffers' bytes and the bytes copied in them."""
    buffers = _Buffers(channel, max((b.nbytes for b in sender.buckets
                                     if sender.copies(b, channel.device)), default=0))
    reading = []              # sends from memory: (work, the memory, the units it lies in)
    filled = {"bucket": -1, "end": 0}       # how far the bucket being packed is filled
    copied = [0]

    def add_to_checksum(flat, pieces):
        if checksum:
            for index, _, count, offset in pieces:
                itemsize = sender.specs[index][1].itemsize
                crc[0] = zlib.crc32(_host_bytes(flat[offset:offset + count * itemsize]), crc[0])

    def pack(k, piece, value_of):
        if sender.buckets[k].source is not None:
            return
        buffer = buffers.take(k, sender.buckets[k].nbytes)
        if filled["bucket"] != k:
            filled.update(bucket=k, end=0)
        index, start, count, offset = piece
        dtype = sender.specs[index][1]
        end = offset + count * dtype.itemsize
        with torch.no_grad():
            if offset > filled["end"]:          # alignment gaps: the same bytes every time
                buffer[filled["end"]:offset].zero_()
            buffer[offset:end].view(dtype).copy_(value_of(index)[start:start + count])
        filled["end"] = end
        copied[0] += end - offset

    def flush(k, value_of):
        bucket = sender.buckets[k]
        what = f"weight-sync bucket {k}"
        if bucket.source is None:
            flat = buffers.take(k, bucket.nbytes)
        elif bucket.source[0] == "range":
            _, home, lo = bucket.source
            flat = sender.memory_bytes(home)[lo:lo + bucket.nbytes]
        else:
            index, start, count, _ = bucket.pieces[0]
            source = value_of(index)[start:start + count]
            dtype = sender.specs[index][1]
            flat = source.view(torch.uint8) if source.dtype == dtype else None
            if flat is None:                    # cast on the way
                flat = buffers.take(k, bucket.nbytes)
                with torch.no_grad():
                    flat.view(dtype).copy_(source)
                copied[0] += bucket.nbytes
        if flat.device != channel.device:       # to the group's device on the way
            staged = buffers.take(k, bucket.nbytes)
            staged.copy_(flat)
            flat = staged
            copied[0] += bucket.nbytes
        add_to_checksum(flat, bucket.pieces)
        views = ([flat[lo:hi] for lo, hi, _ in chain_cuts(bucket, sender.specs)]
                 if channel.chained else None)
        work = channel.bytes(flat, what, views=views)
        if k in buffers.slot:
            buffers.sent(k, work)
        else:
            reading.append((work, flat, sender.units_of(bucket.pieces)))

    def before_release(units):
        """Waits for the sends that read the units' memory (None: all)."""
        for entry in list(reading):
            if units is None or entry[2] & units:
                reading.remove(entry)
                entry[0].wait()

    try:
        sender.run(root, pack, flush, before_release, start)
    finally:
        buffers.finish()
        before_release(None)
    return buffers.nbytes(), copied[0]


def _lazy(t: torch.Tensor) -> bool:
    """Whether t reads other values than its memory holds (a conjugate or
    negative view)."""
    return t.is_conj() or t.is_neg()


def _resolved(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg() if _lazy(t) else t


def _host_bytes(t: torch.Tensor):
    return _resolved(t.detach()).reshape(-1).view(torch.uint8).cpu().numpy()


# ---- receiving ---------------------------------------------------------------------------

def _check_manifest(manifest, record, inner) -> tuple[list, list, list, str | None]:
    """(the receiver's tensors in the manifest's order, the buckets, the
    (module, tensor) of each extra state to set, or an error)."""
    if not isinstance(manifest, dict) or not str(manifest.get("format")).startswith(
            "rlhfz.weight_sync."):
        return [], [], [], f"not an rlhfz weight-sync manifest ({type(manifest).__name__})"
    if manifest["format"] != FORMAT:
        return [], [], [], (f"the sender speaks {manifest['format']}, this receiver {FORMAT}: run "
                        f"the same rlhfz on both sides")
    if record is not None and record.stage3 is not None:
        return [], [], [], ("receive_weights loads a plain, unsharded model (a generation "
                        "worker's); this one is sharded")
    mine, seen = {}, set()
    extra_state = _extra_state_keys(inner)
    for name, t in inner.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            mine[name] = t
    sent = [name for name, _, _ in manifest["tensors"]]
    missing = [n for n in sent if n not in mine]
    named = set(sent)
    # adapters alone: every active adapter of a PEFT receiver must come (one
    # left out keeps its old values and changes what the model computes)
    ours = (mine if manifest["adapters"] != "only" else
            active_adapter_names(inner) if is_peft(inner) else ())
    extra = [n for n in mine if n in ours and n not in named]
    wrong, unwritable, targets = [], [], []
    for name, shape, dtype in manifest["tensors"]:
        t = mine.get(name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            wrong.append(f"{name}: a tensor sent, a {type(t).__name__} here (a module's "
                         f"extra state)")
        elif list(t.shape) != list(shape) or _dtype_name(t.dtype) != dtype:
            wrong.append(f"{name}: {dtype}{list(shape)} sent, {_dtype_name(t.dtype)}"
                         f"{list(t.shape)} here")
        elif not t.is_contiguous():
            wrong.append(f"{name}: not contiguous here")
        elif t.is_meta:
            unwritable.append(f"{name} is on the meta device (no memory to load into)")
        elif t.is_inference() and not torch.is_inference_mode_enabled():
            # torch writes an inference tensor only under inference_mode
            unwritable.append(f"{name} was made under torch.inference_mode and is written "
                              f"only inside it")
        targets.append(t)
    if missing or extra or wrong or unwritable:
        parts = []
        if missing:
            parts.append(f"sent but not in this model: {missing[:5]}"
                         + (" ..." if len(missing) > 5 else ""))
        if extra:
            parts.append(f"in this model but not sent: {extra[:5]}"
                         + (" ..." if len(extra) > 5 else ""))
        if wrong:
            parts.append(f"different: {wrong[:3]}" + (" ..." if len(wrong) > 3 else "")
                         + " (sync_weights' dtype= casts floating tensors on the way)")
        if unwritable:
            parts.append(f"not writable here: {unwritable[:3]}"
                         + (" ..." if len(unwritable) > 3 else ""))
        return [], [], [], "the weights sent do not fit this model: " + "; ".join(parts)
    specs = [(tuple(t.shape), t.dtype) for t in targets]
    buckets, error = check_plan(manifest.get("buckets"), specs, manifest.get("bucket_bytes"))
    # a module's extra state is a tensor get_extra_state made for the state
    # dict: it lands there, and goes in through set_extra_state, as torch's
    # load_state_dict does
    settle = [(extra_state[name], t) for (name, _, _), t in zip(manifest["tensors"], targets)
              if name in extra_state]
    return targets, buckets, settle, error


def _extra_state_keys(inner) -> dict:
    """{state-dict key: module} of the modules with extra state."""
    return {(f"{name}." if name else "") + "_extra_state": module
            for name, module in inner.named_modules()
            if type(module).get_extra_state is not torch.nn.Module.get_extra_state}


def receive_weights(model, group, *, src: int = 0) -> dict:
    """Receives sync_weights' tensors from `src` (the sending trainer's
    global rank) into the model's own tensors, in place. The model is a
    plain, unsharded one; every receiver in `group` calls this. Returns
    {"tensors", "bytes", "buckets", "seconds"}. A sync refused before the
    buckets move writes nothing; one cut off after raises CollectiveError
    saying the model is partly written."""
    started = time.perf_counter()
    _check_src(src)
    me = dist.get_rank()
    if not in_group(group) or me == src:
        raise ValueError(f"rank {me} receives over a group that holds it and src ({src}), "
                         f"not as src itself")
    record, inner = unwrapped(model)
    channel = BroadcastChannel(group, src)
    manifest = channel.object()
    if isinstance(manifest, dict) and manifest.get("refused") is not None:
        raise WeightSyncError(f"receive_weights: the sender refused the sync: "
                              f"{manifest['refused']}")
    targets, buckets, settle, error = _check_manifest(manifest, record, inner)
    verdict = channel.verdict(error)
    if error is not None:
        raise WeightSyncError(f"receive_weights: {error}")
    if verdict is not None:
        raise WeightSyncError(f"receive_weights: another receiver refused the manifest: "
                              f"{verdict}")
    specs = [(tuple(t.shape), t.dtype) for t in targets]
    try:
        _receive_buckets(buckets, specs, targets, channel)
    except CollectiveError as error:
        # the buckets that came before are in the model: it is neither the
        # old weights nor the new
        raise CollectiveError(f"receive_weights: the sync stopped part way, so this model is "
                              f"partly written (some tensors hold the weights sent, the rest "
                              f"their old values): receive a whole sync before using it. "
                              f"{error}") from error
    if manifest["checksum"]:
        mine = 0
        for bucket in buckets:                  # the bytes in the order they were sent
            for index, start, count, _ in bucket.pieces:
                mine = zlib.crc32(_host_bytes(targets[index].view(-1)[start:start + count]),
                                  mine)
        theirs = channel.object()
        error = (None if mine == theirs else
                 f"CRC-32 {mine:#010x} of the weights as loaded, {theirs:#010x} as sent")
        verdict = channel.verdict(error)
        if verdict is not None:
            raise WeightSyncError(f"receive_weights: checksum mismatch: {verdict}")
    elif channel.chained:
        channel.verdict(None)                   # src hears that every receiver holds it all
    for module, value in settle:
        try:
            module.set_extra_state(value)
        except Exception as error:
            raise WeightSyncError(f"receive_weights: the weights are loaded, but "
                                  f"{type(module).__name__}.set_extra_state refused the extra "
                                  f"state sent: {error!r}") from error
    return {"tensors": len(targets), "buckets": len(buckets),
            "bytes": sum(math.prod(s) * d.itemsize for s, d in specs),
            "seconds": time.perf_counter() - started}


def _receive_buckets(buckets, specs, targets, channel: BroadcastChannel) -> None:
    """Each bucket into one of two buffers, unpacked while the next arrives,
    but for what lands straight in its tensor: a bucket that is one chunk of
    one tensor, and down a chain every piece of CHAIN_DIRECT_BYTES or more
    (chain_cuts)."""
    if not buckets:
        return

    def memory_of(piece) -> torch.Tensor | None:
        """The tensor memory a piece lands in straight, where the group's
        device holds it."""
        index, start, count, _ = piece
        target = targets[index]
        if target.device != channel.device or _lazy(target):
            return None
        return target.detach().view(-1)[start:start + count].view(torch.uint8)

    def ways(bucket) -> tuple[list, list]:
        """The bucket's ranges (first, end, piece's place or None) and the
        memory each lands in straight (None: through the buffer)."""
        if channel.chained:
            cuts = chain_cuts(bucket, specs)
        else:
            cuts = [(0, bucket.nbytes, 0 if lands_whole(bucket, specs) else None)]
        return cuts, [None if place is None else memory_of(bucket.pieces[place])
                      for _, _, place in cuts]

    plans = [ways(bucket) for bucket in buckets]

    def through_a_buffer(k) -> bool:
        return any(memory is None for memory in plans[k][1])
    buffers = _Buffers(channel, max((b.nbytes for k, b in enumerate(buckets)
                                     if through_a_buffer(k)), default=0))
    # A receive into a tensor's memory is a write autograd does not see: a
    # graph that saved the tensor must fail at backward, as after
    # load_state_dict (the copies out of a buffer count themselves).
    landed = {id(targets[bucket.pieces[place][0]]): targets[bucket.pieces[place][0]]
              for bucket, (cuts, straight) in zip(buckets, plans)
              for (_, _, place), memory in zip(cuts, straight) if memory is not None}

    def post(k):
        cuts, straight = plans[k]
        buffer = buffers.take(k, buckets[k].nbytes) if through_a_buffer(k) else None
        views = [memory if memory is not None else buffer[lo:hi]
                 for (lo, hi, _), memory in zip(cuts, straight)]
        what = f"weight-sync bucket {k}"
        if channel.chained:
            return channel.bytes(buffer, what, views=views)
        return channel.bytes(views[0], what)

    def unpack(k):
        bucket, (cuts, straight) = buckets[k], plans[k]
        buffer = buffers.take(k, bucket.nbytes)
        went = {place for (_, _, place), memory in zip(cuts, straight) if memory is not None}
        for place, (index, start, count, offset) in enumerate(bucket.pieces):
            if place not in went:
                dtype = specs[index][1]
                source = buffer[offset:offset + count * dtype.itemsize].view(dtype)
                targets[index].detach().view(-1)[start:start + count].copy_(source)

    try:
        work = post(0)
        with torch.no_grad():
            for k in range(len(buckets)):
                upcoming = post(k + 1) if k + 1 < len(buckets) else None
                work.wait()
                if k in buffers.slot:
                    unpack(k)
                work = upcoming
    finally:
        torch.autograd.graph.increment_version(list(landed.values()))
