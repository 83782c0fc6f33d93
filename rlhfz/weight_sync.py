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
   sent, and the bucket size. Each receiver checks it against its model,
   and every rank of the group, then every trainer, learns whether all
   agree, so that a mismatch is an error everywhere, never a hang.
2. Then flat byte buckets, one broadcast each: small tensors back to back,
   large ones in buckets of their own, in chunks of a bucket, sent from and
   received into their own memory (plan_buckets; the manifest says where
   "large" starts: half a bucket, or 1 MiB under stage 3, whose gathered
   units are sent from without a second copy).
   Two buffers alternate, so the sender gathers and packs the next bucket
   while the current one is on the wire; a receiver unpacks one bucket
   while the next arrives. They are kept for the next sync (faulting in
   fresh pages costs more than filling them); release_sync_buffers() frees
   them. The sender's memory beyond the model's: the two buffers, and under
   stage 3 the unit being packed and the next, gathered ahead (as a forward
   gathers them).
3. With checksum=True the sender's CRC-32 of every byte it sent is checked
   against one of the receiver's params as loaded: a verified, bit-exact sync.

dtype= casts floating tensors on the way (e.g. fp32 masters to a bf16
engine); integer buffers go as they are. For a PEFT LoRA model,
adapters="merged" sends the base weights with the adapters folded in,
under the base model's names; "only" sends the adapters' params.
"""
from __future__ import annotations

import math
import time
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm.channel import BroadcastChannel, in_group
from .lora_export import is_peft, merged
from .model_state import unwrapped, whole_shape
from .pretrained import export_entries

FORMAT = "rlhfz.weight_sync.v2"
# every piece starts on this many bytes, so a bucket's bytes view as any dtype
PIECE_ALIGN = 16
# Under stage 3 what is sent lies in gathered units, memory held anyway: a
# tensor of this size or more goes from there (in place of a second copy in
# a bucket buffer). Whole params (stages 0-2) are packed up to half a
# bucket: on the host, fewer broadcasts cost less than the packing copies.
GATHERED_DIRECT_BYTES = 1 << 20
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class WeightSyncError(RuntimeError):
    """A weight sync failed: the manifest did not match a receiver's model,
    or a checksum did not match. Nothing a receiver holds was written when
    the manifest was refused."""

    __module__ = "rlhfz"


# ---- the plan: which bytes go in which bucket --------------------------------------------

class SyncBucket(NamedTuple):
    """One broadcast: its bytes, and the (tensor index, first element,
    elements, byte offset) pieces in it. A direct bucket is one chunk of one
    large tensor, moved straight from and into the tensor's own memory where
    it can be; the others are packed into a buffer."""

    nbytes: int
    pieces: list
    direct: bool


def plan_buckets(specs: list[tuple[tuple[int, ...], torch.dtype]],
                 bucket_bytes: int, direct_bytes: int | None = None) -> list[SyncBucket]:
    """Buckets of at most bucket_bytes for tensors of (shape, dtype), in
    order. A tensor of direct_bytes or more (default: half a bucket) goes in
    buckets of its own, in chunks of a bucket (sent from and received into
    its own memory: no copy on either side); smaller ones are packed back to
    back, each piece on a 16-byte boundary. Fewer, larger broadcasts: each
    has a fixed cost."""
    if direct_bytes is None:
        direct_bytes = bucket_bytes // 2
    buckets, pieces, used = [], [], 0

    def close():
        nonlocal pieces, used
        if pieces:
            buckets.append(SyncBucket(used, pieces, False))
        pieces, used = [], 0

    for index, (shape, dtype) in enumerate(specs):
        itemsize = dtype.itemsize
        numel = math.prod(shape)
        if numel and numel * itemsize >= direct_bytes:
            close()
            per = max(1, bucket_bytes // itemsize)
            for start in range(0, numel, per):
                count = min(per, numel - start)
                buckets.append(SyncBucket(count * itemsize, [(index, start, count, 0)], True))
            continue
        offset = -(-used // PIECE_ALIGN) * PIECE_ALIGN
        if offset + numel * itemsize > bucket_bytes:
            close()
            offset = 0
        pieces.append((index, 0, numel, offset))
        used = offset + numel * itemsize
    close()
    return buckets


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"the manifest names an unknown dtype {name!r}")
    return dtype


# ---- sending -----------------------------------------------------------------------------

def _check_send_args(src, bucket_bytes, dtype, adapters, checksum) -> None:
    if isinstance(src, bool) or not isinstance(src, int) or src < 0:
        raise ValueError(f"src must be a global rank (an int >= 0), not {src!r}")
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
        entries = [(unit_of.get(id(p)), name, p, None)
                   for name, p in inner.named_parameters() if p.requires_grad]
        return sorted(entries, key=lambda e: -1 if e[0] is None else e[0]), unit_of
    _, entries, unit_of = export_entries(record, inner)
    return entries, unit_of


class _Sender:
    """What every trainer of the sending side does: the same gathers in the
    same order; the sender alone packs and sends."""

    def __init__(self, model, adapters: str, dtype, bucket_bytes: int):
        self.record, inner = unwrapped(model)
        self.stage3 = self.record.stage3 if self.record is not None else None
        self.entries, self.unit_of = _entries(self.record if self.stage3 is not None else None,
                                              inner, adapters)
        slots = self.record.sharded_slots() if self.stage3 is not None else {}
        self.specs = []
        for _, name, t, _ in self.entries:
            sent = dtype if dtype is not None and t.dtype in _FLOATS else t.dtype
            self.specs.append((tuple(whole_shape(slots, t)), sent))
        self.bucket_bytes = bucket_bytes
        self.direct_bytes = (min(GATHERED_DIRECT_BYTES, bucket_bytes // 2)
                             if self.stage3 is not None else bucket_bytes // 2)
        self.buckets = plan_buckets(self.specs, bucket_bytes, self.direct_bytes)
        self._last = None

    def manifest(self, adapters: str, checksum: bool) -> dict:
        return {"format": FORMAT, "bucket_bytes": self.bucket_bytes,
                "direct_bytes": self.direct_bytes, "adapters": adapters, "checksum": checksum,
                "tensors": [(name, list(shape), _dtype_name(dtype))
                            for (_, name, _, _), (shape, dtype) in zip(self.entries, self.specs)]}

    def units_of(self, pieces) -> set:
        units = set()
        for index, _, _, _ in pieces:
            unit, _, _, merge = self.entries[index]
            if unit is not None:
                units.add(unit)
            if merge is not None:
                layer = merge[0]
                units |= {self.unit_of[id(p)] for n, p in layer.named_parameters()
                          if "lora_" in n and id(p) in self.unit_of}
        return units

    def run(self, root: int | None = None, pack=None, flush=None,
            before_release=None) -> None:
        """Walks the buckets piece by piece, holding gathered the units the
        current piece reads and, in flight, the next piece's (a collective
        when the model is sharded, onto the shard group's rank `root`
        alone): pack(k, piece, value_of) fills bucket k, flush(k, value_of)
        sends it; before_release() before units go."""
        if self.stage3 is None:
            return self._walk(pack, flush, before_release)
        with self.stage3.gathers_onto(root):
            return self._walk(pack, flush, before_release)

    def _walk(self, pack, flush, before_release) -> None:
        pieces = [(k, piece) for k, bucket in enumerate(self.buckets)
                  for piece in bucket.pieces]
        needs = [self.units_of([piece]) for _, piece in pieces]
        held: set = set()
        try:
            for i, (k, piece) in enumerate(pieces):
                if self.stage3 is not None and not needs[i] <= held:
                    if before_release is not None and held - needs[i]:
                        before_release()
                    for unit in sorted(held - needs[i]):
                        self.stage3.release(unit)
                    self.stage3.gather_many(sorted(needs[i] - held))
                    held = set(needs[i])
                    following = next((n for n in needs[i + 1:] if not n <= held), set())
                    for unit in sorted(following - held):
                        self.stage3.prefetch(unit)     # gathers while this unit is sent
                if pack is not None:
                    pack(k, piece, self.value_of)
                if flush is not None and (i + 1 == len(pieces) or pieces[i + 1][0] != k):
                    flush(k, self.value_of)
        finally:
            if before_release is not None:
                before_release()
            if self.stage3 is not None:
                self.stage3.release_all()

    def value_of(self, index: int) -> torch.Tensor:
        """The whole tensor (its unit gathered), merged where LoRA asks (once
        for all the chunks of a tensor cut across buckets)."""
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        _, _, t, merge = self.entries[index]
        value = (merged(t, *merge) if merge is not None else t.detach()).reshape(-1)
        self._last = (index, value) if merge is not None else None
        return value


def sync_weights(model, group, *, src: int = 0, bucket_bytes: int = 256 << 20, dtype=None,
                 adapters: str = "merged", checksum: bool = False) -> dict:
    """Sends the model's weights from the trainer `src` (a global rank) to
    every receiver in `group`. Every rank of the training model calls it:
    under stage 3 the gathers need them all; a trainer outside `group` only
    gathers. Returns what was sent: {"tensors", "bytes", "buckets",
    "buffer_bytes", "seconds"} (on src; the others' counts are the plan's)."""
    _check_send_args(src, bucket_bytes, dtype, adapters, checksum)
    started = time.perf_counter()
    me = dist.get_rank()
    member = in_group(group)
    if member and me != src:
        raise ValueError(f"rank {me} is in the weight-sync group but is not src ({src}): the "
                         f"other trainers stay out of it, and a receiver calls receive_weights")
    if me == src and not member:
        raise ValueError(f"src (rank {src}) is not in the weight-sync group: the group holds "
                         f"the sending trainer and every receiver")
    sender = _Sender(model, adapters, dtype, bucket_bytes)
    comm = sender.record.comm if sender.stage3 is not None else None
    if comm is not None:
        comm.agree("sync_weights", {"src": src, "bucket_bytes": bucket_bytes,
                                    "dtype": None if dtype is None else _dtype_name(dtype),
                                    "adapters": adapters, "checksum": checksum})
        if src not in comm.members:
            raise ValueError(f"src (rank {src}) is not one of the training model's ranks "
                             f"{comm.members}")
    report = {"tensors": len(sender.entries), "buckets": len(sender.buckets),
              "bytes": sum(math.prod(shape) * d.itemsize
                           for shape, d in sender.specs), "buffer_bytes": 0}
    if comm is None and me != src:
        return dict(report, seconds=0.0)        # params are whole on src: nothing to gather
    channel = BroadcastChannel(group, src) if me == src else None
    verdict = None
    if channel is not None:
        channel.object(sender.manifest(adapters, checksum))
        verdict = channel.verdict(None)
    _agree_verdict(comm, verdict, "the receivers refused the manifest")
    # only the ranks whose shards src needs gather (under hybrid sharding: src's group)
    gathers = comm is not None and src in comm.shard_ranks
    crc = [0]
    root = comm.shard_ranks.index(src) if gathers else None
    if channel is not None:
        report["buffer_bytes"] = _send_buckets(sender, channel, checksum, crc, root)
    elif gathers:
        sender.run(root)
    if checksum:
        verdict = None
        if channel is not None:
            channel.object(crc[0])
            verdict = channel.verdict(None)
        _agree_verdict(comm, verdict, "a receiver's checksum did not match")
    return dict(report, seconds=time.perf_counter() - started)


def _agree_verdict(comm, verdict, what: str) -> None:
    """Every trainer raises if the receivers reported a failure to src."""
    if comm is not None:
        verdict = next((v for v in comm.statuses(verdict, "sync_weights") if v is not None),
                       None)
    if verdict is not None:
        raise WeightSyncError(f"sync_weights: {what}: {verdict}")


# The two bucket buffers of each device, kept from one sync to the next: a
# fresh buffer's pages fault in on first touch, which on the CPU costs
# several times the copy into it. release_sync_buffers() frees them.
_BUFFERS: dict[str, list[torch.Tensor]] = {}


def _bucket_buffers(channel: BroadcastChannel, buckets) -> list[torch.Tensor]:
    size = max((bucket.nbytes for bucket in buckets), default=0)
    count = min(2, len(buckets))
    key = str(channel.device)
    have = _BUFFERS.get(key, [])
    if len(have) < count or (have and have[0].numel() < size):
        _BUFFERS.pop(key, None)                  # the old ones go before the new come
        have = _BUFFERS[key] = [channel.buffer(size) for _ in range(count)]
    return have[:count]


def release_sync_buffers() -> None:
    """Frees the bucket buffers sync_weights and receive_weights keep for the
    next sync (two buckets per device)."""
    _BUFFERS.clear()


def _send_buckets(sender: _Sender, channel: BroadcastChannel, checksum: bool,
                  crc: list, root: int | None) -> int:
    """Packs and broadcasts every bucket through two alternating buffers (a
    direct bucket from its tensor's memory, kept alive and gathered until
    it has gone); returns the buffers' bytes."""
    buffers = _bucket_buffers(channel, sender.buckets)
    works = [None, None]                     # the last send from each buffer
    reading = []                             # direct sends: (work, the memory they read)
    filled = {"bucket": -1, "end": 0}       # how far the bucket being packed is filled

    def take(k) -> torch.Tensor:
        """Bucket k's buffer, once its last send has gone."""
        if works[k % 2] is not None:
            works[k % 2].wait()
            works[k % 2] = None
        return buffers[k % 2]

    def add_to_checksum(flat):
        if checksum:
            crc[0] = zlib.crc32(_host_bytes(flat), crc[0])

    def pack(k, piece, value_of):
        if sender.buckets[k].direct:
            return
        if filled["bucket"] != k:
            take(k)
            filled.update(bucket=k, end=0)
        buffer = buffers[k % 2]
        index, start, count, offset = piece
        dtype = sender.specs[index][1]
        end = offset + count * dtype.itemsize
        with torch.no_grad():
            if offset > filled["end"]:          # alignment gaps: the same bytes every time
                buffer[filled["end"]:offset].zero_()
            buffer[offset:end].view(dtype).copy_(value_of(index)[start:start + count])
        add_to_checksum(buffer[offset:end])
        filled["end"] = end

    def flush(k, value_of):
        bucket = sender.buckets[k]
        what = f"weight-sync bucket {k}"
        if not bucket.direct:
            works[k % 2] = channel.bytes(buffers[k % 2][:bucket.nbytes], what)
            return
        index, start, count, _ = bucket.pieces[0]
        source = value_of(index)[start:start + count]
        dtype = sender.specs[index][1]
        if source.dtype == dtype and source.device == channel.device:
            flat = source.view(torch.uint8)
            add_to_checksum(flat)
            reading.append((channel.bytes(flat, what), source))
            return
        buffer = take(k)                        # cast, or to the group's device, on the way
        with torch.no_grad():
            buffer[:bucket.nbytes].view(dtype).copy_(source)
        add_to_checksum(buffer[:bucket.nbytes])
        works[k % 2] = channel.bytes(buffer[:bucket.nbytes], what)

    def before_release():
        while reading:
            reading.pop(0)[0].wait()

    try:
        sender.run(root, pack, flush, before_release)
    finally:
        for work in works:
            if work is not None:
                work.wait()
        before_release()
    return sum(b.numel() for b in buffers)


