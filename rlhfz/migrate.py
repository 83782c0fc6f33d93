"""Offload and reload: moving an optimizer's and a model's memory between tiers.

A move allocates every target first, copies, then swaps the buffers and
re-points every tensor in place (the bucket's storage registry, or
`t.data = view` for a module's own tensors): Parameters, grads and optimizer state keep their
identity, and the old memory is freed as soon as nothing references it.
Anything that fails before the swap (no memory, an unwritable directory, a
full disk) leaves every tensor where it was. A tensor someone still holds
on the old memory keeps it alive: that is reported, with its bytes.

Tiers: "cpu" means pinned host memory while a budget lasts (pin_memory=
True, or "auto"), pageable beyond it or with pin_memory=False; "disk" is a
file per buffer in the directory `path`, deleted on reload.
"""
from __future__ import annotations

import contextlib
import os
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import _C
from .engine import REGIONS, PinnedPool, backend_for, host_buffer, torch_view, warn_user
from .sharding import sharding_of_model

KINDS = ("params", "grads", "optimizer")


def check_what(what) -> tuple[str, ...]:
    if isinstance(what, str):
        what = (what,)
    what = tuple(what)
    bad = [k for k in what if k not in KINDS]
    if bad or not what:
        raise ValueError(f"what must name some of {KINDS}, not {what!r}")
    return what


def check_target(to: str, path) -> None:
    if to not in ("cpu", "disk"):
        raise ValueError(f"to must be 'cpu' or 'disk', not {to!r}")
    if to == "disk":
        if path is None:
            raise ValueError("to='disk' needs path= (a directory for the offload files)")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"offload path {path!r} is not a directory")
    elif path is not None:
        raise ValueError("path= is for to='disk'")


def _allocator(to: str, path, pin_memory):
    if to == "disk":
        return lambda nbytes: _C.Buffer(nbytes, "disk", path=os.fspath(path))
    return lambda nbytes: host_buffer(nbytes, pin_memory)


def _already_there(buffer, to: str) -> bool:
    return buffer.tier in ("host", "pinned") if to == "cpu" else buffer.tier == "disk"


def _copy_all(pairs, backend, non_blocking: bool):
    """Copies every (old, new) pair. With device memory involved the copies
    go on rlhfz's copy stream, after the work torch's stream has queued
    (which may still write the data); where they fill device memory, torch's
    stream waits for them in turn, so the next forward reads what they
    wrote. non_blocking leaves them in flight. Returns the event that marks
    their end (None without device memory: the CPU copies are done)."""
    if backend.tier != "device":
        for old, new in pairs:
            new.copy_from(old)
        return None
    stream = backend.copy_stream()
    backend.record(backend.stream()).wait(stream)
    for old, new in pairs:
        new.copy_from(old, stream=stream, non_blocking=True)
    done = backend.record(stream)
    if any(new.tier == "device" for _, new in pairs):
        done.wait(backend.stream())
    if not non_blocking:
        done.synchronize()
    return done


def _report_held(olds, engine) -> None:
    """Old buffers that someone outside still holds a view of ((memory_report's
    kind, buffer))."""
    held = [(kind, buffer) for kind, buffer in olds if buffer.exports > 0]
    if not held:
        return
    total = sum(buffer.nbytes for _, buffer in held)
    kinds = sorted({kind for kind, _ in held})
    warn_user(f"rlhfz: {total} bytes ({', '.join(kinds)}) could not be freed: a tensor "
              f"outside the optimizer still views the old memory (e.g. a saved "
              f"p.detach() or a slice of p.data); it is freed when that tensor goes")
    for kind, buffer in held:
        engine.held_elsewhere.append((kind, weakref.ref(buffer)))


