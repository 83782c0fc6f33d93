"""Checkpoints: one tensor file per rank plus a small JSON index, written
atomically and loaded shard by shard into the optimizer's own memory.

A checkpoint is a directory:

    index.json                              what the files hold, and which generation is current
    g-<token>/rank-00000-of-00002.safetensors   rank 0's shard of every bucket (+ the model's
    g-<token>/rank-00001-of-00002.safetensors   buffers and frozen params, in rank 0's file)

Saving writes a new generation beside the old one, makes it durable, then
atomically replaces index.json; only then does the old generation go. A
crash at any point leaves an index.json that names a complete generation.

Loading checks everything it will read before it writes anything: the index
(its own CRC-32, then against the model and optimizer), every file's header, and the CRC-32 of
every byte it needs. Then it copies byte ranges straight into the params and
optimizer state, so the extra host memory it needs is one staging buffer (for
device memory), not the state. A checkpoint written at any world size and
stage loads at any other: each rank reads the byte ranges of the saved
shards that its own shard covers.

Files hold tensors and JSON only (see tensorfile.py): nothing from a
checkpoint is ever executed. The consolidated interchange format (a
torch.save of the model's state_dict and a torch.optim-format optimizer
state) is read with torch.load(weights_only=True).
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from .generation import _unwrap, iter_full_params, stage3_of
from .layout import plan_bucket
from .progress import progress
from .tensorfile import CorruptFileError, TensorFile, TensorFileWriter

FORMAT = "rlhfz.checkpoint.v1"
INDEX = "index.json"
CHECKSUM = "crc32"          # the index's own, over the rest of it
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
MAX_INDEX_BYTES = 256 << 20
_FILE_NAME = re.compile(r"rank-(\d{5})-of-(\d{5})\.safetensors")
_GENERATION = re.compile(r"g-[0-9a-f]{16}")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STATE = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded here: it is missing, damaged,
    or from another model. Nothing was changed."""


# ---- what a checkpoint describes -------------------------------------------------------

def _check_optimizer(optimizer) -> None:
    from .optim import ZeroAdamW
    if not isinstance(optimizer, ZeroAdamW):
        raise TypeError(f"sharded checkpoints hold a ZeroAdamW's state, not "
                        f"{type(optimizer).__name__}'s; save_consolidated writes torch's formats")


def _positions(optimizer) -> dict[int, int]:
    return {id(p): i for i, p in
            enumerate(p for group in optimizer.param_groups for p in group["params"])}


def _names(model, optimizer) -> dict[int, str]:
    names = {}
    if model is not None:
        for name, p in _unwrap(model).named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
    return names


def _extras(model, optimizer) -> dict[str, torch.Tensor]:
    """The model's state that the optimizer does not hold: buffers and
    params it does not train (the same on every rank)."""
    if model is None:
        return {}
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {name: t for name, t in _unwrap(model).state_dict(keep_vars=True).items()
            if id(t) not in owned}


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
    for bucket in optimizer._buckets:
        slots = bucket.layout.slots
        for p, slot in zip(bucket.params, slots):
            params[positions[id(p)]] = {"name": names.get(id(p)), "shape": list(slot.shape),
                                        "dtype": bucket.dtype_name}
        buckets.append({
            "dtype": bucket.dtype_name, "group": bucket.group_index,
            "params": [positions[id(p)] for p in bucket.params],
            "offsets": [s.offset for s in slots], "numels": [s.numel for s in slots],
            "padded_numel": bucket.layout.padded_numel, "shard_numel": bucket.layout.shard_numel,
            "master": bucket.master_buffer is not None, "registered": list(bucket.registered)})
    groups = []
    for group in optimizer._packed_groups():
        groups.append({k: (v if k == "params" else _jsonable(k, v)) for k, v in group.items()})
    extras = _extras(model, optimizer)
    return {"format": FORMAT, "world_size": optimizer.world_size, "stage": optimizer.stage,
            "params": params, "param_groups": groups, "buckets": buckets,
            "module": {name: {"shape": list(t.shape), "dtype": str(t.dtype).split(".")[-1]}
                       for name, t in extras.items()}}


def _file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


# ---- saving -------------------------------------------------------------------------------

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_private(file: str):
    """A new file only its owner can read, whatever the umask (as the tensor
    files are); never an existing file or a link planted at its name."""
    return os.fdopen(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600),
                     "wb")


