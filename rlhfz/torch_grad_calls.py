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
  several optimizers' together, or beside other grads, it takes each
  one's norm where its grads are and scales all of them by torch's rule;
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
import types
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


def clip_grad_norm(parameters: list, optimizers, max_norm, norm_type=2.0,
                   error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_ over `parameters`, where some belong
    to ZeroAdamW among `optimizers` and their grads live there: the norm of
    all of them and of the other params' grads, each scaled as torch
    scales. None when no optimizer owns any of them (torch's own then)."""
    owners, rest = owners_of(parameters, optimizers)
    if not owners:
        return None
    # The way is chosen alike on every rank (the norms are collectives): by
    # which params take grads, not by which have one here.
    trained = [p for p in rest if p.requires_grad]
    others = [p for p in trained if p.grad is not None]
    if len(owners) == 1 and not trained:
        opt, mine = owners[0]
        owned = {id(p) for group in opt.param_groups for p in group["params"]}
        part = None if owned <= {id(p) for p in mine} else mine
        return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach, params=part)
    # several: torch's rule over the union, each norm taken where its grads are
    norm_type = float(norm_type)
    norms = [opt.get_total_norm(norm_type, params=mine) for opt, mine in owners]
    if others:      # this rank's alone, as torch's clip on each rank takes them
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in others], norm_type,
                                                   False, foreach))
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable "
                           "this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    for opt, mine in owners:
        opt.clip_grads_with_norm_(max_norm, total, params=mine)
    if others:
        _TORCH.get("scale", torch_clip_grad._clip_grads_with_norm_)(others, max_norm, total,
                                                                     foreach)
    return total


def owners_of(parameters: list, optimizers) -> tuple[list, list]:
    """([(optimizer, its params among `parameters`)], the rest), the
    optimizers in the order their params first come there: every rank
    calls their collectives alike."""
    owner_of = {}
    for opt in optimizers:
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


def _sharded_owners(parameters: list) -> tuple[list, list]:
    return owners_of(parameters, list(_SHARDED))


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _as_given(parameters, listed: list):
    """listed, as torch's own should see what the caller gave: a generator
    is read once here, and torch warns of an empty one."""
    return (p for p in listed) if isinstance(parameters, types.GeneratorType) else listed


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                     foreach=None):
    listed = _as_list(parameters)
    total = clip_grad_norm(listed, list(_SHARDED), max_norm, norm_type, error_if_nonfinite,
                           foreach)
    if total is None:
        return _TORCH["clip_grad_norm_"](_as_given(parameters, listed), max_norm, norm_type,
                                         error_if_nonfinite, foreach)
    return total


def _clip_grad_value_(parameters, clip_value, foreach=None):
    listed = _as_list(parameters)
    owners, rest = _sharded_owners(listed)
    if not owners:
        _TORCH["clip_grad_value_"](_as_given(parameters, listed), clip_value, foreach)
        return
    for opt, params in owners:
        opt.clip_grad_value_(clip_value, foreach, params=params)   # elementwise: any of them
    # torch's own refuses a list without grads, where the same model whole
    # (its grads on the params) is clipped
    others = [p for p in rest if p.grad is not None]
    if others:
        _TORCH["clip_grad_value_"](others, clip_value, foreach)


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
