"""Offline export: an rlhfz checkpoint becomes a Hugging Face safetensors model.

`python -m rlhfz consolidate CKPT OUT [--dtype fp32|bf16]` needs no process
group and no GPU. It reads a checkpoint of any world size and stage (or a
model-only one), checks every byte it will read against its CRC, and writes
OUT/model.safetensors (and config.json and generation_config.json when
the checkpoint saved the model's configs) one tensor at a time: the
memory it holds is the largest tensor, its cast, and nothing more. Optimizer state is left unread. An
earlier model in OUT goes, as transformers' save_pretrained leaves it: its
other weight files and their index, and its config.json and
generation_config.json where this export writes none, so that no load
reads the old weights or generates with the old settings.
"""
from __future__ import annotations

import json
import os

import torch

from ..progress import progress
from .format import fsync_dir
from .model_only import open_checked, plan_copies
from .safetensors_out import DTYPES as SAFETENSORS_DTYPES
from .safetensors_out import SINGLE_FILE, SafetensorsWriter, drop_stale_weights
from .validation import CheckpointError, read_index

OUTPUT = SINGLE_FILE
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
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
        if not isinstance(dtype, torch.dtype) or dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: {name!r} has dtype {spec['dtype']!r}, which "
                                  f"safetensors does not hold")
        out.setdefault(name, (spec["shape"], dtype))
    return out


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
        os.makedirs(out, exist_ok=True)
        writer = SafetensorsWriter(os.path.join(out, OUTPUT),
                                   [(name, cast(saved), shape)
                                    for name, (shape, saved) in tensors.items()])
        largest = 0
        try:
            with progress(writer.data_bytes, "rlhfz consolidate") as bar:
                for name, (shape, saved) in tensors.items():
                    whole = torch.empty(shape, dtype=saved)
                    largest = max(largest, whole.numel() * whole.element_size())
                    for rank, entry, offset, dest in plan_copies(checkpoint, index,
                                                                 {name: whole}):
                        files[rank].read_into(entry, offset, dest)
                    written = whole.to(cast(saved))
                    writer.write(name, written)
                    bar.update(written.numel() * written.element_size())
                    del whole, written
            writer.close()
        except BaseException:
            writer.abort()
            raise
        drop_stale_weights(out, [OUTPUT])
        for key, name in (("hf_config", CONFIG), ("hf_generation_config", GENERATION_CONFIG)):
            config = index.get(key)
            if isinstance(config, dict):
                config = dict(config)
                if key == "hf_config" and target is not None:
                    config["torch_dtype"] = config["dtype"] = str(target).split(".")[-1]
                with open(os.path.join(out, name), "w") as f:
                    json.dump(config, f, indent=2, sort_keys=True)
            elif os.path.exists(os.path.join(out, name)):
                os.unlink(os.path.join(out, name))        # another model's
        fsync_dir(out)
    finally:
        for tf in files.values():
            tf.close()
    return {"tensors": len(tensors), "bytes": writer.nbytes, "largest": largest}
