"""Sharded save and resume: one tensor file per rank, in the optimizer's
own layout, and loads that copy byte ranges straight into its memory.

Saving writes a new generation (generations.py): a crash at any point
leaves an index.json that names a complete one. Every rank hears whether
every rank succeeded.

Loading checks everything it will read before it writes anything (see
validation.py). Then it copies byte ranges straight into the params and
optimizer state, so the extra host memory it needs is one staging buffer
(for device memory), not the state. A checkpoint written at any world size
and stage loads at any other: each rank reads the byte ranges of the saved
shards that its own shard covers (_Plan).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil

import torch

from ..generation import refuse_while_gathered, unwrap_model
from ..engine import (STORED_MAPS, region_dtype, region_numel, region_unit, shard_owner,
                      state_regions)
from ..progress import progress
from ..sharding import mark_filled, sharding_of_model
from ..state_dict_hooks import gathered_values
from ..state_dict import packed_groups
from .consolidated import MODEL_FILE, load_consolidated
from .format import CorruptFileError, TensorFileWriter, fsync_dir
from .generations import commit_generation, discard_generation
from .model_only import hf_configs, load_model, save_model, whole_model
from .validation import (FORMAT, INDEX, CheckpointError, all_ok, check_entries, check_groups,
                         check_match, file_name, leads, open_files, read_index, verify)


# ---- what a checkpoint describes -------------------------------------------------------

def _check_optimizer(optimizer) -> None:
    from ..optim import ZeroAdamW
    if not isinstance(optimizer, ZeroAdamW):
        raise TypeError(f"sharded checkpoints hold a ZeroAdamW's state, not "
                        f"{type(optimizer).__name__}'s; save_consolidated writes torch's formats")


def _positions(optimizer) -> dict[int, int]:
    return {id(p): i for i, p in
            enumerate(p for group in optimizer.param_groups for p in group["params"])}


def _names(model, optimizer) -> dict[int, str]:
    names = {}
    if model is not None:
        for name, p in unwrap_model(model).named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
    return names


def _extras(model, optimizer, values: bool = False) -> dict[str, torch.Tensor]:
    """The model's state that the optimizer does not hold: buffers and
    params it does not train (the same on every rank). Params kept as
    shards (frozen ones, or another optimizer's) are gathered whole with
    values (a collective; the first rank keeps them), else stand in as meta
    tensors of their shape: never their 0-element placeholders."""
    if model is None:
        return {}
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    extras = {name: t for name, t in unwrap_model(model).state_dict(keep_vars=True).items()
              if id(t) not in owned}
    record = optimizer.sharding
    frozen = record.sharded_slots() if record is not None else {}
    ids = {id(t) for t in extras.values() if id(t) in frozen}
    if not ids:
        return extras
    got = (gathered_values(record, ids, leads(optimizer), "save_checkpoint") if values
           else {})
    for name, t in extras.items():
        if id(t) in frozen:
            bucket, index = frozen[id(t)]
            extras[name] = got.get(id(t), torch.empty(bucket.layout.slots[index].shape,
                                                      dtype=bucket.dtype, device="meta"))
    return extras


def _jsonable(key, value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_jsonable(key, v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"param group option {key!r} = {value!r} cannot be saved in a checkpoint "
                    f"(numbers, strings, booleans and lists of them can)")


def _describe(model, optimizer) -> dict:
    """The index's description of the model and optimizer (no file data)."""
    positions = _positions(optimizer)
    names = _names(model, optimizer)
    params = [None] * len(positions)
    buckets = []
    for bucket in optimizer.engine.buckets:
        slots = bucket.layout.slots
        for p, slot in zip(bucket.params, slots):
            params[positions[id(p)]] = {"name": names.get(id(p)), "shape": list(slot.shape),
                                        "dtype": bucket.dtype_name}
        buckets.append({
            "dtype": bucket.dtype_name, "group": bucket.group_index,
            "params": [positions[id(p)] for p in bucket.params],
            "offsets": [s.offset for s in slots], "numels": [s.numel for s in slots],
            "padded_numel": bucket.layout.padded_numel, "shard_numel": bucket.layout.shard_numel,
            "master": bucket.has_master, "registered": list(bucket.registered),
            "state_dtype": bucket.state_dtype, "maps": STORED_MAPS.get(bucket.state_dtype)})
    groups = []
    for group in packed_groups(optimizer.param_groups):
        groups.append({k: (v if k == "params" else _jsonable(k, v)) for k, v in group.items()})
    extras = _extras(model, optimizer)
    described = {"format": FORMAT, "world_size": optimizer.world_size, "stage": optimizer.stage,
                 "params": params, "param_groups": groups, "buckets": buckets,
                 "module": {name: {"shape": list(t.shape), "dtype": str(t.dtype).split(".")[-1]}
                            for name, t in extras.items()}}
    if model is not None:           # for an export that transformers loads
        described.update(hf_configs(unwrap_model(model)))
    return described


# ---- saving -------------------------------------------------------------------------------

def _rank_entries(optimizer, extras):
    """(name, dtype, shape, parts) of every tensor in this rank's file."""
    entries = []
    for k, bucket in enumerate(optimizer.engine.buckets):
        shard = bucket.layout.shard_numel
        entries.append((f"bucket{k}.param", bucket.dtype, (shard,), (bucket.flat_param_shard,)))
        for name in state_regions(bucket.state_dtype, bucket.has_master):
            device_part, host_part = bucket.state.parts[name]
            parts = (device_part,) + ((host_part,) if host_part is not None else ())
            entries.append((f"bucket{k}.{name}", region_dtype(name, bucket.state_dtype),
                            (region_numel(name, shard),), parts))
        if optimizer.rank == 0:
            entries.append((f"bucket{k}.steps", torch.float32, (len(bucket.params),),
                            (bucket.steps,)))
    if optimizer.rank == 0:
        for name, t in extras.items():
            entries.append((f"module.{name}", t.dtype, tuple(t.shape), (t.detach(),)))
    return entries


def _write_rank_file(directory: str, optimizer, extras) -> dict:
    entries = _rank_entries(optimizer, extras)
    name = file_name(optimizer.rank, optimizer.world_size)
    writer = TensorFileWriter(os.path.join(directory, name),
                              [(n, dtype, shape) for n, dtype, shape, _ in entries],
                              {"format": FORMAT, "rank": str(optimizer.rank)})
    try:
        with progress(writer.nbytes, "rlhfz save") as bar:
            for n, _, _, parts in entries:
                writer.write(n, *parts, progress=bar)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"name": name, "bytes": writer.nbytes, "crc32": writer.crc32}


