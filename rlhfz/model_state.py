"""Whole tensors of a sharded model: its state dict gathered unit by unit,
its params' whole shapes, a blend of one model's params into another's,
and the master weights following a load."""
from __future__ import annotations

import torch

from .generation import iter_full_params, unwrap_model
from .sharding import sharding_of_model
from .state_dict_hooks import gathered_values


def full_state_dict(model, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's whole state dict on the CPU, tied tensors shared as torch
    shares them. For a sharded model a collective: units are gathered one
    at a time; with rank0_only the other ranks keep nothing and get {}."""
    record, inner = unwrapped(model)
    state = inner.state_dict(keep_vars=True)
    values: dict[int, torch.Tensor] = {}
    if record is not None and record.stage3 is not None:
        slots = record.sharded_slots()
        keep = not rank0_only or record.comm.leads
        values = gathered_values(record, {id(t) for t in state.values() if id(t) in slots},
                                 keep, "full_state_dict")
        if not keep:
            return {}
    out = {}
    for name, t in state.items():
        if id(t) not in values:
            values[id(t)] = t.detach().to("cpu", copy=True)
        out[name] = values[id(t)]
    return out


def whole_shape(slots: dict, p: torch.Tensor) -> tuple:
    """A param's shape, also while it is a placeholder (slots: a record's
    sharded_slots(), taken once by the caller)."""
    slot = slots.get(id(p))
    if slot is None:
        return tuple(p.shape)
    bucket, index = slot
    return bucket.layout.slots[index].shape


def blend_params(target, source, alpha: float, *, bucket_bytes: int = 256 << 20) -> None:
    """target's params <- (1 - alpha) * target + alpha * source, name by
    name in the target's dtype (a source of another dtype is cast, as
    torch's add_ casts it), as TRL's SyncRefModelCallback moves a
    reference model toward the policy (the same operations, so the same
    bits). Either model may be sharded at stage 3 across ranks; every rank
    calls it then. Where each rank holds the source's elements of its own
    target shard (both sharded alike over the same ranks, as a trainer
    shards a reference model beside its policy, or the source whole), each
    rank blends its shard in place and nothing crosses ranks. Otherwise it
    is a collective: both are read a few units at a time (iter_full_params)
    and the target written through its load_state_dict, so no rank holds
    either model whole. The models must have the same param names and
    whole shapes: otherwise ValueError, and nothing changed."""
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be within [0, 1], not {alpha}")
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be an int > 0, not {bucket_bytes!r}")
    target_record, target_inner = unwrapped(target)
    source_record, source_inner = unwrapped(source)
    _check_alike(_param_specs(target), _param_specs(source))
    with torch.no_grad():
        parts = _local_parts(target_record, target_inner, source_record, source_inner)
        if parts is not None:
            written = {}
            for mine, theirs, slot in parts:
                mine.mul_(1.0 - alpha).add_(theirs.to(mine.device), alpha=alpha)
                if slot is not None:
                    written.setdefault(id(slot[0]), (slot[0], []))[1].append(slot[1])
            for bucket, indices in written.values():
                bucket.parts_written(indices)        # a trained target's master follows
            return
        if _stage3_record(target_record) is None:
            # in place through the params, so a trained target's optimizer
            # sees the write in their versions (not through .data)
            params = dict(target_inner.named_parameters())
            for name, value in iter_full_params(source, bucket_bytes):
                params[name].mul_(1.0 - alpha).add_(value.to(params[name].device), alpha=alpha)
            return
        # Both iterated in step: alike models yield in the same order, so a
        # tensor waits for its partner only when their units differ.
        waiting = ({}, {})
        ready, size = {}, 0
        for pair in zip(iter_full_params(target, bucket_bytes),
                        iter_full_params(source, bucket_bytes), strict=True):
            for side, (name, value) in enumerate(pair):
                waiting[side][name] = value
            for name in {pair[0][0], pair[1][0]}:
                if name in waiting[0] and name in waiting[1]:
                    mine, theirs = waiting[0].pop(name), waiting[1].pop(name)
                    ready[name] = mine.mul(1.0 - alpha).add_(theirs.to(mine.device), alpha=alpha)
                    size += mine.numel() * mine.element_size()
            if size >= bucket_bytes:
                target_inner.load_state_dict(ready, strict=False)
                ready, size = {}, 0
        if ready:
            target_inner.load_state_dict(ready, strict=False)


def _stage3_record(record):
    return record if record is not None and record.stage3 is not None else None


def _local_parts(target_record, target_inner, source_record, source_inner):
    """[(the target's values this rank holds, the source's same elements,
    (bucket, index) of the target's part or None for a whole param)] when
    every rank holds the source elements its target part needs: both
    sharded over the same ranks with each param at the same place in its
    bucket, or the source whole. None when some rank would need another's
    (a collective blend); the answer is the same on every rank, since
    layouts are."""
    target_record, source_record = _stage3_record(target_record), _stage3_record(source_record)
    if target_record is None:
        return None
    if source_record is not None and \
            source_record.comm.shard_ranks != target_record.comm.shard_ranks:
        return None
    target_slots = target_record.sharded_slots()
    source_slots = source_record.sharded_slots() if source_record is not None else {}
    held = [b for b, _ in list(target_slots.values()) + list(source_slots.values())]
    if any(b.gathered is not None for b in held):
        return None          # whole copies in use: written through, not around
    sources = dict(source_inner.named_parameters())
    parts = []
    for name, mine in target_inner.named_parameters():
        theirs = sources[name]
        if id(mine) not in target_slots:
            if id(theirs) in source_slots:
                return None  # whole here, sharded there
            # the param itself: its version counts the write
            parts.append((mine, theirs.detach(), None))
            continue
        bucket, index = target_slots[id(mine)]
        if id(theirs) not in source_slots:
            parts.append((bucket.param_shard_part(index),
                          bucket.shard.part_of(index, theirs.detach().reshape(-1)),
                          (bucket, index)))
            continue
        other, other_index = source_slots[id(theirs)]
        if _place(bucket, index) != _place(other, other_index):
            return None
        parts.append((bucket.param_shard_part(index), other.param_shard_part(other_index),
                      (bucket, index)))
    return parts


def _place(bucket, index: int) -> tuple:
    """What fixes which elements of a param each rank holds."""
    slot = bucket.layout.slots[index]
    return slot.offset, slot.numel, bucket.layout.shard_numel, bucket.layout.world_size


def _param_specs(model) -> dict[str, tuple]:
    """{name: whole shape} of the model's params, placeholders included."""
    record, inner = unwrapped(model)
    slots = record.sharded_slots() if _stage3_record(record) is not None else {}
    return {name: tuple(whole_shape(slots, p)) for name, p in inner.named_parameters()}


def _check_alike(target: dict, source: dict) -> None:
    if target == source:
        return
    missing = sorted(set(target) - set(source))
    extra = sorted(set(source) - set(target))
    differ = sorted(n for n in set(target) & set(source) if target[n] != source[n])
    parts = []
    if missing:
        parts.append(f"the source lacks {missing[:5]}")
    if extra:
        parts.append(f"the target lacks {extra[:5]}")
    if differ:
        name = differ[0]
        parts.append(f"{len(differ)} differ in shape, as {name}: {target[name]} in the "
                     f"target, {source[name]} in the source")
    raise ValueError("the two models' params do not match, so one cannot be blended into the "
                     "other: " + "; ".join(parts) + ". Nothing was changed")


def sync_buckets(buckets) -> None:
    """After params were written from outside: their master weights follow."""
    for bucket in buckets:
        bucket.sync_master()
        if bucket.state is not None:
            bucket.state.refresh_stitched()


def unwrapped(model):
    """(its ShardedModel or None, the module under DDP / accelerate wrappers)."""
    record = sharding_of_model(model)
    return (record, record.model) if record is not None else (None, unwrap_model(model))
