"""Whole tensors of a sharded model: its state dict gathered unit by unit,
its params' whole shapes, and the master weights following a load."""
from __future__ import annotations

import torch

from .generation import unwrap_model
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
