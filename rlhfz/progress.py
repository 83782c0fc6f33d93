"""Progress for long operations (save, load, large offloads).

A tqdm bar on stderr when stderr is a terminal, the operation moves at least
RLHFZ_PROGRESS_MIN_BYTES (1 GiB by default; a count such as 500M or 2G,
decimal, as the command line writes counts), and this is the first rank;
silence otherwise. RLHFZ_PROGRESS=1 forces bars on (any rank, any size),
RLHFZ_PROGRESS=0 off.
"""
from __future__ import annotations

import os
import sys

from .engine.numbers import env_bytes


class _Quiet:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _first_rank() -> bool:
    try:
        import torch.distributed as dist
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except ImportError:
        return True


def wanted(total_bytes: int) -> bool:
    forced = os.environ.get("RLHFZ_PROGRESS")
    if forced is not None:
        return forced not in ("", "0")
    return total_bytes >= min_bytes() and sys.stderr.isatty() and _first_rank()


def min_bytes() -> int:
    """RLHFZ_PROGRESS_MIN_BYTES (default 1 GiB); a ValueError naming the
    variable when it is not a count of bytes."""
    threshold = env_bytes("RLHFZ_PROGRESS_MIN_BYTES", counts=True)
    return 1 << 30 if threshold is None else threshold


def progress(total_bytes: int, desc: str):
    """A context manager with update(nbytes): a bar, or nothing at all."""
    if not wanted(total_bytes):
        return _Quiet()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Quiet()
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                leave=False, file=sys.stderr)
