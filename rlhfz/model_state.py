"""Whole tensors of a sharded model: its state dict gathered unit by unit,
and whole values written back into its shards."""
from __future__ import annotations

import torch

from .sharding import mark_filled, sharding_of_model
from .state_dict_hooks import gathered_values


def full_state_dict(model, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's whole state dict on the CPU, tied tensors shared as torch
    shares them. For a sharded model a collective: units are gathered one
    at a time; with rank0_only the other ranks keep nothing and get {}."""
    record, inner = unwrapped(model)
    state = inner.state_dict(keep_vars=True)
    if record is None or record.stage3 is None:
        copies: dict[int, torch.Tensor] = {}
        return {name: copies.setdefault(id(t), t.detach().to("cpu", copy=True))
                for name, t in state.items()}
    slots = record.sharded_slots()
    keep = not rank0_only or record.rank == 0
    values = gathered_values(record, {id(t) for t in state.values() if id(t) in slots}, keep,
                             "full_state_dict")
    if not keep:
        return {}
    out = {}
    for name, t in state.items():
        if id(t) not in values:
            values[id(t)] = t.detach().to("cpu", copy=True)
        out[name] = values[id(t)]
    return out


def whole_shape(record, p: torch.Tensor) -> tuple:
    """A param's shape, also while it is a placeholder."""
    slot = record.sharded_slots().get(id(p)) if record is not None else None
    if slot is None:
        return tuple(p.shape)
    bucket, index = slot
    return bucket.layout.slots[index].shape


def write_whole(record, values: dict[int, torch.Tensor], sync: bool = True) -> dict:
    """Sets params from whole tensors, {id(param): value}: a sharded param
    keeps its rank's part, a whole one takes it all. Not a collective.
    The buckets written to follow (an optimizer's master weights) with
    sync, else sync_buckets(returned values) does it once for many writes."""
    slots = record.sharded_slots() if record is not None else {}
    touched = {}
    with torch.no_grad():
        for p in record.model.parameters() if record is not None else ():
            value = values.get(id(p))
            if value is None:
                continue
            if id(p) in slots:
                bucket, index = slots[id(p)]
                bucket.write_param(index, value.to(bucket.flat_param_shard.device))
                touched[id(bucket)] = bucket
            else:
                p.detach().copy_(value)
    mark_filled(record, [p for p in record.model.parameters() if id(p) in values]
                if record is not None else [])
    if sync:
        sync_buckets(touched.values())
    return touched


def sync_buckets(buckets) -> None:
    """After params were written from outside: their master weights follow."""
    for bucket in buckets:
        bucket.sync_master()
        if bucket.state is not None:
            bucket.state.refresh_stitched()


def unwrapped(model):
    """(its ShardedModel or None, the module under DDP / accelerate wrappers)."""
    record = sharding_of_model(model)
    if record is not None:
        return record, record.model
    seen = 0
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and seen < 8:
        model = model.module
        seen += 1
    return None, model
