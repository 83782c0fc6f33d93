"""Between the engine's state and torch.optim.AdamW's state-dict format.

torch keeps, per param index, {"step", "exp_avg", "exp_avg_sq"} in the
param's shape (rlhfz adds "master_param" for 16-bit params). The engine
keeps each rank's shard of flat buckets. This module is the one place that
translates: whole tensors out (gathered across ranks), and in (each rank
takes its shard's part, so a dict saved at any world size loads at any
other), plus a per-rank sharded form for one file per rank.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch

from .engine import warn_user
from .optim_options import check_group, group_storage

SHARDED_FORMAT = "rlhfz.sharded_optimizer_state.v1"


def positions(param_groups) -> dict[int, int]:
    """id(param) -> its index in torch's state-dict numbering."""
    return {id(p): i for i, p in enumerate(p for group in param_groups for p in group["params"])}


def packed_groups(param_groups) -> list[dict]:
    """The param groups as torch's state_dict() packs them (params as indices)."""
    groups, start = [], 0
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        groups.append(packed)
    return groups


# ---- out ----------------------------------------------------------------------------------

def gathered_state(engine, param_groups) -> dict[int, dict[str, torch.Tensor]]:
    """torch's "state" with whole fp32 tensors (low-precision moments
    decoded): a collective across ranks (each state is all-gathered bucket
    by bucket)."""
    position = positions(param_groups)
    state = {}
    for bucket in engine.buckets:
        shards = [("exp_avg", bucket.state.full_shard("exp_avg")),
                  ("exp_avg_sq", bucket.state.full_shard("exp_avg_sq"))]
        if bucket.has_master:
            shards.append(("master_param", bucket.state.full_shard("master")))
        full = {}
        for name, shard in shards:
            if engine.comm is None:           # one rank: its shard is the whole bucket
                full[name] = shard
                continue
            full[name] = torch.empty(bucket.layout.padded_numel, dtype=torch.float32,
                                     device=engine.device)
            engine.comm.all_gather(full[name], shard)
        for i, p in enumerate(bucket.params):
            if not bucket.registered[i]:
                continue
            slot = bucket.layout.slots[i]
            entry = {"step": bucket.steps[i].clone()}
            for name, flat in full.items():
                entry[name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
            state[position[id(p)]] = entry
    return state


def sharded_state(engine, param_groups, groups, replica: int = 0) -> dict[str, Any]:
    """This rank's part of the state, with where each param's elements sit
    (replica: which copy of the shard group, under hybrid sharding)."""
    position = positions(param_groups)
    buckets = []
    for bucket in engine.buckets:
        buckets.append({
            "params": [position[id(p)] for p in bucket.params],
            "shapes": [tuple(s.shape) for s in bucket.layout.slots],
            "offsets": [s.offset for s in bucket.layout.slots],
            "registered": list(bucket.registered),
            "shard_start": bucket.shard.start,
            "steps": bucket.steps.clone(),
            "exp_avg": bucket.state.full_shard("exp_avg").clone(),
            "exp_avg_sq": bucket.state.full_shard("exp_avg_sq").clone(),
            "master_param": (bucket.state.full_shard("master").clone()
                             if bucket.has_master else None),
        })
    return {"format": SHARDED_FORMAT, "rank": engine.rank, "world_size": engine.world_size,
            "replica": replica, "param_groups": groups, "buckets": buckets}


def consolidate_sharded(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The torch.optim.AdamW state dict that a full set of per-rank
    sharded states describe, whatever world size wrote them."""
    if not shards or any(not isinstance(s, dict) or s.get("format") != SHARDED_FORMAT
                         for s in shards):
        raise ValueError(f"expected a list of {SHARDED_FORMAT} dicts, one per rank")
    # Under hybrid sharding every replica of the shard group holds the same
    # state: one replica's parts are the whole of it.
    first = min(s.get("replica", 0) for s in shards)
    shards = [s for s in shards if s.get("replica", 0) == first]
    world_size = shards[0]["world_size"]
    ranks = sorted(s["rank"] for s in shards)
    if ranks != list(range(world_size)) or any(s["world_size"] != world_size for s in shards):
        raise ValueError(f"a sharded state needs every rank's part exactly once: got ranks "
                         f"{ranks} of a world of {world_size}")
    shards = sorted(shards, key=lambda s: s["rank"])
    nbuckets = len(shards[0]["buckets"])
    if any(len(s["buckets"]) != nbuckets for s in shards):
        raise ValueError("the ranks' parts list different numbers of buckets")
    state = {}
    for b in range(nbuckets):
        parts = [s["buckets"][b] for s in shards]
        meta = parts[0]
        full = {}
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            if meta[name] is None:
                continue
            full[name] = torch.cat([part[name] for part in parts])
        for i, (index, shape, offset) in enumerate(zip(meta["params"], meta["shapes"],
                                                       meta["offsets"])):
            if not meta["registered"][i]:
                continue
            numel = math.prod(shape)
            entry = {"step": meta["steps"][i].clone()}
            for name, flat in full.items():
                if offset + numel > flat.numel():
                    raise ValueError(f"bucket {b}: param {index} lies past the saved shards")
                entry[name] = flat[offset:offset + numel].view(shape).clone()
            state[index] = entry
    return {"state": state, "param_groups": shards[0]["param_groups"]}


# ---- in -----------------------------------------------------------------------------------

def check_state_dict(engine, param_groups, state_dict) -> dict:
    """Checks a torch.optim.AdamW-format state dict against the optimizer and
    returns its param index -> param map; raises ValueError (TypeError for
    options of the wrong type), having changed nothing."""
    if not isinstance(state_dict, dict) or "state" not in state_dict \
            or "param_groups" not in state_dict:
        raise ValueError("a state dict needs 'state' and 'param_groups' entries")
    saved_groups = state_dict["param_groups"]
    saved_state = state_dict["state"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                         f"but the optimizer has {len(param_groups)}")
    index_to_param = {}
    shapes = {id(p): slot.shape for b in engine.buckets
              for p, slot in zip(b.params, b.layout.slots)}
    for g, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"loaded state dict contains a parameter group that doesn't "
                             f"match the size of optimizer's group: group {g} has "
                             f"{len(saved['params'])} params, the optimizer's has "
                             f"{len(group['params'])}")
        options = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        # as loaded: AdamW's decoupled decay whatever the dict says (load_checked)
        check_group({**group, **options, "decoupled_weight_decay": True})
        index_to_param.update(zip(saved["params"], group["params"]))
    for key, entry in saved_state.items():
        if key not in index_to_param:
            raise ValueError(f"state for parameter {key!r} matches no parameter of the "
                             f"optimizer")
        param = index_to_param[key]
        check_state_entry(key, entry, shapes.get(id(param), tuple(param.shape)))
    return index_to_param


def check_state_entry(key, entry, shape: tuple) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"state for parameter {key!r} is not a dict")
    for name in ("step", "exp_avg", "exp_avg_sq"):
        if name not in entry:
            raise ValueError(f"state for parameter {key!r} has no {name!r}")
    step = entry["step"]
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"state[{key!r}]['step'] must be a scalar")
        step = step.item()
    try:
        whole = (isinstance(step, (int, float)) and math.isfinite(step) and step >= 0
                 and float(step).is_integer())
    except OverflowError:        # an int no float can hold
        whole = False
    if not whole:
        raise ValueError(f"state[{key!r}]['step'] must be a whole number >= 0, not {step!r}")
    names = ["exp_avg", "exp_avg_sq"] + (["master_param"] if "master_param" in entry else [])
    for name in names:
        value = entry[name]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state[{key!r}][{name!r}] must be a tensor")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"state[{key!r}][{name!r}] has shape {tuple(value.shape)} but "
                             f"the parameter has shape {tuple(shape)}: the state dict "
                             f"is from another model")
        if not value.is_floating_point():
            raise ValueError(f"state[{key!r}][{name!r}] must be floating point, "
                             f"not {value.dtype}")
        if value.is_meta or value.layout != torch.strided:
            raise ValueError(f"state[{key!r}][{name!r}] holds no values to load (a "
                             f"{'meta' if value.is_meta else str(value.layout)} tensor)")


def storage_after_load(param_groups, state_dict) -> list[tuple]:
    """Each group's (state_dtype, min_8bit_size) once the dict is loaded:
    the dict's where it names them (a dict from torch names none)."""
    return [group_storage({**group, **{k: saved[k] for k in ("state_dtype", "min_8bit_size")
                                       if k in saved}})
            for group, saved in zip(param_groups, state_dict["param_groups"])]


def copied_options(state_dict) -> list[dict]:
    """Each saved group's options (param_names too, as torch keeps them),
    copied: taken before anything is written, so that one that cannot be
    copied raises with nothing changed."""
    return [{k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}
            for saved in state_dict["param_groups"]]


def load_checked(engine, param_groups, state_dict, index_to_param, defaults: dict,
                 options=None) -> None:
    """Writes a state dict that check_state_dict passed: group options
    (copied_options) and each rank's part of the state. Each group becomes
    the saved one, as in torch: a key the dict lacks goes (a scheduler's
    stale initial_lr would otherwise set the next one's base lr), but for
    the optimizer's own options, which keep their values; AdamW's
    decoupled_weight_decay is True whatever the dict says (a torch Adam
    dict's False), as torch's AdamW sets it."""
    options = copied_options(state_dict) if options is None else options
    for copied, group in zip(options, param_groups):
        for key in [k for k in group if k not in ("params", "param_names")
                    and k not in defaults and k not in copied]:
            del group[key]
        group.update(copied)
        group["decoupled_weight_decay"] = True
    loaded = {id(index_to_param[k]): entry for k, entry in state_dict["state"].items()}
    stale = []
    for bucket in engine.buckets:
        state = bucket.state
        for i, p in enumerate(bucket.params):
            entry = loaded.get(id(p))
            if entry is None:
                state.reset(i)
                if bucket.has_master:
                    state.write("master", i, bucket.param_shard_part(i).float())
                engine.unregister(bucket, i)
                continue
            state.write("exp_avg", i, bucket.local_part(i, entry["exp_avg"]))
            state.write("exp_avg_sq", i, bucket.local_part(i, entry["exp_avg_sq"]))
            state.steps[i] = float(entry["step"])
            if bucket.has_master:
                state.write("master", i, _master_for(bucket, i, entry.get("master_param"),
                                                     stale))
            engine.register(bucket, i)
        # fp32 params are their own master: the host part's copy follows them
        bucket.pull_host_part(master=not bucket.has_master)
    engine.grads_changed()
    if stale:
        warn_user(
            f"rlhfz: the state dict's master_param of {len(stale)} param(s) (e.g. one of "
            f"shape {stale[0]}) is not fp32 (torch.optim.AdamW casts it to the param's dtype "
            f"and never updates it): the fp32 master weights start again from the params")


def _master_for(bucket, index: int, master, stale: list) -> torch.Tensor:
    """This rank's part of a 16-bit param's fp32 master: the saved one when
    it is fp32, else the param's own values. torch's AdamW casts the master
    it does not know to the param's dtype on load and never updates it, so
    after a round trip through it the params are what training reached.
    (Params loaded later are taken in by the step, element by element.)"""
    if master is not None:
        if master.dtype == torch.float32:
            return bucket.local_part(index, master).reshape(-1)
        stale.append(tuple(bucket.params[index].shape))
    return bucket.param_shard_part(index).float()