def save_checkpoint(path, model, optimizer=None, client_state: dict | None = None) -> None:
    """Writes model and optimizer to the directory `path`, one file per rank
    (a collective: every rank calls it; the directory must be shared).
    Under hybrid sharding the first replica writes the shards.

    The previous checkpoint at `path` stays loadable until the new one is
    complete and durable. client_state (JSON: numbers, strings, lists, dicts)
    comes back from load_checkpoint, e.g. the step and the scheduler's state.
    With no optimizer it writes the model alone (model_only.py): the model
    holds its params whole then, so one process writes it."""
    if optimizer is None:
        save_model(path, model, client_state)
        return
    _check_optimizer(optimizer)
    optimizer.synchronize()          # copies a non-blocking move left in flight
    # writes to gathered params reach the shards only when their units go
    refuse_while_gathered(optimizer, "save")
    optimizer.take_outside_writes()
    path = os.fspath(path)
    comm = optimizer.comm
    try:
        client_text = json.dumps(client_state)
    except (TypeError, ValueError) as error:
        raise TypeError(f"client_state must be JSON-serializable: {error}") from None
    if comm is not None:
        comm.agree("save_checkpoint", {"buckets": len(optimizer.engine.buckets)})
    if optimizer.reducer is not None:
        optimizer.reducer.flush()
    for bucket in optimizer.engine.buckets:
        bucket.state.refresh_stitched()
    token = secrets.token_hex(8)
    if comm is not None:
        token = comm.exchange(token, "save_checkpoint")[0]
    tmp = os.path.join(path, f".tmp-{token}")

    error, info, index = None, None, None
    extras = _extras(model, optimizer, values=True)     # a collective: before any rank can fail
    writes = comm is None or comm.writes_shards
    try:
        index = _describe(model, optimizer)
        index["client_state"] = json.loads(client_text)
        if os.path.exists(path) and not os.path.isdir(path):
            raise CheckpointError(f"{path} exists and is not a directory")
        if leads(optimizer) and not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        if writes:
            os.makedirs(tmp, exist_ok=True)
            info = _write_rank_file(tmp, optimizer, extras)
    except Exception as caught:          # every rank must hear of it before raising
        error = caught
    infos = (comm.exchange(info, "save_checkpoint") if comm is not None else [info])
    try:
        all_ok(optimizer, error, "save_checkpoint", "write its shard")
    except BaseException:
        if leads(optimizer):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    optimizer.engine.release_disk_pages()    # what the writes read stays on disk
    if leads(optimizer):
        try:
            index["generation"] = f"g-{token}"
            index["files"] = infos
            commit_generation(path, tmp, token, index)
        except Exception as caught:
            discard_generation(path, token)
            error = caught
    all_ok(optimizer, error, "save_checkpoint", "commit the checkpoint")