def _rank_entries(optimizer, extras):
    """(name, dtype, shape, parts) of every tensor in this rank's file."""
    entries = []
    for k, bucket in enumerate(optimizer._buckets):
        shard = bucket.layout.shard_numel
        entries.append((f"bucket{k}.param", bucket.dtype, (shard,), (bucket.flat_param_shard,)))
        for name in _STATE:
            device_part, host_part, _ = bucket._state_parts(name)
            if name == "master" and bucket.master_buffer is None:
                continue
            parts = (device_part,) + ((host_part,) if host_part is not None else ())
            entries.append((f"bucket{k}.{name}", torch.float32, (shard,), parts))
        if optimizer.rank == 0:
            entries.append((f"bucket{k}.steps", torch.float32, (len(bucket.params),),
                            (bucket.steps,)))
    if optimizer.rank == 0:
        for name, t in extras.items():
            entries.append((f"module.{name}", t.dtype, tuple(t.shape), (t.detach(),)))
    return entries


def _write_rank_file(directory: str, optimizer, extras) -> dict:
    entries = _rank_entries(optimizer, extras)
    name = _file_name(optimizer.rank, optimizer.world_size)
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


def _index_crc(index: dict) -> int:
    return zlib.crc32(json.dumps(index, separators=(",", ":")).encode())


def _index_text(index: dict) -> bytes:
    """The index with a CRC-32 of itself: the tensor files carry their own,
    and a damaged index could otherwise load the right bytes into the wrong
    places, or drop state, without a word."""
    body = {key: value for key, value in index.items() if key != CHECKSUM}
    body[CHECKSUM] = _index_crc(body)
    return json.dumps(body, separators=(",", ":")).encode()


def _commit(path: str, tmp: str, token: str, index: dict) -> None:
    generation = f"g-{token}"
    text = _index_text(index)
    with _create_private(os.path.join(tmp, INDEX)) as f:   # a generation describes itself too
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    os.rename(tmp, os.path.join(path, generation))
    staged = os.path.join(path, f".index-{token}.json")
    with _create_private(staged) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, os.path.join(path, INDEX))
    _fsync_dir(path)
    # The new generation is current: older ones, and leftovers of saves
    # that crashed, can go.
    for entry in os.listdir(path):
        doomed = os.path.join(path, entry)
        if (_GENERATION.fullmatch(entry) and entry != generation) or entry.startswith(".tmp-"):
            shutil.rmtree(doomed, ignore_errors=True)
        elif entry.startswith(".index-"):
            os.unlink(doomed)


def _discard(path: str, token: str) -> None:
    """What a failed commit leaves, unless the index already names it."""
    shutil.rmtree(os.path.join(path, f".tmp-{token}"), ignore_errors=True)
    staged = os.path.join(path, f".index-{token}.json")
    if os.path.exists(staged):
        os.unlink(staged)
    try:
        with open(os.path.join(path, INDEX), "rb") as f:
            current = json.loads(f.read(MAX_INDEX_BYTES)).get("generation")
    except (OSError, ValueError, AttributeError):
        current = None
    if current != f"g-{token}":
        shutil.rmtree(os.path.join(path, f"g-{token}"), ignore_errors=True)


