"""Sharding a model apart from any optimizer, as FSDP2's fully_shard does.

shard_model(model) puts every param of the module, frozen ones included, in
the stage-3 layout: each unit's params in flat buckets of which every rank
keeps its shard, gathered whole only while the unit runs (stage3.py). A
reference or reward model needs nothing more; a LoRA base needs its frozen
weights sharded beside trainable adapters.

A ZeroAdamW built at stage=3 on params of a sharded model (in any number of
param groups) takes the params it trains out of the frozen buckets: they get
buckets with grads and optimizer state, in the same units, under the same
hooks. ZeroAdamW(model, stage=3) shards the model this way first.

The ShardedModel is the model's record of all that (its attribute
_rlhfz_sharding); every param it holds maps back to it.
"""
from __future__ import annotations

import copy
import itertools
import os
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .comm import communicator_for
from .engine import DTYPE_NAMES, FrozenBucket, ShardEngine, backend_for
from .generation import mark_parts, synced_generation, unwrap_model
from .stage3 import COPY_REFUSED, Stage3, assign_params
from .state_dict_hooks import install_hooks

ATTRIBUTE = "_rlhfz_sharding"
STATE_DICT_TIMEOUT_S = 60.0
_STAGE3 = "_rlhfz_stage3"
_OWNERS = WeakIdKeyDictionary()           # param -> its ShardedModel
_GUARD: list = []                         # the step pre-hook on torch's optimizers, once
_JOINED = [0]                             # bumped as params join a sharded model
_CLEAR = weakref.WeakKeyDictionary()      # optimizer -> (_JOINED, its params' ids) found clear


def _own(p, record) -> None:
    _OWNERS[p] = record
    _JOINED[0] += 1


def _refuse_placeholders(optimizer, args, kwargs):
    """Before any optimizer's step but rlhfz's own: one over params of a
    model sharded across ranks would step empty placeholders with grads
    no rank reduced (torch's error would name only a size). An optimizer
    found clear is looked at again only when its params, or the sharded
    params, change: the step pays for its params' ids, not their owners."""
    if not len(_OWNERS) or _wraps_rlhfz(optimizer):
        return
    params = list(itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))
    seen = (_JOINED[0], tuple(map(id, params)))
    if _CLEAR.get(optimizer) == seen:
        return
    for p in params:
        record = _OWNERS.get(p)
        if record is not None and record.stage3 is not None:
            raise RuntimeError(
                f"{type(optimizer).__name__} was given params of a model sharded at "
                f"stage 3 across ranks (by ZeroAdamW(stage=3) or shard_model): between "
                f"uses they are empty placeholders, their values live in rlhfz's shards, "
                f"and no rank reduces their grads for another optimizer. Train them with "
                f"the ZeroAdamW that holds them (change its param_groups in place for "
                f"new hyperparameters); a model sharded with shard_model takes "
                f"ZeroAdamW(model, stage=3)")
    _CLEAR[optimizer] = seen


def _wraps_rlhfz(optimizer) -> bool:
    """Whether it is rlhfz's optimizer, or a wrapper around one (accelerate's
    AcceleratedOptimizer keeps it as .optimizer and shares its groups)."""
    for _ in range(8):
        if optimizer is None:
            return False
        if type(optimizer).__module__.split(".")[0] == "rlhfz":
            return True
        optimizer = getattr(optimizer, "optimizer", None)
    return False


def _guard_torch_optimizers() -> None:
    if not _GUARD:
        _GUARD.append(register_optimizer_step_pre_hook(_refuse_placeholders))


