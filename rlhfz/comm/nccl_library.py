"""Finding and loading libnccl.so.2 (no torch needed)."""
from __future__ import annotations

import importlib.util
import os

from .. import _C


def wheel_library() -> str | None:
    """libnccl.so.2 as the nvidia-nccl-cu13 (or -cu12) wheel installs it, or None."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.isfile(path):
            return path
    return None


def load() -> str:
    """Loads libnccl.so.2 once and returns the file loaded: a copy already in
    the process (torch's), else $RLHFZ_NCCL_LIBRARY, else the wheel's, else
    the dynamic linker's search."""
    return _C.nccl_load(wheel_library())
