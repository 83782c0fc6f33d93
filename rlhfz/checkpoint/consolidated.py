"""Consolidated interchange: whole state dicts in torch's own formats.

save_consolidated writes model.pt (torch.save of the model's whole
state_dict) and optimizer.pt (torch.optim.AdamW's state_dict format), which
plain torch reads; load_consolidated reads them back into a model sharded
at any stage. Both are read with torch.load(weights_only=True): nothing
from a checkpoint is ever executed.
"""
from __future__ import annotations

import os
import secrets

import torch

from ..generation import iter_full_params, refuse_while_gathered, stage3_of, unwrap_model
from ..sharding import mark_filled, sharding_of_model
from .format import create_private
from .validation import CheckpointError, all_ok

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"


def _atomic_torch_save(obj, file: str) -> None:
    """torch.save into a new private file, renamed over `file` once durable:
    a reader sees the old file or the new one, whole."""
    staged = f"{file}.tmp-{secrets.token_hex(8)}"
    f = create_private(staged)      # before the try: a name already taken is not ours to remove
    try:
        with f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, file)
    except BaseException:
        if os.path.exists(staged):
            os.unlink(staged)
        raise


def full_model_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's whole state_dict on the CPU (under stage 3 a collective:
    params are gathered a few units at a time)."""
    inner = unwrap_model(model)
    keep = inner.state_dict(keep_vars=True)
    if stage3_of(model) is None:
        return {name: t.detach().cpu().clone() for name, t in keep.items()}
    by_id = {}
    params = dict(inner.named_parameters())
    for name, t in iter_full_params(model):
        if name in params:
            by_id[id(params[name])] = t.cpu().clone()
    return {name: by_id.get(id(t), t.detach().cpu().clone()) for name, t in keep.items()}


def save_consolidated(path, model, optimizer=None) -> None:
    """Writes `path`/model.pt (torch.save of the whole model state_dict) and,
    with an optimizer, `path`/optimizer.pt (torch.optim.AdamW's format),
    from the first rank; a collective across ranks. Each file is replaced
    atomically. Plain torch reads both: model.load_state_dict(torch.load(...))."""
    path = os.fspath(path)
    comm = getattr(optimizer, "comm", None)
    model_state = full_model_state_dict(model)
    optimizer_state = optimizer.state_dict() if optimizer is not None else None
    error = None
    if comm is None or comm.leads:
        try:
            os.makedirs(path, exist_ok=True)
            _atomic_torch_save(model_state, os.path.join(path, MODEL_FILE))
            if optimizer_state is not None:
                _atomic_torch_save(optimizer_state, os.path.join(path, OPTIMIZER_FILE))
        except Exception as caught:
            error = caught
    if comm is not None:
        all_ok(optimizer, error, "save_consolidated", "write the consolidated files")
    elif error is not None:
        raise error


def _torch_load(file: str):
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    except Exception as error:     # unpickling refused, truncated zip, ...
        raise CheckpointError(f"{file}: cannot be read as a tensor-only torch.save "
                              f"({type(error).__name__}: {error})") from None


def load_consolidated(path, model, optimizer=None) -> None:
    """Loads `path`/model.pt into the model (any stage: each rank keeps its
    part) and, if present and an optimizer is given, `path`/optimizer.pt.
    Read with weights_only=True and memory-mapped; checked before anything
    is written."""
    path = os.fspath(path)
    state = _torch_load(os.path.join(path, MODEL_FILE))
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise CheckpointError(f"{path}/{MODEL_FILE} is not a state_dict of tensors")
    inner = unwrap_model(model)
    keep = inner.state_dict(keep_vars=True)
    shapes = _param_shapes(optimizer, model)
    missing = sorted(set(keep) - set(state))
    unexpected = sorted(set(state) - set(keep))
    if missing or unexpected:
        raise CheckpointError(f"{path}/{MODEL_FILE} is from another model: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in keep.items():
        shape = shapes.get(id(t), tuple(t.shape))
        if tuple(state[name].shape) != shape or not state[name].is_floating_point() \
                and t.is_floating_point():
            raise CheckpointError(f"{path}/{MODEL_FILE}: {name!r} is {state[name].dtype}"
                                  f"{tuple(state[name].shape)}, the model's is {t.dtype}{shape}")
    optimizer_state = None
    if optimizer is not None and os.path.exists(os.path.join(path, OPTIMIZER_FILE)):
        optimizer_state = _torch_load(os.path.join(path, OPTIMIZER_FILE))
        try:
            optimizer.check_state_dict(optimizer_state)
        except ValueError as error:
            raise CheckpointError(f"{path}/{OPTIMIZER_FILE}: {error}") from None
    refuse_while_gathered(optimizer, "load")
    comm = getattr(optimizer, "comm", None)
    if comm is not None:
        comm.agree("load_consolidated", {"optimizer": optimizer_state is not None})
    with torch.no_grad():
        owners = _param_owners(optimizer, model)
        for name, t in keep.items():
            owner = owners.get(id(t))
            if owner is None:
                t.detach().copy_(state[name])
            else:
                owner[0].write_param(owner[1], state[name])
        for bucket in _buckets(optimizer, model):
            bucket.sync_master()
    mark_filled(inner, list(inner.parameters()))
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)


def _buckets(optimizer, model=None) -> list:
    """A ZeroAdamW's buckets (none for None or one of torch's optimizers),
    and the frozen ones of a sharded model."""
    from ..optim import ZeroAdamW
    record = sharding_of_model(model) if model is not None else None
    return ((optimizer.engine.buckets if isinstance(optimizer, ZeroAdamW) else [])
            + (record.engine.buckets if record is not None else []))


def _param_shapes(optimizer, model) -> dict[int, tuple]:
    return {id(p): tuple(slot.shape) for bucket in _buckets(optimizer, model)
            for p, slot in zip(bucket.params, bucket.layout.slots)}


def _param_owners(optimizer, model) -> dict[int, tuple]:
    return {id(p): (bucket, i) for bucket in _buckets(optimizer, model)
            for i, p in enumerate(bucket.params)}
