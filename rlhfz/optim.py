"""ZeroAdamW: a drop-in torch.optim.AdamW whose memory is owned by rlhfz.

Every parameter is a view into a flat bucket (one per param group and dtype),
16-bit params get fp32 master weights, and a step is one fused kernel call per
bucket. The public surface follows torch.optim.AdamW: the same keywords and
defaults, param groups, LR schedulers, closures, and a state_dict that loads
into torch.optim.AdamW and back.
"""
from __future__ import annotations

import copy
import math
import numbers
import weakref
from typing import Any

import torch
from torch.optim import Optimizer

from .backends import HostBackend, backend_for
from .buckets import DTYPE_NAMES, Bucket
from .comm import communicator_for
from .layout import stage2_bucket_bytes
from .reducer import GradReducer

_TIERS = ("device", "pinned", "host", "disk")
_KINDS = ("params", "grads", "master", "exp_avg", "exp_avg_sq")


SHARDED_FORMAT = "rlhfz.sharded_optimizer_state.v1"

_LIVE = weakref.WeakSet()


def live_optimizers() -> list:
    """Every ZeroAdamW that still exists (integrations find a model's owner)."""
    return list(_LIVE)


def consolidate_sharded(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The torch.optim.AdamW state dict that a full set of per-rank
    sharded_state_dict()s describe, whatever world size wrote them."""
    if not shards or any(not isinstance(s, dict) or s.get("format") != SHARDED_FORMAT
                         for s in shards):
        raise ValueError(f"expected a list of {SHARDED_FORMAT} dicts, one per rank")
    world_size = shards[0]["world_size"]
    ranks = sorted(s["rank"] for s in shards)
    if ranks != list(range(world_size)) or any(s["world_size"] != world_size for s in shards):
        raise ValueError(f"a sharded state needs every rank's part exactly once: got ranks "
                         f"{ranks} of a world of {world_size}")
    shards = sorted(shards, key=lambda s: s["rank"])
    nbuckets = len(shards[0]["buckets"])
    if any(len(s["buckets"]) != nbuckets for s in shards):
        raise ValueError("the ranks' parts list different numbers of buckets")
    state = {}
    for b in range(nbuckets):
        parts = [s["buckets"][b] for s in shards]
        meta = parts[0]
        full = {}
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            if meta[name] is None:
                continue
            full[name] = torch.cat([part[name] for part in parts])
        for i, (index, shape, offset) in enumerate(zip(meta["params"], meta["shapes"],
                                                       meta["offsets"])):
            if not meta["registered"][i]:
                continue
            numel = math.prod(shape)
            entry = {"step": meta["steps"][i].clone()}
            for name, flat in full.items():
                if offset + numel > flat.numel():
                    raise ValueError(f"bucket {b}: param {index} lies past the saved shards")
                entry[name] = flat[offset:offset + numel].view(shape).clone()
            state[index] = entry
    return {"state": state, "param_groups": shards[0]["param_groups"]}


def _common_device(params: list) -> torch.device:
    """The device of the first tensor among params (or param-group dicts);
    _check_params then holds every param to it."""
    for item in params:
        tensors = [item]
        if isinstance(item, dict):
            tensors = item.get("params", [])
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
            elif not isinstance(tensors, (list, tuple, set)) and tensors is not None:
                item["params"] = tensors = list(tensors)   # a generator is read once
        for t in tensors or []:
            t = t[1] if isinstance(t, tuple) else t
            if isinstance(t, torch.Tensor):
                return t.device
    return torch.device("cpu")


def _start_from_first_rank(comm, tensors: list) -> None:
    """Every rank starts from the first rank's values, as DDP and DeepSpeed
    do: ranks that initialized differently would otherwise train a mix of
    models without a word. Ranks whose params differ in number, shape or
    dtype fail here, naming the difference, instead of later, in a hang."""
    comm.agree("ZeroAdamW.add_param_group",
               [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in tensors])
    import torch.distributed as dist
    source = comm._global[0]
    group = getattr(comm, "_data", comm.group)      # under rlhfz's timeout on gloo
    stage_on_host = dist.get_backend(group) == "gloo"
    with torch.no_grad():
        for t in tensors:
            staged = t.detach().cpu() if stage_on_host and t.device.type != "cpu" else t.detach()
            dist.broadcast(staged, src=source, group=group)
            if staged.data_ptr() != t.data_ptr():
                t.copy_(staged)


class NonFiniteGradError(FloatingPointError):
    """A gradient held NaN or Inf under nonfinite='raise'; no state was changed."""


def _number(name: str, value) -> float:
    """A hyperparameter as a float. Like torch, which compares it with 0.0,
    only numbers and one-element tensors pass: a string is a TypeError,
    never parsed."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{name} must be a number or a one-element tensor, not "
                    f"{type(value).__name__} ({value!r})")


