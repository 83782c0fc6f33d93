"""Model-only checkpoints: save_checkpoint(path, model) and
load_checkpoint(path, model) with no optimizer.

A model-only checkpoint is the sharded format with no buckets: one file
whose tensors are the model's state dict (params and buffers, each tied
tensor once), written atomically like any other. Loading a model alone reads
either kind: a model-only checkpoint, or the params (from their buckets,
across every rank's file) and buffers of a full one, leaving the optimizer
state unread: a reference model, or a policy's weights without its states.

A model sharded at stage 3 (shard_model, or a stage-3 ZeroAdamW) is saved
whole: its units are gathered one at a time and the first rank writes (a
collective then). Loading into it is not: each rank reads the whole
tensors and keeps its shard of each.
"""
from __future__ import annotations

import json
import math
import os
import secrets

import torch

from ..engine import shard_owner
from ..generation import unwrap_model
from ..model_state import full_state_dict, sync_buckets, whole_shape
from ..progress import progress
from ..sharding import mark_filled, sharding_of_model
from .format import CorruptFileError, TensorFileWriter, fsync_dir
from .generations import commit_generation, discard_generation
from .validation import (FORMAT, CheckpointError, check_entries, file_name, open_files,
                         read_index, verify)


def whole_model(model, call: str):
    """The module under wrappers (DDP, accelerate)."""
    return unwrap_model(model)


