"""Whole numbers as people write them, on the command line or in the
environment: 7B, 350M, 1.5K, 2G, 7e9 or 125000.

The suffixes are decimal: K 10^3, M 10^6, B and G 10^9, T 10^12. One
parser for the command line's counts and the environment's byte counts,
and one reading of a byte count from an environment variable.
"""
from __future__ import annotations

import os

SCALES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """The whole number `text` writes; ValueError when it writes none."""
    cleaned = text.strip().upper()
    scale = SCALES.get(cleaned[-1:], 1)
    if scale != 1:
        cleaned = cleaned[:-1]
    try:
        return int(cleaned) * scale
    except ValueError:
        pass
    try:
        return int(float(cleaned) * scale)
    except (ValueError, OverflowError):
        raise ValueError(f"{text!r} is not a count: write e.g. 7B, 350M, 125000 or 7e9") from None


def env_bytes(name: str, minimum: int = 0, counts: bool = False) -> int | None:
    """The environment variable `name` as a number of bytes of at least
    `minimum`, None when it is unset or empty; a ValueError naming it
    otherwise. counts: written as parse_count reads (500M, 2G), else digits."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = parse_count(text) if counts else int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        form = "digits, or a count such as 500M or 2G" if counts else "digits"
        raise ValueError(f"{name} must be a whole number of bytes >= {minimum} ({form}), "
                         f"not {text!r}")
    return value
