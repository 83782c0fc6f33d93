"""The sharded AdamW engine: buckets of flat storage, their shards, and the step.

No torch.optim here. The engine keeps the buckets of every param group,
knows which rank owns which elements, and runs a step: it collects (or is
handed, by a reducer) each bucket's grads, checks and clips them, launches
one fused AdamW kernel per bucket part (the backend part and the host part
of offload="cpu" at once), and all-gathers the new params. ZeroAdamW
(optim.py) is the torch.optim face of it; the reducer (stage 2), stage 3,
migration and checkpoints use the public methods below.
"""
from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import torch

from .backends import DTYPE_NAMES, HostBackend
from .bucket import Bucket
from .layout import split_by_bytes, stage2_bucket_bytes

# The largest exp_avg_sq an int8 bucket lets a step reach: a block's scale
# (its largest root) cannot hold an Inf, and below half of fp32's range,
# beta2 * v + (1 - beta2) * g^2 <= max(v, g^2) keeps every later step below
# the top too.
INT8_SQ_LIMIT = float(torch.finfo(torch.float32).max) / 2


@dataclass
class BucketPlan:
    """What one step does to one bucket."""

    bucket: Bucket
    present: list[bool]                       # which params have a grad (on any rank)
    runs: list[tuple[int, int]]               # params that step together (one step count)
    segments: list[tuple[int, int, int, int]]   # (start, stop, lo, hi): runs in shard elements


def _bucket_plan(bucket, present: list[bool]) -> BucketPlan:
    runs = _segment_ranges(present, bucket.steps.tolist())
    segments = []
    for start, stop in runs:
        span = bucket.shard.element_range(start, stop)
        if span is not None:
            segments.append((start, stop) + span)
    return BucketPlan(bucket, present, runs, segments)


def _segment_ranges(present: list[bool], steps: list[float]) -> list[tuple[int, int]]:
    """Runs of consecutive params that have a grad and share a step count:
    each run is one kernel call (one per bucket when every param has a grad)."""
    runs = []
    start = None
    for i, has_grad in enumerate(present):
        if start is not None and (not has_grad or steps[i] != steps[start]):
            runs.append((start, i))
            start = None
        if has_grad and start is None:
            start = i
    if start is not None:
        runs.append((start, len(present)))
    return runs


def _by_state_dtype(params: list, state_dtype: str, min_8bit_size: int):
    """[(state dtype, params)]: int8 moments only for params of at least
    min_8bit_size elements (smaller ones gain little and quantize worst)."""
    if state_dtype != "int8":
        return [(state_dtype, params)]
    small = [p for p in params if p.numel() < min_8bit_size]
    large = [p for p in params if p.numel() >= min_8bit_size]
    return [(kept, members) for kept, members in (("fp32", small), ("int8", large)) if members]


