"""Offline export: an rlhfz checkpoint becomes a Hugging Face safetensors model.

`python -m rlhfz consolidate CKPT OUT [--dtype fp32|bf16]` needs no process
group and no GPU. It reads a checkpoint of any world size and stage (or a
model-only one), checks every byte it will read against its CRC, and writes
OUT/model.safetensors (and config.json when the checkpoint saved the
model's config) one tensor at a time: the memory it holds is the largest
tensor, its cast, and nothing more. Optimizer state is left unread.
"""
from __future__ import annotations

import json
import os
import secrets
import struct

import torch

from ..progress import progress
from .format import fsync_dir
from .model_only import open_checked, plan_copies
from .validation import CheckpointError, read_index

OUTPUT = "model.safetensors"
CONFIG = "config.json"
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _tensors(path, index) -> dict[str, tuple[list, torch.dtype]]:
    """name -> (shape, saved dtype) of every tensor of the model, params
    first (each under its first name), then buffers and frozen params."""
    out = {}
    unnamed = sum(1 for p in index["params"] if p["name"] is None)
    if unnamed:
        raise CheckpointError(f"{path}: {unnamed} params were saved without names (no model "
                              f"was given to save_checkpoint), so they cannot be exported")
    for p in index["params"]:
        out[p["name"]] = (p["shape"], getattr(torch, p["dtype"]))
    for name, spec in index["module"].items():
        dtype = getattr(torch, spec["dtype"], None)
        if not isinstance(dtype, torch.dtype) or dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: {name!r} has dtype {spec['dtype']!r}, which "
                                  f"safetensors does not hold")
        out.setdefault(name, (spec["shape"], dtype))
    return out


def _header(tensors: dict, cast) -> tuple[bytes, int]:
    """safetensors' header (length, JSON, space padding to 8 bytes) and the
    data's length."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in tensors.items():
        out = cast(dtype)
        nbytes = out.itemsize * _numel(shape)
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[out], "shape": list(shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offset


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def consolidate(checkpoint, out, dtype: str | None = None) -> dict:
    """Writes OUT/model.safetensors (and OUT/config.json) from the rlhfz
    checkpoint directory CHECKPOINT; floating tensors cast to `dtype`
    ("fp32" or "bf16") when given. Returns {"tensors", "bytes", "largest"}."""
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, not {dtype!r}")
    target = DTYPES.get(dtype)

    def cast(saved: torch.dtype) -> torch.dtype:
        return target if target is not None and saved.is_floating_point else saved
    index = read_index(checkpoint)
    tensors = _tensors(checkpoint, index)
    # every file and checksum is checked before anything is written
    shapes = {name: torch.empty(shape, dtype=saved, device="meta")
              for name, (shape, saved) in tensors.items()}
    files = open_checked(checkpoint, index, plan_copies(checkpoint, index, shapes))
    try:
        header, data_bytes = _header(tensors, cast)
        os.makedirs(out, exist_ok=True)
        final = os.path.join(out, OUTPUT)
        staged = f"{final}.tmp-{secrets.token_hex(8)}"
        largest = 0
        try:
            with open(staged, "wb") as f, progress(data_bytes, "rlhfz consolidate") as bar:
                f.write(header)
                for name, (shape, saved) in tensors.items():
                    whole = torch.empty(shape, dtype=saved)
                    largest = max(largest, whole.numel() * whole.element_size())
                    for rank, entry, offset, dest in plan_copies(checkpoint, index,
                                                                 {name: whole}):
                        files[rank].read_into(entry, offset, dest)
                    written = whole.to(cast(saved)).contiguous().reshape(-1)
                    f.write(memoryview(written.view(torch.uint8).numpy()))
                    bar.update(written.numel() * written.element_size())
                    del whole, written
                f.flush()
                os.fsync(f.fileno())
            os.replace(staged, final)
        except BaseException:
            if os.path.exists(staged):
                os.unlink(staged)
            raise
        if isinstance(index.get("hf_config"), dict):
            config = dict(index["hf_config"])
            if target is not None:
                config["torch_dtype"] = config["dtype"] = str(target).split(".")[-1]
            with open(os.path.join(out, CONFIG), "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
        fsync_dir(out)
    finally:
        for tf in files.values():
            tf.close()
    return {"tensors": len(tensors), "bytes": len(header) + data_bytes, "largest": largest}
