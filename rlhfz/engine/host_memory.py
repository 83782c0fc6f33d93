"""Host memory for the optimizer: pinned while a budget lasts, pageable beyond.

Pinned memory makes copies to and from a GPU asynchronous, but it is locked
RAM: pinning all of a large optimizer can take the host down. So pinning has
a budget (pin_memory="auto"), and the pinned buffers that a reload empties
are kept for the next offload of the same sizes.
"""
from __future__ import annotations

import os
import resource
import weakref

from .. import _C
from .numbers import env_bytes
from .user_warnings import warn_user

DEFAULT_PIN_FRACTION = 0.5     # of available RAM, and of RLIMIT_MEMLOCK when it is set
# RLHFZ_PINNED_POOL=0: unpin at every reload instead of keeping the buffers (_Pinned)
POOL_PINNED = os.environ.get("RLHFZ_PINNED_POOL", "1") != "0"


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def pin_budget() -> int:
    """Bytes rlhfz pins at most under pin_memory="auto": a fraction of the
    RAM available now, and of RLIMIT_MEMLOCK where that limit is set."""
    budget = int(DEFAULT_PIN_FRACTION * _available_ram())
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY:
        budget = min(budget, int(DEFAULT_PIN_FRACTION * soft))
    override = env_bytes("RLHFZ_PIN_BUDGET_BYTES")
    return budget if override is None else override


class PinnedPool:
    """The bytes rlhfz has pinned in this process (weakly held buffers), and
    the pool of pinned buffers that a reload gave back.

    Pinning and unpinning gigabytes takes seconds, and freeing pinned memory
    synchronizes the device: an RLHF loop that sleeps and wakes the optimizer
    every iteration would pay that each time. So reload() keeps the pinned
    buffers it emptied, and the next offload of the same sizes takes them
    again, once the event recorded after the copies that last read them is
    done. The pool counts against the pin budget like any pinned buffer (an
    offload it leaves no room for goes to pageable memory: unpinning would
    wait for the device, which a non-blocking offload must not);
    rlhfz.release_pinned() and the optimizer's close() empty it, and an
    optimizer dropped without close() takes the buffers it gave with it."""

    buffers: "weakref.WeakSet" = weakref.WeakSet()
    pool: dict[int, list[tuple]] = {}          # nbytes -> [(buffer, event or None, giver)]
    givers: set[int] = set()                   # id()s of the living givers
    noticed = False

    @classmethod
    def in_use(cls) -> int:
        return sum(b.nbytes for b in cls.buffers)

    @classmethod
    def take(cls, nbytes: int):
        entries = cls.pool.get(nbytes, [])
        for i, (buffer, event, _) in enumerate(entries):
            if event is None or event.query():
                del entries[i]
                return buffer
        return None

    @classmethod
    def give(cls, buffer, event, giver) -> None:
        """Pools a pinned buffer until the giver (an engine) goes."""
        if buffer.tier != "pinned" or buffer.exports != 0 or not POOL_PINNED:
            return
        key = id(giver)
        cls.pool.setdefault(buffer.nbytes, []).append((buffer, event, key))
        if key not in cls.givers:
            cls.givers.add(key)
            weakref.finalize(giver, cls._drop, key)

    @classmethod
    def _drop(cls, key: int) -> None:
        """The pooled buffers of a giver that is gone (copies still reading
        one keep it alive until their event: migrate's release_after)."""
        cls.givers.discard(key)
        for nbytes in list(cls.pool):
            cls.pool[nbytes] = [entry for entry in cls.pool[nbytes] if entry[2] != key]
            if not cls.pool[nbytes]:
                del cls.pool[nbytes]

    @classmethod
    def pooled(cls) -> int:
        return sum(b.nbytes for entries in cls.pool.values() for b, _, _ in entries)

    @classmethod
    def release(cls) -> None:
        """Unpins the pool (after the copies that last read it)."""
        for entries in cls.pool.values():
            for _, event, _ in entries:
                if event is not None:
                    event.synchronize()
        cls.pool.clear()
        cls.noticed = False        # the next optimizer to fall back hears it too

    @classmethod
    def notice(cls, text: str) -> None:
        if not cls.noticed:
            cls.noticed = True
            warn_user(text)


def host_buffer(nbytes: int, pin_memory, zero: bool = False):
    """Host memory for an offload (every byte is copied in, so not zeroed):
    pinned while allowed, else pageable. Pinning never fails a run: when it
    is refused, pageable memory is used."""
    if pin_memory is False or not _C.build_info()["cuda"]:
        return _C.Buffer(nbytes, zero=zero)
    pooled = PinnedPool.take(nbytes)
    if pooled is not None:
        if zero:
            pooled.zero_()
        return pooled
    if pin_memory == "auto" and PinnedPool.in_use() + nbytes > pin_budget():
        PinnedPool.notice(f"rlhfz: pinned host memory is at its budget ({pin_budget()} bytes; "
                       f"RLHFZ_PIN_BUDGET_BYTES sets it): offloading to pageable memory")
        return _C.Buffer(nbytes, zero=zero)
    try:
        buffer = _C.Buffer(nbytes, "pinned", zero=zero)
    except MemoryError as error:
        PinnedPool.notice(f"rlhfz: pinning {nbytes} bytes failed ({error}): offloading to "
                       f"pageable memory")
        return _C.Buffer(nbytes, zero=zero)
    PinnedPool.buffers.add(buffer)
    return buffer


def release_pinned() -> None:
    """Gives back the pinned host memory that reload() kept for the next offload."""
    PinnedPool.release()


def pinned_memory() -> dict[str, int]:
    """Pinned host memory rlhfz holds in this process, in bytes: "pinned" in
    all (in use or pooled), "pooled" of it kept by reload() for the next
    offload (release_pinned() gives it back), and the "budget" that
    pin_memory="auto" pins up to."""
    return {"pinned": PinnedPool.in_use(), "pooled": PinnedPool.pooled(), "budget": pin_budget()}
