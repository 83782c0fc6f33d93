"""Reading and checking a sharded checkpoint before anything is loaded.

A load checks everything it will read before it writes anything:
- the index: its own CRC-32 first (the tensor files carry their own, and a
  damaged index could otherwise load the right bytes into the wrong places,
  or drop state, without a word), then its structure, so that nothing later
  trips over a bad value, then against this model and optimizer;
- every file it reads: its size and header against the index;
- the CRC-32 of every byte it needs, on a few threads.
Each failure raises CheckpointError before any byte of the model or
optimizer was changed, and all_ok makes every rank raise when one failed
(a save's failures too). The index is written here as well (index_text),
beside the CRC that checks it.
"""
from __future__ import annotations

import json
import math
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from ..engine import STATE_DTYPES, layout_block, plan_bucket, region_dtype, region_numel
from ..optim_options import check_group
from ..progress import progress
from .format import TensorFile

FORMAT = "rlhfz.checkpoint.v1"
INDEX = "index.json"
CHECKSUM = "crc32"          # the index's own, over the rest of it
MAX_INDEX_BYTES = 256 << 20
GENERATION = re.compile(r"g-[0-9a-f]{16}")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded here: it is missing, damaged,
    or from another model. Nothing was changed."""

    # Users catch it, and tracebacks name it, as rlhfz.checkpoint.CheckpointError.
    __module__ = "rlhfz.checkpoint"


def leads(optimizer) -> bool:
    """The rank that writes what one rank writes for all (the index)."""
    return optimizer.comm is None or optimizer.comm.leads


def file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def all_ok(optimizer, error: BaseException | None, call: str, what: str) -> None:
    """Every rank learns whether every rank succeeded; all raise if one failed."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    statuses = (optimizer.comm.statuses(message, call) if optimizer.comm is not None
                else [message])
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(statuses) if m is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank} failed to {what}: {message}")


# ---- the index and its CRC-32 ----------------------------------------------------------------

def _index_crc(index: dict) -> int:
    return zlib.crc32(json.dumps(index, separators=(",", ":")).encode())


def index_text(index: dict) -> bytes:
    """The index as written, with a CRC-32 of itself."""
    body = {key: value for key, value in index.items() if key != CHECKSUM}
    body[CHECKSUM] = _index_crc(body)
    return json.dumps(body, separators=(",", ":")).encode()


def _fail(path, why: str):
    raise CheckpointError(f"{path}: {why}")


def read_index(path: str) -> dict:
    file = os.path.join(path, INDEX)
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)
    except OSError as error:
        _fail(path, f"cannot read {INDEX}: {error.strerror}")
    if len(raw) > MAX_INDEX_BYTES:
        _fail(path, f"{INDEX} is larger than {MAX_INDEX_BYTES} bytes")
    try:
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        _fail(path, f"{INDEX} is not valid JSON ({error})")
    # json round-trips what index_text wrote (key order, floats), so the
    # same text, and the same CRC, comes back
    saved = index.pop(CHECKSUM, None) if isinstance(index, dict) else None
    if type(saved) is not int or saved != _index_crc(index):
        _fail(path, f"{INDEX} does not match its CRC-32: it was damaged or edited")
    check_index(path, index)
    return index


def _is_int(value, low=0) -> bool:
    return type(value) is int and value >= low


