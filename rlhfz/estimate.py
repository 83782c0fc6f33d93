"""Expected bytes per rank for a model under each ZeRO stage and offload choice.

The same accounting as ZeroAdamW.memory_report(): params and grads in the
param dtype, fp32 master weights only for 16-bit params, two moments in the
state dtype: fp32 (4 bytes each), bf16 (2) or int8 (1, plus a 4-byte scale
per block of 256, counted with its moment; params under min_8bit_size
elements keep fp32 moments, left out here).
Stage 2 and 3 grads across ranks are the shard plus the reducer's staging:
two slots, each the largest bucket or the bucket cap, whichever is smaller
(one param group assumed; a param above the cap goes through the slots in
pieces). At stage 2 buckets are cut at the cap; at stage 3 a bucket is a
whole unit (a transformer block, say), so a slot is the largest unit's
bytes when that is below the cap: given largest_unit (its params) the
figure follows it, else the model stands in for the largest unit and the
grads figure is an upper bound. offload="cpu" keeps the host part's
master and moments on the host, with a host copy of its grads and params
(in the param dtype) that the CPU step reads and writes; fp32 params keep a
master for the host part only. Padding (at most one alignment unit per
bucket) is left out.
"""
from __future__ import annotations

from .engine.layout import MIN_BUCKET_BYTES, env_bucket_bytes, stage2_bucket_bytes
from .engine.moments import QBLOCK

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# bytes of one moment per element, by state_dtype
_MOMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / QBLOCK}


def estimate_bytes(params: int, world_size: int = 1, stage: int = 2,
                   param_dtype: str = "bfloat16", offload: str | None = None,
                   offload_ratio: float = 1.0, bucket_bytes: int | None = None,
                   state_dtype: str = "fp32",
                   largest_unit: int | None = None) -> dict[str, dict[str, int]]:
    """{kind: {tier: bytes}} on one rank; tiers 'device' and 'host'.
    largest_unit: the params of the largest stage-3 unit, where known;
    bucket_bytes None: RLHFZ_BUCKET_BYTES where set, as ZeroAdamW reads it."""
    if params < 0 or world_size < 1 or stage not in (0, 1, 2, 3):
        raise ValueError("params >= 0, world_size >= 1 and stage in 0..3 are required")
    if param_dtype not in _ITEMSIZE:
        raise ValueError(f"param_dtype must be one of {sorted(_ITEMSIZE)}")
    if state_dtype not in _MOMENT_BYTES:
        raise ValueError(f"state_dtype must be one of {sorted(_MOMENT_BYTES)}")
    if not 0.0 <= offload_ratio <= 1.0:
        raise ValueError("offload_ratio must be in [0, 1]")
    if bucket_bytes is not None and bucket_bytes < MIN_BUCKET_BYTES:
        raise ValueError(f"bucket_bytes must be at least {MIN_BUCKET_BYTES}")
    if bucket_bytes is None:
        bucket_bytes = env_bucket_bytes()       # as ZeroAdamW reads it
    if largest_unit is not None and not 1 <= largest_unit <= max(params, 1):
        raise ValueError(f"largest_unit ({largest_unit:,} params) must be between 1 and the "
                         f"model's {params:,}")
    itemsize = _ITEMSIZE[param_dtype]
    per_rank = -(-params // world_size)
    shard = params if stage == 0 else per_rank
    on_host = int(round(shard * offload_ratio)) if offload == "cpu" else 0
    grads = params * itemsize if stage < 2 else per_rank * itemsize
    if stage >= 2 and world_size > 1:
        # the largest bucket: at most the model; at stage 3 a whole unit
        largest = (largest_unit if stage == 3 and largest_unit is not None else params)
        bucket = min(stage2_bucket_bytes(params * itemsize, bucket_bytes), largest * itemsize)
        grads += 2 * bucket
    moment = _MOMENT_BYTES[state_dtype]
    report = {
        "params": {"device": params * itemsize if stage < 3 else per_rank * itemsize,
                   "host": on_host * itemsize},
        "grads": {"device": grads, "host": on_host * itemsize},
        "master": ({"device": 0, "host": on_host * 4} if itemsize == 4 else
                   {"device": (shard - on_host) * 4, "host": on_host * 4}),
        "exp_avg": {"device": round((shard - on_host) * moment), "host": round(on_host * moment)},
        "exp_avg_sq": {"device": round((shard - on_host) * moment),
                       "host": round(on_host * moment)},
    }
    return report


def format_estimate(report: dict[str, dict[str, int]], args) -> str:
    gib = 1024 ** 3
    lines = [f"per-rank bytes for {args.params:,} {args.dtype} params, {args.state_dtype} "
             f"moments, world size "
             f"{args.world_size}, stage {args.stage}, offload {args.offload or 'none'}"
             + (f" (ratio {1.0 if args.offload_ratio is None else args.offload_ratio})"
                if args.offload else "")]
    totals = {"device": 0, "host": 0}
    for kind, tiers in report.items():
        lines.append(f"  {kind:<11} device {tiers['device'] / gib:9.3f} GiB   "
                     f"host {tiers['host'] / gib:9.3f} GiB")
        for tier in totals:
            totals[tier] += tiers[tier]
    lines.append(f"  {'total':<11} device {totals['device'] / gib:9.3f} GiB   "
                 f"host {totals['host'] / gib:9.3f} GiB")
    if args.stage == 3 and args.world_size > 1 and args.largest_unit is None:
        lines.append("  grads is an upper bound: it counts two staging slots of the bucket "
                     "cap (at most the model), and stage 3 makes each slot only as large as "
                     "its largest unit (a block, the embedding) where that is smaller; "
                     "--largest-unit counts that")
    return "\n".join(lines)
