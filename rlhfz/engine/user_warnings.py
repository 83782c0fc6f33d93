"""Warnings that point at the user's own line.

A fixed stacklevel is right for one call path only: the same warning is
raised from opt.offload(), rlhfz.offload() and the offloaded() context,
each through a different number of rlhfz's (and torch's) frames.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

_RLHFZ = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
# contextlib: the offloaded() context's own frames
_SKIPPED = (_RLHFZ + os.sep, _TORCH + os.sep, os.path.abspath(contextlib.__file__))


def warn_user(text: str, category=RuntimeWarning) -> None:
    """warnings.warn, attributed to the first frame outside rlhfz, torch and contextlib."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    warnings.warn(text, category, stacklevel=level if frame is not None else 2)
