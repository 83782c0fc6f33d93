"""Bucket layout: where each parameter lives inside a flat bucket.

A bucket holds the parameters of one (param group, dtype) back to back. Each
parameter starts on an aligned offset, and the total is padded so that it
divides evenly by the world size into equal, aligned shards: rank r owns
``[r * shard_numel, (r + 1) * shard_numel)``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

ALIGN_BYTES = 64


def stage2_bucket_bytes(group_bytes: int) -> int:
    """Stage 2 splits each group into buckets of about this many bytes, so
    that reduction overlaps backward and staging memory (two buckets) stays
    small: RLHFZ_BUCKET_BYTES if set, else 32 MiB but at most an eighth of
    the group (at least 64 KiB), so that small models save memory too."""
    if "RLHFZ_BUCKET_BYTES" in os.environ:
        return int(os.environ["RLHFZ_BUCKET_BYTES"])
    return min(32 << 20, max(group_bytes // 8, 64 << 10))


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
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def plan_bucket(shapes: Sequence[Sequence[int]], itemsize: int, world_size: int = 1,
                align_bytes: int = ALIGN_BYTES) -> BucketLayout:
    """Lay out tensors of the given shapes in one flat bucket."""
    if itemsize not in (2, 4):
        raise ValueError(f"itemsize must be 2 or 4 bytes, not {itemsize}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    if align_bytes < itemsize or align_bytes % itemsize:
        raise ValueError(f"align_bytes {align_bytes} is not a multiple of itemsize {itemsize}")
    # fp32 companions (master, moments) share the element offsets; an offset
    # aligned for the 16-bit array is then aligned for the fp32 ones too.
    align = align_bytes // itemsize
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
                        padded_numel=padded, shard_numel=padded // world_size)