def _host_bytes(t: torch.Tensor):
    return t.detach().reshape(-1).view(torch.uint8).cpu().numpy()


# ---- receiving ---------------------------------------------------------------------------

def _check_manifest(manifest, inner) -> tuple[list, str | None]:
    """(the receiver's tensors in the manifest's order, or an error)."""
    if not isinstance(manifest, dict) or not str(manifest.get("format")).startswith(
            "rlhfz.weight_sync."):
        return [], f"not an rlhfz weight-sync manifest ({type(manifest).__name__})"
    if manifest["format"] != FORMAT:
        return [], (f"the sender speaks {manifest['format']}, this receiver {FORMAT}: run the "
                    f"same rlhfz on both sides")
    mine, seen = {}, set()
    for name, t in inner.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            mine[name] = t
    sent = [name for name, _, _ in manifest["tensors"]]
    missing = [n for n in sent if n not in mine]
    named = set(sent)
    extra = [n for n in mine if n not in named] if manifest["adapters"] != "only" else []
    wrong, targets = [], []
    for name, shape, dtype in manifest["tensors"]:
        t = mine.get(name)
        if t is None:
            continue
        if list(t.shape) != list(shape) or _dtype_name(t.dtype) != dtype:
            wrong.append(f"{name}: {dtype}{list(shape)} sent, {_dtype_name(t.dtype)}"
                         f"{list(t.shape)} here")
        elif not t.is_contiguous():
            wrong.append(f"{name}: not contiguous here")
        targets.append(t)
    if missing or extra or wrong:
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
        return [], "the weights sent do not fit this model: " + "; ".join(parts)
    return targets, None


