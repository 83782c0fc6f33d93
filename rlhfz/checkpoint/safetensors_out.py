"""Writing the safetensors format one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the bytes back to
back. The header needs every tensor's size, not its values: a writer lays
it out from (name, dtype, shape) first, then takes the tensors in that
order, so no more than one is ever in memory. Files are written under a
temporary name and renamed once durable.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import struct

import torch

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


# transformers' names for a model's weights: one file, or shards and their index
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def drop_stale_weights(path: str, written: list[str]) -> None:
    """Removes the weight files and index of an earlier save into `path`
    that this one did not write (`written`: the weight files it did), as
    transformers' save_pretrained does: a load must never read them."""
    keep = set(written) | ({INDEX_FILE} if len(written) > 1 else set())
    for name in os.listdir(path):
        stale = name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(name) is not None
        if stale and name not in keep:
            os.unlink(os.path.join(path, name))


def nbytes(dtype: torch.dtype, shape) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n


class SafetensorsWriter:
    """entries: [(name, dtype, shape)] in the order write() will take them."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple]],
                 metadata: dict | None = None):
        self.path = path
        self.order = [name for name, _, _ in entries]
        header, offset = {"__metadata__": dict(metadata or {"format": "pt"})}, 0
        for name, dtype, shape in entries:
            if dtype not in DTYPES:
                raise TypeError(f"{name}: safetensors holds no {dtype}")
            size = nbytes(dtype, shape)
            header[name] = {"dtype": DTYPES[dtype], "shape": [int(d) for d in shape],
                            "data_offsets": [offset, offset + size]}
            offset += size
        self.specs = header
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_bytes = offset
        self.nbytes = 8 + len(text) + offset
        self.staged = f"{path}.tmp-{secrets.token_hex(8)}"
        self.file = open(self.staged, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor, in the order given; any device, the dtype declared."""
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise RuntimeError(f"safetensors writer: {name!r} out of order")
        spec = self.specs[name]
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if DTYPES.get(flat.dtype) != spec["dtype"] or list(tensor.shape) != spec["shape"]:
            raise ValueError(f"{name}: {flat.dtype}{list(tensor.shape)} given, "
                             f"{spec['dtype']}{spec['shape']} declared")
        self.file.write(memoryview(flat.view(torch.uint8).numpy()))
        self.next += 1

    def close(self) -> None:
        """Durable, then renamed into place."""
        if self.next != len(self.order):
            self.abort()
            raise RuntimeError(f"safetensors writer: {len(self.order) - self.next} tensors "
                               f"were never written to {self.path}")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.staged, self.path)

    def abort(self) -> None:
        self.file.close()
        if os.path.exists(self.staged):
            os.unlink(self.staged)