def check_index(path, index) -> None:
    """The index's structure, so that nothing later trips over a bad value."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        _fail(path, f"{INDEX} is not an {FORMAT} index")
    for key, kind in (("world_size", int), ("stage", int), ("params", list),
                      ("param_groups", list), ("buckets", list), ("module", dict),
                      ("files", list), ("generation", str)):
        if not isinstance(index.get(key), kind) or isinstance(index.get(key), bool):
            _fail(path, f"{INDEX}: {key!r} is missing or not a {kind.__name__}")
    world_size = index["world_size"]
    if world_size < 1 or len(index["files"]) != world_size:
        _fail(path, f"{INDEX}: {len(index['files'])} files for a world of {world_size}")
    if not GENERATION.fullmatch(index["generation"]):
        _fail(path, f"{INDEX}: malformed generation {index['generation']!r}")
    for r, entry in enumerate(index["files"]):
        if not (isinstance(entry, dict) and entry.get("name") == file_name(r, world_size)
                and _is_int(entry.get("bytes")) and isinstance(entry.get("crc32"), dict)):
            _fail(path, f"{INDEX}: file entry {r} is malformed")
        for name, crcs in entry["crc32"].items():
            if not (isinstance(crcs, list) and all(_is_int(c) for c in crcs)):
                _fail(path, f"{INDEX}: checksums of {name!r} in file {r} are malformed")
    count = len(index["params"])
    for i, p in enumerate(index["params"]):
        if not (isinstance(p, dict) and isinstance(p.get("shape"), list)
                and all(_is_int(s) for s in p["shape"]) and p.get("dtype") in _DTYPES
                and "name" in p and (p["name"] is None or isinstance(p["name"], str))):
            _fail(path, f"{INDEX}: param {i} is malformed")
    seen = set()
    for k, b in enumerate(index["buckets"]):
        if not isinstance(b, dict):
            _fail(path, f"{INDEX}: bucket {k} is malformed")
        lists = [b.get(key) for key in ("params", "offsets", "numels", "registered")]
        if not (b.get("dtype") in _DTYPES and all(isinstance(v, list) for v in lists)
                and len({len(v) for v in lists}) == 1 and _is_int(b.get("padded_numel"))
                and _is_int(b.get("shard_numel")) and isinstance(b.get("master"), bool)
                and b["shard_numel"] * world_size == b["padded_numel"]):
            _fail(path, f"{INDEX}: bucket {k} is malformed")
        for pos, offset, numel, registered in zip(*lists):
            if not (_is_int(pos) and pos < count and _is_int(offset) and _is_int(numel)
                    and isinstance(registered, bool)):
                _fail(path, f"{INDEX}: bucket {k} lists a malformed param")
            if pos in seen:
                _fail(path, f"{INDEX}: param {pos} appears in two buckets")
            seen.add(pos)
            param = index["params"][pos]
            if (offset + numel > b["padded_numel"] or numel != math.prod(param["shape"])
                    or param["dtype"] != b["dtype"]):
                _fail(path, f"{INDEX}: bucket {k}: param {pos} does not fit its bucket")
        # The CRC catches damage, not an edit that recomputes it: offsets edited
        # into another layout would load bytes from the wrong places. rlhfz
        # lays out a bucket one way.
        state_dtype = b.get("state_dtype", "fp32")
        if state_dtype not in STATE_DTYPES:
            _fail(path, f"{INDEX}: bucket {k} has an unknown state_dtype {state_dtype!r}")
        layout = plan_bucket([index["params"][pos]["shape"] for pos in b["params"]],
                             _DTYPES[b["dtype"]].itemsize, world_size,
                             block=layout_block(state_dtype))
        if [s.offset for s in layout.slots] != b["offsets"] \
                or layout.padded_numel != b["padded_numel"]:
            _fail(path, f"{INDEX}: bucket {k} is not laid out as rlhfz lays out its params")
    if len(seen) != count:
        _fail(path, f"{INDEX}: {count - len(seen)} params are in no bucket")
    for g, group in enumerate(index["param_groups"]):
        if not (isinstance(group, dict) and isinstance(group.get("params"), list)):
            _fail(path, f"{INDEX}: param group {g} is malformed")
    for name, spec in index["module"].items():
        if not (isinstance(spec, dict) and isinstance(spec.get("shape"), list)
                and all(_is_int(s) for s in spec["shape"]) and isinstance(spec.get("dtype"), str)):
            _fail(path, f"{INDEX}: module entry {name!r} is malformed")
    if not isinstance(index.get("client_state", None), (dict, list, str, int, float, type(None))):
        _fail(path, f"{INDEX}: client_state is malformed")


def check_match(path, index, current) -> None:
    """The checkpoint and this model and optimizer hold the same params."""
    saved, mine = index["params"], current["params"]
    if len(saved) != len(mine):
        _fail(path, f"holds {len(saved)} params, the optimizer has {len(mine)}: it is from "
                    f"another model")
    for i, (a, b) in enumerate(zip(saved, mine)):
        if a["name"] is not None and b["name"] is not None and a["name"] != b["name"]:
            _fail(path, f"param {i} is {a['name']!r} in the checkpoint but {b['name']!r} here")
        if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
            _fail(path, f"param {i} ({b['name'] or '?'}) is {a['dtype']}{a['shape']} in the "
                        f"checkpoint but {b['dtype']}{b['shape']} here")
    sizes = [len(g["params"]) for g in index["param_groups"]]
    if sizes != [len(g["params"]) for g in current["param_groups"]]:
        _fail(path, f"param groups hold {sizes} params in the checkpoint, "
                    f"{[len(g['params']) for g in current['param_groups']]} here")
    if set(index["module"]) != set(current["module"]):
        missing = sorted(set(current["module"]) - set(index["module"]))
        unexpected = sorted(set(index["module"]) - set(current["module"]))
        _fail(path, f"model buffers differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, spec in index["module"].items():
        if spec != current["module"][name]:
            _fail(path, f"model entry {name!r} is {spec} in the checkpoint but "
                        f"{current['module'][name]} here")


def check_groups(path, index, optimizer) -> None:
    """The options the index sets on each param group are ones the optimizer
    takes (an index edited, its CRC recomputed, must not slip through)."""
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, index["param_groups"])):
        merged = {**group, **{k: v for k, v in saved.items() if k not in ("params", "param_names")}}
        try:
            check_group(merged)
        except (TypeError, ValueError, RuntimeError) as error:
            _fail(path, f"{INDEX}: param group {g}: {error}")


# ---- the files ------------------------------------------------------------------------------

def open_files(path, index, needed) -> dict[int, TensorFile]:
    directory = os.path.join(path, index["generation"])
    files = {}
    try:
        for rank in sorted(needed):
            entry = index["files"][rank]
            tf = TensorFile(os.path.join(directory, entry["name"]))
            files[rank] = tf
            if tf.size != entry["bytes"]:
                _fail(path, f"{entry['name']} has {tf.size} bytes, the index says "
                            f"{entry['bytes']} (truncated or replaced)")
            if set(tf.entries) != set(entry["crc32"]):
                _fail(path, f"{entry['name']} holds other tensors than the index lists")
    except BaseException:
        for tf in files.values():
            tf.close()
        raise
    return files


def check_entries(path, index, files, needed) -> None:
    saved = index["buckets"]
    for rank, names in needed.items():
        tf = files[rank]
        for name in names:
            if name.startswith("module."):
                spec = index["module"][name[len("module."):]]
                entry = tf.entry(name)
                if list(entry.shape) != spec["shape"] or str(entry.dtype).split(".")[-1] \
                        != spec["dtype"]:
                    _fail(path, f"{name} does not match the index")
                continue
            k, kind = name[len("bucket"):].split(".")
            b = saved[int(k)]
            if kind == "steps":
                tf.entry(name, torch.float32, len(b["params"]))
            elif kind == "param":
                tf.entry(name, _DTYPES[b["dtype"]], b["shard_numel"])
            else:
                tf.entry(name, region_dtype(kind, b.get("state_dtype", "fp32")),
                         region_numel(kind, b["shard_numel"]))


def verify(path, index, files, needed) -> None:
    total = sum(files[r].entries[n].nbytes for r, names in needed.items() for n in names)
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool, progress(total, "rlhfz verify") as bar:
        for rank, names in needed.items():
            files[rank].verify(index["files"][rank]["crc32"], pool, names, progress=bar)