def receive_weights(model, group, *, src: int = 0) -> dict:
    """Receives sync_weights' tensors from `src` (the sending trainer's
    global rank) into the model's own tensors, in place. The model is a
    plain, unsharded one; every receiver in `group` calls this. Returns
    {"tensors", "bytes", "buckets", "seconds"}."""
    started = time.perf_counter()
    if isinstance(src, bool) or not isinstance(src, int) or src < 0:
        raise ValueError(f"src must be a global rank (an int >= 0), not {src!r}")
    me = dist.get_rank()
    if not in_group(group) or me == src:
        raise ValueError(f"rank {me} receives over a group that holds it and src ({src}), "
                         f"not as src itself")
    record, inner = unwrapped(model)
    if record is not None and record.stage3 is not None:
        raise NotImplementedError("receive_weights loads a plain, unsharded model (a "
                                  "generation worker's); this one is sharded")
    channel = BroadcastChannel(group, src)
    manifest = channel.object()
    targets, error = _check_manifest(manifest, inner)
    verdict = channel.verdict(error)
    if error is not None:
        raise WeightSyncError(f"receive_weights: {error}")
    if verdict is not None:
        raise WeightSyncError(f"receive_weights: another receiver refused the manifest: "
                              f"{verdict}")
    specs = [(tuple(shape), _dtype_of(dtype)) for _, shape, dtype in manifest["tensors"]]
    buckets = plan_buckets(specs, manifest["bucket_bytes"], manifest["direct_bytes"])
    _receive_buckets(buckets, specs, targets, channel)
    if manifest["checksum"]:
        mine = 0
        for t in targets:
            mine = zlib.crc32(_host_bytes(t), mine)
        theirs = channel.object()
        error = (None if mine == theirs else
                 f"CRC-32 {mine:#010x} of the weights as loaded, {theirs:#010x} as sent")
        verdict = channel.verdict(error)
        if verdict is not None:
            raise WeightSyncError(f"receive_weights: checksum mismatch: {verdict}")
    return {"tensors": len(targets), "buckets": len(buckets),
            "bytes": sum(math.prod(s) * d.itemsize for s, d in specs),
            "seconds": time.perf_counter() - started}


