"""The stored forms of AdamW's moments, and fp32 values to and from them.

``state_dtype`` says how a bucket keeps exp_avg and exp_avg_sq: "fp32", or
"bf16", or "int8" (codes in blocks of QBLOCK elements, one fp32 scale per
block and moment, with the maps kernels/rlhfz_kernels.h states). The step
kernels decode, update and encode in one pass; this module does the same
conversions in torch, for what happens outside a step: reading the state
out in torch.optim.AdamW's fp32 form, and writing one in. Decoding repeats
the kernels' fp32 operations, so what it reads is exactly what the next
step will see; encoding rounds to nearest, as the kernels do by default.
"""
from __future__ import annotations

import torch

from .. import _C

STATE_DTYPES = ("fp32", "bf16", "int8")
QBLOCK = _C.QBLOCK
# Stochastic rounding keeps exp_avg_sq's small updates (1 - beta2 of it)
# from being rounded away step after step (bf16's 8 bits of mantissa, int8's
# codes); exp_avg, whose steps are wide, rounds to nearest under either.
ROUNDING = {"bf16": "stochastic", "int8": "stochastic"}
# The dtype each moment is stored in, by state_dtype.
STORED = {
    "fp32": {"exp_avg": torch.float32, "exp_avg_sq": torch.float32},
    "bf16": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
    "int8": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
}
_TOP = {"exp_avg": 127.0, "exp_avg_sq": 255.0}
# What a checkpoint's stored form means beyond its dtype: the int8 codes'
# maps, recorded beside them so that codes are never read through other ones.
STORED_MAPS = {"int8": "exp_avg q/127, exp_avg_sq (q^2/255^2)^2"}
# int8 moments: the region of each one's block scales
SCALES = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}


def layout_block(state_dtype: str) -> int:
    """Elements a bucket aligns its params and shards to: int8 blocks never
    straddle a param, a shard or the offload split."""
    return QBLOCK if state_dtype == "int8" else 1


def state_regions(state_dtype: str, has_master: bool) -> tuple[str, ...]:
    """The regions of a shard's optimizer state, in a fixed order."""
    names = (("master",) if has_master else ()) + ("exp_avg", "exp_avg_sq")
    return names + (tuple(SCALES.values()) if state_dtype == "int8" else ())


def region_dtype(name: str, state_dtype: str) -> torch.dtype:
    """The dtype a state region is stored in."""
    return STORED[state_dtype].get(name, torch.float32)


def region_numel(name: str, numel: int) -> int:
    """Entries of a state region over `numel` shard elements (one per block
    for scales, the last block perhaps short)."""
    return -(-numel // QBLOCK) if name in SCALES.values() else numel


def region_unit(name: str) -> int:
    """Shard elements per entry of a state region."""
    return QBLOCK if name in SCALES.values() else 1


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _per_element(blockwise: torch.Tensor, n: int) -> torch.Tensor:
    return blockwise.repeat_interleave(QBLOCK)[:n]


def decode(name: str, state_dtype: str, stored: torch.Tensor,
           scales: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values of one moment's stored form (flat, starting on a block)."""
    if state_dtype != "int8":
        return stored.float()
    q = stored.to(torch.int32)
    n = q.numel()
    if name == "exp_avg":
        fraction = q.float() * _f32(1.0 / 127.0)
        return fraction * _per_element(scales.float(), n)
    root = (q * q).float() * _f32(1.0 / (255.0 * 255.0)) * _per_element(scales.float(), n)
    return root * root


def encode(name: str, state_dtype: str, values: torch.Tensor, stored: torch.Tensor,
           scales: torch.Tensor | None = None) -> None:
    """Writes fp32 values (flat, starting on a block) into a moment's stored
    form, rounding to nearest."""
    values = values.detach().reshape(-1).float().to(stored.device)
    if state_dtype != "int8":
        stored.copy_(values)
        return
    n = values.numel()
    blocks = -(-n // QBLOCK)
    padded = torch.zeros(blocks * QBLOCK, dtype=torch.float32, device=values.device)
    padded[:n] = values
    rows = padded.view(blocks, QBLOCK)
    finite = rows.isfinite().all(dim=1)
    # exp_avg's scale is its block's largest |value|, exp_avg_sq's its largest root
    magnitude = rows.abs() if name == "exp_avg" else rows.sqrt()
    largest = torch.where(finite, magnitude.amax(dim=1), torch.zeros(()))
    scale = torch.where(finite, largest, torch.full((), float("nan")))
    positive = finite & (largest > 0)
    safe = torch.where(positive, largest, torch.ones(()))
    encoder = torch.where(positive, 1.0 / safe, torch.zeros(()))
    if name == "exp_avg":     # linear: one product by the block's factor
        x = magnitude * (encoder * _f32(_TOP[name]))[:, None]
    else:                     # the square-root axis of the root
        x = (magnitude * encoder[:, None]).sqrt() * _f32(_TOP[name])
    codes = torch.minimum(torch.round(x), _f32(_TOP[name]))
    if name == "exp_avg_sq":  # a value above zero never reads as zero (lowp_state.h)
        codes = torch.where(magnitude > 0, codes.clamp(min=1.0), codes)
    codes = torch.where(finite[:, None], codes, torch.zeros(()))
    if name == "exp_avg":
        codes = torch.where(rows.signbit(), -codes, codes)
    stored.copy_(codes.reshape(-1)[:n].to(stored.dtype))
    scales.copy_(scale)
