"""ZeroAdamW: a drop-in torch.optim.AdamW whose memory is owned by rlhfz.

This is the torch.optim face of the engine (engine/): torch's Optimizer
keeps the param groups, the hooks and the state-dict machinery, and the
engine keeps the buckets and steps them. Options are checked in
optim_options.py, and state dicts are translated in state_dict.py.
"""
from __future__ import annotations

import contextlib
import functools
import math
import weakref
from typing import Any

import torch
from torch.optim import Optimizer

from . import state_dict as translate
from .comm import communicator_for
from .engine import INT8_SQ_LIMIT, ShardEngine, backend_for, host_buffer
from .engine.layout import env_bucket_bytes
from .module_zero_grad import unwatch as unwatch_zero_grad
from .module_zero_grad import watch as watch_zero_grad
from .torch_grad_calls import unwatch as unwatch_torch_grad_calls
from .torch_grad_calls import watch as watch_torch_grad_calls
from .optim_edits import StateEntries, check_group_params
from .optim_options import (check_constructor_hparams, check_engine_options, check_group,
                            check_params, check_state_dtype, check_unsupported, common_device,
                            group_hparams, group_storage)
from .reducer import GradReducer
from .sharding import check_sharded_model, shard_with, sharding_of, sharding_of_model
from .state_dict import SHARDED_FORMAT, consolidate_sharded  # noqa: F401  (public here)

_TIERS = ("device", "pinned", "host", "disk")
_KINDS = ("params", "grads", "master", "exp_avg", "exp_avg_sq")

_LIVE = weakref.WeakSet()
SEVERAL_REDUCERS = (
    "With more than one ZeroAdamW at stage 2 or 3, a backward that gives grads to one "
    "optimizer's params on some ranks only (a loss term that some ranks' batches leave out) "
    "ends this way too: that optimizer reduces on those ranks alone. Put such params in one "
    "ZeroAdamW as param groups, which adds zeros where no grad came, or make every rank's "
    "loss reach them (add 0 * the term).")


def _tensors_of(params: list) -> list:
    """The tensors among params or param-group dicts (named ones too)."""
    out = []
    for item in params:
        group = item.get("params", []) if isinstance(item, dict) else [item]
        group = [group] if isinstance(group, torch.Tensor) else group
        out.extend(t[1] if isinstance(t, tuple) else t for t in group)
    return [t for t in out if isinstance(t, torch.Tensor)]


def _let_go(engines: list) -> None:
    """The params' grad hooks and model.zero_grad's watch go: the params
    are the model's alone again (what close() and a dropped optimizer do)."""
    for engine in engines:
        unwatch_zero_grad(engine)
        engine.detach()


def live_optimizers() -> list:
    """Every ZeroAdamW that still exists (integrations find a model's owner)."""
    return list(_LIVE)


def owning_optimizer(model):
    """The live ZeroAdamW that owns the model's params, or None."""
    ids = {id(p) for p in model.parameters()}
    for opt in live_optimizers():
        if any(id(p) in ids for group in opt.param_groups for p in group["params"]):
            return opt
    return None


def _state_keeper(optimizer_ref):
    """What the engine calls when it gives a param state (or takes it away):
    optimizer.state maps the param to it, as torch's does after the param's
    first step."""
    def keep(bucket, index: int, entry) -> None:
        optimizer = optimizer_ref()
        if optimizer is None:
            return
        param = bucket.params[index]
        if entry is None:
            optimizer.state.pop(param, None)
            optimizer.entries.drop(param)
        else:
            optimizer.state[param] = entry
            optimizer.entries.give(param, entry)
    return keep


class NonFiniteGradError(FloatingPointError):
    """A gradient held NaN or Inf under nonfinite='raise'; no state was changed."""


