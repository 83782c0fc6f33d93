"""The Hugging Face layout, from and into a model of any stage.

save_pretrained writes what transformers' own save_pretrained writes
(safetensors shards up to max_shard_size, model.safetensors.index.json
when there are several, the config): for a sharded model unit by unit from
the first rank, each tied tensor once, under its first name. load_pretrained
reads such a directory into a model in place; a sharded param keeps its
rank's part of what it reads, one tensor at a time.
"""
from __future__ import annotations

import json
import math
import os

import torch

from .checkpoint.safetensors_out import SafetensorsWriter, nbytes
from .model_state import sync_buckets, unwrapped, whole_shape, write_whole
from .progress import progress

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def save_pretrained(model, path, *, max_shard_size="5GB", adapters="merged") -> None:
    """Writes the model as transformers does. A sharded model streams: every
    rank gathers its units one at a time (a collective), and the first rank
    writes each unit's tensors before the next is gathered, so no rank holds
    more than one unit beyond its shard. adapters: "merged" or "only" for a
    PEFT model, which is refused for now (merge the adapters first)."""
    if adapters not in ("merged", "only"):
        raise ValueError(f"adapters must be 'merged' or 'only', not {adapters!r}")
    record, inner = unwrapped(model)
    if type(inner).__module__.startswith("peft"):
        raise NotImplementedError(
            "save_pretrained of a PEFT model is not supported yet: take "
            "rlhfz.full_state_dict(model) and PEFT's own helpers, or merge the adapters "
            "(merge_and_unload) inside gather_for_generation and save the merged model")
    if not hasattr(inner, "save_pretrained") or not hasattr(inner, "config"):
        raise TypeError(f"save_pretrained needs a transformers model (a PreTrainedModel), not "
                        f"{type(inner).__name__}: save_checkpoint writes any nn.Module")
    limit = shard_size_bytes(max_shard_size)
    path = os.fspath(path)
    if record is None or record.stage3 is None:
        inner.save_pretrained(path, max_shard_size=limit, safe_serialization=True)
        return
    error = None
    try:
        _stream(record, inner, path, limit)
    except Exception as caught:          # every rank hears of it
        error = caught
    failed = record.comm.exchange(None if error is None else f"{type(error).__name__}: {error}",
                                  "save_pretrained")
    if error is not None:
        raise error
    bad = next((f for f in failed if f is not None), None)
    if bad is not None:
        raise RuntimeError(f"save_pretrained: another rank failed: {bad}")


def shard_size_bytes(value) -> int:
    """transformers' max_shard_size: an int of bytes, or "5GB" (10^9) / "5GiB" (2^30)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = str(value).strip().upper()
    for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
        if text.endswith(unit):
            try:
                number = float(text[:-len(unit)])
            except ValueError:
                break
            if number > 0:
                return int(number * scale)
    raise ValueError(f"max_shard_size must be bytes (an int) or like '5GB', not {value!r}")


def _layout(record, inner) -> list[tuple[int | None, str, torch.Tensor]]:
    """(unit or None, name, tensor) of every tensor to save, each tied
    tensor once under its first name: whole tensors first, then unit by
    unit in the order they are gathered."""
    slots = record.sharded_slots()
    unit_of = {id(p): u for u, (_, buckets) in enumerate(record.stage3.units)
               for b in buckets for p in b.params}
    seen, entries = set(), []
    for name, t in inner.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        entries.append((unit_of.get(id(t)) if id(t) in slots else None, name, t))
    return sorted(entries, key=lambda e: -1 if e[0] is None else e[0])


def _stream(record, inner, path: str, limit: int) -> None:
    """save_pretrained's files from units gathered one at a time."""
    entries = _layout(record, inner)
    sizes = [(name, t.dtype, tuple(whole_shape(record, t))) for _, name, t in entries]
    files, current, used = [], [], 0
    for spec in sizes:                       # transformers' split: up to limit bytes a file
        size = nbytes(spec[1], spec[2])
        if current and used + size > limit:
            files.append(current)
            current, used = [], 0
        current.append(spec)
        used += size
    files.append(current)
    names = ([_SINGLE] if len(files) == 1 else
             [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))])
    first = record.rank == 0
    # The first rank's failure to write must not stop it gathering: the
    # others would wait for it. It goes on without writing and raises after.
    writers, where, failure = [], {}, None
    if first:
        try:
            os.makedirs(path, exist_ok=True)
            for file, specs in zip(names, files):
                writers.append(SafetensorsWriter(os.path.join(path, file), specs))
                where.update({name: len(writers) - 1 for name, _, _ in specs})
        except Exception as caught:
            failure = caught
    record.comm.agree("save_pretrained", {"tensors": len(entries)})
    by_unit: dict = {}
    for unit, name, t in entries:
        by_unit.setdefault(unit, []).append((name, t))
    with torch.no_grad(), progress(sum(nbytes(*s[1:]) for s in sizes),
                                   "rlhfz save_pretrained") as bar:
        for unit in sorted(by_unit, key=lambda u: -1 if u is None else u):
            if unit is not None:
                record.stage3.gather_many([unit])
            try:
                for name, t in by_unit[unit]:
                    if first and failure is None:
                        try:
                            writers[where[name]].write(name, t)
                        except Exception as caught:
                            failure = caught
                    bar.update(nbytes(t.dtype, t.shape))
            finally:
                if unit is not None:
                    record.stage3.release(unit)
    try:
        if failure is not None:
            raise failure
        for writer in writers:
            writer.close()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    if first:
        if len(names) > 1:
            weight_map = {name: names[where[name]] for name, _, _ in sizes}
            with open(os.path.join(path, _INDEX), "w") as f:
                json.dump({"metadata": {"total_size": sum(nbytes(*s[1:]) for s in sizes)},
                           "weight_map": weight_map}, f, indent=2, sort_keys=True)
        inner.config.save_pretrained(path)
        generation = getattr(inner, "generation_config", None)
        if generation is not None and getattr(inner, "can_generate", lambda: False)():
            generation.save_pretrained(path)