class ShardedModel:
    """A sharded model's units, its frozen buckets, and which params an
    optimizer trains."""

    def __init__(self, model: torch.nn.Module, comm, backend, wrap, threshold: int):
        self.model = model
        self.comm = comm
        self.backend = backend
        self.wrap = wrap
        self.threshold = threshold
        self.rank = comm.rank if comm is not None else 0
        self.world_size = comm.world_size if comm is not None else 1
        # the frozen buckets (no grads, no state): offload moves them like an optimizer's
        self.engine = ShardEngine(backend, comm, stage=3)
        self.stage3 = Stage3(comm, [], root=model) if comm is not None else None
        self.trained: set[int] = set()        # id of every param an optimizer holds
        self.unfilled: set[int] = set()       # built on the meta device, no load yet
        self.optimizer = None
        for p in model.parameters():
            _own(p, self)
        setattr(model, ATTRIBUTE, self)
        self.state_dict_control = None
        if self.stage3 is not None:
            _guard_torch_optimizers()
            setattr(model, _STAGE3, self.stage3)
            # model.state_dict() called on one rank alone (a save on rank 0
            # only) fails in a minute, not at the collectives' timeout
            self.state_dict_control = comm.control.sibling(
                state_dict_timeout(), "RLHFZ_STATE_DICT_TIMEOUT")
            install_hooks(self)
            synced_generation(model, True)
            mark_parts(model, self.stage3)
            _refuse_conversions(model, weakref.ref(self))
            if hasattr(model, "resize_token_embeddings"):
                model.resize_token_embeddings = _refuse_resize

    def __deepcopy__(self, memo):
        if self.stage3 is not None:
            raise TypeError(COPY_REFUSED)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            setattr(copied, key, copy.deepcopy(value, memo))
        return copied

    # ---- frozen buckets ----------------------------------------------------------------

    def shard(self, params: list) -> None:
        """Shards params that no optimizer trains into frozen buckets, unit by
        unit (with one rank they stay whole). Every bucket is allocated
        before any param is touched."""
        if self.stage3 is None or not params:
            return
        order, _ = assign_params(self.model, self.wrap, self.threshold, params)
        self.make_frozen(order)

    def make_frozen(self, order, shapes: dict | None = None) -> None:
        """Frozen buckets for [(unit, params)], one per dtype; shapes
        {id(param): shape} for params that are placeholders already."""
        made = [(unit, [FrozenBucket(
            [p for p in members if p.dtype == dtype], dtype, self.rank, self.world_size,
            self.backend, shapes=None if shapes is None else
            [shapes[id(p)] for p in members if p.dtype == dtype])
            for dtype in DTYPE_NAMES if any(p.dtype == dtype for p in members)])
            for unit, members in order]
        for _, buckets in made:
            for bucket in buckets:
                bucket.attach(index=len(self.engine.buckets))
                self.engine.buckets.append(bucket)
        self.stage3.add_units(made)

    def take(self, params: list) -> None:
        """Params an optimizer trains from now on: out of the frozen buckets,
        whole again, for the optimizer to shard into buckets of its own (a
        collective: the buckets that hold any of them are gathered)."""
        wanted = {id(p) for p in params}
        for bucket in [b for b in self.engine.buckets if any(id(p) in wanted for p in b.params)]:
            bucket.gather(self.comm)
            values = [p.detach().clone() for p in bucket.params]
            keep = [p for p in bucket.params if id(p) not in wanted]
            try:
                rest = (FrozenBucket(keep, bucket.dtype, self.rank, self.world_size,
                                     self.backend) if keep else None)
            finally:
                bucket.release()
            with torch.no_grad():
                for p, value in zip(bucket.params, values):
                    p.data = value
            where = self.engine.buckets.index(bucket)
            if rest is None:
                del self.engine.buckets[where]
            else:
                rest.attach(index=where)
                self.engine.buckets[where] = rest
            self.stage3.replace_bucket(bucket, rest)
        self.trained |= wanted

    def give_back(self, params: list) -> None:
        """Undoes take() when the optimizer could not build its buckets."""
        self.trained -= {id(p) for p in params}
        self.shard(params)

    def check_trainable(self, params: list) -> None:
        """Params a stage-3 optimizer may take: trainable, and not another's."""
        slots = self.sharded_slots()
        frozen = [tuple(slots[id(p)][0].layout.slots[slots[id(p)][1]].shape) if id(p) in slots
                  else tuple(p.shape) for p in params if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"{len(frozen)} param(s) of the group are frozen (requires_grad=False), e.g. one "
                f"of shape {frozen[0]}: leave them out of the optimizer's groups, as "
                f"transformers' Trainer does; the sharded model keeps them sharded without "
                f"grads or state (to unfreeze one, requires_grad_(True) then add_param_group)")
        if self.stage3 is not None and any(id(p) in self.trained for p in params):
            raise ValueError(
                "a param of the group is trained by another optimizer already: at stage 3 "
                "the first ZeroAdamW over a param keeps its shards for the model's life "
                "(close() does not hand them back). Change that optimizer's param_groups "
                "(lr, weight_decay, betas) in place instead of building another, or put the "
                "params in one ZeroAdamW's groups")

    def frozen_slots(self) -> dict[int, tuple]:
        """id(param) -> (its frozen bucket, its index there)."""
        return {id(p): (bucket, i) for bucket in self.engine.buckets
                for i, p in enumerate(bucket.params)}

    def sharded_slots(self) -> dict[int, tuple]:
        """id(param) -> (bucket, index) of every param kept as shards here,
        an optimizer's and the frozen ones."""
        if self.stage3 is None:
            return {}
        return {id(p): (bucket, i) for _, buckets in self.stage3.units for bucket in buckets
                for i, p in enumerate(bucket.params)}