def _check_hparams(lr, betas, eps, weight_decay) -> None:
    lr = _number("lr", lr)
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"Invalid learning rate: {lr}")
    eps = _number("eps", eps)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"Invalid epsilon value: {eps}")
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, not {betas!r}")
    beta1, beta2 = (_number(f"betas[{i}]", b) for i, b in enumerate(betas))
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    weight_decay = _number("weight_decay", weight_decay)
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _check_unsupported(options: dict[str, Any]) -> None:
    """Refuse torch.optim.AdamW options rlhfz does not implement."""
    if options.get("amsgrad"):
        raise ValueError("amsgrad=True is not supported by rlhfz.ZeroAdamW")
    if options.get("capturable"):
        raise ValueError("capturable=True (CUDA graph capture) is not supported by this build "
                         "of rlhfz.ZeroAdamW")
    if options.get("differentiable"):
        raise ValueError("differentiable=True is not supported by rlhfz.ZeroAdamW")
    if options.get("foreach") and options.get("fused"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


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

    ``nonfinite`` says what a NaN or Inf grad does: "raise" (the default)
    raises NonFiniteGradError, "skip" skips the step; both leave params and
    state untouched, which takes one read of the grads before the update
    (free after clip_grad_norm_, which reads them anyway). None does no check,
    as torch.optim.AdamW: a NaN then flows into params and state.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, stage=2, process_group=None, offload=None,
                 offload_ratio=1.0, pin_memory="auto", nonfinite="raise", wrap=None,
                 param_persistence_threshold=100_000, reduce_dtype=None, collectives="torch"):
        # what a copy is built from (see __getstate__)
        self._options = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             maximize=maximize, foreach=foreach, fused=fused, stage=stage,
                             offload=offload, offload_ratio=offload_ratio, pin_memory=pin_memory,
                             nonfinite=nonfinite, wrap=wrap,
                             param_persistence_threshold=param_persistence_threshold,
                             reduce_dtype=reduce_dtype, collectives=collectives)
        _check_hparams(lr, betas, eps, weight_decay)
        _check_unsupported(dict(amsgrad=amsgrad, capturable=capturable,
                                differentiable=differentiable, foreach=foreach, fused=fused))
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}")
        if offload not in (None, "cpu"):
            raise ValueError(f"offload must be None or 'cpu', not {offload!r}")
        if not (isinstance(offload_ratio, (int, float)) and 0.0 <= offload_ratio <= 1.0):
            raise ValueError(f"offload_ratio must be a number in [0, 1], not {offload_ratio!r}")
        if pin_memory not in (True, False, "auto"):
            raise ValueError(f"pin_memory must be True, False or 'auto', not {pin_memory!r}")
        if nonfinite not in ("raise", "skip", None):
            raise ValueError(f"nonfinite must be 'raise', 'skip' or None, not {nonfinite!r}")
        if not (isinstance(param_persistence_threshold, int) and param_persistence_threshold >= 0):
            raise ValueError("param_persistence_threshold must be an int >= 0")
        if reduce_dtype not in (None, torch.float32):
            raise ValueError(f"reduce_dtype must be None (the params' dtype) or torch.float32, "
                             f"not {reduce_dtype!r}")
        if collectives not in ("torch", "nccl"):
            raise ValueError(f"collectives must be 'torch' or 'nccl', not {collectives!r}")
        self.reduce_dtype = reduce_dtype

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
        elif stage == 3:
            raise ValueError("stage=3 shards parameters per module unit, so it needs the "
                             "nn.Module itself: pass ZeroAdamW(model, stage=3)")
        params = params if isinstance(params, list) else list(params)
        self.device = _common_device(params)
        self.backend = backend_for(self.device)
        if collectives == "nccl" and self.backend.tier != "device":
            raise ValueError(f"collectives='nccl' needs params on a CUDA device, not "
                             f"{self.device}")
        self.comm = communicator_for(process_group, collectives, self.backend)
        self.rank = self.comm.rank if self.comm else 0
        self.world_size = self.comm.world_size if self.comm else 1
        if self.world_size > 1 and stage == 0:
            raise ValueError(f"stage=0 does not shard, so it has no use for {self.world_size} "
                             f"ranks: wrap the model in DistributedDataParallel, or pick "
                             f"stage 1, 2 or 3")

        self.stage = stage
        self.module = module
        self.offload_target = offload
        self.offload_ratio = float(offload_ratio)
        # offload="cpu": this fraction of each shard's optimizer state lives
        # and steps on the host (pinned per pin_memory, like offload()).
        self.host_ratio = self.offload_ratio if offload == "cpu" else 0.0
        self.pin_memory = pin_memory
        self.nonfinite = nonfinite
        self.wrap = wrap
        self.param_persistence_threshold = param_persistence_threshold
        self.skipped_steps = 0
        self._buckets: list[Bucket] = []
        self.reducer = (GradReducer(self._buckets, self.comm, self.backend)
                        if stage >= 2 and self.world_size > 1 else None)
        # Stage 3 across ranks: params sharded too, gathered per unit (stage3.py).
        self.stage3 = None
        if stage == 3 and self.world_size > 1:
            from .stage3 import Stage3
            self.stage3 = Stage3(self.comm, [], root=module)
            self.reducer.on_staged = self.stage3.on_staged
            self.reducer.after_flush = self.stage3.release_all
            setattr(module, "_rlhfz_stage3", self.stage3)     # for gather_for_generation
        self._finite_versions: tuple[int, ...] | None = None
        self._host = HostBackend()
        self._offloaded: set[str] = set()          # kinds offload() moved away from home
        self._moves_in_flight = None               # the event after a non-blocking move's copies
        self._held_elsewhere: list = []            # (kind, weakref to a Buffer) still viewed

        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, foreach=foreach, capturable=False,
                        differentiable=False, fused=fused, decoupled_weight_decay=True)
        super().__init__(params, defaults)
        _LIVE.add(self)

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
        return {"options": self._options, "param_groups": groups,
                "state_dict": self.state_dict()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        if "options" not in saved:
            raise TypeError("this is not the state of a ZeroAdamW (no 'options'): build the "
                            "optimizer and use load_state_dict")
        ZeroAdamW.__init__(self, saved["param_groups"], **saved["options"])
        self.load_state_dict(saved["state_dict"])

    def __copy__(self):
        raise TypeError("a shallow copy of a ZeroAdamW would share its params' flat buffers "
                        "with the original: use copy.deepcopy")

    def _host_alloc(self, nbytes: int):
        from .migrate import host_buffer
        return host_buffer(nbytes, self.pin_memory, zero=True)

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
        self._check_params(tensors)
        options = {**self.defaults, **{k: v for k, v in group.items() if k != "params"}}
        _check_hparams(options["lr"], options["betas"], options["eps"], options["weight_decay"])
        _check_unsupported(options)

        if self.comm is not None:
            _start_from_first_rank(self.comm, tensors)

        # Build the buckets before the group is registered: if allocation
        # fails, neither the optimizer nor the model has changed.
        group_index = len(self.param_groups)
        buckets, units = [], []
        if self.stage3 is not None:
            from .stage3 import assign_params
            if self.module is None:
                raise ValueError("stage=3 needs the nn.Module: pass ZeroAdamW(model, stage=3)")
            order, persistent = assign_params(self.module, self.wrap,
                                              self.param_persistence_threshold, tensors)
            # Buckets launch their reduce-scatter in descending index, the
            # order backward finishes them: the root unit (embeddings) last,
            # the small whole params next, the units in reverse.
            root = [(m, ps, True) for m, ps in order if m is self.module]
            blocks = [(m, ps, True) for m, ps in order if m is not self.module]
            groups = root + [(None, persistent, False)] + blocks
        else:
            groups = [(None, tensors, False)]
        for unit, members_all, sharded in groups:
            unit_buckets = []
            for dtype in DTYPE_NAMES:
                members = [p for p in members_all if p.dtype == dtype]
                chunks = [members] if sharded and members else self._bucket_chunks(members)
                for chunk in chunks:
                    unit_buckets.append(Bucket(
                        chunk, group_index, dtype, self.rank, self.world_size,
                        full_grads=self.reducer is None, reduce_dtype=self.reduce_dtype,
                        backend=self.backend, host_ratio=self.host_ratio,
                        host_alloc=self._host_alloc, sharded_params=sharded))
            buckets += unit_buckets
            if unit is not None and unit_buckets:
                units.append((unit, unit_buckets))
        group["params"] = params
        super().add_param_group(group)
        param_group.clear()
        param_group.update(self.param_groups[-1])
        self.param_groups[-1] = param_group
        for bucket in buckets:
            bucket.attach()
            bucket.index = len(self._buckets)
            self._buckets.append(bucket)
            if self.reducer is not None:
                bucket.grad_sink = self.reducer.on_grad
        if self.reducer is not None:
            self.reducer.reserve()
        if units:
            self.stage3.add_units(units)

    def _bucket_chunks(self, members: list) -> list[list]:
        """One bucket per dtype, or under stage 2, runs of about stage2_bucket_bytes."""
        if self.reducer is None or not members:
            return [members] if members else []
        cap = stage2_bucket_bytes(sum(p.numel() * p.element_size() for p in members))
        chunks, current, size = [], [], 0
        for p in members:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap:
                chunks.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        chunks.append(current)
        return chunks

    def _check_params(self, tensors: list) -> None:
        seen = set()
        for p in tensors:
            if not isinstance(p, torch.Tensor):
                raise TypeError("optimizer can only optimize Tensors, but one of the params is "
                                + torch.typename(p))
            if p.layout != torch.strided:
                raise ValueError(f"sparse parameters ({p.layout}) are not supported")
            if p.is_complex() or not p.is_floating_point():
                raise TypeError(f"parameters must be float32, bfloat16 or float16, "
                                f"not {p.dtype}")
            if p.dtype not in DTYPE_NAMES:
                raise TypeError(f"parameters must be float32, bfloat16 or float16, "
                                f"not {p.dtype}")
            if p.device != self.device:
                raise ValueError(f"every parameter must be on one device: {p.device} (shape "
                                 f"{tuple(p.shape)}) differs from {self.device}")
            if id(p) in seen:
                raise ValueError("a parameter appears more than once in the param group "
                                 f"(shape {tuple(p.shape)})")
            seen.add(id(p))
        for group in self.param_groups:
            for q in group["params"]:
                if id(q) in seen:
                    raise ValueError("some parameters appear in more than one parameter group")

    # ---- gradients ---------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._finite_versions = None
        if self.reducer is not None:
            # Stage 2 holds no full grads: the shards start over.
            self.reducer.zero()
            for bucket in self._buckets:
                for p in bucket.params:
                    p.grad = None
            return
        for bucket in self._buckets:
            bucket.zero_grads(set_to_none)

    def _grad_versions(self) -> tuple[int, ...]:
        return tuple(bucket.grad_version() for bucket in self._buckets)

    def _nonfinite_params(self, plan) -> list[str]:
        """Names the params whose grads hold NaN or Inf (the slow path, on failure)."""
        bad = []
        for bucket, present, _, _ in plan:
            for i, has_grad in enumerate(present):
                a, b = bucket.local[i]
                grad = (bucket.grad_views[i] if self.comm is None
                        else bucket.flat_grad_shard[a:b])
                if has_grad and not math.isfinite(self.backend.sumsq([grad])):
                    p = bucket.params[i]
                    group = self.param_groups[bucket.group_index]["params"]
                    position = next(j for j, q in enumerate(group) if q is p)
                    bad.append(f"param_groups[{bucket.group_index}]['params'][{position}] "
                               f"shape {tuple(p.shape)}")
        return bad

    def _sumsq(self, plan) -> float:
        """Sum of squares of every (reduced) grad, over all ranks."""
        total = self.backend.sumsq([bucket.grad_shard_kview_range(lo, hi)
                                    for bucket, _, _, segments in plan
                                    for _, _, lo, hi in segments])
        if self.comm is not None:
            total = self.comm.all_reduce_sum_host(total)
        return total

    def _grads_finite(self, plan) -> bool:
        if self._finite_versions is not None and self._finite_versions == self._grad_versions():
            return True
        return math.isfinite(self._sumsq(plan))

    def _plan(self, call: str = "step"):
        """(bucket, which params have grads, runs of params that step together,
        kernel ranges in shard elements) for every bucket, with grads reduced
        across ranks."""
        if self._offloaded:
            raise RuntimeError(f"{call}() needs the optimizer's memory where it trains, but "
                               f"{', '.join(sorted(self._offloaded))} are offloaded: call "
                               f"reload() first")
        for bucket in self._buckets:
            bucket.reattach_moved()
        if self.reducer is not None:
            self.reducer.finish()
            presence = [list(bucket.arrived) for bucket in self._buckets]
        else:
            presence = [bucket.collect_grads() for bucket in self._buckets]
        if self.comm is not None:
            presence = self._agree_presence(presence, call)
            if self.reducer is None:
                self._reduce_grads(presence)
        plan = []
        for bucket, present in zip(self._buckets, presence):
            runs = bucket.segments(present)
            ranges = []
            for start, stop in runs:
                span = bucket.element_range(start, stop)
                if span is not None:
                    ranges.append((start, stop) + span)
            plan.append((bucket, present, runs, ranges))
        return plan

    def _agree_presence(self, presence, call):
        """A param has a grad if it has one on any rank (DDP's rule); ranks
        without it contribute zeros. One small MAX all-reduce, under rlhfz's
        timeout, which also catches a rank that never entered the step."""
        flat = [has for present in presence for has in present]
        self.comm.agree(f"ZeroAdamW.{call}", {"params": len(flat)})
        mask = torch.tensor(flat, dtype=torch.uint8)
        self.comm.all_reduce_max_control(mask, f"ZeroAdamW.{call}")
        merged, i = [], 0
        for bucket, present in zip(self._buckets, presence):
            agreed = [bool(v) for v in mask[i:i + len(present)].tolist()]
            i += len(present)
            for index, (mine, anyone) in enumerate(zip(present, agreed)):
                if anyone and not mine and bucket.full_grads:
                    bucket.grad_views[index].zero_()
            merged.append(agreed)
        return merged

    def _reduce_grads(self, presence) -> None:
        """Stage 1: average each bucket's grads across ranks in place, once
        per backward (as DDP leaves them); this rank's shard is a range."""
        works = []
        for bucket, present in zip(self._buckets, presence):
            if any(present) and bucket.reduced_version != bucket.flat_grad._version:
                target = bucket.flat_grad
                if bucket.flat_reduce_staging is not None:
                    bucket.flat_reduce_staging.copy_(target)    # 16-bit grads summed in fp32
                    target = bucket.flat_reduce_staging
                works.append((bucket, self.comm.all_reduce_avg(target, async_op=True)))
        for bucket, work in works:
            work.wait()
            bucket.reduced_version = bucket.flat_grad._version

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale all grads so their global 2-norm is at most max_norm; returns
        the norm before clipping, as torch.nn.utils.clip_grad_norm_ does."""
        self.synchronize()
        if float(norm_type) != 2.0:
            raise ValueError(f"only the 2-norm is supported, not norm_type={norm_type}")
        max_norm = float(max_norm)
        plan = self._plan("clip_grad_norm_")
        total = math.sqrt(self._sumsq(plan))
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError("The total norm of order 2.0 for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and "
                               "scale the gradients by the non-finite norm anyway, set "
                               "`error_if_nonfinite=False`")
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for bucket, _, _, segments in plan:
                for _, _, lo, hi in segments:
                    self.backend.scale_(bucket.grad_shard_kview_range(lo, hi), coef)
        # The C kernels leave torch's version counters alone, so these record
        # the grads exactly as checked: an unchanged step skips its own check.
        self._finite_versions = self._grad_versions() if math.isfinite(total) else None
        return torch.tensor(total, dtype=torch.float32, device=self.device)

    # ---- the step ----------------------------------------------------------------

    @staticmethod
    def _group_hparams(group) -> dict[str, Any]:
        _check_unsupported(group)
        beta1, beta2 = (float(b) for b in group["betas"])
        _check_hparams(group["lr"], (beta1, beta2), group["eps"], group["weight_decay"])
        return dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), maximize=bool(group["maximize"]))

    # torch.amp.GradScaler hands itself to step() (grad_scaler=), because
    # only the optimizer knows where sharded grads are: it unscales them
    # after they are reduced and decides on Inf/NaN for every rank at once.
    _step_supports_amp_scaling = True

    def unscale_(self, grad_scaler) -> None:
        """What grad_scaler.unscale_(optimizer) does, on the grads where
        rlhfz keeps them (sharded stages leave param.grad empty): call it
        instead before clipping. A collective across ranks."""
        from torch.amp.grad_scaler import OptState
        record = grad_scaler._per_optimizer_states[id(self)]
        if record["stage"] is not OptState.READY:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update(), or step() was")
        self._scaler_unscale(self._plan("unscale_"), grad_scaler, reached=False)
        record["stage"] = OptState.UNSCALED

    def _scaler_unscale(self, plan, grad_scaler, reached=None) -> bool:
        """Unscales the reduced grads for a GradScaler (unless its unscale_()
        already reached them through param.grad) and records one verdict for
        all ranks where its update() reads it; True when they are finite."""
        record = grad_scaler._per_optimizer_states[id(self)]
        if reached is None:
            reached = record["stage"].name == "UNSCALED" and bool(record["found_inf_per_device"])
        if not reached:
            inv_scale = 1.0 / grad_scaler.get_scale()
            for bucket, _, _, segments in plan:
                for _, _, lo, hi in segments:
                    self.backend.scale_(bucket.grad_shard_kview_range(lo, hi), inv_scale)
        finite = math.isfinite(self._sumsq(plan))
        flag = torch.tensor(0.0 if finite else 1.0, dtype=torch.float32,
                            device=grad_scaler._scale.device)
        record["found_inf_per_device"] = {flag.device: flag}
        self._finite_versions = None
        return finite

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        self.synchronize()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Everything that can fail is checked before the first kernel runs,
        # so a refused step leaves params and state exactly as they were.
        hparams = [self._group_hparams(group) for group in self.param_groups]
        plan = self._plan()
        if grad_scaler is not None and not self._scaler_unscale(plan, grad_scaler):
            self.skipped_steps += 1           # the scaler backs off; nothing changes
            return loss
        if self.nonfinite is not None and not self._grads_finite(plan):
            self._finite_versions = None
            if self.nonfinite == "skip":
                self.skipped_steps += 1
                return loss
            bad = self._nonfinite_params(plan)
            raise NonFiniteGradError(
                f"non-finite gradient (NaN or Inf) in {len(bad)} parameter(s): "
                f"{'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. The step was not taken "
                f"and no state changed; pass nonfinite='skip' to skip such steps instead.")
        gathers = []
        # Host parts' grads come over first, so the device kernels launched
        # next run while the CPU kernels step the host parts.
        for bucket, _, _, segments in plan:
            if bucket.split < bucket.layout.shard_numel and segments:
                bucket.host_flat_grad.copy_(bucket.flat_grad_shard[bucket.split:])
        for bucket, present, runs, segments in plan:
            hp = hparams[bucket.group_index]
            steps = bucket.steps.tolist()
            k = bucket.split
            copied = False
            for start, stop, lo, hi in segments:
                step = int(steps[start]) + 1
                if lo < min(hi, k):
                    self.backend.adamw_step(bucket.kernel_views(lo, min(hi, k)), step, hp)
                if max(lo, k) < hi:
                    bucket.wait_host_param()     # its last copy to the device has read it
                    self._host.adamw_step(bucket.host_kernel_views(max(lo, k), hi), step, hp)
                    a, b = max(lo, k) - k, hi - k
                    bucket.flat_param_shard[a + k:b + k].copy_(bucket.host_flat_param[a:b],
                                                                non_blocking=True)
                    copied = True
            if copied and self.backend.tier == "device":
                # the copies read the staging buffer after this returns
                bucket.fence_host_param(self.backend.record(self.backend.stream()))
            if bucket.stitched:
                bucket.refresh_stitched()
            # Step counts advance for every param with a grad, also those
            # whose elements all live on other ranks.
            for start, stop in runs:
                if start == 0 and stop == len(present):
                    bucket.steps.add_(1.0)
                else:
                    bucket.steps[start:stop].add_(1.0)
                if not bucket.all_registered:
                    for i in range(start, stop):
                        if not bucket.registered[i]:
                            self._register_state(bucket, i)
                    bucket.all_registered = all(bucket.registered)
            if self.comm is not None and any(present) and not bucket.sharded_params:
                # in flight while the next bucket steps
                gathers.append(self.comm.all_gather(bucket.flat_param, bucket.flat_param_shard,
                                                    async_op=True))
        for work in gathers:
            work.wait()
        self._finite_versions = None
        return loss

    def _register_state(self, bucket: Bucket, index: int) -> None:
        state = {"step": bucket.step_views[index],
                 "exp_avg": bucket.exp_avg_views[index],
                 "exp_avg_sq": bucket.exp_avg_sq_views[index]}
        if bucket.master_views is not None:
            state["master_param"] = bucket.master_views[index]
        self.state[bucket.params[index]] = state
        bucket.registered[index] = True

    def _unregister_state(self, bucket: Bucket, index: int) -> None:
        self.state.pop(bucket.params[index], None)
        bucket.registered[index] = False
        bucket.all_registered = False

    # ---- state dicts -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The torch.optim.AdamW format. Across processes this is a collective
        (every rank calls it, and every rank gets the whole dict)."""
        self.synchronize()
        if self.comm is None:
            return super().state_dict()
        self.comm.agree("ZeroAdamW.state_dict",
                        {"buckets": [len(b.params) for b in self._buckets]})
        # torch's post-hooks see the finished dict: this rank's shards are
        # replaced by the whole state below, so they run after that
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = type(post_hooks)()
        try:
            packed = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        position = {id(p): i for i, p in
                    enumerate(p for group in self.param_groups for p in group["params"])}
        state = {}
        for bucket in self._buckets:
            shards = [("exp_avg", bucket.full_shard("exp_avg")),
                      ("exp_avg_sq", bucket.full_shard("exp_avg_sq"))]
            if bucket.master_buffer is not None:
                shards.append(("master_param", bucket.full_shard("master")))
            full = {}
            for name, shard in shards:
                full[name] = torch.empty(bucket.layout.padded_numel, dtype=torch.float32,
                                         device=self.device)
                self.comm.all_gather(full[name], shard)
            for i, p in enumerate(bucket.params):
                if not bucket.registered[i]:
                    continue
                slot = bucket.layout.slots[i]
                entry = {"step": bucket.steps[i].clone()}
                for name, flat in full.items():
                    entry[name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                state[position[id(p)]] = entry
        packed["state"] = state
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
        packed = super().state_dict() if self.comm is None else None
        groups = packed["param_groups"] if packed else self._packed_groups()
        position = {id(p): i for i, p in
                    enumerate(p for group in self.param_groups for p in group["params"])}
        buckets = []
        for bucket in self._buckets:
            buckets.append({
                "params": [position[id(p)] for p in bucket.params],
                "shapes": [tuple(s.shape) for s in bucket.layout.slots],
                "offsets": [s.offset for s in bucket.layout.slots],
                "registered": list(bucket.registered),
                "shard_start": bucket.shard_start,
                "steps": bucket.steps.clone(),
                "exp_avg": bucket.full_shard("exp_avg").clone(),
                "exp_avg_sq": bucket.full_shard("exp_avg_sq").clone(),
                "master_param": (bucket.full_shard("master").clone()
                                 if bucket.master_buffer is not None else None),
            })
        return {"format": SHARDED_FORMAT, "rank": self.rank, "world_size": self.world_size,
                "param_groups": groups, "buckets": buckets}

    def _packed_groups(self) -> list[dict]:
        groups, start = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(packed)
        return groups

    def load_sharded_state_dict(self, shards: list[dict[str, Any]]) -> None:
        """Loads the sharded_state_dict() of every rank of a run of any world
        size (a list, in any order); a collective across processes."""
        self.load_state_dict(consolidate_sharded(shards))

    def _checked_state_dict(self, state_dict: dict[str, Any]) -> dict:
        """Checks a torch.optim.AdamW-format state dict against this optimizer
        and returns its param index -> param map; raises ValueError."""
        if not isinstance(state_dict, dict) or "state" not in state_dict \
                or "param_groups" not in state_dict:
            raise ValueError("a state dict needs 'state' and 'param_groups' entries")
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                             f"but the optimizer has {len(self.param_groups)}")
        index_to_param = {}
        shapes = {id(p): slot.shape for b in self._buckets
                  for p, slot in zip(b.params, b.layout.slots)}
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"loaded state dict contains a parameter group that doesn't "
                                 f"match the size of optimizer's group: group {g} has "
                                 f"{len(saved['params'])} params, the optimizer's has "
                                 f"{len(group['params'])}")
            options = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            merged = {**group, **options}
            _check_unsupported(merged)
            _check_hparams(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
            index_to_param.update(zip(saved["params"], group["params"]))
        for key, entry in saved_state.items():
            if key not in index_to_param:
                raise ValueError(f"state for parameter {key!r} matches no parameter of the "
                                 f"optimizer")
            param = index_to_param[key]
            self._check_state_entry(key, entry, shapes.get(id(param), tuple(param.shape)))

        return index_to_param

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
        index_to_param = self._checked_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if self.comm is not None:
            self.comm.agree("ZeroAdamW.load_state_dict",
                            {"buckets": [len(b.params) for b in self._buckets]})
        # All checked: now write. Each rank takes its shard's part of every
        # full tensor, so a dict saved at any world size loads at this one.
        for saved, group in zip(saved_groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":      # saved param_names too, as torch keeps them
                    group[k] = copy.deepcopy(v)
        loaded = {id(index_to_param[k]): entry for k, entry in saved_state.items()}
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                entry = loaded.get(id(p))
                if entry is None:
                    zeros = torch.zeros(bucket.local[i][1] - bucket.local[i][0])
                    bucket.write_state("exp_avg", i, zeros)
                    bucket.write_state("exp_avg_sq", i, zeros)
                    bucket.steps[i] = 0.0
                    if bucket.master_views is not None:
                        bucket.write_state("master", i, bucket.param_shard_part(i).float())
                    self._unregister_state(bucket, i)
                    continue
                bucket.write_state("exp_avg", i, bucket.local_part(i, entry["exp_avg"]))
                bucket.write_state("exp_avg_sq", i, bucket.local_part(i, entry["exp_avg_sq"]))
                bucket.steps[i] = float(entry["step"])
                if bucket.master_views is not None:
                    master = entry.get("master_param")
                    bucket.write_state("master", i, (
                        bucket.local_part(i, master) if master is not None
                        else bucket.param_shard_part(i)).float())
                self._register_state(bucket, i)
            # fp32 params are their own master: the host part's copy follows them
            bucket.pull_host_part(master=bucket.master_views is None)
        self._finite_versions = None
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    @staticmethod
    def _check_state_entry(key, entry, shape: tuple) -> None:
        if not isinstance(entry, dict):
            raise ValueError(f"state for parameter {key!r} is not a dict")
        for name in ("step", "exp_avg", "exp_avg_sq"):
            if name not in entry:
                raise ValueError(f"state for parameter {key!r} has no {name!r}")
        step = entry["step"]
        if isinstance(step, torch.Tensor):
            if step.numel() != 1:
                raise ValueError(f"state[{key!r}]['step'] must be a scalar")
            step = step.item()
        try:
            whole = (isinstance(step, (int, float)) and math.isfinite(step) and step >= 0
                     and float(step).is_integer())
        except OverflowError:        # an int no float can hold
            whole = False
        if not whole:
            raise ValueError(f"state[{key!r}]['step'] must be a whole number >= 0, not {step!r}")
        names = ["exp_avg", "exp_avg_sq"] + (["master_param"] if "master_param" in entry else [])
        for name in names:
            value = entry[name]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"state[{key!r}][{name!r}] must be a tensor")
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"state[{key!r}][{name!r}] has shape {tuple(value.shape)} but "
                                 f"the parameter has shape {tuple(shape)}: the state dict "
                                 f"is from another model")
            if not value.is_floating_point():
                raise ValueError(f"state[{key!r}][{name!r}] must be floating point, "
                                 f"not {value.dtype}")

    # ---- reports ---------------------------------------------------------------------

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank's optimizer owns, by kind and by the tier each
        lives in now. fp32 params are their own master weights, so 'master'
        counts only separate copies. Memory that offload() could not free
        because a tensor outside still views it appears under the tier
        'held_elsewhere' of its kind."""
        report = {kind: {tier: 0 for tier in _TIERS} for kind in _KINDS}
        for bucket in self._buckets:
            for kind, per_tier in bucket.nbytes_by_tier().items():
                for tier, nbytes in per_tier.items():
                    report[kind][tier] += nbytes
        if self.reducer is not None:
            report["grads"][self.backend.tier] += self.reducer.nbytes()
        self._held_elsewhere = [(kind, ref) for kind, ref in self._held_elsewhere
                                if ref() is not None and ref().exports > 0]
        for kind, ref in self._held_elsewhere:
            buffer = ref()
            if buffer is not None:
                kinds = ("master", "exp_avg", "exp_avg_sq") if kind == "optimizer" else (kind,)
                entry = report[kinds[0]]
                entry["held_elsewhere"] = entry.get("held_elsewhere", 0) + buffer.nbytes
        return report

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

    def synchronize(self) -> None:
        """Waits for the copies a non_blocking offload() or reload() left in
        flight. rlhfz does so itself before it touches the moved memory (a
        step, a state dict, a checkpoint); code of yours that reads a moved
        tensor on the host calls this first."""
        from .migrate import settle
        settle(self)

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
        from .migrate import offload_optimizer
        offload_optimizer(self, what, to, path, non_blocking)

    def reload(self, non_blocking=False) -> None:
        """Brings everything offload() moved back where the optimizer trains."""
        from .migrate import reload_optimizer
        reload_optimizer(self, non_blocking)

    def close(self) -> None:
        """Releases what the optimizer holds outside Python's reach: the
        process groups it made for its collectives (sockets, gloo threads),
        the native NCCL communicator (collectives="nccl"), and the pinned
        buffers reload() kept for the next offload. Every rank calls it; the
        optimizer cannot step afterwards."""
        if self.comm is not None:
            self.comm.destroy()
        from .migrate import release_pinned
        release_pinned()

    def __repr__(self) -> str:
        params = sum(len(b.params) for b in self._buckets)
        return (f"ZeroAdamW(stage={self.stage}, world_size={self.world_size}, "
                f"groups={len(self.param_groups)}, buckets={len(self._buckets)}, "
                f"params={params})")