def _tensors(module) -> dict[str, torch.Tensor]:
    """The state dict with each tensor once (tied weights under their first name)."""
    seen, out = set(), {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def save_model(path, model, client_state=None) -> None:
    """Writes the model's state dict as a model-only checkpoint: one
    process writes it, or for a sharded model the first rank, from units
    gathered one at a time (a collective then)."""
    module = whole_model(model, "save_checkpoint")
    try:
        client = json.loads(json.dumps(client_state))
    except (TypeError, ValueError) as error:
        raise TypeError(f"client_state must be JSON-serializable: {error}") from None
    record = sharding_of_model(module)
    if record is None or record.stage3 is None:
        _write_model(os.fspath(path), _tensors(module), client, hf_configs(module))
        return
    state = full_state_dict(module, rank0_only=True)
    error = None
    if record.comm.leads:
        try:
            seen, tensors = set(), {}
            for name, t in state.items():
                if id(t) not in seen:
                    seen.add(id(t))
                    tensors[name] = t
            _write_model(os.fspath(path), tensors, client, hf_configs(module))
        except Exception as caught:          # every rank hears of it
            error = caught
    failed = record.comm.statuses(None if error is None else f"{type(error).__name__}: {error}",
                                  "save_checkpoint")[0]
    if error is not None:
        raise error
    if failed is not None:
        raise CheckpointError(f"save_checkpoint: the first rank could not write {path}: {failed}")


def hf_configs(module) -> dict:
    """A transformers model's config, and its generation config where it
    generates, as dicts under "hf_config" and "hf_generation_config" (saved
    beside the tensors, so that an export is what transformers saves);
    empty for any other module."""
    out = {}
    config = getattr(module, "config", None)
    generation = (getattr(module, "generation_config", None)
                  if getattr(module, "can_generate", lambda: False)() else None)
    for key, held in (("hf_config", config), ("hf_generation_config", generation)):
        to_dict = getattr(held, "to_dict", None)
        if to_dict is None:
            continue
        try:
            out[key] = json.loads(json.dumps(to_dict()))
        except (TypeError, ValueError):
            continue
    return out


def _write_model(path: str, tensors: dict, client, configs: dict) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a directory")
    token = secrets.token_hex(8)
    tmp = os.path.join(path, f".tmp-{token}")
    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    os.makedirs(tmp, exist_ok=True)
    name = file_name(0, 1)
    writer = TensorFileWriter(os.path.join(tmp, name),
                              [(f"module.{n}", t.dtype, tuple(t.shape))
                               for n, t in tensors.items()],
                              {"format": FORMAT, "rank": "0"})
    try:
        with torch.no_grad(), progress(writer.nbytes, "rlhfz save") as bar:
            for n, t in tensors.items():
                writer.write(f"module.{n}", t.detach(), progress=bar)
        writer.close()
    except BaseException:
        writer.abort()
        discard_generation(path, token)
        raise
    index = {"format": FORMAT, "world_size": 1, "stage": 0, "model_only": True,
             "params": [], "param_groups": [], "buckets": [],
             "module": {n: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
                        for n, t in tensors.items()},
             "client_state": client, "generation": f"g-{token}",
             **configs,
             "files": [{"name": name, "bytes": writer.nbytes, "crc32": writer.crc32}]}
    try:
        commit_generation(path, tmp, token, index)
    except BaseException:
        discard_generation(path, token)
        raise


def plan_copies(path, index, tensors) -> list[tuple[int, str, int, torch.Tensor]]:
    """(rank, saved tensor, byte offset, destination) for every tensor of the
    model; CheckpointError, before anything is read, if any does not match."""
    params = {p["name"]: pos for pos, p in enumerate(index["params"]) if p["name"] is not None}
    slots = {pos: (k, offset) for k, b in enumerate(index["buckets"])
             for pos, offset in zip(b["params"], b["offsets"])}
    copies, missing, wrong = [], [], []
    for name, t in tensors.items():
        dest = t.detach()
        here = (list(dest.shape), _dtype_name(dest.dtype))
        if name in index["module"]:
            spec = index["module"][name]
            if (spec["shape"], spec["dtype"]) != here:
                wrong.append(f"{name}: {spec['dtype']}{spec['shape']} saved, "
                             f"{here[1]}{here[0]} here")
                continue
            copies.append((0, f"module.{name}", 0, dest))
        elif name in params:
            pos = params[name]
            spec = index["params"][pos]
            if (spec["shape"], spec["dtype"]) != here:
                wrong.append(f"{name}: {spec['dtype']}{spec['shape']} saved, "
                             f"{here[1]}{here[0]} here")
                continue
            k, source = slots[pos]
            bucket = index["buckets"][k]
            shard, itemsize = bucket["shard_numel"], getattr(torch, bucket["dtype"]).itemsize
            flat, done, count = dest.reshape(-1), 0, math.prod(spec["shape"])
            while count > 0:       # the param's elements, rank file by rank file
                rank, local = shard_owner(source, shard)
                n = min(count, shard - local)
                copies.append((rank, f"bucket{k}.param", local * itemsize, flat[done:done + n]))
                source, done, count = source + n, done + n, count - n
        else:
            missing.append(name)
    if missing or wrong:
        raise CheckpointError(
            f"{path} does not hold this model: "
            + (f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "")
            + ("; " if missing and wrong else "")
            + (f"different {wrong[:3]}{' ...' if len(wrong) > 3 else ''}" if wrong else ""))
    return copies


def open_checked(path, index, copies) -> dict:
    """The rank files the copies read, opened, each entry and CRC checked
    (CheckpointError on any fault, with nothing left open)."""
    needed: dict[int, set[str]] = {}
    for rank, name, _, _ in copies:
        needed.setdefault(rank, set()).add(name)
    files = {}
    try:
        files = open_files(path, index, needed)
        check_entries(path, index, files, needed)
        verify(path, index, files, needed)
    except BaseException as error:
        for tf in files.values():
            tf.close()
        if isinstance(error, CorruptFileError):
            raise CheckpointError(str(error)) from None
        raise
    return files


def load_model(path, model):
    """Loads the model's tensors from a model-only or a full checkpoint, in
    place; returns its client_state. Everything is checked first: on any
    error it raises CheckpointError and the model is unchanged."""
    module = whole_model(model, "load_checkpoint")
    path = os.fspath(path)
    index = read_index(path)
    tensors = _tensors(module)
    # A sharded param stands in as a meta tensor of its whole shape while
    # everything is checked, then is read whole, one at a time, and keeps
    # its rank's part.
    record = sharding_of_model(module)
    slots = record.sharded_slots() if record is not None else {}
    sharded = {}
    for name, t in tensors.items():
        if id(t) in slots:
            sharded[name] = slots[id(t)]
            tensors[name] = torch.empty(whole_shape(slots, t), dtype=t.dtype, device="meta")
    for name, t in tensors.items():
        if not t.detach().is_contiguous():
            raise CheckpointError(f"{name} is not contiguous in this model: loading writes "
                                  f"into the tensor itself")
    copies = plan_copies(path, index, tensors)
    files = open_checked(path, index, copies)
    touched = {}
    try:
        total = sum(dest.numel() * dest.element_size() for _, _, _, dest in copies)
        with torch.no_grad(), progress(total, "rlhfz load") as bar:
            for rank, name, offset, dest in copies:
                if not dest.is_meta:
                    files[rank].read_into(name, offset, dest)
                    bar.update(dest.numel() * dest.element_size())
            for name, (bucket, i) in sharded.items():
                whole = torch.empty(tensors[name].shape, dtype=bucket.dtype)
                for rank, entry, offset, dest in plan_copies(path, index, {name: whole}):
                    files[rank].read_into(entry, offset, dest)
                bucket.write_param(i, whole)
                touched[id(bucket)] = bucket
                bar.update(whole.numel() * whole.element_size())
                del whole
    finally:
        for tf in files.values():
            tf.close()
    # The reads are C writes, which torch's version counters do not see: an
    # optimizer keeping its own copy of a param (an fp32 master, a host
    # part) learns of them by the version (Bucket.adopt_written).
    torch.autograd.graph.increment_version([t for t in tensors.values() if not t.is_meta])
    sync_buckets(touched.values())
    mark_filled(module, list(module.parameters()))
    return index.get("client_state")
