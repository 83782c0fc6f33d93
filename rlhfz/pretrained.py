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

from .checkpoint.safetensors_out import (INDEX_FILE, SINGLE_FILE, SafetensorsWriter,
                                         drop_stale_weights, nbytes)
from .engine import split_by_bytes
from .generation import refuse_while_gathered
from .lora_export import adapter_units, is_peft, merge_plan, merged
from .model_state import sync_buckets, unwrapped, whole_shape
from .progress import progress
from .sharding import mark_filled
from .state_dict_hooks import gathered_values, placeholders_kept



def save_pretrained(model, path, *, max_shard_size="5GB", adapters="merged") -> None:
    """Writes the model as transformers does. A sharded model streams: every
    rank gathers its units one at a time (a collective), and the first rank
    writes each unit's tensors before the next is gathered, so no rank holds
    more than one unit beyond its shard. For a PEFT LoRA model,
    adapters="merged" writes the base model with the adapters folded in (as
    merge_and_unload would, the model untouched), "only" the adapter files
    PEFT loads."""
    if adapters not in ("merged", "only"):
        raise ValueError(f"adapters must be 'merged' or 'only', not {adapters!r}")
    record, inner = unwrapped(model)
    if not hasattr(inner, "save_pretrained") or not hasattr(inner, "config"):
        raise TypeError(f"save_pretrained needs a transformers or PEFT model, not "
                        f"{type(inner).__name__}: save_checkpoint writes any nn.Module")
    limit = shard_size_bytes(max_shard_size)
    path = os.fspath(path)
    peft = is_peft(inner)
    sharded = record is not None and record.stage3 is not None
    if not peft and not sharded:
        inner.save_pretrained(path, max_shard_size=limit, safe_serialization=True)
        return
    error = None
    try:
        if peft and adapters == "only":
            _save_adapters(record if sharded else None, inner, path)
        else:
            _stream(record if sharded else None, inner, path, limit)
    except Exception as caught:          # every rank hears of it
        error = caught
    failed = (record.comm.statuses(None if error is None else f"{type(error).__name__}: {error}",
                                   "save_pretrained") if sharded else [None])
    if error is not None:
        raise error
    bad = next((f for f in failed if f is not None), None)
    if bad is not None:
        raise RuntimeError(f"save_pretrained: another rank failed: {bad}")


def _save_adapters(record, peft_model, path: str) -> None:
    """PEFT's adapter files, as peft_model.save_pretrained writes them: every
    adapter (active or not, trained or frozen), each in its own file, and
    the base embeddings where PEFT saves those too. PEFT picks the tensors
    from the state dict; under stage 3 the ones it picks are gathered whole
    and the rest stay placeholders, which it leaves alone."""
    state = peft_model.state_dict(keep_vars=True)
    slots = record.sharded_slots() if record is not None else {}
    derived_refused = ("save_pretrained(adapters='only'): PEFT computes some of this model's "
                       "adapter tensors from others (AdaLoRA's rank pattern, say), which "
                       "stage 3 holds as shards: gather the model with "
                       "gather_for_generation(model) and call its own save_pretrained inside")
    try:
        picked = _picked_by_peft(peft_model, state)
    except (IndexError, RuntimeError, ValueError) as error:
        if record is None:
            raise
        # what PEFT computes from them, it computed from the empty placeholders
        raise NotImplementedError(f"{derived_refused} (PEFT: {type(error).__name__}: "
                                  f"{error})") from error
    wanted = {id(t) for t in picked if id(t) in slots}
    held = {id(t) for t in state.values()}
    derived = [t for t in picked if id(t) not in held]
    if record is not None and derived:
        raise NotImplementedError(derived_refused)
    keep = record is None or record.comm.leads
    got = (gathered_values(record, wanted, keep, "save_pretrained")
           if record is not None else {})
    if keep:
        whole = {name: got.get(id(t), t.detach()) for name, t in state.items()}
        with placeholders_kept():         # PEFT reads some modules' keys: no gathers
            peft_model.save_pretrained(path, state_dict=whole, safe_serialization=True)