def _files(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it."""
    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, _SINGLE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path}: neither {_INDEX} nor {_SINGLE} (a Hugging Face "
                                f"safetensors checkpoint) is here")
    from safetensors import safe_open
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_pretrained(model, path) -> None:
    """Loads a Hugging Face safetensors checkpoint into the model in place
    (not a collective). Every param and buffer is matched by name, shape and
    dtype before anything is written; a tied param may be saved under one
    of its names only. A sharded param keeps its rank's part."""
    from safetensors import safe_open
    path = os.fspath(path)
    record, inner = unwrapped(model)
    files = _files(path)
    wanted, seen = {}, {}
    for name, t in inner.state_dict(keep_vars=True).items():
        seen.setdefault(id(t), []).append(name)
        wanted[name] = t
    plan, missing, wrong = [], [], []
    for ident, names in seen.items():
        present = [n for n in names if n in files]
        if not present:
            missing.append(names[0])
            continue
        t = wanted[present[0]]
        plan.append((present[0], t))
    opened = {}
    try:
        for name, t in plan:
            file = files[name]
            if file not in opened:
                opened[file] = safe_open(file, framework="pt")
            sliced = opened[file].get_slice(name)
            shape = tuple(sliced.get_shape())
            dtype = sliced.get_dtype()
            here = whole_shape(record, t)
            if shape != tuple(here) or _dtype_name(dtype) != str(t.dtype).split(".")[-1]:
                wrong.append(f"{name}: {dtype}{list(shape)} saved, {t.dtype}{list(here)} here")
        if missing or wrong:
            raise ValueError(
                f"{path} does not hold this model: "
                + (f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing
                   else "")
                + ("; " if missing and wrong else "")
                + (f"different {wrong[:3]}{' ...' if len(wrong) > 3 else ''}" if wrong else ""))
        touched = {}
        total = sum(math.prod(whole_shape(record, t)) * t.element_size() for _, t in plan)
        with progress(total, "rlhfz load_pretrained") as bar:
            for name, t in plan:             # one whole tensor in memory at a time
                value = opened[files[name]].get_tensor(name)
                if record is not None:
                    touched.update(write_whole(record, {id(t): value}, sync=False))
                else:
                    with torch.no_grad():
                        t.detach().copy_(value)
                bar.update(value.numel() * value.element_size())
                del value
        sync_buckets(touched.values())
    finally:
        opened.clear()


def _dtype_name(safetensors_dtype: str) -> str:
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
            "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8",
            "BOOL": "bool"}.get(str(safetensors_dtype), str(safetensors_dtype))
