"""Shard state: the fp32 master weights, moments and step counts of one
bucket's shard, and per-param views of them in torch.optim.AdamW's shapes.

Under offload="cpu" a shard's state lives in two parts, on the backend and
on the host (ShardLayout.split). A param whose range crosses the split gets
a stitched copy as its state tensor, refreshed after every change.
"""
from __future__ import annotations

import torch

from .layout import ShardLayout

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


class ShardState:
    def __init__(self, shard: ShardLayout, world_size: int, has_master: bool, count: int):
        self.shard = shard
        self.world_size = world_size
        self.has_master = has_master          # 16-bit params: fp32 params are their own
        # Per-param step counts, as torch.optim.AdamW keeps them; state['step']
        # is a 0-dim view of one entry.
        self.steps = torch.zeros(count, dtype=torch.float32)
        self.step_views = [self.steps[i] for i in range(count)]
        self.registered = [False] * count
        self.all_registered = False           # lets a step skip the per-param check
        self.parts: dict[str, tuple] = {}     # name -> (backend part, host part or None)
        self.views: dict[str, list | None] = {}
        self.stitched: list[int] = []

    def build(self, parts: dict[str, tuple]) -> dict[str, list | None]:
        """Per-param views over the flat parts (name -> (backend, host));
        returns them by name, for the storage's registry."""
        self.parts = parts
        self.stitched = []
        views = {}
        for name in STATE_NAMES:
            device_part, host_part = parts[name]
            views[name] = (self._views(device_part, host_part)
                           if name != "master" or self.has_master else None)
        self.views = views
        self.refresh_stitched()
        return views

    def _views(self, device_part: torch.Tensor, host_part) -> list[torch.Tensor]:
        views = []
        for i, (a, b) in enumerate(self.shard.local):
            device, host = self.shard.sides(a, b)
            if host is None:
                view = device_part[a:b]
            elif device is None:
                view = host_part[host[0]:host[1]]
            else:
                view = torch.empty(b - a, dtype=torch.float32)
                if i not in self.stitched:
                    self.stitched.append(i)
            # with one rank, the state has the params' shapes, as torch's does
            views.append(view.view(self.shard.bucket.slots[i].shape)
                         if self.world_size == 1 else view)
        return views

    def adopt(self, views: dict[str, list | None]) -> None:
        """The views by their registered identities (after a rebind)."""
        self.views = {name: views[name] for name in STATE_NAMES}

    def read(self, name: str, index: int) -> torch.Tensor:
        """This rank's part of one param's state, flat, on the host."""
        device_part, host_part = self.parts[name]
        device, host = self.shard.sides(*self.shard.local[index])
        pieces = []
        if device is not None:
            pieces.append(device_part[device[0]:device[1]].cpu())
        if host is not None:
            pieces.append(host_part[host[0]:host[1]])
        return torch.cat(pieces) if pieces else torch.empty(0)

    def write(self, name: str, index: int, values: torch.Tensor) -> None:
        """Writes this rank's part of one param's state (values: the shard's
        part of a param-shaped tensor)."""
        device_part, host_part = self.parts[name]
        values = values.reshape(-1)
        a, _ = self.shard.local[index]
        device, host = self.shard.sides(*self.shard.local[index])
        with torch.no_grad():
            if device is not None:
                device_part[device[0]:device[1]].copy_(values[:device[1] - a])
            if host is not None:
                host_part[host[0]:host[1]].copy_(values[values.numel() - (host[1] - host[0]):])
            views = self.views.get(name)
            if views is not None and index in self.stitched:
                views[index].view(-1).copy_(values)

    def refresh_stitched(self) -> None:
        """Copies the current state of the params that cross the split into
        their stitched state tensors (after every step, and before saving)."""
        with torch.no_grad():
            for index in self.stitched:
                for name in STATE_NAMES:
                    views = self.views.get(name)
                    if views is not None:
                        views[index].view(-1).copy_(self.read(name, index))

    def full_shard(self, name: str) -> torch.Tensor:
        """This rank's whole shard of a state, on the backend's device (a view
        when it all lives there, else the two parts joined)."""
        device_part, host_part = self.parts[name]
        if host_part is None:
            return device_part
        return torch.cat([device_part, host_part.to(device_part.device)])

    def entry(self, index: int) -> dict[str, torch.Tensor]:
        """A param's state in torch.optim.AdamW's form (views, not copies)."""
        state = {"step": self.step_views[index], "exp_avg": self.views["exp_avg"][index],
                 "exp_avg_sq": self.views["exp_avg_sq"][index]}
        if self.views["master"] is not None:
            state["master_param"] = self.views["master"][index]
        return state
