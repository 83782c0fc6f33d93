"""torch.amp.GradScaler.unscale_ reaching the grads that live in an
optimizer's shards.

At stages 2 and 3 across ranks p.grad is None after backward, so the
scaler's unscale_ finds no grads, and torch's recipe (scaler.unscale_(opt),
then clip_grad_norm_) would clip grads still multiplied by the scale. So
GradScaler.unscale_ is wrapped, once (as the clips are, torch_clip_grad.py):
given such an optimizer it calls the optimizer's unscale_(scaler), which
unscales the shards and records what the scaler's own would. Any other
optimizer goes to torch's own. A bound method taken before the wrap keeps
torch's: the step then refuses the clip after it (ZeroAdamW._scaler_unscale).
"""
from __future__ import annotations

import functools
import weakref

import torch

_SHARDED: weakref.WeakSet = weakref.WeakSet()   # optimizers whose grads live in shards
_TORCH: dict = {}


def watch(optimizer) -> None:
    """scaler.unscale_(optimizer) reaches its shards from now on."""
    if not _TORCH:
        original = torch.amp.GradScaler.unscale_
        _TORCH["unscale_"] = original
        torch.amp.GradScaler.unscale_ = functools.wraps(original)(_unscale_)
    _SHARDED.add(optimizer)


def unwatch(optimizer) -> None:
    _SHARDED.discard(optimizer)


def _unscale_(self, optimizer):
    if optimizer in _SHARDED:
        return optimizer.unscale_(self)
    return _TORCH["unscale_"](self, optimizer)