class ShardEngine:
    """Every bucket of one optimizer, on one backend, over one communicator
    (None in a single process)."""

    def __init__(self, backend, comm, *, stage: int, host_ratio: float = 0.0,
                 reduce_dtype: torch.dtype | None = None, bucket_bytes: int | None = None,
                 host_alloc=None):
        self.backend = backend
        self.device = backend.device
        self.comm = comm
        self.rank = comm.rank if comm else 0
        self.world_size = comm.world_size if comm else 1
        self.stage = stage
        self.host_ratio = host_ratio
        self.reduce_dtype = reduce_dtype
        self.bucket_bytes = bucket_bytes
        self.host_alloc = host_alloc
        self.buckets: list[Bucket] = []
        self.reducer = None              # stage 2 across ranks: reduces grads during backward
        self.on_state = None             # on_state(bucket, index, entry or None)
        self.offloaded: set[str] = set()          # kinds moved away from where they train
        self.moves_in_flight = None               # the event after a non-blocking move's copies
        self.held_elsewhere: list = []            # (report kind, weakref to a Buffer) viewed
        self._host = HostBackend()
        self._finite_versions: tuple[int, ...] | None = None
        # A clip not yet applied to grads only rlhfz can read (the reducer's
        # shards): (plans, factor). The step folds the factor into its grad
        # scale; anything else that reads or adds to those grads applies it
        # first (settle_grads), as does the reducer before new grads come.
        self._pending_clip: tuple[list, float] | None = None
        self.clipped = False             # clip() ran since the grads were last zeroed
        # Stage 1 across ranks averages grads when a backward ends, as DDP
        # does (so p.grad holds the mean for whatever reads it before the
        # step); inside no_sync() that waits for a later backward or the step.
        self.average_after_backward = True
        self.serial = next(_SERIALS)     # engines made earlier average first
        self._stale: set[int] = set()    # id(bucket): stage 1's next average includes it
        # The sum of squares of the grads as the next step reads them (clip
        # included), over all ranks, from the last check; None: not known.
        self._step_sumsq: float | None = None
        # stage 3: what else the shard group's ranks agree on at each plan
        # (Stage3.take_trail), or None
        self.trail = None

    def use_reducer(self, reducer) -> None:
        """Grads go to the reducer from now on (before any bucket exists)."""
        self.reducer = reducer
        reducer.before_new_grads = self.settle_grads

    # ---- building buckets ---------------------------------------------------------

    def make_buckets(self, group_index: int, parts, state_dtype: str = "fp32",
                     min_8bit_size: int = 0) -> list[tuple[object, list[Bucket]]]:
        """Buckets for one param group, allocated but not attached: if memory
        runs out, nothing has changed. parts: [(unit or None, params,
        sharded)]; returns [(unit, its buckets)]. One bucket per dtype, or
        under stage 2 runs of about stage2_bucket_bytes; a sharded unit's
        params of one dtype stay in one bucket, gathered together. With
        state_dtype "int8", params under min_8bit_size elements keep fp32
        moments, in buckets of their own."""
        made = []
        for unit, members_all, sharded in parts:
            unit_buckets = []
            for dtype in DTYPE_NAMES:
                of_dtype = [p for p in members_all if p.dtype == dtype]
                for kept, members in _by_state_dtype(of_dtype, state_dtype, min_8bit_size):
                    chunks = [members] if sharded and members else self._chunks(members)
                    for chunk in chunks:
                        unit_buckets.append(Bucket(
                            chunk, group_index, dtype, self.rank, self.world_size,
                            full_grads=self.reducer is None, reduce_dtype=self.reduce_dtype,
                            backend=self.backend, host_ratio=self.host_ratio,
                            host_alloc=self.host_alloc, sharded_params=sharded,
                            state_dtype=kept))
            made.append((unit, unit_buckets))
        return made

    def _chunks(self, members: list) -> list[list]:
        if self.reducer is None or not members:
            return [members] if members else []
        cap = stage2_bucket_bytes(sum(p.numel() * p.element_size() for p in members),
                                  self.bucket_bytes)
        return split_by_bytes(members, lambda p: p.numel() * p.element_size(), cap)

    def attach(self, buckets: list[Bucket]) -> None:
        """Makes the buckets' params views of their memory, and the engine's."""
        sink = (self.reducer.on_grad if self.reducer is not None else
                self._grad_arrived if self.comm is not None else _keep_grad_in_bucket)
        before = self.reducer.before_grad if self.reducer is not None else None
        for bucket in buckets:
            bucket.attach(sink, index=len(self.buckets), before_grad=before)
            self.buckets.append(bucket)
        if self.reducer is not None:
            self.reducer.reserve()

    def owners(self) -> dict[int, tuple[Bucket, int]]:
        """id(param) -> (its bucket, its index there)."""
        return {id(p): (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}

    # ---- state registration ---------------------------------------------------------

    def register(self, bucket: Bucket, index: int) -> None:
        """The param has optimizer state (as torch.optim.AdamW's, after its first step)."""
        bucket.state.registered[index] = True
        if self.on_state is not None:
            self.on_state(bucket, index, bucket.state.entry(index))

    def unregister(self, bucket: Bucket, index: int) -> None:
        bucket.state.registered[index] = False
        bucket.state.all_registered = False
        if self.on_state is not None:
            self.on_state(bucket, index, None)

    def release_disk_pages(self) -> None:
        """Drops from this process the pages of state offloaded to disk that
        a read or a write since (a checkpoint) brought in; the files keep
        the bytes."""
        for bucket in self.buckets:
            for _, _, buffer in bucket.storage.movable(("params", "grads", "optimizer")):
                if buffer.tier == "disk":
                    buffer.release_pages()

    def grads_changed(self) -> None:
        """Grads were written outside a step: the next step checks them again
        (and takes their sum of squares anew)."""
        self._finite_versions = None
        self._step_sumsq = None

    # ---- grads -----------------------------------------------------------------------

    def zero_grads(self, set_to_none: bool) -> None:
        self.grads_changed()
        self._pending_clip = None        # the grads it scaled are gone
        self.clipped = False
        if self.reducer is not None:
            self.reducer.zero(set_to_none)   # stage 2 holds no full grads: the shards start over
        for bucket in self.buckets:
            bucket.reattach_moved()      # a cast since the last step: grads and params home first
            bucket.zero_grads(set_to_none)

    def zero_param_grads(self, ids: set, set_to_none: bool = True) -> None:
        """module.zero_grad() over params of this optimizer whose grads live
        in the reducer's shards (p.grad is None, so torch's finds nothing):
        those params' grads start over, as p.grad = None (or, with
        set_to_none=False, p.grad.zero_()) would make them."""
        hits = [(b, i) for b in self.buckets for i, p in enumerate(b.params) if id(p) in ids]
        if not hits:
            return
        if len(hits) == sum(len(b.params) for b in self.buckets):
            self.zero_grads(set_to_none)
            return
        self.settle_grads()              # a clip of the grads that stay applies to them alone
        self.grads_changed()
        for bucket, index in hits:
            self.reducer.zero_param(bucket, index, set_to_none)

    def _grad_versions(self) -> tuple[int, ...]:
        if self.reducer is not None:
            return tuple(self.reducer.version(b) for b in self.buckets)
        return tuple(b.flat_grad._version for b in self.buckets)

    def require_home(self, call: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"{call}() needs the optimizer's memory where it trains, but "
                               f"{', '.join(sorted(self.offloaded))} are offloaded: call "
                               f"reload() first")

    def adopt_written(self) -> None:
        """Params whose memory or values changed outside rlhfz since the last
        look: the optimizer's copies follow (Bucket.reattach_moved,
        Bucket.adopt_written)."""
        for bucket in self.buckets:
            bucket.reattach_moved()
            bucket.adopt_written()
            bucket.take_sharded_swaps()
            if bucket.state is not None and bucket.state.stitched:
                bucket.state.take_stitched_writes()

    def moved_to(self) -> torch.device | None:
        """The device that every param was moved to outside rlhfz
        (model.to(device) after the optimizer was built), or None: none
        moved, or not all alike (plan() then says what is wrong)."""
        # model.to() moves every param: the first tells (a partial move is
        # plan()'s to refuse), so a step pays one look, not one per param
        first = next((b.params[0] for b in self.buckets if b.param_views and b.params), None)
        if first is None or first.device == self.device:
            return None
        pairs = [(p, view) for bucket in self.buckets if bucket.param_views is not None
                 for p, view in zip(bucket.params, bucket.param_views)]
        devices = {p.device for p, _ in pairs}
        if len(devices) != 1 or next(iter(devices)) == self.device:
            return None
        if any(p.dtype != view.dtype or p.shape != view.shape for p, view in pairs):
            return None
        return next(iter(devices))

    def detach(self) -> None:
        """Lets go of the params: no more grad hooks (the engine that takes
        them over attaches its own)."""
        for bucket in self.buckets:
            bucket.detach_hooks()

    def plan(self, call: str = "step") -> list[BucketPlan]:
        """Every bucket's plan, with grads reduced across ranks."""
        self.require_home(call)
        self.adopt_written()
        handed = None
        if self.reducer is not None:
            handed = self.reducer.hand_set()
            presence = [[arrived or mine for arrived, mine in
                         zip(self.reducer.arrived(bucket), marks)]
                        for bucket, marks in zip(self.buckets, handed)]
        else:
            presence = [bucket.collect_grads() for bucket in self.buckets]
        if self.comm is not None:
            presence, handed = self._agree_presence(presence, call, handed)
            if self.reducer is None:
                self._reduce_grads(presence)
        if self.reducer is not None:
            self.reducer.take_hand_set(handed)
        return [_bucket_plan(bucket, present) for bucket, present in zip(self.buckets, presence)]

    @staticmethod
    def restrict(plans, ids: set) -> list[BucketPlan]:
        """The plans cut down to the params whose id is in ids (a clip over
        some of the params)."""
        return [_bucket_plan(plan.bucket, [has and id(p) in ids for has, p in
                                           zip(plan.present, plan.bucket.params)])
                for plan in plans]

    def _grad_arrived(self, bucket: Bucket, index: int, param: torch.Tensor) -> None:
        """Stage 1 across ranks: the grad goes into its bucket, and the
        engine's grads are averaged when the backward ends."""
        _keep_grad_in_bucket(bucket, index, param)
        if self.average_after_backward:
            _AVERAGES.add(self)

    def average_grads(self) -> None:
        presence, _ = self._agree_presence([bucket.collect_grads() for bucket in self.buckets],
                                           "backward")
        self._reduce_grads(presence)

    def _agree_presence(self, presence, call, handed=None):
        """A param has a grad if it has one on any rank (DDP's rule); ranks
        without it contribute zeros. One small MAX all-reduce, under rlhfz's
        timeout, which also catches a rank that never entered the step.
        Stage 1: a bucket written since its last average on any rank is
        averaged again on every rank (self._stale). Stages 2 and 3: which
        params any rank set a grad for by hand (handed), in the same mask.
        Returns (presence, handed), both as agreed."""
        flat = [has for present in presence for has in present]
        full = [bucket for bucket in self.buckets if bucket.full_grads]
        self.comm.agree(f"ZeroAdamW.{call}", {"params": len(flat)},
                        within=self.trail() if self.trail is not None else None)
        hand = [] if handed is None else [mine for marks in handed for mine in marks]
        mask = torch.tensor(flat + [not bucket.grads_reduced() for bucket in full] + hand,
                            dtype=torch.uint8)
        self.comm.all_reduce_max_control(mask, f"ZeroAdamW.{call}")
        self._stale = {id(bucket) for bucket, stale in
                       zip(full, mask[len(flat):len(flat) + len(full)].tolist()) if stale}
        if handed is not None:
            agreed, at = [], len(flat) + len(full)
            for marks in handed:
                agreed.append([bool(v) for v in mask[at:at + len(marks)].tolist()])
                at += len(marks)
            handed = agreed
        merged, i = [], 0
        for bucket, present in zip(self.buckets, presence):
            agreed = [bool(v) for v in mask[i:i + len(present)].tolist()]
            i += len(present)
            for index, (mine, anyone) in enumerate(zip(present, agreed)):
                if anyone and not mine and bucket.full_grads:
                    # attached, so a later plan() (a clip, then the step)
                    # finds it present and leaves the reduced grad alone;
                    # after the reduction it holds the mean, as DDP leaves it
                    view = bucket.unheld_grad_view(index)
                    view.zero_()
                    bucket.params[index].grad = view
            merged.append(agreed)
        return merged, handed

    def _reduce_grads(self, presence) -> None:
        """Stage 1: average each bucket's grads across ranks in place, once
        per backward (as DDP leaves them); this rank's shard is a range."""
        works = []
        for bucket, present in zip(self.buckets, presence):
            if any(present) and id(bucket) in self._stale:
                target = bucket.flat_grad
                if bucket.flat_reduce_staging is not None:
                    bucket.flat_reduce_staging.copy_(target)    # 16-bit grads summed in fp32
                    target = bucket.flat_reduce_staging
                works.append((bucket, self.comm.all_reduce_avg(target, async_op=True)))
        for bucket, work in works:
            work.wait()
            if bucket.flat_reduce_staging is not None:
                # p.grad holds the mean too (rounded), as DDP leaves it; the
                # step reads the fp32 sum's mean
                bucket.flat_grad.copy_(bucket.flat_reduce_staging)
            bucket.mark_reduced()

    def _grad_views(self, plans):
        return [p.bucket.grad_shard_kview_range(lo, hi)
                for p in plans for _, _, lo, hi in p.segments]

    def settle_grads(self) -> None:
        """Applies a clip the step has not folded in yet to the grads."""
        pending, self._pending_clip = self._pending_clip, None
        if pending is not None:
            self._scale_views(*pending)

    def sumsq(self, plans, local_inf: bool = False) -> float:
        """Sum of squares of every (reduced) grad, over all ranks; local_inf:
        this rank knows of an Inf already, so every rank's total is Inf."""
        self.settle_grads()
        total = math.inf if local_inf else self.backend.sumsq(self._grad_views(plans))
        if self.comm is not None:
            total = self.comm.all_reduce_sum_host(total)
        self._step_sumsq = total
        return total

    def scale_grads(self, plans, factor: float) -> None:
        self.settle_grads()
        self._scale_views(plans, factor)

    def _scale_views(self, plans, factor: float) -> None:
        # NaN or Inf times the zero padding between params is NaN, and
        # nothing writes padding again: every later norm would be NaN. So a
        # non-finite factor scales each param's own elements only.
        finite = math.isfinite(factor)
        views = []
        for plan in plans:
            bucket = plan.bucket
            whole = bucket.full_grads and bucket.world_size > 1
            if whole:
                # stage 1: p.grad is the whole mean grad, reduced again after
                # a write to it: all of it scales, not this rank's range alone
                slots = bucket.layout.slots
                runs = plan.runs if finite else [(i, i + 1) for a, b in plan.runs
                                                 for i in range(a, b)]
                spans = [(slots[a].offset, slots[b - 1].offset + slots[b - 1].numel)
                         for a, b in runs]
                views += [bucket.grad_kview_range(lo, hi) for lo, hi in spans if lo < hi]
            if not whole or bucket.reduces_in_staging:
                spans = ([(lo, hi) for _, _, lo, hi in plan.segments] if finite else
                         [span for start, stop, _, _ in plan.segments
                          for span in bucket.shard.local[start:stop]])
                views += [bucket.grad_shard_kview_range(lo, hi) for lo, hi in spans if lo < hi]
        for view in views:
            self.backend.scale_(view, factor)

    def clamp_grads(self, plans, value: float, ids: set | None = None) -> None:
        """Clamps the reduced grads in the shards to [-value, value], as
        torch.nn.utils.clip_grad_value_ does to whole ones: all of them, or
        the params' whose id is in `ids`. Elementwise, so each rank clamps
        its own range; the zero padding stays zero and NaN stays NaN."""
        self.settle_grads()
        for plan in plans:
            bucket = plan.bucket
            if ids is None:        # whole runs at once: their padding is zero and stays so
                spans = [(lo, hi) for _, _, lo, hi in plan.segments]
            else:
                spans = [bucket.shard.local[index] for start, stop, _, _ in plan.segments
                         for index in range(start, stop) if id(bucket.params[index]) in ids]
            for lo, hi in spans:
                if lo < hi:
                    bucket.flat_grad_shard[lo:hi].clamp_(-value, value)
        self.grads_changed()

    def norm(self, plans, norm_type: float = 2.0) -> tuple[float, float | None]:
        """The global norm of the grads, as torch.nn.utils.clip_grad_norm_
        computes it over whole grads (a collective across ranks), and their
        sum of squares where it was taken (else None). torch takes each
        tensor's norm in the grad's dtype, then the norm of those: for
        16-bit grads that rounding shows, so each param's norm is taken over
        its shards and rounded as torch rounds it. A 2-norm of 32-bit grads
        is the exact one, on rlhfz's fused kernels (torch's differs from it
        by rounding in the last bits)."""
        if not (norm_type > 0 or norm_type == math.inf):
            raise ValueError(f"norm_type must be > 0 or inf, not {norm_type}: a norm of the "
                             f"shards with zero padding would differ from torch's")
        if norm_type == 2.0 and all(p.bucket.dtype.itemsize >= 4 for p in plans):
            sumsq = self.sumsq(plans)
            return math.sqrt(sumsq), sumsq
        self.settle_grads()
        grads, dtypes = [], []
        for plan in plans:     # every rank lists the same params: those with a grad anywhere
            bucket = plan.bucket
            for index, has_grad in enumerate(plan.present):
                if has_grad:
                    lo, hi = bucket.shard.local[index]
                    grads.append((bucket, lo, hi))
                    dtypes.append(bucket.dtype)
        if not grads:
            return 0.0, 0.0
        if norm_type == 2.0:
            held = [i for i, (_, lo, hi) in enumerate(grads) if hi > lo]
            parts = self.backend.sumsq_each([grads[i][0].grad_shard_kview_range(*grads[i][1:])
                                             for i in held])
            totals = torch.zeros(len(grads), dtype=torch.float64)
            totals[held] = torch.tensor(parts, dtype=torch.float64)
        else:
            # the max is exact in any dtype; a sum of powers is taken in double.
            # Stacked where the grads are, then one read to the host.
            wide = None if norm_type == math.inf else torch.float64
            parts = [torch.linalg.vector_norm(b.flat_grad_shard[lo:hi], norm_type, dtype=wide)
                     .to(torch.float64) if hi > lo
                     else b.flat_grad_shard.new_zeros((), dtype=torch.float64)
                     for b, lo, hi in grads]
            totals = torch.stack([t.to(parts[0].device) for t in parts]).cpu()
            if norm_type != math.inf:
                totals = totals.pow(norm_type)
        totals = self._combine_shards(totals, norm_type)
        each = totals if norm_type == math.inf else totals.pow(1.0 / norm_type)
        norms = torch.stack([value.to(dtype) for value, dtype in zip(each, dtypes)])
        total = float(torch.linalg.vector_norm(norms, norm_type))
        return total, (float(totals.sum()) if norm_type == 2.0 else None)

    def _combine_shards(self, totals: torch.Tensor, norm_type: float) -> torch.Tensor:
        """Each param's sum of |g|**p (or max |g|) over its shards on every
        rank. A NaN anywhere stays NaN, as in torch: a MAX all-reduce may
        drop one, so NaNs go as a flag beside the values."""
        if self.comm is None:
            return totals
        if norm_type != math.inf:
            return self.comm.all_reduce_sum_host(totals)
        nan = totals.isnan()
        both = torch.cat([totals.masked_fill(nan, 0.0), nan.to(torch.float64)])
        self.comm.all_reduce_max_control(both, "clip_grad_norm_")
        values, flags = both.chunk(2)
        return values.masked_fill(flags > 0, math.nan)

    def clip(self, plans, total: float, max_norm: float, dtype: torch.dtype,
             sumsq: float | None = None, in_place: bool = False) -> None:
        """Scales grads of global norm `total` as torch.nn.utils.clip_grad_norm_
        does: by max_norm / (total + 1e-6), at most 1, computed in the norm's
        dtype (the grads' promoted one). A NaN norm makes every grad NaN and
        an infinite one zeroes them (an Inf grad becomes NaN), as in torch.
        sumsq: the grads' sum of squares (of a 2-norm), or None. in_place:
        the plans cover some params only (restrict), or `total` was not
        taken here: they are scaled now (the step's factor is for every
        grad) and checked again at the step."""
        self.clipped = True
        norm = torch.tensor(total, dtype=dtype)
        coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        if in_place:
            self.settle_grads()
            if not coef >= 1.0:
                self._scale_views(plans, coef)
            self.grads_changed()     # the others' grads were never checked
            return
        if coef < 1.0 and self.reducer is not None and math.isfinite(total):
            # Only rlhfz reads these grads (param.grad is None): the step
            # multiplies by coef as it reads them, which saves a pass that
            # reads and writes every grad.
            self._pending_clip = (plans, coef)
        elif not coef >= 1.0:
            self.scale_grads(plans, coef)
        # The C kernels leave torch's version counters alone, so these record
        # the grads exactly as checked: an unchanged step skips its own check.
        self._finite_versions = self._grad_versions() if math.isfinite(total) else None
        self._step_sumsq = None if sumsq is None else sumsq * min(coef, 1.0) ** 2

    def grads_finite(self, plans) -> bool:
        if self._finite_versions is not None and self._finite_versions == self._grad_versions():
            return True
        return math.isfinite(self.sumsq(plans))

    def nonfinite(self, plans) -> list[tuple[Bucket, int]]:
        """(bucket, index) of the params whose grads hold NaN or Inf (the
        slow path, after a failed check)."""
        self.settle_grads()
        bad = []
        for plan in plans:
            bucket = plan.bucket
            for i, has_grad in enumerate(plan.present):
                a, b = bucket.shard.local[i]
                grad = bucket.grad_views[i] if self.comm is None else bucket.flat_grad_shard[a:b]
                if has_grad and not math.isfinite(self.backend.sumsq([grad])):
                    bad.append((bucket, i))
        return bad

    def int8_overflow(self, plans, hparams: list[dict]) -> tuple[bool, list[tuple[Bucket, int]]]:
        """Whether this step would carry an int8 bucket's exp_avg_sq past
        INT8_SQ_LIMIT on any rank (a collective when the grads are that
        large), and (bucket, index) of this rank's params it would. Torch's
        fp32 exp_avg_sq would turn Inf there and stop those elements; an
        int8 block's scale would turn NaN and stop all of its elements."""
        if not any(p.bucket.state_dtype == "int8" for p in plans):
            return False, []
        total = self._step_sumsq if self._step_sumsq is not None else self.sumsq(plans)
        if total <= INT8_SQ_LIMIT:    # no grad's square is larger than the sum of all
            return False, []
        self.settle_grads()
        bad = []
        for plan in plans:
            bucket = plan.bucket
            if bucket.state_dtype != "int8":
                continue
            beta2 = hparams[bucket.group_index]["beta2"]
            for i, has_grad in enumerate(plan.present):
                a, b = bucket.shard.local[i]
                if not has_grad or a == b:
                    continue
                grad = bucket.grad_views[i] if self.comm is None else bucket.flat_grad_shard[a:b]
                grad = grad.detach().reshape(-1).to("cpu", torch.float64)
                v = bucket.state.read("exp_avg_sq", i).to(torch.float64)
                if bool((beta2 * v + (1.0 - beta2) * grad * grad > INT8_SQ_LIMIT).any()):
                    bad.append((bucket, i))
        if self.comm is None:
            return bool(bad), bad
        flag = torch.tensor([1.0 if bad else 0.0], dtype=torch.float64)
        self.comm.all_reduce_max_control(flag, "the int8 exp_avg_sq check")
        return bool(flag.item()), bad

    # ---- the step ----------------------------------------------------------------

    def step(self, plans, hparams: list[dict]) -> None:
        """One AdamW step of every planned bucket (hparams: per param group,
        the kernels' keywords), then the new params to every rank."""
        _AVERAGES.forget_failed()
        gathers = []
        factor = 1.0 if self._pending_clip is None else self._pending_clip[1]
        if factor != 1.0:
            hparams = [dict(hp, grad_scale=factor) for hp in hparams]
        # Host parts' grads come over first, so the backend kernels launched
        # next run while the CPU kernels step the host parts.
        for plan in plans:
            bucket = plan.bucket
            if bucket.shard.host_numel and plan.segments:
                bucket.flat_host_grad.copy_(bucket.flat_grad_shard[bucket.shard.split:])
        for plan in plans:
            bucket = plan.bucket
            hp = hparams[bucket.group_index]
            steps = bucket.steps.tolist()
            copied = False
            for start, stop, lo, hi in plan.segments:
                step = int(steps[start]) + 1
                device, host = bucket.shard.sides(lo, hi)
                if device is not None:
                    self.backend.adamw_step(*bucket.kernel_views(*device), step, hp)
                if host is not None:
                    bucket.wait_host_param()     # its last copy to the device has read it
                    self._host.adamw_step(*bucket.host_kernel_views(*host), step, hp)
                    k = bucket.shard.split
                    bucket.flat_param_shard[host[0] + k:host[1] + k].copy_(
                        bucket.flat_host_param[host[0]:host[1]], non_blocking=True)
                    copied = True
            if copied and self.backend.tier == "device":
                # the copies read the staging buffer after this returns
                bucket.fence_host_param(self.backend.record(self.backend.stream()))
            if bucket.state.stitched:
                bucket.state.refresh_stitched()
            self._count_steps(bucket, plan)
            if self.comm is not None and any(plan.present) and not bucket.sharded_params:
                # in flight while the next bucket steps
                gathers.append(self.comm.all_gather(bucket.flat_param, bucket.flat_param_shard,
                                                    async_op=True))
        for work in gathers:
            work.wait()
        self.grads_changed()

    def _count_steps(self, bucket: Bucket, plan: BucketPlan) -> None:
        """Step counts advance for every param with a grad, also those whose
        elements all live on other ranks."""
        state = bucket.state
        for start, stop in plan.runs:
            if start == 0 and stop == len(plan.present):
                state.steps.add_(1.0)
            else:
                state.steps[start:stop].add_(1.0)
            if not state.all_registered:
                for i in range(start, stop):
                    if not state.registered[i]:
                        self.register(bucket, i)
                state.all_registered = all(state.registered)

    # ---- memory ---------------------------------------------------------------------

    def synchronize(self) -> None:
        """Waits for the copies a non-blocking move left in flight."""
        done, self.moves_in_flight = self.moves_in_flight, None
        if done is not None:
            done.synchronize()
            self.backend.reap()

    def memory_report(self, tiers, kinds) -> dict[str, dict[str, int]]:
        """Bytes this rank owns, {kind: {tier: bytes}}; memory a move could
        not free because a tensor outside still views it appears under
        the tier 'held_elsewhere' of its kind."""
        report = {kind: {tier: 0 for tier in tiers} for kind in kinds}
        for bucket in self.buckets:
            for kind, per_tier in bucket.nbytes_by_tier().items():
                for tier, nbytes in per_tier.items():
                    report[kind][tier] += nbytes
        if self.reducer is not None:
            report["grads"][self.backend.tier] += self.reducer.nbytes()
        self.held_elsewhere = [(kind, ref) for kind, ref in self.held_elsewhere
                               if ref() is not None and ref().exports > 0]
        for kind, ref in self.held_elsewhere:
            buffer = ref()
            if buffer is not None:
                entry = report[kind]
                entry["held_elsewhere"] = entry.get("held_elsewhere", 0) + buffer.nbytes
        return report

    def flush_grads(self) -> None:
        """No collective may still read or write grads after this."""
        if self.reducer is not None:
            self.reducer.flush()


_SERIALS = itertools.count()


class _BackwardAverages:
    """The stage-1 engines that got grads in each running backward (by
    autograd's graph task), averaged together when it ends: in the order
    the engines were made, so that every rank meets each engine's process
    group in the same order, whatever order its grads arrived in. A
    backward that fails runs no callback and leaves its small entry (weak
    references) until the next step, when no backward runs. A reentrant
    backward (activation checkpointing with use_reentrant=True) is a task
    of its own, run inside a node of the outer one: its engines join the
    outer task once that node is done, so the average comes once, when
    the outermost backward ends."""

    def __init__(self):
        self.pending: dict[int, dict[int, weakref.ref]] = {}

    def add(self, engine) -> None:
        task = torch._C._current_graph_task_id()
        if task < 0:
            return       # not inside backward (a grad set by hand): the step averages
        engines = self.pending.get(task)
        if engines is None:
            engines = self.pending[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._run(task))
        engines.setdefault(engine.serial, weakref.ref(engine))

    def forget_failed(self) -> None:
        """Outside every backward, what is pending was left by backwards
        that failed (their grads are averaged by the step, as stale)."""
        if torch._C._current_graph_task_id() < 0:
            self.pending.clear()

    def _run(self, task: int) -> None:
        engines = self.pending.pop(task, {})

        def join_outer():
            for ref in engines.values():
                engine = ref()
                if engine is not None:
                    self.add(engine)
        if after_outer_node(join_outer):
            return
        for serial in sorted(engines):
            engine = engines[serial]()
            if engine is not None:
                engine.average_grads()


_AVERAGES = _BackwardAverages()


def after_outer_node(fn) -> bool:
    """At the end of a backward: if it ran nested inside a node of an outer
    backward (reentrant activation checkpointing), calls fn once that node
    is done, within the outer backward, and returns True; returns False at
    the end of the outermost backward."""
    node = torch._C._current_autograd_node()
    if node is None:
        return False
    node.register_hook(lambda *_: fn())
    return True


def _keep_grad_in_bucket(bucket: Bucket, index: int, param: torch.Tensor) -> None:
    # a param moved or cast outside rlhfz (model.to(), .half()) keeps its
    # grad where autograd made it: the next step adopts the move or refuses
    # it, saying what to do
    slot = bucket.grad_views[index]
    if param.device != slot.device or param.dtype != slot.dtype:
        return
    del slot        # a reference held here would read as the user's (unheld_grad_view)
    bucket.adopt_grad(index)

