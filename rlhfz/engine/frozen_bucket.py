"""A frozen bucket: the params of one (stage-3 unit, dtype) that nothing
trains, sharded across ranks with nothing else beside them.

A reference or reward model, or a LoRA base, needs its params sharded like
a policy's, but no grads, no master weights and no moments: only this rank's
shard of the params, gathered whole while a unit runs (Bucket.gather and
release, which this shares). Offload moves it like any bucket's params.
"""
from __future__ import annotations

import torch

from .backends import DTYPE_NAMES, HostBackend, torch_view
from .bucket import Bucket
from .layout import ShardLayout, plan_bucket
from .storage import FlatStorage


class FrozenBucket(Bucket):
    def __init__(self, params: list[torch.Tensor], dtype: torch.dtype, rank: int,
                 world_size: int, backend=None, host_alloc=None, shapes=None):
        """shapes: the params' shapes, where they are placeholders already
        (a model built on the meta device); attach() then keeps zeros."""
        # not Bucket.__init__: that allocates grads and optimizer state
        self.params = params
        self.group_index = None
        self.index = 0
        self.dtype = dtype
        self.dtype_name = DTYPE_NAMES[dtype]
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.has_values = shapes is None
        self.layout = plan_bucket(shapes if shapes is not None else
                                  [tuple(p.shape) for p in params], self.itemsize, world_size)
        self.shard = ShardLayout.of(self.layout, rank)
        self.world_size = world_size
        self.backend = backend or HostBackend()
        self.sharded_params = True
        self.param_base = 0
        self.gathered = None
        self.full_grads = False
        self.reduce_dtype = dtype
        self.state = None
        self.trainable = 0
        self.host_param_fence = None
        self.reduced_version = None
        self._hook_handles = []
        self.param_versions = None
        self.gathered_versions = None
        self.storage = FlatStorage({"param": (self.shard.numel, self.dtype_name)},
                                   self.backend.buffer,
                                   host_alloc or (lambda nbytes: HostBackend().buffer(nbytes)))
        self.storage.hand_out(self._build_views())

    def _build_views(self) -> dict[str, object]:
        self.param_kview = self.storage.view("param")
        self.param_shard_kview = self.param_kview
        flat = torch_view(self.param_kview)
        views = {"flat_param": flat, "flat_param_shard": flat}
        self._adopt(views)
        return views

    def _adopt(self, views: dict[str, object]) -> None:
        for name, value in views.items():
            setattr(self, name, value)
        self.param_views = None
        self.grad_views = None
        self.flat_host_master = None

    @property
    def has_master(self) -> bool:
        return False

    def attach(self, grad_hook=None, index: int = 0) -> None:
        """Keeps this rank's part of each param; the param becomes an empty
        placeholder until gather(). Params without values (built on the
        meta device) leave their shards zero until a load fills them."""
        self.index = index
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if self.has_values:
                    self.param_shard_part(i).copy_(
                        self.shard.part_of(i, p.detach().reshape(-1)))
        self.to_placeholders()

    def sync_master(self) -> None:
        return None

    def zero_grads(self, set_to_none: bool) -> None:
        return None