def _picked_by_peft(peft_model, state: dict) -> list:
    """The tensors of state that PEFT's save_pretrained writes, over every
    adapter it saves (with the embeddings it may add, so a superset where
    it decides that by itself). Every rank finds the same ones."""
    import warnings
    from peft import get_peft_model_state_dict
    picked = {}
    with warnings.catch_warnings(), placeholders_kept():
        warnings.simplefilter("ignore")
        for adapter in peft_model.peft_config:
            for t in get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter,
                                               save_embedding_layers=True).values():
                picked[id(t)] = t
    return list(picked.values())


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


def export_entries(record, inner):
    """(config holder, [(unit or None, name, tensor, merge)], {id(param): unit}):
    every tensor a Hugging Face export holds, each tied tensor once under
    its first name, whole tensors first, then unit by unit in the order they
    are gathered. For a PEFT model: the base model's names, LoRA weights to
    merge, no adapter params, the modules_to_save copies in use under the
    base model's names."""
    merges, rename, holder = {}, (lambda n: n), inner
    if is_peft(inner):
        holder, merges, rename = merge_plan(inner)
    slots = record.sharded_slots() if record is not None else {}
    unit_of = ({id(p): u for u, (_, buckets) in enumerate(record.stage3.units)
                for b in buckets for p in b.params} if record is not None else {})
    seen, entries = set(), []
    for name, t in holder.state_dict(keep_vars=True).items():
        name = rename(name)
        if name is None or id(t) in seen:
            continue
        seen.add(id(t))
        entries.append((unit_of.get(id(t)) if id(t) in slots else None, name, t,
                        merges.get(id(t))))
    return holder, sorted(entries, key=lambda e: -1 if e[0] is None else e[0]), unit_of


def _stream(record, inner, path: str, limit: int) -> None:
    """save_pretrained's files, from units gathered one at a time."""
    holder, entries, unit_of = export_entries(record, inner)
    slots = record.sharded_slots() if record is not None else {}
    sizes = [(name, t.dtype, tuple(whole_shape(slots, t))) for _, name, t, _ in entries]
    # transformers' split: files of up to limit bytes, in the order written
    files = split_by_bytes(sizes, lambda spec: nbytes(spec[1], spec[2]), limit)
    names = ([SINGLE_FILE] if len(files) == 1 else
             [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))])
    first = record is None or record.comm.leads
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
    if record is not None:
        record.comm.agree("save_pretrained", {"tensors": len(entries)})
    by_unit: dict = {}
    for unit, name, t, merge in entries:
        by_unit.setdefault(unit, []).append((name, t, merge))
    with torch.no_grad(), progress(sum(nbytes(*s[1:]) for s in sizes),
                                   "rlhfz save_pretrained") as bar:
        for unit in sorted(by_unit, key=lambda u: -1 if u is None else u):
            # a merge reads its adapters, which may sit in another unit
            units = sorted(({unit} if unit is not None else set()).union(
                *[adapter_units(m[0], unit_of) for _, _, m in by_unit[unit] if m]))
            if record is not None and units:
                record.stage3.gather_many(units)
            try:
                for name, t, merge in by_unit[unit]:
                    if first and failure is None:
                        try:
                            writers[where[name]].write(
                                name, merged(t, *merge) if merge else t)
                        except Exception as caught:
                            failure = caught
                    bar.update(nbytes(t.dtype, t.shape))
            finally:
                for held in units if record is not None else ():
                    record.stage3.release(held)
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
        # an earlier save's files go before the new index: a stale
        # model.safetensors would be read first
        drop_stale_weights(path, names)
        if len(names) > 1:
            weight_map = {name: names[where[name]] for name, _, _ in sizes}
            staged = os.path.join(path, f".{INDEX_FILE}.tmp")
            with open(staged, "w") as f:
                json.dump({"metadata": {"total_size": sum(nbytes(*s[1:]) for s in sizes)},
                           "weight_map": weight_map}, f, indent=2, sort_keys=True)
            os.replace(staged, os.path.join(path, INDEX_FILE))
        holder.config.save_pretrained(path)
        generation = getattr(holder, "generation_config", None)
        if generation is not None and getattr(holder, "can_generate", lambda: False)():
            generation.save_pretrained(path)