def _all_ok(optimizer, error: BaseException | None, call: str, what: str) -> None:
    """Every rank learns whether every rank succeeded; all raise if one failed."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    statuses = (optimizer.comm.exchange(message, call) if optimizer.comm is not None
                else [message])
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(statuses) if m is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"rank {rank} failed to {what}: {message}")


def save_checkpoint(path, model, optimizer, client_state: dict | None = None) -> None:
    """Writes model and optimizer to the directory `path`, one file per rank
    (a collective: every rank calls it; the directory must be shared).

    The previous checkpoint at `path` stays loadable until the new one is
    complete and durable. client_state (JSON: numbers, strings, lists, dicts)
    comes back from load_checkpoint, e.g. the step and the scheduler's state."""
    _check_optimizer(optimizer)
    optimizer.synchronize()          # copies a non-blocking move left in flight
    path = os.fspath(path)
    comm = optimizer.comm
    try:
        client_text = json.dumps(client_state)
    except (TypeError, ValueError) as error:
        raise TypeError(f"client_state must be JSON-serializable: {error}") from None
    if comm is not None:
        comm.agree("save_checkpoint", {"buckets": len(optimizer._buckets)})
    if optimizer.reducer is not None:
        optimizer.reducer.flush()
    for bucket in optimizer._buckets:
        bucket.refresh_stitched()
    token = secrets.token_hex(8)
    if comm is not None:
        token = comm.exchange(token, "save_checkpoint")[0]
    tmp = os.path.join(path, f".tmp-{token}")

    error, info, index = None, None, None
    try:
        index = _describe(model, optimizer)
        index["client_state"] = json.loads(client_text)
        if os.path.exists(path) and not os.path.isdir(path):
            raise CheckpointError(f"{path} exists and is not a directory")
        if optimizer.rank == 0 and not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
        os.makedirs(tmp, exist_ok=True)
        info = _write_rank_file(tmp, optimizer, _extras(model, optimizer))
    except Exception as caught:          # every rank must hear of it before raising
        error = caught
    infos = (comm.exchange(info, "save_checkpoint") if comm is not None else [info])
    try:
        _all_ok(optimizer, error, "save_checkpoint", "write its shard")
    except BaseException:
        if optimizer.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if optimizer.rank == 0:
        try:
            index["generation"] = f"g-{token}"
            index["files"] = infos
            _commit(path, tmp, token, index)
        except Exception as caught:
            _discard(path, token)
            error = caught
    _all_ok(optimizer, error, "save_checkpoint", "commit the checkpoint")


# ---- loading: reading and checking the index -------------------------------------------------

def _fail(path, why: str):
    raise CheckpointError(f"{path}: {why}")


def _read_index(path: str) -> dict:
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
    # json round-trips what _index_text wrote (key order, floats), so the
    # same text, and the same CRC, comes back
    saved = index.pop(CHECKSUM, None) if isinstance(index, dict) else None
    if type(saved) is not int or saved != _index_crc(index):
        _fail(path, f"{INDEX} does not match its CRC-32: it was damaged or edited")
    _check_index(path, index)
    return index


def _is_int(value, low=0) -> bool:
    return type(value) is int and value >= low