def _refuse_conversions(model: torch.nn.Module, record_ref) -> None:
    """model.half(), .to(dtype or device), .cuda() on a sharded model are
    refused when asked for, before any module changes: the values live in
    shards, which such a conversion would never reach (a cast there and
    back would leave torch's values rounded and rlhfz's not). Conversions
    that change nothing (model.to(its own device), share_memory()) run."""
    for module in model.modules():
        module._apply = _checked_apply(weakref.ref(module), record_ref)


def _checked_apply(module_ref, record_ref):
    def _apply(fn, *args, **kwargs):
        module, record = module_ref(), record_ref()
        if record is not None and record.stage3 is not None:
            slots = record.sharded_slots()
            seen = set()
            for p in module.parameters():
                if id(p) not in slots or (p.dtype, p.device) in seen:
                    continue
                seen.add((p.dtype, p.device))
                probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
                if probe.dtype != p.dtype or probe.device != p.device:
                    raise RuntimeError(
                        f"the model is sharded (stage 3): its {p.dtype} params on {p.device} "
                        f"live in shards that a conversion to {probe.dtype} on {probe.device} "
                        f"(model.to() / .half() / .cuda()) would never reach: cast or move "
                        f"the model before shard_model or ZeroAdamW(stage=3)")
        return type(module)._apply(module, fn, *args, **kwargs)
    return _apply


def _refuse_resize(*args, **kwargs):
    raise NotImplementedError(
        "resize_token_embeddings on a sharded model would copy the empty placeholders its "
        "embeddings hold between uses: resize the model before shard_model or "
        "ZeroAdamW(model, stage=3)")


def state_dict_timeout() -> float:
    return float(os.environ.get("RLHFZ_STATE_DICT_TIMEOUT", STATE_DICT_TIMEOUT_S))


def sharding_of_model(model) -> ShardedModel | None:
    """The record of a model sharded by shard_model or a stage-3 ZeroAdamW
    (under DDP / accelerate wrappers too), or None."""
    return getattr(unwrap_model(model, ATTRIBUTE), ATTRIBUTE, None)


def sharding_of(params: list) -> ShardedModel | None:
    """The ShardedModel that holds these params, or None when none of them
    belongs to one. Params of several models, or of a sharded model mixed
    with others, are refused."""
    records = {id(r): r for r in (_OWNERS.get(p) for p in params) if r is not None}
    if not records:
        return None
    if len(records) > 1 or any(_OWNERS.get(p) is None for p in params):
        raise ValueError("the params come from more than one model, or mix a model sharded "
                         "with rlhfz.shard_model with others: one stage-3 optimizer trains "
                         "params of one sharded model")
    return next(iter(records.values()))


def check_sharded_model(record: ShardedModel, stage: int, process_group, wrap,
                        threshold: int, collectives: str, device_mesh=None) -> None:
    """A ZeroAdamW on params of a sharded model takes its sharding: options
    that say otherwise are refused."""
    if record.world_size == 1:
        return
    if stage != 3:
        raise ValueError(f"these params belong to a model sharded with rlhfz.shard_model (or a "
                         f"stage-3 ZeroAdamW): train them with stage=3, not stage={stage}")
    group = record.comm.group
    if process_group is not None and process_group is not group:
        raise ValueError("process_group differs from the one the model was sharded over: "
                         "leave it out, the optimizer takes the model's")
    if device_mesh is not None and device_mesh is not record.comm.mesh:
        raise ValueError("device_mesh differs from the one the model was sharded over: leave "
                         "it out, the optimizer takes the model's")
    if wrap is not None and wrap != record.wrap:
        raise ValueError(f"wrap={wrap!r} differs from the model's sharding ({record.wrap!r}): "
                         f"leave it out, the optimizer takes the model's units")
    if threshold not in (100_000, record.threshold):
        raise ValueError(f"param_persistence_threshold={threshold} differs from the model's "
                         f"sharding ({record.threshold}): leave it out")
    if collectives != "torch":
        raise ValueError("a model sharded with rlhfz.shard_model gathers over torch.distributed: "
                         "collectives='nccl' needs ZeroAdamW(model, stage=3) on the unsharded "
                         "model")