def _files(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it: model.safetensors
    when there is one, as transformers reads it, else the index's files."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index) and not os.path.exists(os.path.join(path, SINGLE_FILE)):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} (a Hugging "
                                f"Face safetensors checkpoint) is here")
    from safetensors import safe_open
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_pretrained(model, path) -> None:
    """Loads a Hugging Face safetensors checkpoint into the model in place
    (not a collective). Every param and buffer is matched by name, shape and
    dtype before anything is written; a tied param may be saved under one
    of its names only. A sharded param reads only the rows that hold its
    rank's part."""
    from safetensors import safe_open
    path = os.fspath(path)
    record, inner = unwrapped(model)
    refuse_while_gathered(record, "load_pretrained")
    files = _files(path)
    wanted, seen = {}, {}
    for name, t in inner.state_dict(keep_vars=True).items():
        seen.setdefault(id(t), []).append(name)
        wanted[name] = t
    slots = record.sharded_slots() if record is not None else {}
    plan, missing, wrong = [], [], []
    for names in seen.values():
        present = [n for n in names if n in files]
        if not present:
            missing.append(names[0])
            continue
        t = wanted[present[0]]
        plan.append((present[0], t, tuple(whole_shape(slots, t))))
    opened = {}
    try:
        for name, t, here in plan:
            file = files[name]
            if file not in opened:
                opened[file] = safe_open(file, framework="pt")
            sliced = opened[file].get_slice(name)
            shape = tuple(sliced.get_shape())
            dtype = sliced.get_dtype()
            if shape != here or _dtype_name(dtype) != str(t.dtype).split(".")[-1]:
                wrong.append(f"{name}: {dtype}{list(shape)} saved, {t.dtype}{list(here)} here")
        if missing or wrong:
            raise ValueError(
                f"{path} does not hold this model: "
                + (f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing
                   else "")
                + ("; " if missing and wrong else "")
                + (f"different {wrong[:3]}{' ...' if len(wrong) > 3 else ''}" if wrong else ""))
        touched = {}
        total = sum(math.prod(shape) * t.element_size() for _, t, shape in plan)
        with torch.no_grad(), progress(total, "rlhfz load_pretrained") as bar:
            for name, t, shape in plan:
                source = opened[files[name]]
                if id(t) in slots:           # the rows that hold this rank's part, no more
                    bucket, i = slots[id(t)]
                    bucket.param_shard_part(i).copy_(_local_part(source, name, bucket, i))
                    touched[id(bucket)] = bucket
                else:
                    t.detach().copy_(source.get_tensor(name))
                bar.update(math.prod(shape) * t.element_size())
        sync_buckets(touched.values())
        mark_filled(record, [t for _, t, _ in plan])
    finally:
        opened.clear()


def _local_part(source, name: str, bucket, index: int) -> torch.Tensor:
    """This rank's elements of a saved tensor, flat, read as the few whole
    rows (first-dimension slices) that cover them."""
    shape = bucket.layout.slots[index].shape
    a, b = bucket.shard.local[index]
    offset = bucket.layout.slots[index].offset - bucket.shard.start
    lo, hi = a - offset, b - offset              # the part, in the param's own elements
    if hi <= lo:
        return torch.empty(0, dtype=bucket.dtype)
    if len(shape) == 0:
        return source.get_tensor(name).reshape(-1)[lo:hi]
    row = math.prod(shape[1:])
    first, last = lo // row, -(-hi // row)
    rows = source.get_slice(name)[first:last]
    return rows.reshape(-1)[lo - first * row:hi - first * row]


def _dtype_name(safetensors_dtype: str) -> str:
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
            "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8",
            "BOOL": "bool"}.get(str(safetensors_dtype), str(safetensors_dtype))