class ZeroAdamW(Optimizer):
    """AdamW over flat, rlhfz-owned buckets.

    ``foreach`` and ``fused`` are accepted for compatibility: every rlhfz step
    is one fused kernel per bucket, whatever they say.

    ``reduce_dtype=torch.float32`` averages 16-bit grads across ranks in fp32
    (the grad shard is then fp32 too); None reduces in the params' dtype.

    Params on a CUDA device get their buckets and optimizer state on that
    device and are stepped by the CUDA kernels on torch's current stream;
    params on the CPU by the SIMD kernels. All params share one device.
    ``collectives`` picks the engine across processes: "torch"
    (torch.distributed, the default) or "nccl" (rlhfz's own NCCL
    communicator on its own stream, CUDA only); close() destroys the latter.

    ``device_mesh`` (a torch DeviceMesh, instead of process_group): 1-D
    shards over its ranks; 2-D, with dims ("replicate", "shard"), shards
    within each shard group and replicates across groups, as FSDP2's HSDP:
    grads are reduce-scattered within the group and their shards averaged
    across replicas, and params are gathered within the group only.

    ``nonfinite`` says what a NaN or Inf grad does (or, in an int8
    state_dtype group, a grad so large that exp_avg_sq would overflow, which
    an int8 block cannot hold): "raise" (the default)
    raises NonFiniteGradError, "skip" skips the step; both leave params and
    state untouched, which takes one read of the grads before the update
    (free after clip_grad_norm_, which reads them anyway). None does no check,
    as torch.optim.AdamW: a NaN then flows into params and state.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, stage=2, process_group=None, offload=None,
                 offload_ratio=1.0, pin_memory="auto", nonfinite="raise", wrap=None,
                 param_persistence_threshold=100_000, reduce_dtype=None, collectives="torch",
                 bucket_bytes=None, state_dtype="fp32", min_8bit_size=4096, device_mesh=None):
        # the options besides torch's defaults, from which a copy is built (__getstate__)
        self._options = dict(stage=stage, offload=offload, offload_ratio=offload_ratio,
                             pin_memory=pin_memory, nonfinite=nonfinite, wrap=wrap,
                             param_persistence_threshold=param_persistence_threshold,
                             reduce_dtype=reduce_dtype, collectives=collectives,
                             bucket_bytes=bucket_bytes)
        check_constructor_hparams(lr, betas, eps, weight_decay, foreach, capturable)
        check_state_dtype(state_dtype, min_8bit_size)
        check_unsupported(dict(amsgrad=amsgrad, capturable=capturable,
                               differentiable=differentiable, foreach=foreach, fused=fused))
        check_engine_options(stage, offload, offload_ratio, pin_memory, nonfinite,
                             param_persistence_threshold, reduce_dtype, collectives,
                             bucket_bytes)
        if isinstance(params, torch.Tensor):
            # as torch.optim.Optimizer: iterating it would give its rows
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            "Tensors or dicts, but got " + torch.typename(params))
        module = params if isinstance(params, torch.nn.Module) else None
        if module is not None:
            if stage >= 1 and isinstance(module, torch.nn.parallel.DistributedDataParallel):
                raise ValueError(
                    "the model is wrapped in DistributedDataParallel, which reduces grads itself; "
                    f"with stage={stage} rlhfz reduces them too, so they would be reduced twice. "
                    "Pass the unwrapped module.")
            params = [p for p in module.parameters() if p.requires_grad]
        params = params if isinstance(params, list) else list(params)
        self.device = common_device(params)
        record = sharding_of(_tensors_of(params)) if module is None else \
            sharding_of_model(module)
        if record is not None:
            check_sharded_model(record, stage, process_group, wrap, param_persistence_threshold,
                                collectives, device_mesh)
            module, wrap = record.model, record.wrap
            param_persistence_threshold = record.threshold
            self.device = record.backend.device
        elif module is None and stage == 3:
            raise ValueError("stage=3 shards parameters per module unit, so it needs the "
                             "nn.Module itself: pass ZeroAdamW(model, stage=3), or the params "
                             "(or param groups) of a model sharded with rlhfz.shard_model")
        self.backend = backend_for(self.device)
        if collectives == "nccl" and self.backend.tier != "device":
            raise ValueError(f"collectives='nccl' needs params on a CUDA device, not "
                             f"{self.device}")
        self._engines: list = []                # every engine built, for _let_go
        made_comm = record is None
        self.comm = (record.comm if record is not None else
                     communicator_for(process_group, collectives, self.backend, device_mesh))
        try:
            self.rank = self.comm.rank if self.comm else 0
            self.world_size = self.comm.world_size if self.comm else 1
            if self.world_size > 1 and stage == 0:
                raise ValueError(f"stage=0 does not shard, so it has no use for "
                                 f"{self.world_size} ranks: wrap the model in "
                                 f"DistributedDataParallel, or pick stage 1, 2 or 3")
            if self.comm is not None:
                # options that shape the collectives: ranks that differ in one
                # are told so here, not by a timeout in the first backward
                self.comm.agree("ZeroAdamW", {
                    "stage": stage, "collectives": collectives,
                    "reduce_dtype": str(reduce_dtype), "state_dtype": state_dtype,
                    "bucket_bytes": bucket_bytes if bucket_bytes is not None
                    else env_bucket_bytes()})
            self.stage = stage
            self.module = module
            self.reduce_dtype = reduce_dtype
            self.bucket_bytes = bucket_bytes
            self.offload_target = offload
            self.offload_ratio = float(offload_ratio)
            self.pin_memory = pin_memory
            self.nonfinite = nonfinite
            self.wrap = wrap
            self.param_persistence_threshold = param_persistence_threshold
            self.skipped_steps = 0
            self._built_storage: list[tuple] = []   # each group's (state_dtype, min_8bit_size)
            self._built_params: list[tuple] = []    # each group's params, as its buckets hold them
            self.entries = StateEntries()           # what optimizer.state was given
            # offload="cpu": this fraction of each shard's optimizer state lives
            # and steps on the host (pinned per pin_memory, like offload()).
            # Nothing the engine keeps refers back to the optimizer: with no cycle,
            # an optimizer dropped is freed at once (its device memory too),
            # not at some later garbage collection.
            self._closed = False
            self._make_engine()
            if stage >= 2 and self.world_size > 1:
                self.engine.use_reducer(GradReducer(self.engine.buckets, self.comm, self.backend,
                                                    self.bucket_bytes))
                watch_zero_grad(self.engine)
                watch_torch_grad_calls(self)
                self._explain_several_reducers()
            # Stage 3 across ranks: params sharded too, gathered per unit
            # (stage3.py); the model's frozen params are sharded beside them
            # (sharding.py), and a model sharded before brings its own.
            self.stage3 = None
            self.sharding = None
            if stage == 3 and self.world_size > 1:
                if record is None:
                    shard_with(module, self.comm, self.backend, wrap,
                               param_persistence_threshold,
                               [p for p in module.parameters() if not p.requires_grad])
                    record = sharding_of_model(module)
                self.sharding = record
                self.stage3 = record.stage3
                reducer = self.engine.reducer
                self.engine.trail = self.stage3.take_trail
                reducer.after_flush = self.stage3.release_all
                reducer.round_ended = self.stage3.round_ended
                # reductions launch where every rank is at the same point
                # among stage 3's gathers (reducer.py)
                reducer.launch_when_staged = False
                self.stage3.listen(reducer.unit_done)
            defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            amsgrad=False, maximize=maximize, foreach=foreach, capturable=False,
                            differentiable=False, fused=fused, decoupled_weight_decay=True,
                            state_dtype=state_dtype, min_8bit_size=min_8bit_size)
            super().__init__(params, defaults)
        except BaseException:
            # the groups built before the bad one leave the model as it was,
            # and a communicator this constructor made goes with it
            self._abandon(made_comm)
            raise
        _LIVE.add(self)
        # Dropped without close(), it still lets go of the params' grad
        # hooks, which would go on taking their grads from p.grad.
        weakref.finalize(self, _let_go, self._engines)

    def _abandon(self, made_comm: bool) -> None:
        _let_go(self._engines)
        record = sharding_of_model(self.module) if getattr(self, "module", None) is not None \
            else None
        if made_comm and self.comm is not None and (record is None or record.comm is not self.comm):
            try:
                self.comm.destroy()
            except Exception:       # noqa: BLE001 (the constructor's own error is the news)
                pass

    def _explain_several_reducers(self) -> None:
        """With another live optimizer that reduces grads in backward, a
        collective failure may mean a backward left one of them out on some
        ranks: the errors of both say so from now on."""
        others = [o for o in live_optimizers()
                  if o is not self and not o._closed and o.reducer is not None]
        for optimizer in others + ([self] if others else []):
            optimizer.comm.explain_failures(SEVERAL_REDUCERS)

    def _refuse_params_of_another(self, tensors: list) -> None:
        """A param another live ZeroAdamW trains, where either one's grads go
        through a reducer (stage 2 or 3 across ranks): its grad hook takes
        the grad out of p.grad, so the other would step without it."""
        ids = {id(t) for t in tensors}
        for other in live_optimizers():
            if other is self or other._closed or (self.reducer is None and other.reducer is None):
                continue
            if any(id(p) in ids for b in other.engine.buckets for p in b.params):
                raise ValueError(
                    "a param of the group is trained by another ZeroAdamW already, and at "
                    "stage 2 or 3 across ranks a backward's grads go into one optimizer's "
                    "shards, so the other would step without them: put both sets of params "
                    "in one ZeroAdamW as param groups (a policy and a value head over one "
                    "body, say), or close() the other optimizer first")

    def _make_engine(self) -> None:
        self.engine = ShardEngine(
            self.backend, self.comm, stage=self.stage,
            host_ratio=self.offload_ratio if self.offload_target == "cpu" else 0.0,
            reduce_dtype=self.reduce_dtype, bucket_bytes=self.bucket_bytes,
            host_alloc=functools.partial(host_buffer, pin_memory=self.pin_memory, zero=True))
        self.engine.on_state = _state_keeper(weakref.ref(self))
        self._engines.append(self.engine)

    @property
    def reducer(self):
        return self.engine.reducer

    # ---- a model moved after the optimizer was built ---------------------------------

    def _follow_moved_params(self) -> None:
        """model.to(device), .cuda() or .cpu() after the optimizer was built
        gives every param a copy on the new device (torch's module._apply
        replaces .data), and torch's AdamW trains on with the same param
        objects. Here the buckets, master weights and moments follow: new
        ones on that device, the params views of them again, the state
        copied over, the old memory freed. In one process, stages 0-2;
        elsewhere this refuses, before anything changes."""
        target = self.engine.moved_to()
        if target is None:
            return
        where = self._cannot_rebuild()
        if where is not None:
            raise RuntimeError(
                f"the params were moved to {target} after the optimizer was built "
                f"(model.to() / .cuda() / .cpu()); ZeroAdamW follows such a move in one "
                f"process at stages 0-2, not {where}: build the optimizer after placing the "
                f"model, or use offload() / reload() to move its memory")
        self.synchronize()
        # torch's form of the state (fp32 moments), over the old buckets' memory
        moved = {"param_groups": translate.packed_groups(self.param_groups),
                 "state": translate.gathered_state(self.engine, self.param_groups)}
        self._rebuild(backend_for(target), target, self._built_storage)
        index_to_param = translate.check_state_dict(self.engine, self.param_groups, moved)
        translate.load_checked(self.engine, self.param_groups, moved, index_to_param,
                               self.defaults)

    def _cannot_rebuild(self) -> str | None:
        """Why the buckets cannot be built anew here (None: they can). They
        can in one process at stages 0-2, with nothing offloaded."""
        return ("across processes" if self.comm is not None else
                "at stage 3" if self.stage == 3 else
                "while state is offloaded (call reload() first)" if self.engine.offloaded
                else None)

    def _rebuild(self, backend, device, storage: list[tuple]) -> None:
        """New buckets for every group, on `backend`, each group's moments
        kept as storage[i] says; the params become views of them and the old
        engine's memory is freed (tensors still viewing it keep theirs).
        The state is not carried over: the caller loads one. Everything is
        allocated first: out of memory, nothing has changed."""
        old = (self.engine, self.backend, self.device)
        self.backend, self.device = backend, device
        try:
            self._make_engine()
            made = [self.engine.make_buckets(index, self._parts(list(group["params"])),
                                             *storage[index])
                    for index, group in enumerate(self.param_groups)]
        except BaseException:
            self.engine, self.backend, self.device = old
            raise
        for group_made in made:
            self.engine.attach([b for _, buckets in group_made for b in buckets])
        old[0].detach()
        self._built_storage = list(storage)

    # ---- copies ----------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """For deepcopy and pickle. In one process: the options, the param
        groups and the state dict, from which the copy builds buckets of its
        own (torch's default would copy the groups and state but not the
        buckets behind them). Across processes each rank holds only its
        part of the state, and stage 3 is built from the module, so copying
        those is refused now rather than failing later."""
        if self.comm is not None or self.stage == 3:
            where = "across processes" if self.comm is not None else "at stage 3"
            raise TypeError(
                f"a ZeroAdamW {where} cannot be copied or pickled: each rank holds its "
                f"shard of the state. Save opt.state_dict() (or rlhfz.save_checkpoint) and "
                f"load it into a new optimizer instead.")
        groups = [{k: v for k, v in g.items() if k != "param_names"} for g in self.param_groups]
        options = {**{k: v for k, v in self.defaults.items()
                      if k in ("lr", "betas", "eps", "weight_decay", "maximize", "foreach",
                               "fused", "state_dtype", "min_8bit_size")}, **self._options}
        return {"options": options, "param_groups": groups, "state_dict": self.state_dict()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        if "options" not in saved:
            raise TypeError("this is not the state of a ZeroAdamW (no 'options'): build the "
                            "optimizer and use load_state_dict")
        ZeroAdamW.__init__(self, saved["param_groups"], **saved["options"])
        self.load_state_dict(saved["state_dict"])

    def __copy__(self):
        raise TypeError("a shallow copy of a ZeroAdamW would share its params' flat buffers "
                        "with the original: use copy.deepcopy")

    # ---- param groups ----------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        group = dict(param_group)
        params = group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs. "
                            "Please use a list instead.")
        elif params is None:
            raise ValueError("param_group has no 'params'")
        params = list(params)
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        check_params(tensors, self.device, self.param_groups)
        self._refuse_params_of_another(tensors)
        options = {**self.defaults, **{k: v for k, v in group.items() if k != "params"}}
        check_group(options)
        if self.sharding is not None:
            self.sharding.check_trainable(tensors)
            self.sharding.take(tensors)       # whole again, out of the frozen buckets
        if self.comm is not None:
            self.comm.start_from_first_rank(tensors, "ZeroAdamW.add_param_group")
        # Build the buckets before the group is registered: if allocation
        # fails, neither the optimizer nor the model has changed (params
        # taken from the frozen buckets go back to them).
        try:
            made = self.engine.make_buckets(len(self.param_groups), self._parts(tensors),
                                            *group_storage(options))
        except BaseException:
            if self.sharding is not None:
                self.sharding.give_back(tensors)
            raise
        group["params"] = params
        super().add_param_group(group)
        self._built_storage.append(group_storage(self.param_groups[-1]))
        self._built_params.append(tuple(self.param_groups[-1]["params"]))
        param_group.clear()
        param_group.update(self.param_groups[-1])
        self.param_groups[-1] = param_group
        self.engine.attach([b for _, buckets in made for b in buckets])
        units = [(unit, buckets) for unit, buckets in made if unit is not None and buckets]
        if units:
            self.stage3.add_units(units)

    def _check_reform(self, storage: list[tuple]) -> None:
        """Refuses a state dict that keeps its moments in another form
        (state_dtype, min_8bit_size) where the buckets cannot be built anew."""
        where = self._cannot_rebuild() if storage != self._built_storage else None
        if where is not None:
            raise ValueError(
                f"the state dict keeps its moments as (state_dtype, min_8bit_size) "
                f"{storage}, this optimizer as {self._built_storage}; switching is done in "
                f"one process at stages 0-2, not {where}: build the optimizer with the "
                f"state dict's state_dtype, or set its param_groups' state_dtype to this "
                f"optimizer's before loading")

    def _reform(self, storage: list[tuple]) -> None:
        """A state dict that keeps its moments in another form: the buckets
        are built anew in that form, in one process at stages 0-2; elsewhere
        this refuses, before anything changes."""
        self._check_reform(storage)
        self.synchronize()
        self._rebuild(self.backend, self.device, storage)

    def _check_storage_unchanged(self) -> None:
        """The moments stay in the form their buckets were built with: a
        group's state_dtype or min_8bit_size changed afterwards would be
        silently ignored, so it is refused."""
        for index, (group, built) in enumerate(zip(self.param_groups, self._built_storage)):
            now = group_storage(group)
            if now != built:
                raise ValueError(
                    f"param_groups[{index}] asks for (state_dtype, min_8bit_size) {now}, but "
                    f"its moments were built as {built}: they cannot change form in place. "
                    f"Build a new ZeroAdamW with the new options and load this one's "
                    f"state_dict() into it.")

    def _parts(self, tensors: list) -> list[tuple]:
        """[(stage-3 unit or None, params, sharded)] of a new group."""
        if self.stage3 is None:
            return [(None, tensors, False)]
        from .stage3 import assign_params
        order, persistent = assign_params(self.module, self.wrap,
                                          self.param_persistence_threshold, tensors)
        # Buckets launch their reduce-scatter in descending index, the order
        # backward finishes them: the root unit (embeddings) last, the small
        # whole params next, the units in reverse.
        root = [(m, ps, True) for m, ps in order if m is self.module]
        blocks = [(m, ps, True) for m, ps in order if m is not self.module]
        return root + [(None, persistent, False)] + blocks

    # ---- gradients ---------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._follow_moved_params()
        self.engine.zero_grads(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach=None,
                        params=None) -> torch.Tensor:
        """Scale all grads so their global norm is at most max_norm; returns
        the norm before clipping, as torch.nn.utils.clip_grad_norm_ does
        (norm_type: any p > 0, or inf; foreach is accepted and changes nothing).
        params: some of this optimizer's params, to take the norm of and
        clip those alone, as torch's over them would (a collective at stages
        2 and 3 across ranks, as the whole clip is)."""
        ids, plans = self._clip_plans(params, "clip_grad_norm_")
        norm_type, max_norm = float(norm_type), float(max_norm)
        total, dtype, sumsq = self._norm_of(plans, norm_type, ids is not None,
                                            error_if_nonfinite)
        self.engine.clip(plans, total, max_norm, dtype, sumsq=sumsq, in_place=ids is not None)
        return torch.tensor(total, dtype=dtype, device=self.device)

    @torch.no_grad()
    def get_total_norm(self, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                       params=None) -> torch.Tensor:
        """torch.nn.utils.get_total_norm of this optimizer's grads, or of
        those of `params` (some of its params), where rlhfz keeps them; with
        clip_grads_with_norm_, a clip over several optimizers' params
        together (torch_grad_calls.py). A collective across ranks."""
        ids, plans = self._clip_plans(params, "get_total_norm")
        total, dtype, _ = self._norm_of(plans, float(norm_type), True, error_if_nonfinite)
        return torch.tensor(total, dtype=dtype, device=self.device)

    @torch.no_grad()
    def clip_grads_with_norm_(self, max_norm: float, total_norm, params=None) -> None:
        """torch.nn.utils.clip_grads_with_norm_ on this optimizer's grads, or
        those of `params`: scaled by max_norm / (total_norm + 1e-6), at most
        1, in total_norm's dtype. The grads are scaled at once and checked
        again at the step, since total_norm was not taken here."""
        ids, plans = self._clip_plans(params, "clip_grads_with_norm_")
        dtype = total_norm.dtype if isinstance(total_norm, torch.Tensor) else torch.float32
        self.engine.clip(plans, float(total_norm), float(max_norm), dtype, in_place=True)

    def _clip_plans(self, params, call: str):
        """(ids of params or None for all, the plans a clip covers)."""
        ids = self._own_ids(params, call)
        self.synchronize()
        self._follow_moved_params()
        plans = self.engine.plan(call)
        return ids, (plans if ids is None else self.engine.restrict(plans, ids))

    def _norm_of(self, plans, norm_type: float, part: bool, error_if_nonfinite: bool):
        """(the grads' norm as torch takes it, the dtype torch returns it in,
        their sum of squares or None)."""
        total, sumsq = self.engine.norm(plans, norm_type)
        if part:
            self.engine.grads_changed()     # the sum of squares just taken is of some grads
        # torch sums |g|**p in fp32 (also for 16-bit grads): past fp32's
        # range its norm is inf, which zeroes the grads or raises below
        if math.isfinite(norm_type) and total > 0 and \
                norm_type * math.log(total) > math.log(torch.finfo(torch.float32).max):
            total = math.inf
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                               "`parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and "
                               "scale the gradients by the non-finite norm anyway, set "
                               "`error_if_nonfinite=False`")
        # torch returns the norm in the grads' (promoted) dtype and clips in it
        dtypes = {p.bucket.dtype for p in plans if any(p.present)}
        dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32
        return total, dtype, (sumsq if math.isfinite(total) else None)

    def _own_ids(self, params, call: str) -> set | None:
        """ids of `params` (None: all), which must be this optimizer's."""
        if params is None:
            return None
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        owned = {id(p) for group in self.param_groups for p in group["params"]}
        if any(id(p) not in owned for p in params):
            raise ValueError(f"{call}(params=...) takes this optimizer's params only; clip "
                             f"others with torch.nn.utils.{call}")
        return {id(p) for p in params}

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float, foreach=None, params=None) -> None:
        """Clamps grads to [-clip_value, clip_value], as
        torch.nn.utils.clip_grad_value_ does, where rlhfz keeps them: all of
        this optimizer's, or those of `params` (some of its params). At
        stages 2 and 3 across ranks a collective (the grads are reduced
        first); foreach is accepted and changes nothing."""
        clip_value = float(clip_value)
        if params is not None:
            params = [params] if isinstance(params, torch.Tensor) else list(params)
        ids = self._own_ids(params, "clip_grad_value_")
        if self.reducer is None:
            # p.grad holds every grad (at stage 1 the mean): torch's own clamps it
            chosen = params if params is not None else \
                [p for group in self.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad.clip_grad_value_(chosen, clip_value, foreach)
            return
        self.synchronize()
        self._follow_moved_params()
        plans = self.engine.plan("clip_grad_value_")
        self.engine.clamp_grads(plans, clip_value, ids)

    # torch.amp.GradScaler hands itself to step() (grad_scaler=), because
    # only the optimizer knows where sharded grads are: it unscales them
    # after they are reduced and decides on Inf/NaN for every rank at once.
    _step_supports_amp_scaling = True

    def unscale_(self, grad_scaler) -> None:
        """What grad_scaler.unscale_(optimizer) does, on the grads where
        rlhfz keeps them (sharded stages leave param.grad empty; there the
        scaler's unscale_ calls this, torch_grad_calls.py). A collective
        across ranks."""
        from torch.amp.grad_scaler import OptState
        if not grad_scaler.is_enabled():
            return           # as grad_scaler.unscale_ does: GradScaler(enabled=use_amp)
        record = grad_scaler._per_optimizer_states[id(self)]
        if record["stage"] is not OptState.READY:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update(), or step() was")
        self._follow_moved_params()
        self._scaler_unscale(self.engine.plan("unscale_"), grad_scaler, reached=False)
        record["stage"] = OptState.UNSCALED

    def _scaler_unscale(self, plans, grad_scaler, reached=None) -> bool:
        """Unscales the reduced grads for a GradScaler (unless its unscale_()
        already reached them through param.grad) and records one verdict for
        all ranks where its update() reads it; True when they are finite."""
        record = grad_scaler._per_optimizer_states[id(self)]
        unscaled = record["stage"].name == "UNSCALED"
        if reached is None:
            reached = unscaled and bool(record["found_inf_per_device"])
            if self.comm is not None:
                # a rank without grads (under no_sync) was reached by nothing,
                # but the mean it steps on is made of the others' unscaled ones
                flag = torch.tensor([int(reached)], dtype=torch.uint8)
                self.comm.all_reduce_max_control(flag, "ZeroAdamW.step")
                reached = bool(flag.item())
        if unscaled and not reached and self.reducer is not None and self.engine.clipped:
            raise RuntimeError(
                "grad_scaler.unscale_(optimizer) reached no grads: at stage "
                f"{self.stage} they live in the optimizer's shards, not in param.grad, so "
                "the clip_grad_norm_ after it measured grads still multiplied by the scale "
                f"({grad_scaler.get_scale():g}). Call optimizer.unscale_(grad_scaler) "
                "instead, before clipping. Nothing was stepped; the grads are clipped by "
                "the wrong factor, so zero them and run backward again.")
        # An Inf the scaler's own unscale_ found counts even when something
        # (clip_grad_value_, say) made the grads finite since, as in torch.
        found = reached and any(bool(flag.item()) for flag in
                                record["found_inf_per_device"].values())
        if not reached:
            self.engine.scale_grads(plans, 1.0 / grad_scaler.get_scale())
        finite = math.isfinite(self.engine.sumsq(plans, local_inf=found))
        flag = torch.tensor(0.0 if finite else 1.0, dtype=torch.float32,
                            device=grad_scaler._scale.device)
        record["found_inf_per_device"] = {flag.device: flag}
        self.engine.grads_changed()
        return finite

    # ---- the step ----------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        if self._closed:
            raise RuntimeError("step() on a ZeroAdamW that was closed: it let go of the "
                               "params' grads, and its groups may be gone; build a new "
                               "optimizer to train on")
        stage3 = self.stage3
        if stage3 is not None and (stage3.suspended or stage3.keep):
            raise RuntimeError(
                "step() inside gather_for_generation (enabled=True, or with a budget): the "
                "units it holds whole would go on with the weights from before the step "
                "until it closes. Step after the context closes (or use enabled=False, "
                "which gathers each unit anew).")
        self.synchronize()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Everything that can fail is checked before the first kernel runs,
        # so a refused step leaves params and state exactly as they were.
        hparams = [group_hparams(group) for group in self.param_groups]
        self._check_storage_unchanged()
        self._follow_moved_params()
        self._take_state_edits()
        plans = self.engine.plan()
        if grad_scaler is not None and not self._scaler_unscale(plans, grad_scaler):
            self.skipped_steps += 1           # the scaler backs off; nothing changes
            return loss
        if self.nonfinite is not None and not self.engine.grads_finite(plans):
            self.engine.grads_changed()
            if self.nonfinite == "skip":
                self.skipped_steps += 1
                return loss
            bad = [self._describe_param(bucket, i) for bucket, i in self.engine.nonfinite(plans)]
            raise NonFiniteGradError(
                f"non-finite gradient (NaN or Inf) in {len(bad)} parameter(s): "
                f"{'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. The step was not taken "
                f"and no state changed; pass nonfinite='skip' to skip such steps instead.")
        if self.nonfinite is not None:
            overflow, bad = self.engine.int8_overflow(plans, hparams)
            if overflow:
                if self.nonfinite == "skip":
                    self.skipped_steps += 1
                    return loss
                names = [self._describe_param(bucket, i) for bucket, i in bad]
                where = "; ".join(names[:5]) + (" ..." if len(names) > 5 else "") \
                    if names else "params on another rank"
                raise NonFiniteGradError(
                    f"a gradient so large that exp_avg_sq would pass "
                    f"{INT8_SQ_LIMIT:.3g}, which state_dtype='int8' cannot hold (torch's fp32 "
                    f"exp_avg_sq turns Inf there), in {where}. The step was not taken and no "
                    f"state changed; clip the grads (clip_grad_norm_), keep these params in a "
                    f"'fp32' or 'bf16' state_dtype group, or pass nonfinite='skip'.")
        self.engine.step(plans, hparams)
        return loss

    def take_outside_writes(self) -> None:
        """Before the state is read out (state_dict, checkpoints): what was
        changed behind the optimizer since the last step, as a step would
        take it in: optimizer.state edits, values written into params (to
        the master) and into stitched state copies."""
        self._take_state_edits()
        self.engine.adopt_written()

    def _take_state_edits(self) -> None:
        """optimizer.state and param_groups as a user left them, carried into
        the buckets or refused (optim_edits.py)."""
        check_group_params(self.param_groups, self._built_params)
        self.entries.take(self.state, self.engine)

    def _describe_param(self, bucket, index: int) -> str:
        p = bucket.params[index]
        group = self.param_groups[bucket.group_index]["params"]
        position = next(j for j, q in enumerate(group) if q is p)
        return f"param_groups[{bucket.group_index}]['params'][{position}] shape {tuple(p.shape)}"

    # ---- state dicts -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The torch.optim.AdamW format, with fp32 moments whatever their
        state_dtype (so torch's AdamW loads it). Across processes this is a
        collective (every rank calls it, and every rank gets the whole dict)."""
        self.synchronize()
        self.take_outside_writes()
        if self.comm is None and all(b.state_dtype == "fp32" for b in self.engine.buckets):
            return super().state_dict()
        if self.comm is not None:
            self.comm.agree("ZeroAdamW.state_dict",
                            {"buckets": [len(b.params) for b in self.engine.buckets]})
        # torch's post-hooks see the finished dict: this rank's shards are
        # replaced by the whole state below, so they run after that
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = type(post_hooks)()
        try:
            packed = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        packed["state"] = translate.gathered_state(self.engine, self.param_groups)
        for hook in post_hooks.values():
            result = hook(self, packed)
            if result is not None:
                packed = result
        return packed

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state, with where each param's
        elements sit, for one file per rank. Not a collective. Any world size
        reads a full set back with load_sharded_state_dict."""
        self.synchronize()
        self.take_outside_writes()
        groups = (super().state_dict()["param_groups"] if self.comm is None
                  else translate.packed_groups(self.param_groups))
        return translate.sharded_state(self.engine, self.param_groups, groups,
                                       getattr(self.comm, "replica", 0))

    def load_sharded_state_dict(self, shards: list[dict[str, Any]]) -> None:
        """Loads the sharded_state_dict() of every rank of a run of any world
        size (a list, in any order); a collective across processes."""
        self.load_state_dict(consolidate_sharded(shards))

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raises ValueError if load_state_dict would refuse the dict."""
        translate.check_state_dict(self.engine, self.param_groups, state_dict)
        self._check_reform(translate.storage_after_load(self.param_groups, state_dict))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch.optim.AdamW-format state dict (from torch or from rlhfz).

        Everything is checked before anything is written: on any mismatch this
        raises and the optimizer is unchanged. torch's load_state_dict pre-
        and post-hooks run as in torch: a pre-hook may return a new dict."""
        self.synchronize()
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        index_to_param = translate.check_state_dict(self.engine, self.param_groups, state_dict)
        if self.comm is not None:
            self.comm.agree("ZeroAdamW.load_state_dict",
                            {"buckets": [len(b.params) for b in self.engine.buckets]})
        options = translate.copied_options(state_dict)
        storage = translate.storage_after_load(self.param_groups, state_dict)
        if storage != self._built_storage:
            self._reform(storage)
            index_to_param = translate.check_state_dict(self.engine, self.param_groups,
                                                        state_dict)
        translate.load_checked(self.engine, self.param_groups, state_dict, index_to_param,
                               self.defaults, options)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ---- memory ---------------------------------------------------------------------

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank's optimizer owns, by kind and by the tier each
        lives in now. fp32 params are their own master weights, so 'master'
        counts only separate copies. Memory that offload() could not free
        because a tensor outside still views it appears under the tier
        'held_elsewhere' of its kind."""
        return self.engine.memory_report(_TIERS, _KINDS)

    def placement(self) -> dict[str, str]:
        """Where each kind lives now: 'device', 'pinned', 'host' or 'disk'."""
        report = self.memory_report()
        home = self.backend.tier
        placement = {}
        for kind in _KINDS:
            tiers = [t for t in _TIERS if report[kind][t] > 0]
            placement[kind] = tiers[0] if len(tiers) == 1 else (home if not tiers else
                                                                "+".join(tiers))
        return placement

    @contextlib.contextmanager
    def no_sync(self):
        """As DistributedDataParallel.no_sync(): at stage 1 across ranks the
        backwards inside keep each rank's own grads in p.grad, and the next
        backward outside (or the step) averages what they accumulated: one
        all-reduce per accumulation instead of one per backward. Elsewhere
        it changes nothing (stages 2 and 3 reduce-scatter in every backward)."""
        engine = self.engine
        before, engine.average_after_backward = engine.average_after_backward, False
        try:
            yield
        finally:
            engine.average_after_backward = before

    def synchronize(self) -> None:
        """Waits for the copies a non_blocking offload() or reload() left in
        flight. rlhfz does so itself before it touches the moved memory (a
        step, a state dict, a checkpoint); code of yours that reads a moved
        tensor on the host calls this first."""
        self.engine.synchronize()

    def offload(self, what=("params", "grads", "optimizer"), to="cpu", path=None,
                non_blocking=False) -> None:
        """Moves this rank's params, grads and/or optimizer state to host
        memory (to="cpu") or to files in the directory `path` (to="disk").
        Every tensor keeps its identity; the memory left behind goes back
        (device memory to the driver). Offloading what is already there
        does nothing. Call reload() before the next step. non_blocking:
        copies between device and pinned memory stay queued on torch's
        current stream instead of being waited for here (work queued after
        them on that stream sees the data; the host does not until it syncs)."""
        from .generation import refuse_while_gathered
        from .migrate import check_target, check_what, offload_engine
        what = check_what(what)
        check_target(to, path)
        refuse_while_gathered(self, "offload")
        offload_engine(self.engine, what, to, path, non_blocking, self.pin_memory)

    def reload(self, non_blocking=False) -> None:
        """Brings everything offload() moved back where the optimizer trains."""
        from .migrate import reload_engine
        reload_engine(self.engine, non_blocking, self.pin_memory)

    def close(self) -> None:
        """Releases what the optimizer holds outside Python's reach: the
        process groups it made for its collectives (sockets, gloo threads),
        the native NCCL communicator (collectives="nccl"), and the pinned
        buffers reload() kept for the next offload. Every rank calls it; the
        optimizer cannot step afterwards. At stages 0-2 the model's params
        keep their values and train with whatever optimizer comes next. At
        stage 3 across ranks the model stays sharded: its forward,
        generation, state_dict and save_pretrained work, and its params
        keep their shards for the model's life, so another optimizer over
        them (rlhfz's or torch's) is refused with an error that says so; the
        process groups stay for the model's collectives. Any collective
        through the closed optimizer itself raises CollectiveError."""
        self._closed = True
        _LIVE.discard(self)         # it owns no model's params for the integrations
        unwatch_torch_grad_calls(self)
        _let_go(self._engines)
        from .engine import release_pinned
        try:
            module = getattr(self, "module", None)
            record = sharding_of_model(module) if module is not None else None
            if self.comm is not None and (record is None or record.comm is not self.comm):
                self.comm.destroy()
        finally:
            release_pinned()

    def __repr__(self) -> str:
        params = sum(len(b.params) for b in self.engine.buckets)
        return (f"ZeroAdamW(stage={self.stage}, world_size={self.world_size}, "
                f"groups={len(self.param_groups)}, buckets={len(self.engine.buckets)}, "
                f"params={params})")