def _check_index(path, index) -> None:
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
    if not _GENERATION.fullmatch(index["generation"]):
        _fail(path, f"{INDEX}: malformed generation {index['generation']!r}")
    for r, entry in enumerate(index["files"]):
        if not (isinstance(entry, dict) and entry.get("name") == _file_name(r, world_size)
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
        # The index has no checksum: offsets edited into another layout would
        # load bytes from the wrong places. rlhfz lays out a bucket one way.
        layout = plan_bucket([index["params"][pos]["shape"] for pos in b["params"]],
                             _DTYPES[b["dtype"]].itemsize, world_size)
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


def _match(path, index, current) -> None:
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


def _check_groups(path, index, optimizer) -> None:
    """The options the index sets on each param group are ones the optimizer
    takes (the index has no checksum: an edited one must not slip through)."""
    from .optim import _check_hparams, _check_unsupported
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, index["param_groups"])):
        merged = {**group, **{k: v for k, v in saved.items() if k not in ("params", "param_names")}}
        try:
            _check_unsupported(merged)
            _check_hparams(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        except (TypeError, ValueError, RuntimeError) as error:
            _fail(path, f"{INDEX}: param group {g}: {error}")


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
        for bucket in optimizer._buckets:
            lo = bucket.shard_start if bucket.sharded_params else 0
            hi = lo + bucket.flat_param.numel()
            self._plan(bucket, positions, "param", lo, hi)
            for name in _STATE:
                if name == "master" and bucket.master_buffer is None:
                    continue
                self._plan(bucket, positions, name, bucket.shard_start,
                           bucket.shard_start + bucket.layout.shard_numel)
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

    def _plan(self, bucket, positions, name, lo, hi):
        saved = self.index["buckets"]
        itemsize = 4 if name != "param" else bucket.itemsize
        # Where this rank keeps the elements: (first element, tensor) pieces,
        # the state split between its device and host parts.
        if name == "param":
            parts = [(lo, bucket.flat_param)]
        else:
            device_part, host_part, _ = bucket._state_parts(name)
            parts = [(bucket.shard_start, device_part)]
            if host_part is not None:
                parts.append((bucket.shard_start + bucket.split, host_part))
        for target, k, source, count, _ in self._runs(bucket, positions, lo, hi):
            if name == "master" and not saved[k]["master"]:
                raise CheckpointError("a 16-bit param has no saved master weights")
            shard = saved[k]["shard_numel"]
            while count > 0:
                rank, local = divmod(source, shard)
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


def _open_files(path, index, needed) -> dict[int, TensorFile]:
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


def _check_entries(path, index, files, needed) -> None:
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
                tf.entry(name, torch.float32, b["shard_numel"])


def _verify(path, index, files, needed) -> None:
    total = sum(files[r].entries[n].nbytes for r, names in needed.items() for n in names)
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool, progress(total, "rlhfz verify") as bar:
        for rank, names in needed.items():
            files[rank].verify(index["files"][rank]["crc32"], pool, names, progress=bar)


def _refuse_while_gathered(optimizer) -> None:
    stage3 = getattr(optimizer, "stage3", None)
    if stage3 is not None and (stage3.suspended or stage3.keep or stage3.gathered_bytes()):
        raise RuntimeError("the model's params are gathered (a gather_for_generation context "
                           "is open, or a forward is running): load after it closes")


def load_checkpoint(path, model, optimizer=None):
    """Loads a checkpoint into the existing model and optimizer, in place, and
    returns its client_state (a collective when the optimizer spans ranks).

    `path` is a directory from save_checkpoint (any world size, any stage),
    or one from save_consolidated (model.pt, optimizer.pt). On any error
    (missing, truncated or modified files, another model's checkpoint) it
    raises CheckpointError on every rank and nothing has changed."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, INDEX)):
        if os.path.exists(os.path.join(path, MODEL_FILE)):
            load_consolidated(path, model, optimizer)
            return None
        raise CheckpointError(f"{path}: no checkpoint here (neither {INDEX} nor {MODEL_FILE})")
    if optimizer is None:
        raise TypeError(f"{path} is a sharded checkpoint, laid out by the optimizer's buckets: "
                        f"pass the ZeroAdamW too (load_checkpoint(path, model, optimizer))")
    _check_optimizer(optimizer)
    optimizer.synchronize()
    _refuse_while_gathered(optimizer)
    comm = optimizer.comm
    if comm is not None:
        comm.agree("load_checkpoint", {"buckets": len(optimizer._buckets)})
    if optimizer.reducer is not None:
        optimizer.reducer.flush()
    error, files, plan, index = None, {}, None, None
    try:
        index = _read_index(path)
        _match(path, index, _describe(model, optimizer))
        _check_groups(path, index, optimizer)
        plan = _Plan(index, optimizer)
        needed = plan.needs()
        files = _open_files(path, index, needed)
        _check_entries(path, index, files, needed)
        _verify(path, index, files, needed)
    except (CheckpointError, CorruptFileError) as caught:
        error = caught if isinstance(caught, CheckpointError) else CheckpointError(str(caught))
    except Exception as caught:
        error = caught
    try:
        _all_ok(optimizer, error, "load_checkpoint", "check the checkpoint")
        _apply(index, plan, files, model, optimizer)
    finally:
        for tf in files.values():
            tf.close()
    return index.get("client_state")


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
                if saved[k]["registered"][s]:
                    optimizer._register_state(bucket, i)
                else:
                    optimizer._unregister_state(bucket, i)
            # fp32 params are their own master: the host part's copy follows them
            bucket.pull_host_part(master=bucket.master_buffer is None)
            bucket.refresh_stitched()
        extras = _extras(model, optimizer)
        for name, t in extras.items():
            target = t.detach()
            if target.is_contiguous():
                files[0].read_into(f"module.{name}", 0, target)
            else:
                target.copy_(files[0].read(f"module.{name}"))
        for group, saved_group in zip(optimizer.param_groups, index["param_groups"]):
            for key, value in saved_group.items():
                if key not in ("params", "param_names"):
                    group[key] = tuple(value) if isinstance(value, list) else value
    optimizer._finite_versions = None


# ---- consolidated interchange: torch.save of whole state dicts --------------------------------

def _atomic_torch_save(obj, file: str) -> None:
    staged = f"{file}.tmp-{secrets.token_hex(8)}"
    f = _create_private(staged)      # before the try: a name already taken is not ours to remove
    try:
        with f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, file)
    except BaseException:
        if os.path.exists(staged):
            os.unlink(staged)
        raise


def full_model_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's whole state_dict on the CPU (under stage 3 a collective:
    params are gathered a few units at a time)."""
    inner = _unwrap(model)
    keep = inner.state_dict(keep_vars=True)
    if stage3_of(model) is None:
        return {name: t.detach().cpu().clone() for name, t in keep.items()}
    by_id = {}
    params = dict(inner.named_parameters())
    for name, t in iter_full_params(model):
        if name in params:
            by_id[id(params[name])] = t.cpu().clone()
    return {name: by_id.get(id(t), t.detach().cpu().clone()) for name, t in keep.items()}


def save_consolidated(path, model, optimizer=None) -> None:
    """Writes `path`/model.pt (torch.save of the whole model state_dict) and,
    with an optimizer, `path`/optimizer.pt (torch.optim.AdamW's format),
    from the first rank; a collective across ranks. Each file is replaced
    atomically. Plain torch reads both: model.load_state_dict(torch.load(...))."""
    path = os.fspath(path)
    comm = getattr(optimizer, "comm", None)
    model_state = full_model_state_dict(model)
    optimizer_state = optimizer.state_dict() if optimizer is not None else None
    rank = getattr(optimizer, "rank", 0)
    error = None
    if rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            _atomic_torch_save(model_state, os.path.join(path, MODEL_FILE))
            if optimizer_state is not None:
                _atomic_torch_save(optimizer_state, os.path.join(path, OPTIMIZER_FILE))
        except Exception as caught:
            error = caught
    if comm is not None:
        _all_ok(optimizer, error, "save_consolidated", "write the consolidated files")
    elif error is not None:
        raise error


def _torch_load(file: str):
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    except Exception as error:     # unpickling refused, truncated zip, ...
        raise CheckpointError(f"{file}: cannot be read as a tensor-only torch.save "
                              f"({type(error).__name__}: {error})") from None


def load_consolidated(path, model, optimizer=None) -> None:
    """Loads `path`/model.pt into the model (any stage: each rank keeps its
    part) and, if present and an optimizer is given, `path`/optimizer.pt.
    Read with weights_only=True and memory-mapped; checked before anything
    is written."""
    path = os.fspath(path)
    state = _torch_load(os.path.join(path, MODEL_FILE))
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise CheckpointError(f"{path}/{MODEL_FILE} is not a state_dict of tensors")
    inner = _unwrap(model)
    keep = inner.state_dict(keep_vars=True)
    shapes = _param_shapes(optimizer)
    missing = sorted(set(keep) - set(state))
    unexpected = sorted(set(state) - set(keep))
    if missing or unexpected:
        raise CheckpointError(f"{path}/{MODEL_FILE} is from another model: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in keep.items():
        shape = shapes.get(id(t), tuple(t.shape))
        if tuple(state[name].shape) != shape or not state[name].is_floating_point() \
                and t.is_floating_point():
            raise CheckpointError(f"{path}/{MODEL_FILE}: {name!r} is {state[name].dtype}"
                                  f"{tuple(state[name].shape)}, the model's is {t.dtype}{shape}")
    optimizer_state = None
    if optimizer is not None and os.path.exists(os.path.join(path, OPTIMIZER_FILE)):
        optimizer_state = _torch_load(os.path.join(path, OPTIMIZER_FILE))
        try:
            optimizer._checked_state_dict(optimizer_state)
        except ValueError as error:
            raise CheckpointError(f"{path}/{OPTIMIZER_FILE}: {error}") from None
    if optimizer is not None:
        _refuse_while_gathered(optimizer)
    comm = getattr(optimizer, "comm", None)
    if comm is not None:
        comm.agree("load_consolidated", {"optimizer": optimizer_state is not None})
    with torch.no_grad():
        owners = _param_owners(optimizer)
        for name, t in keep.items():
            owner = owners.get(id(t))
            if owner is None:
                t.detach().copy_(state[name])
            else:
                owner[0].write_param(owner[1], state[name])
        for bucket in getattr(optimizer, "_buckets", []):
            bucket.sync_master()
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)


def _param_shapes(optimizer) -> dict[int, tuple]:
    return {id(p): tuple(slot.shape) for bucket in getattr(optimizer, "_buckets", [])
            for p, slot in zip(bucket.params, bucket.layout.slots)}


def _param_owners(optimizer) -> dict[int, tuple]:
    return {id(p): (bucket, i) for bucket in getattr(optimizer, "_buckets", [])
            for i, p in enumerate(bucket.params)}
