"""Tensor-only files in the safetensors layout, written and read in pieces.

A file is an 8-byte little-endian header length, a JSON header mapping each
name to {"dtype", "shape", "data_offsets"} (plus "__metadata__": str -> str),
then the raw little-endian bytes. Reading one parses JSON and copies bytes:
nothing in the file is ever executed. The safetensors library reads these
files too.

Writers stream each tensor from wherever it lives, in pieces, and readers
copy byte ranges straight into existing memory, so neither needs a second
copy of the data. Every tensor's bytes get a CRC-32 per CHUNK_BYTES, which
lets a reader verify a file on several threads before it trusts any of it.

Beside the format, the two file primitives every checkpoint write builds on:
create_private (a new file only its owner reads) and fsync_dir (a rename
made durable).
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK_BYTES = 16 << 20
MAX_HEADER_BYTES = 64 << 20
# Host memory a copy to or from a non-CPU tensor stages through, at most.
STAGING_BYTES = 64 << 20

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
CODES = {dtype: code for code, dtype in DTYPES.items()}


class CorruptFileError(ValueError):
    """A tensor file is truncated, malformed, or its bytes fail their checksum."""


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _pieces(t: torch.Tensor):
    """(memoryview, staging) pairs covering t's bytes in order: t itself on
    the CPU, else copies through one reused host staging tensor."""
    t = t.detach().reshape(-1)
    if t.device.type == "cpu":
        yield _host_bytes(t.contiguous())
        return
    raw = t.view(torch.uint8)
    staging = torch.empty(min(raw.numel(), STAGING_BYTES), dtype=torch.uint8)
    for lo in range(0, raw.numel(), staging.numel()):
        n = min(staging.numel(), raw.numel() - lo)
        staging[:n].copy_(raw[lo:lo + n])
        yield _host_bytes(staging[:n])


class TensorFileWriter:
    """Writes a file whose names, dtypes and sizes are all declared up front,
    so the header goes first and each tensor's bytes stream after it."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple]],
                 metadata: dict[str, str] | None = None):
        header, offset = {}, 0
        self._sizes = {}
        for name, dtype, shape in entries:
            if name in header:
                raise ValueError(f"tensor {name!r} declared twice")
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._sizes[name] = nbytes
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)     # data starts 8-byte aligned
        self.path = path
        self._order = [name for name, _, _ in entries]
        self._next = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self.nbytes = 8 + len(text) + offset
        self.crc32: dict[str, list[int]] = {}
        try:
            self._write(struct.pack("<Q", len(text)) + text)
        except BaseException:
            self.abort()
            raise

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def write(self, name: str, *parts: torch.Tensor, progress=None) -> None:
        """The bytes of `name`: the parts joined, in declaration order."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            raise ValueError(f"tensor {name!r} written out of its declared order")
        crcs, crc, filled, total = [], 0, 0, 0
        for part in parts:
            for view in _pieces(part):
                while view:
                    take = min(len(view), CHUNK_BYTES - filled)
                    chunk = view[:take]
                    self._write(chunk)
                    crc = zlib.crc32(chunk, crc)
                    filled += take
                    total += take
                    view = view[take:]
                    if progress is not None:
                        progress.update(take)
                    if filled == CHUNK_BYTES:
                        crcs.append(crc)
                        crc, filled = 0, 0
        if filled or not crcs:
            crcs.append(crc)
        if total != self._sizes[name]:
            raise ValueError(f"tensor {name!r}: {total} bytes written, {self._sizes[name]} "
                             f"declared")
        self.crc32[name] = crcs
        self._next += 1

    def close(self) -> None:
        """Durable on return: every byte is on disk."""
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} declared tensors were not written")
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Entry:
    __slots__ = ("name", "dtype", "shape", "start", "nbytes")

    def __init__(self, name, dtype, shape, start, nbytes):
        self.name, self.dtype, self.shape, self.start, self.nbytes = \
            name, dtype, shape, start, nbytes

    @property
    def numel(self) -> int:
        return _numel(self.shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class TensorFile:
    """A tensor file opened for reading. The header is checked in full on
    open: every entry's dtype, shape and byte range, which must tile the
    data section exactly. Only byte ranges are read afterwards."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as error:
            raise CorruptFileError(f"{path}: cannot open: {error.strerror}") from error
        try:
            self.size = os.fstat(self._fd).st_size
            self.entries, self.metadata = self._parse_header()
        except BaseException:
            self.close()
            raise

    def _fail(self, why: str):
        raise CorruptFileError(f"{self.path}: {why}")

    def _parse_header(self):
        if self.size < 8:
            self._fail(f"{self.size} bytes, too short for a tensor file header")
        (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if length > min(MAX_HEADER_BYTES, self.size - 8):
            self._fail(f"header length {length} does not fit the file ({self.size} bytes)")
        raw = os.pread(self._fd, length, 8)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as error:
            self._fail(f"header is not valid JSON ({error})")
        if not isinstance(header, dict):
            self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", {}) or {}
        if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            self._fail("__metadata__ must map strings to strings")
        base = 8 + length
        entries, spans = {}, []
        for name, spec in header.items():
            if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
                self._fail(f"entry {name!r} is not {{dtype, shape, data_offsets}}")
            dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
            if dtype is None:
                self._fail(f"entry {name!r} has unknown dtype {spec['dtype']!r}")
            shape, offsets = spec["shape"], spec["data_offsets"]
            if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
                self._fail(f"entry {name!r} has a malformed shape {shape!r}")
            if not (isinstance(offsets, list) and len(offsets) == 2
                    and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
                self._fail(f"entry {name!r} has malformed data_offsets {offsets!r}")
            nbytes = offsets[1] - offsets[0]
            if nbytes != _numel(shape) * torch.empty((), dtype=dtype).element_size():
                self._fail(f"entry {name!r}: {nbytes} bytes for shape {shape} of {spec['dtype']}")
            entries[name] = Entry(name, dtype, tuple(shape), base + offsets[0], nbytes)
            spans.append((offsets[0], offsets[1]))
        end = 0
        for lo, hi in sorted(spans):
            if lo != end:
                self._fail("tensor byte ranges overlap or leave holes")
            end = hi
        if base + end != self.size:
            self._fail(f"the header describes {base + end} bytes, the file has {self.size} "
                       f"(truncated or extended)")
        return entries, metadata

    def entry(self, name: str, dtype: torch.dtype | None = None, numel: int | None = None):
        found = self.entries.get(name)
        if found is None:
            self._fail(f"has no tensor {name!r}")
        if dtype is not None and found.dtype != dtype:
            self._fail(f"tensor {name!r} is {found.dtype}, expected {dtype}")
        if numel is not None and found.numel != numel:
            self._fail(f"tensor {name!r} has {found.numel} elements, expected {numel}")
        return found

    def _read_exact(self, view: memoryview, offset: int) -> None:
        while view:
            n = os.preadv(self._fd, [view], offset)
            if n <= 0:
                self._fail(f"unexpected end of file at byte {offset}")
            view = view[n:]
            offset += n

    def read_into(self, name: str, byte_lo: int, dest: torch.Tensor) -> None:
        """Copies bytes [byte_lo, byte_lo + dest's size) of tensor `name`
        into dest (any device): straight into CPU memory, through a bounded
        staging buffer otherwise."""
        entry = self.entries[name]
        dest = dest.view(-1)
        nbytes = dest.numel() * dest.element_size()
        if byte_lo < 0 or byte_lo + nbytes > entry.nbytes:
            raise ValueError(f"bytes [{byte_lo}, {byte_lo + nbytes}) lie outside {name!r}")
        raw = dest.view(torch.uint8)
        if raw.device.type == "cpu" and raw.is_contiguous():
            self._read_exact(_host_bytes(raw), entry.start + byte_lo)
            return
        staging = torch.empty(min(nbytes, STAGING_BYTES), dtype=torch.uint8)
        for lo in range(0, nbytes, staging.numel()):
            n = min(staging.numel(), nbytes - lo)
            self._read_exact(_host_bytes(staging[:n]), entry.start + byte_lo + lo)
            raw[lo:lo + n].copy_(staging[:n])

    def read(self, name: str) -> torch.Tensor:
        """A whole (small) tensor, as a new CPU tensor."""
        entry = self.entries[name]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(name, 0, out)
        return out

    def verify(self, crcs: dict[str, list[int]], pool: ThreadPoolExecutor | None = None,
               names=None, progress=None) -> None:
        """Checks the named tensors' bytes against their CRC-32s, a chunk per
        task, each task holding at most one chunk in memory."""
        names = list(crcs) if names is None else list(names)
        jobs = []
        for name in names:
            entry = self.entry(name)
            expected = crcs.get(name)
            chunks = max(1, -(-entry.nbytes // CHUNK_BYTES))
            if not isinstance(expected, list) or len(expected) != chunks:
                self._fail(f"no checksums for tensor {name!r}")
            for k in range(chunks):
                lo = k * CHUNK_BYTES
                jobs.append((name, k, entry.start + lo, min(CHUNK_BYTES, entry.nbytes - lo),
                             expected[k]))

        def check(job):
            name, k, offset, n, expected = job
            buffer = bytearray(n)
            self._read_exact(memoryview(buffer), offset)
            if zlib.crc32(buffer) != expected:
                self._fail(f"tensor {name!r} fails its checksum in chunk {k} (the file was "
                           f"modified or damaged)")
            if progress is not None:
                progress.update(n)

        if pool is None:
            for job in jobs:
                check(job)
            return
        futures = [pool.submit(check, job) for job in jobs]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:      # one bad chunk is enough: stop reading
                future.cancel()

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- files written for a checkpoint ---------------------------------------------------------

def create_private(file: str):
    """A new file only its owner can read, whatever the umask (as the tensor
    files are); never an existing file or a link planted at its name."""
    return os.fdopen(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600),
                     "wb")


def fsync_dir(path: str) -> None:
    """Makes the entries of a directory (a create, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
