"""Shard state: the fp32 master weights, moments and step counts of one
bucket's shard, and per-param views of them in torch.optim.AdamW's shapes.

The moments are kept in the bucket's state_dtype (moments.py): each param's
state shows the stored form (bf16 values, or int8 codes with their block
scales), and read / write / full_shard convert to and from fp32 values.

Under offload="cpu" a shard's state lives in two parts, on the backend and
on the host (ShardLayout.split). A param whose range crosses the split gets
a stitched copy as its state tensor, refreshed after every change.
"""
from __future__ import annotations

import torch

from . import moments
from .layout import ShardLayout

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
SCALES = moments.SCALES


class ShardState:
    def __init__(self, shard: ShardLayout, world_size: int, has_master: bool, count: int,
                 state_dtype: str = "fp32"):
        self.shard = shard
        self.world_size = world_size
        self.has_master = has_master          # 16-bit params: fp32 params are their own
        self.state_dtype = state_dtype
        # the regions behind each param's state tensors
        self.names = STATE_NAMES + (tuple(SCALES.values()) if state_dtype == "int8" else ())
        # Per-param step counts, as torch.optim.AdamW keeps them; state['step']
        # is a 0-dim view of one entry.
        self.steps = torch.zeros(count, dtype=torch.float32)
        self.step_views = [self.steps[i] for i in range(count)]
        self.registered = [False] * count
        self.all_registered = False           # lets a step skip the per-param check
        self.parts: dict[str, tuple] = {}     # name -> (backend part, host part or None)
        self.views: dict[str, list | None] = {}
        self.stitched: list[int] = []
        self._stitched_seen: dict[tuple[str, int], int] = {}   # their versions as refreshed

    def build(self, parts: dict[str, tuple]) -> dict[str, list | None]:
        """Per-param views over the flat parts (name -> (backend, host));
        returns them by name, for the storage's registry."""
        self.parts = parts
        self.stitched = []
        self._stitched_seen = {}
        views = {}
        for name in self.names:
            device_part, host_part = parts[name]
            views[name] = (self._views(name, device_part, host_part)
                           if name != "master" or self.has_master else None)
        self.views = views
        self.refresh_stitched()
        return views

    def _ranges(self, name: str, a: int, b: int) -> tuple[int, int, tuple | None, tuple | None]:
        """A param's shard elements [a, b) in the units of region `name`
        (blocks for scales), with the backend and host sides of them."""
        device, host = self.shard.sides(a, b)
        if name not in SCALES.values():
            return a, b, device, host
        block = moments.QBLOCK
        lo, hi = ShardLayout.blocks(a, b, block)
        device = None if device is None else ShardLayout.blocks(*device, block)
        host = None if host is None else ShardLayout.blocks(*host, block)
        return lo, hi, device, host

    def _views(self, name: str, device_part: torch.Tensor, host_part) -> list[torch.Tensor]:
        views = []
        for i, (a, b) in enumerate(self.shard.local):
            lo, hi, device, host = self._ranges(name, a, b)
            if host is None:
                view = device_part[lo:hi]
            elif device is None:
                view = host_part[host[0]:host[1]]
            else:
                view = torch.empty(hi - lo, dtype=device_part.dtype)
                if i not in self.stitched:
                    self.stitched.append(i)
            # with one rank, the state has the params' shapes, as torch's does
            shaped = self.world_size == 1 and name not in SCALES.values()
            views.append(view.view(self.shard.bucket.slots[i].shape) if shaped else view)
        return views

    def adopt(self, views: dict[str, list | None]) -> None:
        """The views by their registered identities (after a rebind)."""
        self.views = {name: views[name] for name in self.names}

    def read_stored(self, name: str, index: int) -> torch.Tensor:
        """This rank's part of one param's region `name` as stored, flat, on
        the host (codes and scales of int8 moments as they are)."""
        device_part, host_part = self.parts[name]
        _, _, device, host = self._ranges(name, *self.shard.local[index])
        pieces = []
        if device is not None:
            pieces.append(device_part[device[0]:device[1]].cpu())
        if host is not None:
            pieces.append(host_part[host[0]:host[1]])
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=device_part.dtype)

    def read(self, name: str, index: int) -> torch.Tensor:
        """This rank's part of one param's state, flat fp32 values, on the host."""
        stored = self.read_stored(name, index)
        if name == "master" or self.state_dtype == "fp32":
            return stored
        scales = self.read_stored(SCALES[name], index) if self.state_dtype == "int8" else None
        return moments.decode(name, self.state_dtype, stored, scales)

    def write_stored(self, name: str, index: int, values: torch.Tensor) -> None:
        """Writes this rank's part of one param's region `name` as stored."""
        device_part, host_part = self.parts[name]
        values = values.reshape(-1)
        lo, _, device, host = self._ranges(name, *self.shard.local[index])
        with torch.no_grad():
            if device is not None:
                device_part[device[0]:device[1]].copy_(values[:device[1] - lo])
            if host is not None:
                host_part[host[0]:host[1]].copy_(values[values.numel() - (host[1] - host[0]):])
            views = self.views.get(name)
            if views is not None and index in self.stitched:
                views[index].view(-1).copy_(values)
                self._stitched_seen[name, index] = views[index]._version

    def write(self, name: str, index: int, values: torch.Tensor) -> None:
        """Writes this rank's part of one param's state (values: the shard's
        part of a param-shaped tensor, fp32 values), stored in state_dtype."""
        if name == "master" or self.state_dtype == "fp32":
            self.write_stored(name, index, values)
            return
        a, b = self.shard.local[index]
        stored = torch.empty(b - a, dtype=moments.STORED[self.state_dtype][name])
        scales = None
        if self.state_dtype == "int8":
            scales = torch.empty(moments.region_numel(SCALES[name], b - a),
                                 dtype=torch.float32)
        moments.encode(name, self.state_dtype, values, stored, scales)
        self.write_stored(name, index, stored)
        if scales is not None:
            self.write_stored(SCALES[name], index, scales)

    def write_step(self, index: int, step: float) -> None:
        self.steps[index] = step

    def reset(self, index: int) -> None:
        """A param's state as before its first step: zero moments, step 0."""
        a, b = self.shard.local[index]
        zeros = torch.zeros(b - a)
        self.write("exp_avg", index, zeros)
        self.write("exp_avg_sq", index, zeros)
        self.write_step(index, 0.0)

    def refresh_stitched(self) -> None:
        """Copies the current state of the params that cross the split into
        their stitched state tensors (after every step, and before saving)."""
        with torch.no_grad():
            for index in self.stitched:
                for name in self.names:
                    views = self.views.get(name)
                    if views is not None:
                        views[index].view(-1).copy_(self.read_stored(name, index))
                        self._stitched_seen[name, index] = views[index]._version

    def take_stitched_writes(self) -> None:
        """A stitched state tensor written in place since its last refresh
        (opt.state[p]["exp_avg"].zero_()): the state it copies takes the
        values, as the views of every other param do by being the state."""
        for (name, index), seen in list(self._stitched_seen.items()):
            view = self.views[name][index]
            if view._version != seen:
                self.write_stored(name, index, view.detach().reshape(-1).clone())
                self._stitched_seen[name, index] = view._version

    def full_shard(self, name: str) -> torch.Tensor:
        """This rank's whole shard of a state, fp32 values on the backend's
        device (a view when it all lives there as fp32, else a copy)."""
        whole = self.full_shard_stored(name)
        if name == "master" or self.state_dtype == "fp32":
            return whole
        scales = None
        if self.state_dtype == "int8":
            scales = self.full_shard_stored(SCALES[name])
        return moments.decode(name, self.state_dtype, whole, scales)

    def full_shard_stored(self, name: str) -> torch.Tensor:
        """This rank's whole shard of region `name` as stored."""
        device_part, host_part = self.parts[name]
        if host_part is None:
            return device_part
        return torch.cat([device_part, host_part.to(device_part.device)])

    def entry(self, index: int) -> dict[str, torch.Tensor]:
        """A param's state as optimizer.state shows it (views, not copies):
        torch.optim.AdamW's keys, the moments in their stored form, and for
        int8 moments their block scales."""
        state = {"step": self.step_views[index], "exp_avg": self.views["exp_avg"][index],
                 "exp_avg_sq": self.views["exp_avg_sq"][index]}
        if self.state_dtype == "int8":
            for scale in SCALES.values():
                state[scale] = self.views[scale][index]
        if self.views["master"] is not None:
            state["master_param"] = self.views["master"][index]
        return state