def check_shardable(model: torch.nn.Module) -> tuple[torch.device, bool]:
    """(the device to shard on, whether the params are on the meta device)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"shard_model takes an nn.Module, not {type(model).__name__}")
    if hasattr(model, ATTRIBUTE):
        raise ValueError("this model is sharded already (by shard_model or a stage-3 "
                         "ZeroAdamW)")
    params = list(model.parameters())
    devices = {p.device for p in params}
    meta = any(d.type == "meta" for d in devices)
    if meta:
        buffers = {b.device for b in model.buffers()}
        if len(devices) > 1 or any(d.type == "meta" for d in buffers):
            raise NotImplementedError(
                "shard_model takes a model whose params are all on the meta device and whose "
                "buffers are real (as accelerate.init_empty_weights() builds it): buffers such "
                "as rotary frequencies are not in a checkpoint, so they cannot be filled later")
        devices = buffers or {torch.device("cpu")}
    if len(devices) > 1:
        raise ValueError(f"every param must be on one device to shard, not "
                         f"{sorted(map(str, devices))}")
    bad = sorted({str(p.dtype) for p in params if p.dtype not in DTYPE_NAMES})
    if bad:
        raise TypeError(f"shard_model shards float32, bfloat16 and float16 params, not {bad}: "
                        f"cast the model first")
    return (next(iter(devices)) if devices else torch.device("cpu")), meta


def shard_model(model: torch.nn.Module, *, process_group=None, wrap=None,
                param_persistence_threshold: int = 100_000,
                device_mesh=None) -> torch.nn.Module:
    """Shards every param of the model in place, frozen ones included (the
    stage-3 layout, with or without an optimizer); returns the model. Every
    rank calls it and starts from the first rank's values. With one process
    the params stay whole. device_mesh (instead of process_group): a 1-D
    mesh shards over its ranks, a 2-D one ("replicate", "shard") within
    each shard group, the shards replicated across groups."""
    device, meta = check_shardable(model)
    if isinstance(param_persistence_threshold, bool) or \
            not isinstance(param_persistence_threshold, int) or param_persistence_threshold < 0:
        raise ValueError(f"param_persistence_threshold must be an int >= 0, not "
                         f"{param_persistence_threshold!r}")
    backend = backend_for(device)
    comm = communicator_for(process_group, "torch", backend, device_mesh)
    return shard_with(model, comm, backend, wrap, param_persistence_threshold,
                      list(model.parameters()), from_meta=meta)


def shard_with(model, comm, backend, wrap, threshold: int, params: list,
               from_meta: bool = False) -> torch.nn.Module:
    """shard_model on a communicator already made (a stage-3 ZeroAdamW's):
    shards `params`, the rest are left to the optimizer. Params on the meta
    device get only this rank's shard (zeros, and whole small params as
    zeros), and the model refuses to run until a load fills them."""
    if comm is not None:
        # the units follow from these: ranks that differ would gather apart
        comm.agree("shard_model", {"wrap": _described(wrap), "threshold": threshold})
    record = ShardedModel(model, comm, backend, wrap, threshold)
    if from_meta:
        _materialize_shards(record, params)
        model.register_forward_pre_hook(_refuse_unfilled(weakref.ref(record)))
        return model
    if comm is not None:
        comm.start_from_first_rank(params, "shard_model")
    record.shard(params)
    return model


def _described(wrap):
    """wrap as every rank can compare it: class names, not objects."""
    if isinstance(wrap, (list, tuple, set, frozenset)):
        return sorted(f"{getattr(w, '__module__', '')}.{getattr(w, '__qualname__', repr(w))}"
                      for w in wrap)
    return repr(wrap)


def _materialize_shards(record, params: list) -> None:
    """Params on the meta device become real ones on the backend's device:
    whole small ones as zeros, the rest as this rank's shards (zeros) behind
    empty placeholders. Never the whole model on any rank."""
    device = record.backend.device
    order = []
    if record.stage3 is not None:
        order, _ = assign_params(record.model, record.wrap, record.threshold, params)
    sharded = {id(p) for _, members in order for p in members}
    swap = {}
    for p in params:
        value = (torch.empty(0, dtype=p.dtype, device=device) if id(p) in sharded
                 else torch.zeros(p.shape, dtype=p.dtype, device=device))
        swap[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
    shapes = {id(swap[id(p)]): tuple(p.shape) for p in params}
    for module in record.model.modules():         # tied params: every owner takes the new one
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in swap:
                setattr(module, name, swap[id(p)])
    for new in swap.values():
        _own(new, record)
    record.unfilled = {id(new) for new in swap.values()}
    if order:
        record.make_frozen([(unit, [swap[id(p)] for p in members]) for unit, members in order],
                           shapes)


def _refuse_unfilled(ref):
    def hook(module, args):
        record = ref()
        if record is not None and record.unfilled:
            raise RuntimeError(
                f"{len(record.unfilled)} params of this model were built on the meta device "
                f"and hold no values yet: fill them with rlhfz.load_pretrained(model, path) or "
                f"rlhfz.load_checkpoint(path, model) before running it")
    return hook


def mark_filled(model_or_record, params) -> None:
    """A load wrote these params: a model built on the meta device may run
    once every param was written."""
    record = (model_or_record if isinstance(model_or_record, ShardedModel)
              else sharding_of_model(model_or_record))
    if record is not None and record.unfilled:
        record.unfilled -= {id(p) for p in params}
