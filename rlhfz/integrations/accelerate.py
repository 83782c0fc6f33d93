"""accelerate, with rlhfz owning grad reduction.

accelerate wraps a model in DistributedDataParallel whenever more than one
process runs; with a ZeroAdamW at stage >= 1 grads would then be reduced
twice. ZeroAccelerator is an Accelerator that leaves models whose params a
ZeroAdamW owns unwrapped (still placed on the device, still under autocast),
and sends clip_grad_norm_ to the optimizer, which knows where sharded grads
are. Use it in place of Accelerator, or let ZeroTrainerMixin install it.
"""
from __future__ import annotations

import functools

from accelerate import Accelerator


def zero_optimizer(optimizer):
    """The ZeroAdamW under accelerate's (or anyone's) optimizer wrappers, or None."""
    from ..optim import ZeroAdamW
    seen = 0
    while optimizer is not None and not isinstance(optimizer, ZeroAdamW) and seen < 8:
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return optimizer if isinstance(optimizer, ZeroAdamW) else None


def owning_optimizer(model):
    """The live ZeroAdamW that owns the model's params, or None."""
    from ..optim import live_optimizers
    ids = {id(p) for p in model.parameters()}
    for opt in live_optimizers():
        if any(id(p) in ids for group in opt.param_groups for p in group["params"]):
            return opt
    return None


class ZeroAcceleratorMixin:
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        opt = owning_optimizer(model)
        if opt is not None and opt.stage >= 1:
            # evaluation_mode is accelerate's switch for "no DDP" (mixed
            # precision still applies). Placement is rlhfz's: params are views
            # of its buffers, already on the optimizer's device, and a .to()
            # that copies (cpu vs cpu:0 counts) would detach them.
            evaluation_mode = True
            device_placement = False
        return super().prepare_model(model, device_placement=device_placement,
                                     evaluation_mode=evaluation_mode)

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
        parameters = list(parameters)
        ids = {id(p) for p in parameters}
        for opt in self._zero_optimizers():
            if any(id(p) in ids for group in opt.param_groups for p in group["params"]):
                if getattr(self, "scaler", None) is not None:
                    self.unscale_gradients(opt)
                return opt.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)


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
