"""The Hugging Face layout, from and into a model of any stage.

save_pretrained writes what transformers' own save_pretrained writes
(safetensors shards, model.safetensors.index.json when there are several,
the config), from whole tensors gathered unit by unit: transformers'
writer stores tied weights once and AutoModel.from_pretrained reads the
result. load_pretrained reads such a directory into a model in place; a
sharded param keeps its rank's part of what it reads, one tensor at a time.
"""
from __future__ import annotations

import json
import math
import os

import torch

from .model_state import full_state_dict, sync_buckets, unwrapped, whole_shape, write_whole
from .progress import progress

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def save_pretrained(model, path, *, max_shard_size="5GB", adapters="merged") -> None:
    """Writes the model as transformers does, with the real tensors of a
    sharded model (a collective then: every rank calls it, the first writes).
    adapters: "merged" or "only" for a PEFT model; PEFT models are refused
    for now (merge the adapters with PEFT's merge_and_unload first)."""
    if adapters not in ("merged", "only"):
        raise ValueError(f"adapters must be 'merged' or 'only', not {adapters!r}")
    record, inner = unwrapped(model)
    if type(inner).__module__.startswith("peft"):
        raise NotImplementedError(
            "save_pretrained of a PEFT model is not supported yet: take "
            "rlhfz.full_state_dict(model) and PEFT's own helpers, or merge the adapters "
            "(merge_and_unload) inside gather_for_generation and save the merged model")
    if not hasattr(inner, "save_pretrained"):
        raise TypeError(f"save_pretrained needs a transformers model (a PreTrainedModel), not "
                        f"{type(inner).__name__}: save_checkpoint writes any nn.Module")
    state = full_state_dict(model, rank0_only=True)
    rank = record.rank if record is not None else 0
    error = None
    if rank == 0:
        try:
            inner.save_pretrained(os.fspath(path), state_dict=state,
                                  max_shard_size=max_shard_size, safe_serialization=True)
        except Exception as caught:          # every rank hears of it
            error = caught
    if record is not None and record.comm is not None:
        failed = record.comm.exchange(
            None if error is None else f"{type(error).__name__}: {error}", "save_pretrained")[0]
        if error is None and failed is not None:
            raise RuntimeError(f"save_pretrained: the first rank could not write {path}: "
                               f"{failed}")
    if error is not None:
        raise error


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
