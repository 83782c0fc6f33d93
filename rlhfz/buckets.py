"""Flat buckets: the memory behind a group's parameters of one dtype.

A Bucket owns five rlhfz Buffers (params, grads, fp32 master, exp_avg,
exp_avg_sq; fp32 params are their own master), in its backend's tier (host
or CUDA device), and hands out torch views of them. ``param.data`` and ``param.grad`` are such views, so the optimizer
steps a whole bucket with one kernel call and autograd accumulates straight
into bucket memory.
"""
from __future__ import annotations

import weakref

import torch

from .backends import HostBackend, torch_view
from .layout import BucketLayout, plan_bucket

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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


class Bucket:
    """The params of one (param group, dtype), laid out back to back."""

    def __init__(self, params: list[torch.Tensor], group_index: int, dtype: torch.dtype,
                 rank: int = 0, world_size: int = 1, full_grads: bool = True,
                 reduce_dtype: torch.dtype | None = None, backend=None,
                 host_ratio: float = 0.0, host_alloc=None, sharded_params: bool = False):
        self.params = params
        self.group_index = group_index
        self.dtype = dtype
        self.dtype_name = DTYPE_NAMES[dtype]
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.itemsize = itemsize
        self.layout: BucketLayout = plan_bucket([tuple(p.shape) for p in params], itemsize,
                                                world_size)
        self.rank, self.world_size = rank, world_size
        self.backend = backend or HostBackend()
        alloc = self.backend.buffer
        n = self.layout.padded_numel
        shard = self.layout.shard_numel
        self.shard_start = rank * shard
        # Allocate everything before touching any param, so a failure here
        # (out of memory) leaves the model as it was. Params and grads are
        # whole; master, moments and the reduced grad cover this rank's shard.
        # Stage 3 (sharded_params) keeps only this rank's shard of the params
        # too; gather() makes the whole bucket for as long as it is needed.
        self.sharded_params = sharded_params
        self.param_base = 0 if sharded_params else self.shard_start
        self.param_buffer = alloc((shard if sharded_params else n) * itemsize)
        self.gathered = None          # stage 3: (bytes, flat tensor) while gathered
        # Stage 2 keeps no full-size grads: the reducer stages them briefly.
        self.full_grads = full_grads
        self.grad_buffer = alloc(n * itemsize) if full_grads else None
        # Grads are averaged across ranks in reduce_dtype (fp32 for 16-bit
        # params if asked). Stage 2 keeps the averaged shard in its own
        # buffer. Stage 1 all-reduces in place, as DDP does, so every rank's
        # grads hold the average and the shard is a range of them (of an
        # fp32 copy of the bucket when reduce_dtype differs).
        self.reduce_dtype = reduce_dtype or dtype
        reduce_itemsize = torch.empty((), dtype=self.reduce_dtype).element_size()
        self.grad_shard_buffer = (alloc(shard * reduce_itemsize)
                                  if world_size > 1 and not full_grads else None)
        self.reduce_staging_buffer = (alloc(n * reduce_itemsize)
                                      if world_size > 1 and full_grads
                                      and self.reduce_dtype != dtype else None)
        # offload="cpu": the last host_ratio of the shard's elements keep their
        # state on the host and step there (the CPU kernel), the rest on the
        # backend. The host part has its own fp32 master (also for fp32
        # params, whose own memory is on the device), a copy of its grads and
        # a staging copy of its new param values.
        self.split = shard - int(round(host_ratio * shard))
        host = shard - self.split
        self.master_buffer = None if dtype == torch.float32 else alloc(self.split * 4)
        self.exp_avg_buffer = alloc(self.split * 4)
        self.exp_avg_sq_buffer = alloc(self.split * 4)
        host_alloc = host_alloc or (lambda nbytes: HostBackend().buffer(nbytes))
        self.host_master_buffer = host_alloc(host * 4) if host else None
        self.host_exp_avg_buffer = host_alloc(host * 4) if host else None
        self.host_exp_avg_sq_buffer = host_alloc(host * 4) if host else None
        self.host_grad_buffer = host_alloc(host * reduce_itemsize) if host else None
        self.host_param_buffer = host_alloc(host * itemsize) if host else None
        self.host_param_fence = None       # see fence_host_param
        # Each param's part of this rank's shard, in shard coordinates (empty
        # ranges for params wholly on other ranks).
        self.local = [self._local_range(slot) for slot in self.layout.slots]
        self._build_views()
        self.reduced_version = None    # flat_grad's version when last reduce-scattered
        # Per-param step counts, as torch.optim.AdamW keeps them; state['step']
        # is a 0-dim view of one entry.
        self.steps = torch.zeros(len(params), dtype=torch.float32)
        self.step_views = [self.steps[i] for i in range(len(params))]
        self.registered = [False] * len(params)
        self.all_registered = False   # lets a step skip the per-param check
        self._hook_handles = []
        # Stage 2 (see reducer.py): where grads go, and this backward's progress.
        self.grad_sink = None
        self.index = 0
        self.expected = sum(1 for p in params if p.requires_grad)
        self.arrived = [False] * len(params)
        self.accumulated = False
        self.generation = 0
        self.staged = None
        self.staged_params = [False] * len(params)    # grad written to staging this round
        self.gaps = self.layout.gaps()
        self.arrived_now = 0          # distinct params staged this round
        self.launched = False

    # Buffers by the kind offload() names them, and the torch tensors that
    # are views of them (rebind() re-points these in place).
    BUFFERS = {"params": ("param_buffer", "host_param_buffer"),
               "grads": ("grad_buffer", "grad_shard_buffer", "reduce_staging_buffer",
                         "host_grad_buffer"),
               "optimizer": ("master_buffer", "exp_avg_buffer", "exp_avg_sq_buffer",
                             "host_master_buffer", "host_exp_avg_buffer",
                             "host_exp_avg_sq_buffer")}
    _HOST_PART = ("host_param_buffer", "host_grad_buffer", "host_master_buffer",
                  "host_exp_avg_buffer", "host_exp_avg_sq_buffer")
    _TENSORS = ("flat_param", "flat_grad", "flat_grad_shard", "flat_reduce_staging",
                "flat_param_shard", "flat_master", "flat_exp_avg", "flat_exp_avg_sq",
                "host_flat_master", "host_flat_exp_avg", "host_flat_exp_avg_sq",
                "host_flat_grad", "host_flat_param")
    _TENSOR_LISTS = ("param_views", "grad_views", "master_views", "exp_avg_views",
                     "exp_avg_sq_views")

    def _build_views(self) -> None:
        """Kernel views and torch tensors over the current buffers."""
        shard = self.layout.shard_numel
        # (buffer, element offset) of the grad shard's first element
        if self.grad_shard_buffer is not None:
            self._grad_shard_at = (self.grad_shard_buffer, 0)
        else:
            self._grad_shard_at = (self.reduce_staging_buffer or self.grad_buffer,
                                   self.shard_start)
        # Kernel-facing views of whole buckets and shards: passed to _C without DLPack.
        self.param_kview = self.param_buffer.view(self.dtype_name)
        self.grad_kview = self.grad_buffer.view(self.dtype_name) if self.full_grads else None
        self.grad_shard_kview = self.grad_shard_kview_range(0, shard)
        self.master_kview = self._master_view(0, self.split)
        self.param_shard_kview = self.param_buffer.view(self.dtype_name, self.param_base,
                                                        (shard,))
        self.exp_avg_kview = self.exp_avg_buffer.view("float32")
        self.exp_avg_sq_kview = self.exp_avg_sq_buffer.view("float32")

        # Torch-facing flat tensors, and per-param views of them. Slices of one
        # flat tensor share its version counter, which tells whether any grad
        # in the bucket was modified in place since a check.
        self.flat_param = torch_view(self.param_kview)
        self.flat_grad = torch_view(self.grad_kview) if self.full_grads else None
        self.flat_grad_shard = torch_view(self.grad_shard_kview)
        self.flat_reduce_staging = (
            torch_view(self.reduce_staging_buffer.view(DTYPE_NAMES[self.reduce_dtype]))
            if self.reduce_staging_buffer is not None else None)
        self.flat_param_shard = torch_view(self.param_shard_kview)
        self.flat_master = torch_view(self.master_kview)
        self.flat_exp_avg = torch_view(self.exp_avg_kview)
        self.flat_exp_avg_sq = torch_view(self.exp_avg_sq_kview)
        for attr in self._HOST_PART:
            buffer = getattr(self, attr)
            name = "host_flat_" + attr[len("host_"):-len("_buffer")]
            dtype = {"host_param_buffer": self.dtype_name,
                     "host_grad_buffer": DTYPE_NAMES[self.reduce_dtype]}.get(attr, "float32")
            setattr(self, name, torch_view(buffer.view(dtype)) if buffer else None)
        self.param_views = None if self.sharded_params else self._views(self.flat_param)
        self.grad_views = self._views(self.flat_grad) if self.full_grads else None
        # With one rank, the state views have the params' shapes, as
        # torch.optim.AdamW's do. A param whose shard range crosses into the
        # host part gets a stitched copy instead (refresh_stitched).
        self.stitched = []
        self.master_views = (self._state_views(self.flat_master, self.host_flat_master)
                             if self.master_buffer else None)
        self.exp_avg_views = self._state_views(self.flat_exp_avg, self.host_flat_exp_avg)
        self.exp_avg_sq_views = self._state_views(self.flat_exp_avg_sq,
                                                  self.host_flat_exp_avg_sq)
        self.refresh_stitched()

    def rebind(self) -> None:
        """After buffers were replaced: every tensor handed out before (param
        data, grads, optimizer state) is re-pointed in place at the new
        memory, so no reference anyone holds changes identity."""
        before = {name: getattr(self, name) for name in self._TENSORS + self._TENSOR_LISTS}
        self._build_views()
        with torch.no_grad():
            for name, old in before.items():
                new = getattr(self, name)
                if old is None:
                    continue
                if isinstance(old, list):
                    for o, n in zip(old, new):
                        o.data = n
                else:
                    old.data = new
                setattr(self, name, old)
            for p, view in zip(self.params, self.param_views or []):
                p.data = view

    def _master_view(self, lo: int, n: int):
        """fp32 master over shard elements [lo, lo + n): its own buffer for
        16-bit params, else this rank's range of the params themselves."""
        if self.master_buffer is not None:
            return self.master_buffer.view("float32", lo, (n,))
        return self.param_buffer.view("float32", self.param_base + lo, (n,))

    def _local_range(self, slot) -> tuple[int, int]:
        lo = max(slot.offset, self.shard_start)
        hi = min(slot.offset + slot.numel, self.shard_start + self.layout.shard_numel)
        lo = min(lo, hi)
        return lo - self.shard_start, hi - self.shard_start

    def local_part(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """The part of a param-shaped tensor that lies in this rank's shard,
        shaped like the param's state view."""
        if self.world_size == 1:
            return full
        a, b = self.local[index]
        offset = self.layout.slots[index].offset - self.shard_start
        return full.reshape(-1)[a - offset:b - offset]

    def reattach_moved(self) -> None:
        """Params whose .data something replaced (module.to() copies even to
        the same device in some torch versions) become views of the bucket
        again, keeping the values they hold now. A param cast or moved to
        another dtype or device cannot: that raises."""
        if self.param_views is None:
            return
        for p, view in zip(self.params, self.param_views):
            if p.data_ptr() == view.data_ptr() or p.numel() == 0 and view.numel() == 0:
                continue
            if p.dtype != view.dtype or p.device != view.device or p.shape != view.shape:
                raise RuntimeError(
                    f"a param of shape {tuple(view.shape)} was moved or cast to {p.dtype} on "
                    f"{p.device} outside rlhfz (model.to() / .cuda() / .half() after the "
                    f"optimizer was built); its memory is the optimizer's {view.dtype} on "
                    f"{view.device}: build the optimizer after placing the model, or use "
                    f"offload() / reload() to move it")
            with torch.no_grad():
                view.copy_(p.detach())
            p.data = view

    def param_shard_part(self, index: int) -> torch.Tensor:
        """This rank's part of one param's values, flat, from the param shard
        (which every stage keeps, gathered or not)."""
        a, b = self.local[index]
        return self.flat_param_shard[a:b]

    def write_param(self, index: int, full: torch.Tensor) -> None:
        """Sets one param's values from a whole, param-shaped tensor: all of
        it, or under stage 3 this rank's part. sync_master() follows."""
        with torch.no_grad():
            if not self.sharded_params:
                self.param_views[index].copy_(full)
                return
            a, b = self.local[index]
            offset = self.layout.slots[index].offset - self.shard_start
            self.flat_param_shard[a:b].copy_(full.reshape(-1)[a - offset:b - offset])

    def sync_master(self) -> None:
        """fp32 master weights (device and host parts) from the params, after
        the params were set from outside."""
        if self.master_buffer is not None:
            self.backend.cast_(self.master_kview, self.param_buffer.view(
                self.dtype_name, self.param_base, (self.split,)))
        self.pull_host_part()
        self.refresh_stitched()

    def _state_views(self, device_part: torch.Tensor, host_part) -> list[torch.Tensor]:
        views = []
        for i, (a, b) in enumerate(self.local):
            if b <= self.split:
                view = device_part[a:b]
            elif a >= self.split:
                view = host_part[a - self.split:b - self.split]
            else:
                view = torch.empty(b - a, dtype=torch.float32)
                if i not in self.stitched:
                    self.stitched.append(i)
            views.append(view.view(self.layout.slots[i].shape) if self.world_size == 1 else view)
        return views

    # ---- state across the device and host parts --------------------------------------

    def _state_parts(self, name: str):
        return {"master": (self.flat_master, self.host_flat_master, self.master_views),
                "exp_avg": (self.flat_exp_avg, self.host_flat_exp_avg, self.exp_avg_views),
                "exp_avg_sq": (self.flat_exp_avg_sq, self.host_flat_exp_avg_sq,
                               self.exp_avg_sq_views)}[name]

    def read_state(self, name: str, index: int) -> torch.Tensor:
        """This rank's part of one param's state, flat, from wherever it lives."""
        device_part, host_part, _ = self._state_parts(name)
        a, b = self.local[index]
        k = self.split
        pieces = []
        if a < min(b, k):
            pieces.append(device_part[a:min(b, k)].cpu())
        if max(a, k) < b:
            pieces.append(host_part[max(a, k) - k:b - k])
        return torch.cat(pieces) if pieces else torch.empty(0)

    def write_state(self, name: str, index: int, values: torch.Tensor) -> None:
        """Writes this rank's part of one param's state (values: local_part of
        a param-shaped tensor) to the device part, the host part, or both."""
        device_part, host_part, views = self._state_parts(name)
        values = values.reshape(-1)
        a, b = self.local[index]
        k = self.split
        with torch.no_grad():
            if a < min(b, k):
                device_part[a:min(b, k)].copy_(values[:min(b, k) - a])
            if max(a, k) < b:
                host_part[max(a, k) - k:b - k].copy_(values[max(a, k) - a:])
            if views is not None and index in self.stitched:
                views[index].view(-1).copy_(values)

    def refresh_stitched(self) -> None:
        """Copies the current state of the params that cross the split into
        their stitched state tensors (after every step, and before saving)."""
        with torch.no_grad():
            for index in self.stitched:
                for name in ("master", "exp_avg", "exp_avg_sq"):
                    views = self._state_parts(name)[2]
                    if views is not None:
                        views[index].view(-1).copy_(self.read_state(name, index))

    def full_shard(self, name: str) -> torch.Tensor:
        """This rank's whole shard of a state, on the backend's device (a view
        when it all lives there, else the two parts joined)."""
        device_part, host_part, _ = self._state_parts(name)
        if host_part is None:
            return device_part
        return torch.cat([device_part, host_part.to(device_part.device)])

    def fence_host_param(self, event) -> None:
        """The event after the asynchronous copies that read the host part's
        staged params: the host may write them again only once it is done,
        whichever stream the next step runs on."""
        self.host_param_fence = event

    def wait_host_param(self) -> None:
        if self.host_param_fence is not None:
            self.host_param_fence.synchronize()
            self.host_param_fence = None

    def pull_host_part(self, master: bool = True) -> None:
        """The host part's staged params (and, with master, its fp32 master)
        from the param shard: at attach, and after a state dict is loaded."""
        if self.host_flat_master is None:
            return
        self.wait_host_param()
        with torch.no_grad():
            current = self.flat_param_shard[self.split:]
            if master:
                self.host_flat_master.copy_(current)
            self.host_flat_param.copy_(current)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.layout.slots]

    # ---- attaching params -------------------------------------------------------

    def attach(self) -> None:
        """Copy each param's values in, and make param.data a view of the bucket."""
        if self.sharded_params:
            self._attach_shard()
            return
        with torch.no_grad():
            grad_views = self.grad_views or [None] * len(self.params)
            for p, view, grad_view in zip(self.params, self.param_views, grad_views):
                view.copy_(p.detach())
                grad = p.grad
                p.data = view
                if grad is not None and grad_view is not None:
                    grad_view.copy_(grad)
                    p.grad = grad_view
        self._finish_attach()

    def _attach_shard(self) -> None:
        """Stage 3: keep this rank's part of each param, and leave the param
        an empty placeholder until gather()."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                a, b = self.local[i]
                if a < b:
                    offset = self.layout.slots[i].offset - self.shard_start
                    flat = p.detach().reshape(-1)
                    self.flat_param_shard[a:b].copy_(flat[a - offset:b - offset])
                p.grad = None
                p.data = self.placeholder(p)
        self._finish_attach()

    def placeholder(self, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.backend.device)

    def _finish_attach(self) -> None:
        if self.master_buffer is not None:
            self.backend.cast_(self.master_kview, self.param_buffer.view(
                self.dtype_name, self.param_base, (self.split,)))
        self.pull_host_part()
        self_ref = weakref.ref(self)
        for i, p in enumerate(self.params):
            if p.requires_grad:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(
                    _make_grad_hook(self_ref, i)))

    # ---- stage 3: whole params only while needed ----------------------------------

    def gather(self, comm, async_op: bool = False):
        """Makes every param whole (param.data a view of a gathered bucket);
        returns the collective's work with async_op."""
        if self.gathered is not None:
            return None
        # Transient memory: on a GPU torch's cache hands the same blocks back
        # gather after gather, in stream order (backends.CudaBackend.empty).
        flat = self.backend.empty(self.layout.padded_numel, self.dtype)
        work = comm.all_gather(flat, self.flat_param_shard, async_op=async_op)
        self.gathered = (flat.numel() * self.itemsize, flat)
        with torch.no_grad():
            for p, slot in zip(self.params, self.layout.slots):
                p.data = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
        return work

    def release(self) -> None:
        """Back to placeholders; the gathered memory goes back at once."""
        if self.gathered is None:
            return
        with torch.no_grad():
            for p in self.params:
                p.data = self.placeholder(p)
        self.gathered = None

    def gathered_bytes(self) -> int:
        return self.gathered[0] if self.gathered is not None else 0

    def detach_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    # ---- grads ------------------------------------------------------------------

    def adopt_grad(self, index: int) -> None:
        """Move a grad that lives outside the bucket (autograd allocates one
        after grads were set to None, or a user assigned one) into it."""
        p = self.params[index]
        grad = p.grad
        view = self.grad_views[index]
        if grad is None or grad is view:
            return
        if grad.layout != torch.strided:
            raise ValueError(f"sparse gradients are not supported (param {index} of group "
                             f"{self.group_index}, shape {tuple(p.shape)})")
        if grad.shape != view.shape:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} for a param of shape "
                             f"{tuple(view.shape)}")
        with torch.no_grad():
            view.copy_(grad)
        p.grad = view

    def collect_grads(self) -> list[bool]:
        """Which params have a grad; stray grads are moved into the bucket."""
        present = []
        for i, (p, view) in enumerate(zip(self.params, self.grad_views)):
            grad = p.grad
            if grad is None:
                present.append(False)
                continue
            if grad is not view:
                self.adopt_grad(i)
            present.append(True)
        return present

    def zero_grads(self, set_to_none: bool) -> None:
        if set_to_none:
            # The bucket keeps its memory; the next backward's grads are moved
            # into it by the post-accumulate hook.
            for p in self.params:
                p.grad = None
            return
        for i, p in enumerate(self.params):
            if p.grad is not None and p.grad is not self.grad_views[i]:
                self.adopt_grad(i)
        self.backend.zero_(self.grad_buffer, self.flat_grad)

    # ---- kernel views of param ranges -----------------------------------------------

    def segments(self, present: list[bool]) -> list[tuple[int, int]]:
        return _segment_ranges(present, self.steps.tolist())

    def element_range(self, start: int, stop: int) -> tuple[int, int] | None:
        """Shard elements spanned by params [start, stop): the whole shard
        when that covers every param (padding is zero and stays zero); None
        when none of them has elements on this rank."""
        if start == 0 and stop == len(self.params):
            return 0, self.layout.shard_numel
        pieces = [self.local[i] for i in range(start, stop) if self.local[i][0] < self.local[i][1]]
        if not pieces:
            return None
        return pieces[0][0], pieces[-1][1]

    def kernel_views(self, lo: int, hi: int):
        """(master, exp_avg, exp_avg_sq, grad, param_out) over shard elements [lo, hi)."""
        if lo == 0 and hi == self.layout.shard_numel:      # the whole shard, on the backend
            param_out = self.param_shard_kview if self.master_buffer is not None else None
            return (self.master_kview, self.exp_avg_kview, self.exp_avg_sq_kview,
                    self.grad_shard_kview, param_out)
        n = (hi - lo,)
        param_out = None
        if self.master_buffer is not None:
            param_out = self.param_buffer.view(self.dtype_name, self.param_base + lo, n)
        return (self._master_view(lo, hi - lo),
                self.exp_avg_buffer.view("float32", lo, n),
                self.exp_avg_sq_buffer.view("float32", lo, n),
                self.grad_shard_kview_range(lo, hi),
                param_out)

    def host_kernel_views(self, lo: int, hi: int):
        """(master, exp_avg, exp_avg_sq, grad, param_out) of the host part over
        shard elements [lo, hi), all at or past the split."""
        o, n = lo - self.split, (hi - lo,)
        return (self.host_master_buffer.view("float32", o, n),
                self.host_exp_avg_buffer.view("float32", o, n),
                self.host_exp_avg_sq_buffer.view("float32", o, n),
                self.host_grad_buffer.view(DTYPE_NAMES[self.reduce_dtype], o, n),
                self.host_param_buffer.view(self.dtype_name, o, n))

    def grad_version(self) -> int:
        """Changes whenever the grads this step would use change."""
        return self.flat_grad._version if self.full_grads else self.generation

    def grad_shard_kview_range(self, lo: int, hi: int):
        """The (reduced) grads of shard elements [lo, hi)."""
        buffer, start = self._grad_shard_at
        return buffer.view(DTYPE_NAMES[self.reduce_dtype], start + lo, (hi - lo,))

    # ---- accounting -------------------------------------------------------------------

    def nbytes_by_tier(self) -> dict[str, dict[str, int]]:
        """{kind: {tier: bytes}}, kinds as memory_report names them."""
        report: dict[str, dict[str, int]] = {}
        kinds = {"params": self.BUFFERS["params"], "grads": self.BUFFERS["grads"],
                 "master": ("master_buffer", "host_master_buffer"),
                 "exp_avg": ("exp_avg_buffer", "host_exp_avg_buffer"),
                 "exp_avg_sq": ("exp_avg_sq_buffer", "host_exp_avg_sq_buffer")}
        for kind, attrs in kinds.items():
            entry = report.setdefault(kind, {})
            for attr in attrs:
                buffer = getattr(self, attr)
                if buffer is not None:
                    entry[buffer.tier] = entry.get(buffer.tier, 0) + buffer.nbytes
        return report


def _make_grad_hook(bucket_ref, index):
    def hook(param):
        bucket = bucket_ref()
        if bucket is None:
            return
        if bucket.grad_sink is not None:
            bucket.grad_sink(bucket, index, param)
        elif param.grad is not bucket.grad_views[index]:
            bucket.adopt_grad(index)
    return hook
