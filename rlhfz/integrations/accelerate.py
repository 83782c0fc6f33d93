"""accelerate, with rlhfz owning grad reduction.

accelerate wraps a model in DistributedDataParallel whenever more than one
process runs; with a ZeroAdamW at stage >= 1 grads would then be reduced
twice. ZeroAccelerator is an Accelerator that leaves models whose params a
ZeroAdamW owns unwrapped (still placed on the device, still under autocast),
and sends clip_grad_norm_ to the optimizer, which knows where sharded grads
are. Use it in place of Accelerator, or let ZeroTrainerMixin install it.

Under a stage-3 ZeroAdamW across ranks, a model prepared in evaluation mode
(TRL's reference and reward models) is sharded as the policy is, over the
same ranks, units and threshold, as DeepSpeed's ZeRO-3 shards them: each
rank keeps its part, and each forward gathers unit by unit. The optimizer
is the one rlhfz_shard_like() names (ZeroTrainerMixin sets it: its
trainer's), else the one stage-3 ZeroAdamW prepared with this accelerator.
"""
from __future__ import annotations

import functools
import warnings

import torch
from accelerate import Accelerator

from ..generation import unwrap_model
from ..optim import owning_optimizer
from ..sharding import shard_with, sharding_of, sharding_of_model
from ..torch_grad_calls import clip_grad_norm, owners_of


def zero_optimizer(optimizer):
    """The ZeroAdamW under accelerate's (or anyone's) optimizer wrappers, or None."""
    from ..optim import ZeroAdamW
    seen = 0
    while optimizer is not None and not isinstance(optimizer, ZeroAdamW) and seen < 8:
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return optimizer if isinstance(optimizer, ZeroAdamW) else None


def shard_like(model, optimizer) -> bool:
    """Shards a model no optimizer trains over a stage-3 ZeroAdamW's ranks,
    with its units and threshold; False where there is nothing to shard (a
    model sharded already, or one on another device, with a warning)."""
    inner = unwrap_model(model)
    params = list(inner.parameters())
    if optimizer.stage3 is None or not params or sharding_of_model(inner) is not None:
        return False
    try:
        shared = sharding_of(params) is not None
    except ValueError:             # some params of a sharded model, some not
        shared = True
    if shared:
        warnings.warn(f"{type(inner).__name__} stays as it is: it shares params with a model "
                      f"sharded already, which shard that model's way", stacklevel=3)
        return False
    devices = {p.device for p in params}
    if devices != {optimizer.device}:
        warnings.warn(f"{type(inner).__name__} stays whole on every rank: its params are on "
                      f"{sorted(map(str, devices))}, the stage-3 optimizer's on "
                      f"{optimizer.device}, and rlhfz shards a model on one device with it",
                      stacklevel=3)
        return False
    shard_with(inner, optimizer.comm, optimizer.backend, optimizer.wrap,
               optimizer.param_persistence_threshold, params)
    return True


class ZeroAcceleratorMixin:
    # None, or a callable giving the ZeroAdamW whose sharding models prepared
    # in evaluation mode take (None from it: they stay whole)
    rlhfz_shard_like = None

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        opt = owning_optimizer(model)
        if opt is not None and opt.stage >= 1:
            # evaluation_mode is accelerate's switch for "no DDP" (mixed
            # precision still applies). Placement is rlhfz's: params are views
            # of its buffers, already on the optimizer's device, and a .to()
            # that copies (cpu vs cpu:0 counts) would detach them.
            evaluation_mode = True
            device_placement = False
        prepared = super().prepare_model(model, device_placement=device_placement,
                                         evaluation_mode=evaluation_mode)
        if opt is None and evaluation_mode:
            like = self._shard_like()
            if like is not None:
                # placed first: a sharded model refuses to move
                shard_like(self.unwrap_model(prepared), like)
        return prepared

    def _shard_like(self):
        if self.rlhfz_shard_like is not None:
            return self.rlhfz_shard_like()
        stage3 = [z for z in self._zero_optimizers() if z.stage3 is not None]
        return stage3[0] if len(stage3) == 1 else None

    def get_state_dict(self, model, unwrap=True):
        state_dict = super().get_state_dict(model, unwrap=unwrap)
        if owning_optimizer(self.unwrap_model(model)) is None:
            return state_dict
        # The params are views of one flat buffer per bucket, and accelerate
        # (as safetensors) keeps one tensor per storage, taking the others for
        # tied weights: each view gets memory of its own, real ties stay one.
        copies = {}
        for name, tensor in state_dict.items():
            if isinstance(tensor, torch.Tensor):
                key = _view_key(tensor)
                if key not in copies:
                    copies[key] = tensor.detach().clone()
                state_dict[name] = copies[key]
        return state_dict

    def load_state(self, input_dir=None, *args, **kwargs):
        # accelerate reads model.safetensors through safetensors' load_model,
        # which refuses params that share a storage none of them covers whole:
        # every rlhfz param (views of a flat buffer). Those models load through
        # load_state_dict, tied weights (saved once) counted as loaded.
        from accelerate import checkpointing
        original = checkpointing.load_model
        checkpointing.load_model = functools.partial(_load_model, original)
        try:
            return super().load_state(input_dir, *args, **kwargs)
        finally:
            checkpointing.load_model = original

    def _zero_optimizers(self):
        return [z for z in (zero_optimizer(o) for o in getattr(self, "_optimizers", []))
                if z is not None]

    def unscale_gradients(self, optimizer=None):
        zeros = ([zero_optimizer(optimizer)] if optimizer is not None
                 else self._zero_optimizers())
        zeros = [z for z in zeros if z is not None]
        if not zeros or getattr(self, "scaler", None) is None:
            return super().unscale_gradients(optimizer)
        for opt in zeros:
            opt.unscale_(self.scaler)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        zeros = self._zero_optimizers()
        owners, _ = owners_of(parameters, zeros)
        if not owners:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if getattr(self, "scaler", None) is not None:
            for opt, _ in owners:
                self.unscale_gradients(opt)
        return clip_grad_norm(parameters, zeros, max_norm, norm_type)


def _view_key(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def _load_model(original, model, filename, strict=True, device="cpu", **kwargs):
    if owning_optimizer(model) is None:
        return original(model, filename, strict=strict, device=device, **kwargs)
    from safetensors.torch import load_file
    state_dict = load_file(filename, device=device)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    current = model.state_dict()
    loaded = {_view_key(current[name]) for name in state_dict if name in current}
    missing = [name for name in missing if _view_key(current[name]) not in loaded]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading {filename} into {type(model).__name__}: "
                           f"missing keys {missing}, unexpected keys {list(unexpected)}")
    return missing, list(unexpected)


class ZeroAccelerator(ZeroAcceleratorMixin, Accelerator):
    """An accelerate.Accelerator that leaves rlhfz's grad reduction alone."""


@functools.lru_cache(maxsize=None)
def zero_accelerator_class(cls):
    """ZeroAccelerator's behaviour on top of any Accelerator subclass."""
    if issubclass(cls, ZeroAcceleratorMixin):
        return cls
    if cls is Accelerator:
        return ZeroAccelerator
    return type(f"Zero{cls.__name__}", (ZeroAcceleratorMixin, cls), {})
