"""A checkpoint's generations: each save writes g-<token>/ beside the
current one, makes it durable, then atomically replaces index.json; only
then do older generations go. A crash at any point leaves an index.json
that names a complete generation."""
from __future__ import annotations

import json
import os
import shutil

from .format import create_private, fsync_dir
from .validation import GENERATION, INDEX, MAX_INDEX_BYTES, index_text


def commit_generation(path: str, tmp: str, token: str, index: dict) -> None:
    generation = f"g-{token}"
    text = index_text(index)
    with create_private(os.path.join(tmp, INDEX)) as f:   # a generation describes itself too
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    os.rename(tmp, os.path.join(path, generation))
    staged = os.path.join(path, f".index-{token}.json")
    with create_private(staged) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, os.path.join(path, INDEX))
    fsync_dir(path)
    # The new generation is current: older ones, and leftovers of saves
    # that crashed, can go.
    for entry in os.listdir(path):
        doomed = os.path.join(path, entry)
        if (GENERATION.fullmatch(entry) and entry != generation) or entry.startswith(".tmp-"):
            shutil.rmtree(doomed, ignore_errors=True)
        elif entry.startswith(".index-"):
            os.unlink(doomed)


def discard_generation(path: str, token: str) -> None:
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
