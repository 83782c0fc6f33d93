"""rlhfz: a ZeRO-style sharded AdamW whose engine is a C/CUDA extension.

``import rlhfz`` loads only the C core; the torch-facing parts (ZeroAdamW and
friends) import torch on first use, so the core works with NumPy alone.
"""
from __future__ import annotations

import sys

from . import _C

__version__ = _C.__version__

_LAZY = {
    "ZeroAdamW": ("rlhfz.optim", "ZeroAdamW"),
    "NonFiniteGradError": ("rlhfz.optim", "NonFiniteGradError"),
    "offload": ("rlhfz.migrate", "offload"),
    "reload": ("rlhfz.migrate", "reload"),
    "offloaded": ("rlhfz.migrate", "offloaded"),
    "release_pinned": ("rlhfz.engine", "release_pinned"),
    "pinned_memory": ("rlhfz.engine", "pinned_memory"),
    "gather_for_generation": ("rlhfz.generation", "gather_for_generation"),
    "iter_full_params": ("rlhfz.generation", "iter_full_params"),
    "save_checkpoint": ("rlhfz.checkpoint", "save_checkpoint"),
    "load_checkpoint": ("rlhfz.checkpoint", "load_checkpoint"),
    "save_consolidated": ("rlhfz.checkpoint", "save_consolidated"),
    "load_consolidated": ("rlhfz.checkpoint", "load_consolidated"),
    "CheckpointError": ("rlhfz.checkpoint", "CheckpointError"),
    "CollectiveError": ("rlhfz.comm", "CollectiveError"),
    "shard_model": ("rlhfz.sharding", "shard_model"),
    "full_state_dict": ("rlhfz.model_state", "full_state_dict"),
    "save_pretrained": ("rlhfz.pretrained", "save_pretrained"),
    "load_pretrained": ("rlhfz.pretrained", "load_pretrained"),
    "sync_weights": ("rlhfz.weight_sync", "sync_weights"),
    "receive_weights": ("rlhfz.weight_sync", "receive_weights"),
    "WeightSyncError": ("rlhfz.weight_sync", "WeightSyncError"),
    "release_sync_buffers": ("rlhfz.weight_sync", "release_sync_buffers"),
}


def build_info() -> dict:
    """What this build of rlhfz has: version, CUDA and NCCL availability,
    SIMD level in use, CPU threads, and the torch version (the one loaded,
    else the one installed; None when there is none)."""
    info = dict(_C.build_info())
    info.update(_nccl_info(info["cuda"]))
    torch = sys.modules.get("torch")
    info["torch"] = getattr(torch, "__version__", None) or _installed_version("torch")
    return info


def _installed_version(distribution: str):
    from importlib import metadata
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _nccl_info(cuda: bool) -> dict:
    """NCCL is available when libnccl.so.2 loads and a CUDA device is visible.
    Loading prefers a copy already in the process, so torch's is reused."""
    from .comm.nccl_library import load
    try:
        path = load()
        version = _C.nccl_version()
    except RuntimeError as error:
        return {"nccl": False, "nccl_version": None, "nccl_library": None,
                "nccl_error": str(error)}
    return {"nccl": bool(cuda), "nccl_version": version, "nccl_library": path,
            "nccl_error": None if cuda else "no CUDA device is visible"}


def set_num_threads(n: int) -> None:
    """Threads the CPU kernels use (default: every CPU this process may run on)."""
    _C.set_num_threads(n)


def get_num_threads() -> int:
    return _C.get_num_threads()


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        import importlib
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlhfz' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["ZeroAdamW", "NonFiniteGradError", "offload", "reload", "offloaded", "release_pinned",
           "pinned_memory",
           "gather_for_generation", "iter_full_params", "save_checkpoint", "load_checkpoint",
           "save_consolidated", "load_consolidated", "CheckpointError", "CollectiveError",
           "shard_model", "full_state_dict", "save_pretrained", "load_pretrained", "sync_weights",
           "receive_weights", "WeightSyncError", "release_sync_buffers", "build_info",
           "set_num_threads", "get_num_threads", "__version__"]