def move_buckets(engine, kinds, allocate, to_home: bool = False, to: str = "cpu",
                 non_blocking: bool = False) -> None:
    """Moves the kinds' buffers of every bucket: allocate all, copy all, then
    swap and re-point. On any failure before the swap, nothing has moved.
    allocate(region, nbytes) makes a target. to_home: back where each buffer
    trains (the backend's tier; host memory for offload="cpu"'s host part)."""
    moves = []
    for bucket in engine.buckets:
        for region, kind, buffer in bucket.storage.movable(kinds):
            if to_home:
                home = "host" if REGIONS[region].host else engine.backend.tier
                if buffer.tier == home or (home == "host" and buffer.tier == "pinned"):
                    continue
            elif _already_there(buffer, to):
                continue
            moves.append((bucket, region, kind, buffer))
    if not moves:
        return
    backend = engine.backend
    if backend.tier == "device":
        backend.reap()
    fresh = [allocate(region, old.nbytes) for _, region, _, old in moves]   # may raise
    pairs = [(old, new) for (_, _, _, old), new in zip(moves, fresh)]
    # a file's pages are dropped from RAM right after the swap: its copy must be done
    to_disk = any(new.tier == "disk" for _, new in pairs)
    done = _copy_all(pairs, backend, non_blocking and not to_disk)
    engine.moves_in_flight = done if non_blocking and not to_disk else None
    touched = []
    for (bucket, region, _, _), new in zip(moves, fresh):
        bucket.storage.replace(region, new)
        if new.tier == "disk":
            new.release_pages()     # the file holds it now, not this process's RAM
        if bucket not in touched:
            touched.append(bucket)
    for bucket in touched:
        bucket.rebind()
    olds = [(REGIONS[region].report, old) for _, region, _, old in moves]
    del moves, fresh
    _report_held(olds, engine)
    if done is not None:
        for _, old in olds:
            PinnedPool.give(old, done, engine)
        # copies in flight still read the old buffers
        backend.release_after([old for _, old in olds], done)


def offload_engine(engine, what=KINDS, to="cpu", path=None, non_blocking=False,
                   pin_memory="auto") -> None:
    kinds = check_what(what)
    check_target(to, path)
    engine.flush_grads()       # no collective may still read or write grads
    if "grads" in kinds:
        engine.settle_grads()  # a folded clip goes into grads before they leave
    # A swapped param storage or a write behind the optimizer is taken in
    # (or refused) before the move re-points every param at its bucket.
    engine.adopt_written()
    allocate = _allocator(to, path, pin_memory)
    move_buckets(engine, kinds, lambda region, nbytes: allocate(nbytes), to=to,
                 non_blocking=non_blocking)
    if "grads" in kinds and engine.reducer is not None:
        engine.reducer.release()
    engine.offloaded.update(kinds)
    if engine.backend.tier == "device":
        # What torch's caching allocator holds goes back too, for whatever
        # runs while the optimizer is away (an inference engine, say).
        engine.backend.empty_cache()


def reload_engine(engine, non_blocking=False, pin_memory="auto", kinds=KINDS) -> None:
    def allocate(region, nbytes):
        if REGIONS[region].host:
            return host_buffer(nbytes, pin_memory)
        return engine.backend.buffer(nbytes, zero=False)

    def move():
        move_buckets(engine, kinds, allocate, to_home=True, non_blocking=non_blocking)
    engine.adopt_written()     # a swap made while offloaded, as at offload
    try:
        move()
    except MemoryError:
        if engine.backend.tier != "device":
            raise
        # Free device memory may sit in torch's cache (activations, gathers
        # since the offload): give it back and try once more. Nothing moved.
        engine.backend.empty_cache()
        move()
    if engine.reducer is not None and "grads" in kinds:
        engine.reducer.reserve()
    engine.offloaded.difference_update(kinds)


# ---- a model's own tensors ------------------------------------------------------------

_HOME = "_rlhfz_offload_home"


def _module_tensors(model, optimizer):
    owned = set()
    if optimizer is not None:
        owned = set(optimizer.engine.owners())
    record = sharding_of_model(model)
    if record is not None:
        owned |= set(record.engine.owners())     # frozen shards move with their buckets
    seen = set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in owned or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield tensor


def _storage_ref(t: torch.Tensor):
    """(address, (a weak reference to t's storage, its bytes)): whether the
    old memory is freed once t is re-pointed."""
    storage = t.untyped_storage()
    return storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes())