# ---- loading: which saved bytes land where ---------------------------------------------------

class _Plan:
    """For this rank: every (file, tensor, byte offset, destination) copy."""

    def __init__(self, index, optimizer):
        self.index = index
        self.copies = []             # (rank, tensor name, byte offset, dest tensor)
        self.steps = []              # (bucket, [(slot, saved bucket, saved slot)])
        saved = index["buckets"]
        self.source = {}
        for k, b in enumerate(saved):
            for s, (pos, offset) in enumerate(zip(b["params"], b["offsets"])):
                self.source[pos] = (k, s, offset)
        positions = _positions(optimizer)
        for bucket in optimizer.engine.buckets:
            lo = bucket.shard.start if bucket.sharded_params else 0
            hi = lo + bucket.flat_param.numel()
            self._plan(bucket, positions, "param", lo, hi)
            self._check_state_dtypes(bucket, positions)
            for name in state_regions(bucket.state_dtype, bucket.has_master):
                self._plan(bucket, positions, name, bucket.shard.start,
                           bucket.shard.start + bucket.layout.shard_numel)
            self.steps.append((bucket, [(i,) + self.source[positions[id(p)]][:2]
                                        for i, p in enumerate(bucket.params)]))

    def _runs(self, bucket, positions, lo, hi):
        """(target element, saved bucket, saved element, count), merged where
        both sides are contiguous (alignment gaps included)."""
        runs = []
        for slot, p in zip(bucket.layout.slots, bucket.params):
            k, s, offset = self.source[positions[id(p)]]
            a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if a >= b:
                continue
            run = [a, k, offset + a - slot.offset, b - a, s]
            if runs:
                last = runs[-1]
                gap = a - (last[0] + last[3])
                if (last[1] == k and s == last[4] + 1 and gap >= 0
                        and run[2] - (last[2] + last[3]) == gap):
                    last[3] = b - last[0]
                    last[4] = s
                    continue
            runs.append(run)
        return runs

    def _check_state_dtypes(self, bucket, positions) -> None:
        """Moments are copied in their stored form, which must be this
        bucket's: a checkpoint of another state_dtype goes in through its
        consolidated (fp32) form instead."""
        saved = self.index["buckets"]
        for p in bucket.params:
            k = self.source[positions[id(p)]][0]
            kept = saved[k].get("state_dtype", "fp32")
            if kept != bucket.state_dtype:
                raise CheckpointError(
                    f"the checkpoint keeps a param's moments as state_dtype={kept!r}, but this "
                    f"optimizer keeps them as {bucket.state_dtype!r}: build it with "
                    f"state_dtype={kept!r}, or load the state through state_dict() / "
                    f"save_consolidated, which convert")
            maps = saved[k].get("maps")
            if kept in STORED_MAPS and maps != STORED_MAPS[kept]:
                raise CheckpointError(
                    f"the checkpoint's {kept} moments are codes of other maps "
                    f"({maps or 'those of an earlier rlhfz'}) than this rlhfz reads "
                    f"({STORED_MAPS[kept]}): load it with the rlhfz that saved it and "
                    f"save it with save_consolidated (fp32 moments), which this one loads")

    def _plan(self, bucket, positions, name, lo, hi):
        saved = self.index["buckets"]
        # entries (blocks, for scales) and their bytes in this region
        unit = 1 if name == "param" else region_unit(name)
        itemsize = (bucket.itemsize if name == "param" else
                    region_dtype(name, bucket.state_dtype).itemsize)
        # Where this rank keeps the elements: (first entry, tensor) pieces,
        # the state split between its device and host parts.
        if name == "param":
            parts = [(lo, bucket.flat_param)]
        else:
            device_part, host_part = bucket.state.parts[name]
            parts = [(bucket.shard.start // unit, device_part)]
            if host_part is not None:
                parts.append(((bucket.shard.start + bucket.shard.split) // unit, host_part))
        for target, k, source, count, _ in self._runs(bucket, positions, lo, hi):
            if name == "master" and not saved[k]["master"]:
                raise CheckpointError("a 16-bit param has no saved master weights")
            # runs start on a param or shard, hence on a block: the blocks they cover
            end = -(-(target + count) // unit)
            target, source, count = target // unit, source // unit, end - target // unit
            shard = saved[k]["shard_numel"] // unit
            while count > 0:
                rank, local = shard_owner(source, shard)
                start, part = next((s, t) for s, t in reversed(parts) if target >= s)
                n = min(count, shard - local, start + part.numel() - target)
                self.copies.append((rank, f"bucket{k}.{name}", local * itemsize,
                                    part[target - start:target - start + n]))
                target, source, count = target + n, source + n, count - n

    def needs(self) -> dict[int, set[str]]:
        """Tensors this rank reads, by the rank whose file holds them."""
        needed: dict[int, set[str]] = {0: {f"bucket{k}.steps"
                                           for k in range(len(self.index["buckets"]))}}
        needed[0].update(f"module.{name}" for name in self.index["module"])
        for rank, name, _, _ in self.copies:
            needed.setdefault(rank, set()).add(name)
        return needed


def load_checkpoint(path, model, optimizer=None):
    """Loads a checkpoint into the existing model and optimizer, in place, and
    returns its client_state (a collective when the optimizer spans ranks).
    With no optimizer only the model is loaded, from a model-only or a full
    checkpoint (model_only.py).

    `path` is a directory from save_checkpoint (any world size, any stage),
    or one from save_consolidated (model.pt, optimizer.pt). On any error
    (missing, truncated or modified files, another model's checkpoint) it
    raises CheckpointError on every rank and nothing has changed."""
    path = os.fspath(path)
    if optimizer is None:
        # loaded into the shards, under whole copies a forward would go on reading
        refuse_while_gathered(sharding_of_model(whole_model(model, "load_checkpoint")), "load")
    if not os.path.exists(os.path.join(path, INDEX)):
        if os.path.exists(os.path.join(path, MODEL_FILE)):
            load_consolidated(path, model, optimizer)
            return None
        raise CheckpointError(f"{path}: no checkpoint here (neither {INDEX} nor {MODEL_FILE})")
    if optimizer is None:
        return load_model(path, model)
    _check_optimizer(optimizer)
    optimizer.synchronize()
    refuse_while_gathered(optimizer, "load")
    comm = optimizer.comm
    if comm is not None:
        comm.agree("load_checkpoint", {"buckets": len(optimizer.engine.buckets)})
    if optimizer.reducer is not None:
        optimizer.reducer.flush()
    error, files, plan, index = None, {}, None, None
    try:
        index = read_index(path)
        if index.get("model_only"):
            raise CheckpointError(f"{path} holds a model alone, no optimizer state: load it "
                                  f"with load_checkpoint(path, model)")
        check_match(path, index, _describe(model, optimizer))
        check_groups(path, index, optimizer)
        plan = _Plan(index, optimizer)
        needed = plan.needs()
        files = open_files(path, index, needed)
        check_entries(path, index, files, needed)
        verify(path, index, files, needed)
    except (CheckpointError, CorruptFileError) as caught:
        error = caught if isinstance(caught, CheckpointError) else CheckpointError(str(caught))
    except Exception as caught:
        error = caught
    try:
        all_ok(optimizer, error, "load_checkpoint", "check the checkpoint")
        _apply(index, plan, files, model, optimizer)
    finally:
        for tf in files.values():
            tf.close()
        optimizer.engine.release_disk_pages()    # state offloaded to disk stays there
    return index.get("client_state")


def _sharded_by_name(model, optimizer) -> dict[str, tuple]:
    """name -> (bucket, index, frozen) of the model's params kept as shards
    that the optimizer does not own: frozen ones, or another optimizer's."""
    record = optimizer.sharding
    if record is None or model is None:
        return {}
    sharded, frozen = record.sharded_slots(), record.frozen_slots()
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {name: sharded[id(p)] + (id(p) in frozen,) for name, p in
            unwrap_model(model).named_parameters(remove_duplicate=False)
            if id(p) in sharded and id(p) not in owned}


def _apply(index, plan, files, model, optimizer) -> None:
    total = sum(dest.numel() * dest.element_size() for _, _, _, dest in plan.copies)
    with torch.no_grad(), progress(total, "rlhfz load") as bar:
        for rank, name, offset, dest in plan.copies:
            files[rank].read_into(name, offset, dest)
            bar.update(dest.numel() * dest.element_size())
        saved = index["buckets"]
        steps = {k: files[0].read(f"bucket{k}.steps") for k in {k for _, entries in plan.steps
                                                                for _, k, _ in entries}}
        for bucket, entries in plan.steps:
            for i, k, s in entries:
                bucket.steps[i] = steps[k][s]
                (optimizer.engine.register if saved[k]["registered"][s]
                 else optimizer.engine.unregister)(bucket, i)
            # fp32 params are their own master: the host part's copy follows them
            bucket.pull_host_part(master=not bucket.has_master)
            bucket.state.refresh_stitched()
        extras = _extras(model, optimizer)
        sharded = _sharded_by_name(model, optimizer)
        written = []
        for name, t in extras.items():
            target = t.detach()
            if name in sharded:       # a param kept as shards: this rank's part of it
                bucket, slot, frozen = sharded[name]
                value = files[0].read(f"module.{name}").view(bucket.layout.slots[slot].shape)
                if frozen:
                    bucket.write_param(slot, value)
                else:      # another optimizer's: its master follows
                    bucket.load_whole([(slot, value)])
            elif target.is_contiguous():
                files[0].read_into(f"module.{name}", 0, target)
                written.append(target)
            else:
                target.copy_(files[0].read(f"module.{name}"))
        # read_into is a C write, which torch's version counter does not see:
        # another optimizer holding one of these params (its fp32 master, a
        # host part) learns of it by the version (Bucket.adopt_written)
        torch.autograd.graph.increment_version(written)
        for group, saved_group in zip(optimizer.param_groups, index["param_groups"]):
            for key, value in saved_group.items():
                # the form the moments are kept in is this optimizer's, built
                # in (each bucket's was checked against the checkpoint's)
                if key not in ("params", "param_names", "state_dtype", "min_8bit_size"):
                    group[key] = tuple(value) if isinstance(value, list) else value
    optimizer.engine.grads_changed()
    if model is not None:
        mark_filled(unwrap_model(model), list(unwrap_model(model).parameters()))
