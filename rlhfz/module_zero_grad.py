"""model.zero_grad() reaching the grads that live in an optimizer's shards.

At stages 2 and 3 across ranks a param's grad lives in the reducer's shard,
and p.grad is None after backward, so torch's Module.zero_grad finds nothing
to clear and the next backward would add to the last step's grads
(transformers' Trainer clears grads this way). So Module.zero_grad is
wrapped, once: after torch's own, the module's params' grads in the shards
start over, as p.grad = None makes them start over in torch.
"""
from __future__ import annotations

import functools
import weakref

import torch

_ENGINES: weakref.WeakSet = weakref.WeakSet()
_TORCH_ZERO_GRAD = None


def watch(engine) -> None:
    """The engine's shard grads follow module.zero_grad() from now on."""
    global _TORCH_ZERO_GRAD
    if _TORCH_ZERO_GRAD is None:
        _TORCH_ZERO_GRAD = torch.nn.Module.zero_grad
        torch.nn.Module.zero_grad = functools.wraps(_TORCH_ZERO_GRAD)(_zero_grad)
    _ENGINES.add(engine)


def unwatch(engine) -> None:
    _ENGINES.discard(engine)


def _zero_grad(self, set_to_none: bool = True) -> None:
    _TORCH_ZERO_GRAD(self, set_to_none)
    engines = list(_ENGINES)
    if engines:
        ids = {id(p) for p in self.parameters()}
        for engine in engines:
            engine.zero_param_grads(ids, set_to_none)
