"""torch's calls that read param.grad (the clips, GradScaler.unscale_)
reaching the grads that live in an optimizer's shards.

At stages 2 and 3 across ranks p.grad is None after backward, so torch's
clips find no grads: clip_grad_norm_ would return 0 and clip nothing, and
the step would take unclipped grads; the scaler's unscale_ would unscale
nothing, and a clip after it would measure scaled grads. So these are
wrapped, once, when the first such optimizer is built (as Module.zero_grad
is, module_zero_grad.py):
- clip_grad_norm_ over one such optimizer's params (all or some of them)
  clips its shards, as its own clip_grad_norm_(params=...) does; over
  several optimizers' together, or beside other grads, it is refused with
  what to do instead;
- clip_grad_value_ clamps any of such an optimizer's params in its shards;
- GradScaler.unscale_ given such an optimizer calls its unscale_(scaler).
Everything else goes to torch's own. The clips are redirected inside
torch's own function objects, so code that bound them before (`from
torch.nn.utils import clip_grad_norm_`) reaches these too; where torch's
are not built so, only the names are rebound, and torch's clip_grad_norm_
bound before is refused over such params (as clip_grads_with_norm_ always
is, given a norm taken without them). A bound scaler.unscale_ taken before
keeps torch's: the step then refuses the clip after it
(ZeroAdamW._scaler_unscale).
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.utils.clip_grad as torch_clip_grad

_SHARDED: weakref.WeakSet = weakref.WeakSet()   # optimizers whose grads live in shards
_TORCH: dict = {}                                # name -> torch's own function


def watch(optimizer) -> None:
    """torch's clips and scaler unscales of the optimizer's params reach
    its shards from now on."""
    if not _TORCH:
        _wrap_torch()
    _SHARDED.add(optimizer)


def unwatch(optimizer) -> None:
    _SHARDED.discard(optimizer)


def _wrap_torch() -> None:
    for name, wrapper in (("clip_grad_norm_", _clip_grad_norm_),
                          ("clip_grad_value_", _clip_grad_value_)):
        function = getattr(torch_clip_grad, name)
        inner = _redirect(function, wrapper)
        if inner is not None:
            _TORCH[name] = inner
            continue
        _TORCH[name] = function
        wrapped = functools.wraps(function)(wrapper)
        # both names: torch.nn.utils re-exports them, and the deprecated
        # clip_grad_norm looks clip_grad_norm_ up in its own module
        setattr(torch_clip_grad, name, wrapped)
        setattr(torch.nn.utils, name, wrapped)
    # torch's clip_grad_norm_ where it could not be redirected and was bound
    # before, and clip_grads_with_norm_, scale through this one
    scale = getattr(torch_clip_grad, "_clip_grads_with_norm_", None)
    if scale is not None:
        _TORCH["scale"] = scale
        guard = functools.wraps(scale)(_refuse_unreached)
        torch_clip_grad._clip_grads_with_norm_ = guard
        if getattr(torch.nn.utils, "clip_grads_with_norm_", None) is scale:
            torch.nn.utils.clip_grads_with_norm_ = guard      # its public name
    _TORCH["unscale_"] = torch.amp.GradScaler.unscale_
    torch.amp.GradScaler.unscale_ = functools.wraps(_TORCH["unscale_"])(_unscale_)


def _redirect(function, wrapper):
    """torch's function itself pointed at wrapper, so that references bound
    before (`from torch.nn.utils import clip_grad_value_` at a script's top)
    reach it too: torch builds each clip as a no_grad shell that calls its
    body from a closure cell, and the cell now holds wrapper. Returns the
    body (torch's own, for what is not ours), or None where the function is
    not built that way and only the names can be rebound."""
    cells = getattr(function, "__closure__", None) or ()
    names = getattr(getattr(function, "__code__", None), "co_freevars", ())
    if names != ("func",) or len(cells) != 1:
        return None
    body = cells[0].cell_contents
    if body is not getattr(function, "__wrapped__", None) or not callable(body):
        return None
    cells[0].cell_contents = functools.wraps(body)(wrapper)
    return body


def one_owner(parameters: list, optimizers, call: str):
    """(the one optimizer among `optimizers` whose params are among
    `parameters`, and those params where they are part of its own only, else
    None), or (None, None) when none is. ValueError when the clip would need
    several optimizers' params together, or grads of params outside them
    beside them: one optimizer's shards give one norm at a time."""
    ids = {id(p) for p in parameters}
    owners = []
    for opt in optimizers:
        owned = {id(p) for group in opt.param_groups for p in group["params"]}
        if owned & ids:
            owners.append((opt, owned))
    if not owners:
        return None, None
    owned = set().union(*(o for _, o in owners))
    others = [p for p in parameters if id(p) not in owned and p.grad is not None]
    if len(owners) > 1 or others:
        what = ("several optimizers' together" if len(owners) > 1 else
                "a ZeroAdamW's params and other params' grads together")
        raise ValueError(
            f"{call} over these parameters would need the norm of {what}, but a ZeroAdamW "
            f"takes the norm of its own params only (its grads are sharded). Clip each "
            f"optimizer's params with its own call (or its clip_grad_norm_), and other grads "
            f"apart")
    opt, mine = owners[0]
    part = None if mine <= ids else [p for p in parameters if id(p) in mine]
    return opt, part


def _sharded_owners(parameters: list) -> tuple[list, list]:
    """([(watched optimizer, its params among `parameters`)], the rest), the
    optimizers in the order their params first come there: every rank
    calls their collectives alike."""
    owner_of = {}
    for opt in list(_SHARDED):
        for group in opt.param_groups:
            owner_of.update((id(p), opt) for p in group["params"])
    owned, rest = {}, []
    for p in parameters:
        opt = owner_of.get(id(p))
        if opt is None:
            rest.append(p)
        else:
            owned.setdefault(opt, []).append(p)
    return list(owned.items()), rest


def _as_list(parameters) -> list:
    # a generator is read once: torch's own gets the list
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                     foreach=None):
    parameters = _as_list(parameters)
    owners, _ = _sharded_owners(parameters)
    if not owners:
        return _TORCH["clip_grad_norm_"](parameters, max_norm, norm_type,
                                         error_if_nonfinite, foreach)
    opt, part = one_owner(parameters, [opt for opt, _ in owners],
                          "torch.nn.utils.clip_grad_norm_")
    return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach, params=part)


def _clip_grad_value_(parameters, clip_value, foreach=None):
    parameters = _as_list(parameters)
    owners, rest = _sharded_owners(parameters)
    for opt, params in owners:
        opt.clip_grad_value_(clip_value, foreach, params=params)   # elementwise: any of them
    if rest or not owners:
        _TORCH["clip_grad_value_"](rest, clip_value, foreach)


def _refuse_unreached(parameters, max_norm, total_norm, foreach=None):
    parameters = _as_list(parameters)
    if _sharded_owners(parameters)[0]:
        raise ValueError(
            "torch's own clip_grad_norm_ (its body, or the function where rlhfz could not "
            "redirect it and code bound it before a ZeroAdamW at stage 2 or 3 was built), or "
            "clip_grads_with_norm_, got "
            "params whose grads that optimizer keeps in its shards: p.grad is None there, so "
            "torch's norm leaves them out and they would not be clipped. Nothing was clipped. "
            "Call the optimizer's clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_ "
            "looked up where it is called")
    return _TORCH["scale"](parameters, max_norm, total_norm, foreach)


def _unscale_(self, optimizer):
    if optimizer in _SHARDED:
        return optimizer.unscale_(self)
    return _TORCH["unscale_"](self, optimizer)
