"""A bucket: the params of one (param group, dtype), laid out back to back.

It puts together the bucket's layout and shard (layout.py), its memory
(storage.py) and its shard's optimizer state (state.py), and makes each
param's ``.data`` and ``.grad`` a view of that memory, so the optimizer
steps a whole bucket with one kernel call and autograd accumulates straight
into bucket memory. Stage 3 keeps only the shard of the params, and
gather() makes them whole for as long as they are needed.
"""
from __future__ import annotations

import sys
import weakref

import torch

from . import moments
from .backends import DTYPE_NAMES, HostBackend, torch_view
from .layout import BucketLayout, ShardLayout, plan_bucket
from .state import SCALES, ShardState
from .storage import REGIONS, FlatStorage


class Bucket:
    def __init__(self, params: list[torch.Tensor], group_index: int, dtype: torch.dtype,
                 rank: int = 0, world_size: int = 1, full_grads: bool = True,
                 reduce_dtype: torch.dtype | None = None, backend=None,
                 host_ratio: float = 0.0, host_alloc=None, sharded_params: bool = False,
                 state_dtype: str = "fp32"):
        self.params = params
        self.group_index = group_index
        self.index = 0                       # place among the engine's buckets
        self.dtype = dtype
        self.dtype_name = DTYPE_NAMES[dtype]
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        # how the moments are kept (moments.py); int8 blocks never straddle
        # a param, a shard or the offload split
        self.state_dtype = state_dtype
        block = moments.layout_block(state_dtype)
        self.layout: BucketLayout = plan_bucket([tuple(p.shape) for p in params], self.itemsize,
                                                world_size, block=block)
        self.shard = ShardLayout.of(self.layout, rank, host_ratio, block)
        self.world_size = world_size
        self.backend = backend or HostBackend()
        # Params and grads are whole; master, moments and the reduced grad
        # cover this rank's shard. Stage 3 (sharded_params) keeps only this
        # rank's shard of the params too.
        self.sharded_params = sharded_params
        self.param_base = 0 if sharded_params else self.shard.start
        # stage 3: (bytes, flat tensor) while gathered; (bytes, None) while
        # sent to another rank's gather (gather(root=...))
        self.gathered = None
        # Stage 2 keeps no full-size grads: the reducer stages them briefly.
        self.full_grads = full_grads
        # Grads are averaged across ranks in reduce_dtype. Stage 2 keeps the
        # averaged shard in its own region. Stage 1 all-reduces in place, as
        # DDP does, so the shard is a range of the grads (of an fp32 copy of
        # the bucket when reduce_dtype differs).
        self.reduce_dtype = reduce_dtype or dtype
        reduce_name = DTYPE_NAMES[self.reduce_dtype]
        n, shard = self.layout.padded_numel, self.shard.numel
        split, host = self.shard.split, self.shard.host_numel
        f32 = "float32"
        stored = {name: DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")
                  for name, dtype in moments.STORED[state_dtype].items()}
        blocks = (moments.region_numel("exp_avg_scale", split),
                  moments.region_numel("exp_avg_scale", host))
        int8 = state_dtype == "int8"
        sizes = {
            "param": ((shard if sharded_params else n), self.dtype_name),
            "grad": (n, self.dtype_name) if full_grads else None,
            "grad_shard": (shard, reduce_name) if world_size > 1 and not full_grads else None,
            "reduce_staging": ((n, reduce_name) if world_size > 1 and full_grads
                               and self.reduce_dtype != dtype else None),
            # offload="cpu": the host part has its own fp32 master (also for
            # fp32 params, whose own memory is on the backend), a copy of its
            # grads and a staging copy of its new param values
            "master": None if dtype == torch.float32 else (split, f32),
            "exp_avg": (split, stored["exp_avg"]), "exp_avg_sq": (split, stored["exp_avg_sq"]),
            "exp_avg_scale": (blocks[0], f32) if int8 else None,
            "exp_avg_sq_scale": (blocks[0], f32) if int8 else None,
            "host_master": (host, f32) if host else None,
            "host_exp_avg": (host, stored["exp_avg"]) if host else None,
            "host_exp_avg_sq": (host, stored["exp_avg_sq"]) if host else None,
            "host_exp_avg_scale": (blocks[1], f32) if host and int8 else None,
            "host_exp_avg_sq_scale": (blocks[1], f32) if host and int8 else None,
            "host_grad": (host, reduce_name) if host else None,
            "host_param": (host, self.dtype_name) if host else None,
        }
        self.storage = FlatStorage(sizes, self.backend.buffer,
                                   host_alloc or (lambda nbytes: HostBackend().buffer(nbytes)))
        self.state = ShardState(self.shard, world_size, dtype != torch.float32, len(params),
                                state_dtype)
        self.storage.hand_out(self._build_views())
        self.reduced_version = None    # flat_grad's version when last reduced (stage 1)
        self.host_param_fence = None   # see fence_host_param
        self._hook_handles = []
        self.param_versions = None     # see adopt_written
        self.gathered_versions = None  # stage 3: see release
        self.trainable = sum(1 for p in params if p.requires_grad)

    # ---- views -------------------------------------------------------------------

    def _build_views(self) -> dict[str, object]:
        """Kernel views and torch tensors over the current buffers: the
        storage registers the tensors, so a move re-points them in place."""
        storage, shard = self.storage, self.shard.numel
        # where the grad shard's first element is: (region, element offset)
        if storage.buffers["grad_shard"] is not None:
            self._grad_shard_at = ("grad_shard", 0)
        elif storage.buffers["reduce_staging"] is not None:
            self._grad_shard_at = ("reduce_staging", self.shard.start)
        else:
            self._grad_shard_at = ("grad", self.shard.start)
        # Kernel-facing views of whole buckets and shards: passed to _C without DLPack.
        self.param_kview = storage.view("param")
        self.grad_kview = storage.view("grad") if self.full_grads else None
        self.grad_shard_kview = self.grad_shard_kview_range(0, shard)
        self.master_kview = self._master_view(0, self.shard.split)
        self.param_shard_kview = storage.view("param", self.param_base, shard)
        self.exp_avg_kview = storage.view("exp_avg")
        self.exp_avg_sq_kview = storage.view("exp_avg_sq")
        self.scale_kviews = {name: storage.view(name) for name in SCALES.values()
                             if storage.buffers[name] is not None}
        # Torch-facing flat tensors, and per-param views of them. Slices of one
        # flat tensor share its version counter, which tells whether any grad
        # in the bucket was modified in place since a check.
        flat = {name: (torch_view(storage.view(name)) if storage.buffers[name] is not None
                       else None)
                for name in ("grad", "reduce_staging") + tuple(n for n in REGIONS
                                                                if REGIONS[n].host)}
        flat["param"] = torch_view(self.param_kview)
        flat["grad_shard"] = torch_view(self.grad_shard_kview)
        flat["param_shard"] = torch_view(self.param_shard_kview)
        flat["master"] = torch_view(self.master_kview)
        flat["exp_avg"] = torch_view(self.exp_avg_kview)
        flat["exp_avg_sq"] = torch_view(self.exp_avg_sq_kview)
        for name in SCALES.values():
            flat[name] = (torch_view(self.scale_kviews[name]) if name in self.scale_kviews
                          else None)
        views = {f"flat_{name}": t for name, t in flat.items()}
        views["param_views"] = None if self.sharded_params else self._views(flat["param"])
        views["grad_views"] = self._views(flat["grad"]) if self.full_grads else None
        state = self.state.build({name: (flat[name], flat[f"host_{name}"])
                                  for name in self.state.names})
        views.update({f"{name}_views": v for name, v in state.items()})
        self._adopt(views)
        return views

    def _adopt(self, views: dict[str, object]) -> None:
        for name, value in views.items():
            setattr(self, name, value)
        self.state.adopt({name: views[f"{name}_views"] for name in self.state.names})
        self.state.parts = {name: (views[f"flat_{name}"], views[f"flat_host_{name}"])
                            for name in self.state.names}

    def rebind(self) -> None:
        """After buffers were replaced: every tensor handed out before (param
        data, grads, optimizer state) is re-pointed in place at the new
        memory, so no reference anyone holds changes identity."""
        self._adopt(self.storage.rebind(self._build_views))
        with torch.no_grad():
            for p, view in zip(self.params, self.param_views or []):
                p.data = view

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.layout.slots]

    def _master_view(self, lo: int, n: int):
        """fp32 master over shard elements [lo, lo + n): its own region for
        16-bit params, else this rank's range of the params themselves."""
        if self.storage.buffers["master"] is not None:
            return self.storage.view("master", lo, n)
        return self.storage.buffers["param"].view("float32", self.param_base + lo, (n,))

    @property
    def has_master(self) -> bool:
        return self.state.has_master

    @property
    def steps(self) -> torch.Tensor:
        return self.state.steps

    @property
    def registered(self) -> list[bool]:
        return self.state.registered

    # ---- values from outside ----------------------------------------------------------

    def local_part(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """The part of a param-shaped tensor that lies in this rank's shard,
        shaped like the param's state view."""
        if self.world_size == 1:
            return full
        return self.shard.part_of(index, full.reshape(-1))

    def param_shard_part(self, index: int) -> torch.Tensor:
        """This rank's part of one param's values, flat, from the param shard
        (which every stage keeps, gathered or not)."""
        a, b = self.shard.local[index]
        return self.flat_param_shard[a:b]

    def write_param(self, index: int, full: torch.Tensor) -> None:
        """Sets one param's values from a whole, param-shaped tensor: all of
        it, or under stage 3 this rank's part. sync_master() follows."""
        with torch.no_grad():
            if not self.sharded_params:
                self.param_views[index].copy_(full)
                return
            self.param_shard_part(index).copy_(self.shard.part_of(index, full.reshape(-1)))

    def load_whole(self, values: list[tuple[int, torch.Tensor]]) -> None:
        """Sets params from whole, param-shaped tensors ((index, value)):
        this rank's part of each under stage 3, the master following."""
        for index, value in values:
            self.write_param(index, value.detach())
        self._adopt_param_values([index for index, _ in values])

    def sync_master(self) -> None:
        """fp32 master weights (backend and host parts) from the params, after
        the params were set from outside."""
        if self.has_master:
            self.backend.cast_(self.master_kview, self.storage.view(
                "param", self.param_base, self.shard.split))
        self.pull_host_part()
        self.state.refresh_stitched()

    def reattach_moved(self) -> None:
        """Params whose .data something replaced (module.to() copies even to
        the same device in some torch versions) become views of the bucket
        again, keeping the values they hold now. A param cast or moved to
        another dtype or device cannot: that raises."""
        if self.param_views is None:
            return
        moved = [i for i, (p, view) in enumerate(zip(self.params, self.param_views))
                 if p.data_ptr() != view.data_ptr() and (p.numel() or view.numel())]
        # every moved param is checked before any is taken back: a refusal
        # leaves params, masters and grads as they were
        for i in moved:
            p, view = self.params[i], self.param_views[i]
            if p.dtype != view.dtype or p.device != view.device or p.shape != view.shape:
                raise RuntimeError(
                    f"a param of shape {tuple(view.shape)} was moved or cast to {p.dtype} on "
                    f"{p.device} outside rlhfz (model.to() / .cuda() / .half() after the "
                    f"optimizer was built); its memory is the optimizer's {view.dtype} on "
                    f"{view.device}: build the optimizer after placing the model, or use "
                    f"offload() / reload() to move it")
        changed = []
        for i in moved:
            p, view = self.params[i], self.param_views[i]
            with torch.no_grad():
                if not torch.equal(view, p.detach()):
                    changed.append(i)
                    view.copy_(p.detach())
            p.data = view
        if changed:
            self._adopt_param_values(changed)
        self._reattach_grad_views()

    def adopt_written(self) -> None:
        """Values written into params in place since the last look
        (model.load_state_dict(), p.copy_(), an EMA, a re-init: torch counts
        each in the param's version) reach the copy the optimizer steps from,
        where it keeps its own (a 16-bit param's fp32 master, the host part
        under offload="cpu"), so the next step starts from them, as torch's
        AdamW does. Elements the write left as they were keep their master's
        precision. A write through .data, numpy or DLPack counts in no
        version: write through the param itself."""
        if self.param_versions is None or not (self.has_master or
                                               self.flat_host_master is not None):
            return
        versions = [p._version for p in self.params]
        if versions == self.param_versions:
            return
        changed = [i for i, (now, seen) in enumerate(zip(versions, self.param_versions))
                   if now != seen]
        self.param_versions = versions
        if not self.has_master:
            self.pull_host_part(master=True)     # fp32 params are their own master
            return
        with torch.no_grad():
            for i in changed:
                held = self.state.read("master", i)
                written = self.param_shard_part(i).cpu()
                kept = held.to(written.dtype) == written
                if not bool(kept.all()):
                    self.state.write("master", i, torch.where(kept, held, written.float()))
        self.pull_host_part(master=False)

    def parts_written(self, indices: list[int]) -> None:
        """This rank's parts of these params were written in place (through
        param_shard_part): the copies the optimizer steps from follow."""
        self._adopt_param_values(list(indices))

    def _adopt_param_values(self, changed: list[int]) -> None:
        """New values written into params' slots: the fp32 master follows
        them (a 16-bit param's own master, or the host part's copy of an fp32
        one), as at attach. Unchanged params keep their master's precision."""
        if self.has_master:
            for i in changed:
                self.state.write("master", i, self.param_shard_part(i).float())
            self.pull_host_part(master=False)
        else:
            self.pull_host_part(master=True)

    def _reattach_grad_views(self) -> None:
        """module._apply also sets p.grad.data when a grad exists: the grad
        view object itself (which p.grad is) then holds other memory. Its
        values go back into the bucket and the object views the bucket again,
        in place, so p.grad follows."""
        if self.grad_views is None:
            return
        base, itemsize = self.flat_grad.data_ptr(), self.flat_grad.element_size()
        for view, slot in zip(self.grad_views, self.layout.slots):
            if view.data_ptr() == base + slot.offset * itemsize or slot.numel == 0:
                continue
            home = self.flat_grad[slot.offset:slot.offset + slot.numel].view(slot.shape)
            if view.dtype != home.dtype or view.device != home.device or \
                    view.shape != home.shape:
                raise RuntimeError(
                    f"a grad of shape {tuple(home.shape)} was moved or cast to {view.dtype} on "
                    f"{view.device} outside rlhfz; the optimizer keeps grads as {home.dtype} on "
                    f"{home.device}: cast the model back, or build the optimizer after it")
            with torch.no_grad():
                home.copy_(view)
            view.data = home

    # ---- the host part --------------------------------------------------------------------

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
        if self.flat_host_master is None:
            return
        self.wait_host_param()
        with torch.no_grad():
            current = self.flat_param_shard[self.shard.split:]
            if master:
                self.flat_host_master.copy_(current)
            self.flat_host_param.copy_(current)

    # ---- attaching params -------------------------------------------------------

    def attach(self, grad_hook, index: int = 0, before_grad=None) -> None:
        """Copy each param's values in, make param.data a view of the bucket,
        and call grad_hook(bucket, index, param) after each grad accumulates
        (and before_grad(bucket, index, param), if given, before it does).
        index: the bucket's place among its engine's."""
        self.index = index
        with torch.no_grad():
            if self.sharded_params:
                # Stage 3: keep this rank's part of each param, and leave the
                # param an empty placeholder until gather().
                for i, p in enumerate(self.params):
                    self.param_shard_part(i).copy_(
                        self.shard.part_of(i, p.detach().reshape(-1)))
                    p.grad = None
                self.to_placeholders()
            else:
                grad_views = self.grad_views or [None] * len(self.params)
                for p, view, grad_view in zip(self.params, self.param_views, grad_views):
                    view.copy_(p.detach())
                    grad = p.grad
                    p.data = view
                    if grad is not None and grad_view is not None:
                        grad_view.copy_(grad)
                        p.grad = grad_view
        if self.has_master:
            self.backend.cast_(self.master_kview, self.storage.view(
                "param", self.param_base, self.shard.split))
        self.pull_host_part()
        if not self.sharded_params:
            self.param_versions = [p._version for p in self.params]
        self_ref = weakref.ref(self)
        for i, p in enumerate(self.params):
            if p.requires_grad:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(
                    _make_grad_hook(self_ref, i, grad_hook)))
                if before_grad is not None:
                    self._hook_handles.append(p.register_hook(
                        _make_before_grad_hook(self_ref, i, p, before_grad)))

    def placeholder(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.backend.device)

    def to_placeholders(self) -> None:
        """Stage 3: every param an empty placeholder."""
        with torch.no_grad():
            for p in self.params:
                p.data = self.placeholder()

    def take_sharded_swaps(self) -> None:
        """Stage 3, while sharded: a param given a whole tensor behind rlhfz
        (`p.data = t`) has its values taken into the shards, as a swap is at
        stages 0-2, and is a placeholder again. Anything else than a whole
        tensor of the param's shape, dtype and device raises. (A cast of the
        sharded model is refused when it is asked for: sharding.py.)"""
        if not self.sharded_params or self.gathered is not None:
            return
        swapped = [i for i, p in enumerate(self.params) if p.numel()]
        if not swapped:
            return
        for i in swapped:
            p, slot = self.params[i], self.layout.slots[i]
            if tuple(p.shape) != tuple(slot.shape) or p.dtype != self.dtype or \
                    p.device != self.backend.device:
                raise RuntimeError(
                    f"a sharded param of shape {tuple(slot.shape)} ({self.dtype} on "
                    f"{self.backend.device}) was given a {p.dtype} tensor of shape "
                    f"{tuple(p.shape)} on {p.device} outside a forward (p.data = t): its "
                    f"values live in shards. Assign a whole tensor of the param's shape, "
                    f"dtype and device, or use load_pretrained / load_checkpoint")
        self.load_whole([(i, self.params[i]) for i in swapped])
        self.to_placeholders()

    def detach_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    # ---- stage 3: whole params only while needed ----------------------------------

    def gather(self, comm, async_op: bool = False, root: int | None = None):
        """Makes every param whole (param.data a view of a gathered bucket);
        returns the collective's work with async_op. With root (a rank of
        comm, where comm.gathers_to_one), only root's params become whole:
        the others send their shards and stay as they are, though counted
        as gathered, so that every rank decides alike what to gather next."""
        if self.gathered is not None:
            return None
        self.take_sharded_swaps()
        for p in self.params:
            if p.dtype != self.dtype or p.device != self.backend.device:
                raise RuntimeError(
                    f"a sharded param (shape {tuple(self.layout.slots[0].shape)}, ...) was cast "
                    f"or moved to {p.dtype} on {p.device} after sharding (model.to() / .half() "
                    f"/ .cuda()); its shards are {self.dtype} on {self.backend.device} and stay "
                    f"so: cast or move the model before shard_model or ZeroAdamW(stage=3)")
        # Transient memory: on a GPU torch's cache hands the same blocks back
        # gather after gather, in stream order (backends.CudaBackend.empty).
        nbytes = self.layout.padded_numel * self.itemsize
        if self.flat_param_shard.device.type != "cpu":
            root = None             # gloo's point-to-point takes host memory only
        if root is not None and comm.rank != root:
            work = comm.gather_to(root, None, self.flat_param_shard, async_op=async_op)
            self.gathered = (nbytes, None)
            return work
        # Made under inference_mode (a generation), the whole params would be
        # inference tensors, which some of torch's kernels take another way
        # than the model's own (logits a bit off the unsharded model's).
        with torch.inference_mode(False):
            flat = self.backend.empty(self.layout.padded_numel, self.dtype)
            if root is not None:
                work = comm.gather_to(root, flat, self.flat_param_shard, async_op=async_op)
            else:
                work = comm.all_gather(flat, self.flat_param_shard, async_op=async_op)
            self.gathered = (nbytes, flat)
            with torch.no_grad():
                for p, slot in zip(self.params, self.layout.slots):
                    p.data = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
        self.gathered_versions = [p._version for p in self.params]
        return work

    def release(self) -> None:
        """Back to placeholders; the gathered memory goes back at once.
        Values written into a whole param meanwhile (inside
        gather_for_generation: model.load_state_dict(), p.copy_()) go into
        this rank's shard first, so they are kept as torch keeps them; every
        rank writes its own part, so the write is made on every rank."""
        if self.gathered is None:
            return
        if self.gathered[1] is not None:
            written = [i for i, (p, seen) in enumerate(zip(self.params, self.gathered_versions))
                       if p._version != seen]
            if written:
                self.load_whole([(i, self.params[i]) for i in written])
            self.to_placeholders()
        self.gathered = None

    def gathered_bytes(self) -> int:
        return self.gathered[0] if self.gathered is not None else 0

    # ---- grads ------------------------------------------------------------------

    def adopt_grad(self, index: int) -> None:
        """Move a grad that lives outside the bucket (autograd allocates one
        after grads were set to None, or a user assigned one) into it."""
        p = self.params[index]
        grad = p.grad
        if grad is None or grad is self.grad_views[index]:
            return
        if grad.layout != torch.strided:
            raise ValueError(f"sparse gradients are not supported (param {index} of group "
                             f"{self.group_index}, shape {tuple(p.shape)})")
        if grad.shape != self.grad_views[index].shape:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} for a param of shape "
                             f"{tuple(self.grad_views[index].shape)}")
        check_grad_dtype(p, grad, self.group_index)
        view = self.unheld_grad_view(index)
        with torch.no_grad():
            view.copy_(grad)
        p.grad = view

    def unheld_grad_view(self, index: int) -> torch.Tensor:
        """The slot's grad view, about to take new values while p.grad is
        not it. A view someone kept from an earlier p.grad (a grad logged,
        or summed over tasks) would change under them, where torch's next
        backward makes a new tensor: that object gets memory of its own,
        holding its values, and the slot a new view."""
        # references: the list, and getrefcount's argument
        if sys.getrefcount(self.grad_views[index]) > 2:
            held = self.grad_views[index]
            with torch.no_grad():
                held.data = held.detach().clone()
            del held
            slot = self.layout.slots[index]
            self.grad_views[index] = self.flat_grad[slot.offset:slot.offset + slot.numel] \
                .view(slot.shape)
        return self.grad_views[index]

    def grads_reduced(self) -> bool:
        """Stage 1: the grads are as the last all-reduce left them (torch
        bumps the version counter of every in-place write to them)."""
        return self.reduced_version == self.flat_grad._version

    def mark_reduced(self) -> None:
        self.reduced_version = self.flat_grad._version

    def collect_grads(self) -> list[bool]:
        """Which params have a grad; stray grads are moved into the bucket."""
        present = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                present.append(False)
                continue
            self.adopt_grad(i)
            present.append(True)
        return present

    def zero_grads(self, set_to_none: bool) -> None:
        if set_to_none or not self.full_grads:
            # The bucket keeps its memory; the next backward's grads are moved
            # into it by the post-accumulate hook.
            for p in self.params:
                p.grad = None
            return
        for i, p in enumerate(self.params):
            if p.grad is not None and p.grad is not self.grad_views[i]:
                self.adopt_grad(i)
        self.backend.zero_(self.storage.buffers["grad"], self.flat_grad)

    # ---- kernel views of shard ranges -----------------------------------------------

    def kernel_views(self, lo: int, hi: int):
        """((master, exp_avg, exp_avg_sq, grad, param_out), lowp) over
        backend-part shard elements [lo, hi); lowp: the low-precision step's
        further keywords, or None for fp32 moments."""
        if lo == 0 and hi == self.shard.numel:      # the whole shard, on the backend
            param_out = self.param_shard_kview if self.has_master else None
            return ((self.master_kview, self.exp_avg_kview, self.exp_avg_sq_kview,
                     self.grad_shard_kview, param_out), self._lowp("", lo, hi, lo))
        n = hi - lo
        param_out = (self.storage.view("param", self.param_base + lo, n) if self.has_master
                     else None)
        return ((self._master_view(lo, n), self.storage.view("exp_avg", lo, n),
                 self.storage.view("exp_avg_sq", lo, n), self.grad_shard_kview_range(lo, hi),
                 param_out), self._lowp("", lo, hi, lo))

    def host_kernel_views(self, lo: int, hi: int):
        """As kernel_views, for the host part's elements [lo, hi)."""
        n, storage = hi - lo, self.storage
        return ((storage.view("host_master", lo, n), storage.view("host_exp_avg", lo, n),
                 storage.view("host_exp_avg_sq", lo, n), storage.view("host_grad", lo, n),
                 storage.view("host_param", lo, n)),
                self._lowp("host_", lo, hi, self.shard.split + lo))

    def _lowp(self, prefix: str, lo: int, hi: int, shard_lo: int) -> dict | None:
        """The low-precision step's keywords for a part's elements [lo, hi)
        (shard_lo: where they start in the shard). Stochastic rounding counts
        elements from the bucket's start, so any world size draws the same."""
        if self.state_dtype == "fp32":
            return None
        extra = {"rounding": moments.ROUNDING[self.state_dtype],
                 "seed": (self.group_index * 65537 + self.index) & 0xFFFFFFFF,
                 "index_base": self.shard.start + shard_lo}
        if self.state_dtype == "int8":
            if not prefix and lo == 0 and hi == self.shard.split:
                extra.update(self.scale_kviews)         # the whole part: made once
                return extra
            a, b = self.shard.blocks(lo, hi, moments.QBLOCK)
            for name in SCALES.values():
                extra[name] = self.storage.view(prefix + name, a, b - a)
        return extra

    def grad_kview_range(self, lo: int, hi: int):
        """The whole bucket's grads (stages 0 and 1), elements [lo, hi)."""
        return self.storage.view("grad", lo, hi - lo)

    @property
    def reduces_in_staging(self) -> bool:
        """Stage 1 with 16-bit grads: the step reads the mean from an fp32
        copy of the grads, not from the grads themselves."""
        return self._grad_shard_at[0] == "reduce_staging"

    def grad_shard_kview_range(self, lo: int, hi: int):
        """The (reduced) grads of shard elements [lo, hi)."""
        name, start = self._grad_shard_at
        return self.storage.buffers[name].view(DTYPE_NAMES[self.reduce_dtype], start + lo,
                                               (hi - lo,))

    # ---- accounting -------------------------------------------------------------------

    def nbytes_by_tier(self) -> dict[str, dict[str, int]]:
        """{kind: {tier: bytes}}, kinds as memory_report names them."""
        return self.storage.nbytes_by_tier()


def _make_grad_hook(bucket_ref, index, sink):
    def hook(param):
        bucket = bucket_ref()
        if bucket is not None:
            sink(bucket, index, param)
    return hook


def _make_before_grad_hook(bucket_ref, index, param, sink):
    param_ref = weakref.ref(param)

    def hook(grad):
        bucket, p = bucket_ref(), param_ref()
        if bucket is not None and p is not None:
            sink(bucket, index, p)
        # None: the grad goes on as it is
    return hook


def check_grad_dtype(param: torch.Tensor, grad: torch.Tensor, group: int) -> None:
    """A grad must have its param's dtype, as torch's AdamW requires: one of
    another dtype (set through p.grad.data) would be cast without a word."""
    if grad.dtype != param.dtype:
        raise TypeError(f"a param of dtype {param.dtype} (group {group}, shape "
                        f"{tuple(param.shape)}) has a grad of dtype {grad.dtype}: a grad "
                        f"must have its param's dtype")