def _nbytes(t: torch.Tensor) -> int:
    """A Buffer size for t's bytes, in whole 2-byte words (at least one)."""
    return max(2, (t.numel() * t.element_size() + 1) // 2 * 2)


def _view_of(buffer, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and typed like `like` over the buffer's first bytes
    (any dtype: it is built from the raw bytes)."""
    raw = torch_view(buffer.view("float16")).view(torch.uint8)
    return raw[:like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def offload_module(model, optimizer=None, to="cpu", path=None, pin_memory="auto") -> None:
    """Moves the model's params and buffers that the optimizer does not own."""
    check_target(to, path)
    home = getattr(model, _HOME, None)
    if home is None:
        home = {}
        setattr(model, _HOME, home)
    # A tensor offloaded before moves again only where `to` names another
    # tier (host memory to disk, or back); its home stays where it began.
    tensors = [t for t in _module_tensors(model, optimizer) if t.is_contiguous() and (
               (home[id(t)][2] == "disk") != (to == "disk") if id(t) in home else
               t.device.type == "cuda" or to == "disk")]
    allocate = _allocator(to, path, pin_memory)
    fresh = [allocate(_nbytes(t)) for t in tensors]
    views = [_view_of(buffer, t) for buffer, t in zip(fresh, tensors)]
    olds = dict(_storage_ref(t) for t in tensors)
    with torch.no_grad():
        for t, view, buffer in zip(tensors, views, fresh):
            view.copy_(t)
        for t, view, buffer in zip(tensors, views, fresh):
            device = home[id(t)][1] if id(t) in home else t.device
            home[id(t)] = (weakref.ref(t), device, buffer.tier)
            t.data = view
            if buffer.tier == "disk":
                buffer.release_pages()
    held = sum(nbytes for ref, nbytes in olds.values() if not ref.expired())
    if held:
        warn_user(f"rlhfz: {held} bytes of the model's own params and buffers could not be "
                  f"freed: a tensor outside the model still views the old memory (e.g. a "
                  f"saved .detach() or a slice); it is freed when that tensor goes")
    devices = {device for _, device, _ in home.values() if device.type == "cuda"}
    for device in devices:
        # the originals came from torch's caching allocator
        (optimizer.backend if optimizer is not None and optimizer.backend.device == device
         else backend_for(device)).empty_cache()


def reload_module(model) -> None:
    home = getattr(model, _HOME, None)
    if not home:
        return
    pending = [(ref(), device) for ref, device, _ in home.values() if ref() is not None]
    # Device copies first: if one fails for memory, none is re-pointed.
    copies = [t.detach().to(device) if device.type == "cuda" else
              _view_of(_C.Buffer(_nbytes(t)), t)
              for t, device in pending]
    with torch.no_grad():
        for (t, device), new in zip(pending, copies):
            if device.type != "cuda":
                new.copy_(t)
            t.data = new
    home.clear()


def offload(model, optimizer=None, what=KINDS, to="cpu", path=None, non_blocking=False) -> None:
    """Offloads an optimizer's memory (what: params, grads, optimizer) and
    the model's own params and buffers that the optimizer does not hold.
    All or nothing: if a later move fails, the earlier ones this call made
    are reloaded before the error is raised."""
    kinds = check_what(what)
    check_target(to, path)
    undo = []
    pin_memory = getattr(optimizer, "pin_memory", "auto")

    def undone(engine, moved):
        # only the kinds this call moved go back; ones offloaded before stay
        moved = tuple(k for k in moved if k not in engine.offloaded)
        return lambda: reload_engine(engine, pin_memory=pin_memory, kinds=moved)
    try:
        if optimizer is not None:
            back = undone(optimizer.engine, kinds)
            optimizer.offload(what=kinds, to=to, path=path, non_blocking=non_blocking)
            undo.append(back)
        if "params" in kinds:
            record = sharding_of_model(model)
            if record is not None and record.engine.buckets:
                from .generation import refuse_while_gathered
                refuse_while_gathered(record, "offload")
                back = undone(record.engine, ("params",))
                offload_engine(record.engine, ("params",), to, path, pin_memory=pin_memory)
                undo.append(back)
            offload_module(model, optimizer, to=to, path=path, pin_memory=pin_memory)
    except BaseException:
        for step in reversed(undo):
            step()
        raise


def reload(model, optimizer=None, non_blocking=False) -> None:
    if optimizer is not None:
        optimizer.reload(non_blocking=non_blocking)
    record = sharding_of_model(model)
    if record is not None and record.engine.offloaded:
        reload_engine(record.engine, pin_memory=getattr(optimizer, "pin_memory", "auto"))
    reload_module(model)


@contextlib.contextmanager
def offloaded(model, optimizer=None, what=KINDS, to="cpu", path=None):
    """Offloaded inside the block (e.g. while an inference engine runs),
    reloaded on the way out, also when the block raises."""
    offload(model, optimizer, what=what, to=to, path=path)
    try:
        yield model
    finally:
        reload(model, optimizer)
