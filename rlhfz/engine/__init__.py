"""rlhfz's engine: flat storage, shard layout, shard state and the step.

    layout.py       where each param sits in a bucket, which elements each rank owns
    storage.py      a bucket's Buffers by region, and the registry of tensors over them
    state.py        a shard's master weights, moments and step counts
    bucket.py       the three put together, with the params attached
    frozen_bucket.py  params alone (nothing trains them), sharded: reference models, LoRA bases
    engine.py       every bucket of an optimizer, and the step
    backends.py     the kernels and memory of a device (CPU, CUDA, simulated CUDA)
    host_memory.py  pinned host memory under a budget
    user_warnings.py  warnings attributed to the user's line

Nothing here imports torch.optim or another rlhfz module above it.
"""
from .backends import (DTYPE_NAMES, CudaBackend, HostBackend, SimulatedCudaBackend, backend_for,
                       torch_view)
from .bucket import Bucket, check_grad_dtype
from .engine import INT8_SQ_LIMIT, BucketPlan, ShardEngine, after_outer_node
from .frozen_bucket import FrozenBucket
from .host_memory import PinnedPool, host_buffer, pin_budget, pinned_memory, release_pinned
from .layout import (ALIGN_BYTES, MIN_BUCKET_BYTES, BucketLayout, ShardLayout, Slot,
                     most_per_rank, plan_bucket, rank_range, shard_owner, shard_size,
                     split_by_bytes, stage2_bucket_bytes)
from .moments import (QBLOCK, STATE_DTYPES, STORED_MAPS, layout_block, region_dtype,
                      region_numel, region_unit, state_regions)
from .state import STATE_NAMES, ShardState
from .storage import REGIONS, FlatStorage
from .user_warnings import warn_user

__all__ = ["ALIGN_BYTES", "INT8_SQ_LIMIT", "Bucket", "BucketLayout", "BucketPlan", "CudaBackend", "DTYPE_NAMES",
           "FlatStorage", "FrozenBucket", "HostBackend", "MIN_BUCKET_BYTES", "PinnedPool", "QBLOCK",
           "REGIONS", "STATE_DTYPES", "STATE_NAMES", "STORED_MAPS", "ShardEngine", "ShardLayout",
           "ShardState",
           "SimulatedCudaBackend", "Slot", "after_outer_node", "backend_for", "check_grad_dtype", "host_buffer", "warn_user",
           "layout_block",
           "most_per_rank", "pin_budget", "pinned_memory", "plan_bucket", "rank_range", "region_dtype",
           "region_numel", "region_unit", "release_pinned", "shard_owner", "state_regions",
           "shard_size", "split_by_bytes", "stage2_bucket_bytes", "torch_view"]
