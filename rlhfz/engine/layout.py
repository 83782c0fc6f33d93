"""Bucket layout: where each parameter lives inside a flat bucket, and which
elements each rank owns.

A bucket holds the parameters of one (param group, dtype) back to back. Each
parameter starts on an aligned offset, and the total is padded so that it
divides evenly by the world size into equal, aligned shards: rank r owns
``[r * shard_numel, (r + 1) * shard_numel)``. Under offload="cpu" a shard
splits once more: its first `split` elements step on the backend, the rest
on the host. Every piece of that arithmetic lives in this module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .numbers import env_bytes

ALIGN_BYTES = 64
# the smallest bucket_bytes= taken: one page
MIN_BUCKET_BYTES = 4096


def stage2_bucket_bytes(group_bytes: int, bucket_bytes: int | None = None) -> int:
    """Stage 2 splits each group into buckets of about this many bytes, so
    that reduction overlaps backward and staging memory (two buckets) stays
    small: bucket_bytes (ZeroAdamW's option) or RLHFZ_BUCKET_BYTES if set,
    else 32 MiB but at most an eighth of the group (at least 64 KiB), so
    that small models save memory too."""
    if bucket_bytes is not None:
        return bucket_bytes
    from_env = env_bucket_bytes()
    if from_env is not None:
        return from_env
    return min(32 << 20, max(group_bytes // 8, 64 << 10))


def env_bucket_bytes() -> int | None:
    """RLHFZ_BUCKET_BYTES as a number of bytes, None when it is not set; a
    ValueError naming the variable unless it is a whole number of at least
    MIN_BUCKET_BYTES, as bucket_bytes= must be."""
    return env_bytes("RLHFZ_BUCKET_BYTES", MIN_BUCKET_BYTES)


def split_by_bytes(items: list, size_of, cap: int) -> list[list]:
    """Items in order, cut into runs of at most cap bytes each (an item
    larger than cap is a run of its own); at least one run."""
    runs, current, size = [], [], 0
    for item in items:
        nbytes = size_of(item)
        if current and size + nbytes > cap:
            runs.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
    runs.append(current)
    return runs


@dataclass(frozen=True)
class Slot:
    """One parameter's place in its bucket."""

    offset: int          # first element, in elements of the bucket's dtype
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BucketLayout:
    slots: tuple[Slot, ...]
    itemsize: int
    world_size: int
    padded_numel: int    # total elements, padding included
    shard_numel: int     # elements each rank owns

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (no padding)."""
        return sum(slot.numel for slot in self.slots)

    def gaps(self) -> list[tuple[int, int]]:
        """[start, stop) element ranges that no parameter covers (alignment
        and the tail), in order."""
        ranges, end = [], 0
        for slot in self.slots:
            if slot.offset > end:
                ranges.append((end, slot.offset))
            end = max(end, slot.offset + slot.numel)
        if self.padded_numel > end:
            ranges.append((end, self.padded_numel))
        return ranges

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of size {self.world_size}")
        return rank_range(rank, self.shard_numel)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def plan_bucket(shapes: Sequence[Sequence[int]], itemsize: int, world_size: int = 1,
                align_bytes: int = ALIGN_BYTES, block: int = 1) -> BucketLayout:
    """Lay out tensors of the given shapes in one flat bucket. block > 1
    (int8 moments: elements per quantization block) starts every tensor and
    every shard on a block boundary, so no block is shared by two params or
    two ranks, and a param's blocks are the same at any world size."""
    if itemsize not in (2, 4):
        raise ValueError(f"itemsize must be 2 or 4 bytes, not {itemsize}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if align_bytes < itemsize or align_bytes % itemsize:
        raise ValueError(f"align_bytes {align_bytes} is not a multiple of itemsize {itemsize}")
    # fp32 companions (master, moments) share the element offsets; an offset
    # aligned for the 16-bit array is then aligned for the fp32 ones too.
    align = math.lcm(align_bytes // itemsize, block)
    slots = []
    offset = 0
    for shape in shapes:
        shape = tuple(int(d) for d in shape)
        numel = 1
        for dim in shape:
            numel *= dim
        slots.append(Slot(offset=offset, numel=numel, shape=shape))
        offset = _round_up(offset + numel, align)
    padded = _round_up(max(offset, 1), align * world_size)
    return BucketLayout(slots=tuple(slots), itemsize=itemsize, world_size=world_size,
                        padded_numel=padded, shard_numel=shard_size(padded, world_size))


def shard_size(numel: int, world_size: int) -> int:
    """Elements per rank of a flat tensor split evenly among world_size ranks."""
    if numel % world_size:
        raise ValueError(f"{numel} elements do not split evenly among {world_size} ranks")
    return numel // world_size


def most_per_rank(numel: int, world_size: int) -> int:
    """Elements per rank when numel is cut in world_size parts, rounded up."""
    return -(-numel // world_size)


def rank_range(rank: int, shard_numel: int) -> tuple[int, int]:
    """[lo, hi): the elements that rank owns of a flat tensor cut in shards."""
    return rank * shard_numel, (rank + 1) * shard_numel


def shard_owner(element: int, shard_numel: int) -> tuple[int, int]:
    """(rank, offset in its shard) of a flat tensor's element."""
    return divmod(element, shard_numel)


@dataclass(frozen=True)
class ShardLayout:
    """One rank's shard of a bucket, and the shard's split between the
    backend (elements [0, split)) and the host (elements [split, numel))."""

    bucket: BucketLayout
    rank: int
    split: int
    local: tuple[tuple[int, int], ...] = field(init=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.split <= self.bucket.shard_numel:
            raise ValueError(f"split {self.split} is outside a shard of "
                             f"{self.bucket.shard_numel} elements")
        start, stop = self.bucket.shard_range(self.rank)
        ranges = []
        for slot in self.bucket.slots:
            lo = max(slot.offset, start)
            hi = min(slot.offset + slot.numel, stop)
            lo = min(lo, hi)
            ranges.append((lo - start, hi - start))
        # each param's part of this shard, in shard elements (empty when it
        # lies wholly on other ranks)
        object.__setattr__(self, "local", tuple(ranges))

    @classmethod
    def of(cls, layout: BucketLayout, rank: int, host_ratio: float = 0.0,
           block: int = 1) -> "ShardLayout":
        """host_ratio: the fraction of the shard's elements on the host,
        rounded to whole blocks (a block never straddles the split)."""
        shard = layout.shard_numel
        host = int(round(host_ratio * shard / block)) * block
        return cls(layout, rank, shard - min(host, shard))

    @property
    def numel(self) -> int:
        return self.bucket.shard_numel

    @property
    def start(self) -> int:
        """The shard's first element in the bucket."""
        return rank_range(self.rank, self.bucket.shard_numel)[0]

    @property
    def host_numel(self) -> int:
        return self.numel - self.split

    def part_of(self, index: int, flat: "torch.Tensor") -> "torch.Tensor":
        """The part of a param's flat values that lies in this shard."""
        a, b = self.local[index]
        offset = self.bucket.slots[index].offset - self.start
        return flat[a - offset:b - offset]

    def sides(self, lo: int, hi: int):
        """Shard elements [lo, hi) cut at the split: ((lo, hi) on the
        backend or None, (lo, hi) in host-part elements or None)."""
        k = self.split
        device = (lo, min(hi, k)) if lo < min(hi, k) else None
        host = (max(lo, k) - k, hi - k) if max(lo, k) < hi else None
        return device, host

    @staticmethod
    def blocks(lo: int, hi: int, block: int) -> tuple[int, int]:
        """[lo, hi) in elements -> the blocks that cover it (lo on a block
        boundary, as every param and part starts)."""
        return lo // block, -(-hi // block)

    def element_range(self, start: int, stop: int) -> tuple[int, int] | None:
        """Shard elements spanned by params [start, stop): the whole shard
        when that covers every param (padding is zero and stays zero); None
        when none of them has elements on this rank."""
        if start == 0 and stop == len(self.local):
            return 0, self.numel
        pieces = [self.local[i] for i in range(start, stop) if self.local[i][0] < self.local[i][1]]
        if not pieces:
            return None
        return pieces[0][0], pieces[-1][1]