def _receive_buckets(buckets, specs, targets, channel: BroadcastChannel) -> None:
    """Each bucket into one of two buffers, or a direct one straight into
    its tensor; one is unpacked while the next arrives."""
    if not buckets:
        return
    buffers = _bucket_buffers(channel, buckets)

    def into(k) -> torch.Tensor | None:
        """The tensor memory a direct bucket lands in, where the group's
        device holds it."""
        bucket = buckets[k]
        if not bucket.direct:
            return None
        index, start, count, _ = bucket.pieces[0]
        target = targets[index]
        if target.device != channel.device:
            return None
        return target.detach().view(-1)[start:start + count].view(torch.uint8)

    def post(k):
        flat = into(k)
        flat = flat if flat is not None else buffers[k % 2][:buckets[k].nbytes]
        return channel.bytes(flat, f"weight-sync bucket {k}")

    work = post(0)
    with torch.no_grad():
        for k, bucket in enumerate(buckets):
            upcoming = post(k + 1) if k + 1 < len(buckets) else None
            work.wait()
            if into(k) is None:
                buffer = buffers[k % 2]
                for index, start, count, offset in bucket.pieces:
                    dtype = specs[index][1]
                    itemsize = dtype.itemsize
                    source = buffer[offset:offset + count * itemsize].view(dtype)
                    targets[index].detach().view(-1)[start:start + count].copy_(source)
            work = upcoming
