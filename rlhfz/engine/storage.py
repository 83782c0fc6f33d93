"""Flat storage: the Buffers behind one bucket, and every tensor over them.

A bucket's memory is a handful of regions (its params, grads, fp32 master,
moments, and under offload="cpu" the host part's copies of them), each one
rlhfz Buffer in a tier. Torch tensors handed out over them (param.data,
param.grad, optimizer state) are all registered here, in one place, so that
a move to another tier can re-point every one of them in place: no
reference anyone holds changes identity.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class Region(NamedTuple):
    kind: str        # what offload() names it: params, grads or optimizer
    report: str      # what memory_report() names it
    host: bool       # lives on the host wherever the bucket trains (offload="cpu")


REGIONS = {
    "param": Region("params", "params", False),
    "grad": Region("grads", "grads", False),
    "grad_shard": Region("grads", "grads", False),
    "reduce_staging": Region("grads", "grads", False),
    "master": Region("optimizer", "master", False),
    "exp_avg": Region("optimizer", "exp_avg", False),
    "exp_avg_sq": Region("optimizer", "exp_avg_sq", False),
    # int8 moments: one fp32 scale per block, counted with its moment
    "exp_avg_scale": Region("optimizer", "exp_avg", False),
    "exp_avg_sq_scale": Region("optimizer", "exp_avg_sq", False),
    "host_param": Region("params", "params", True),
    "host_grad": Region("grads", "grads", True),
    "host_master": Region("optimizer", "master", True),
    "host_exp_avg": Region("optimizer", "exp_avg", True),
    "host_exp_avg_sq": Region("optimizer", "exp_avg_sq", True),
    "host_exp_avg_scale": Region("optimizer", "exp_avg", True),
    "host_exp_avg_sq_scale": Region("optimizer", "exp_avg_sq", True),
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1}


class FlatStorage:
    """Buffers by region name (None where a bucket has no such region), the
    dtype of each, and the registry of torch tensors over them."""

    def __init__(self, sizes: dict[str, tuple[int, str] | None], alloc, host_alloc):
        """sizes: region -> (elements, dtype name) or None. Everything is
        allocated here, before any param is touched, so that running out of
        memory leaves the model as it was."""
        self.dtypes = {name: spec[1] for name, spec in sizes.items() if spec is not None}
        self.buffers = {}
        for name in REGIONS:
            spec = sizes.get(name)
            if spec is None:
                self.buffers[name] = None
                continue
            numel, dtype = spec
            nbytes = numel * ITEMSIZE[dtype]
            self.buffers[name] = (host_alloc if REGIONS[name].host else alloc)(nbytes)
        self.handed: dict[str, object] = {}

    def view(self, name: str, lo: int = 0, numel: int | None = None):
        """A kernel view (no DLPack) of a region's elements [lo, lo + numel)."""
        buffer = self.buffers[name]
        if numel is None and lo == 0:
            return buffer.view(self.dtypes[name])
        return buffer.view(self.dtypes[name], lo, (numel,))

    def hand_out(self, tensors: dict[str, object]) -> None:
        """Registers the tensors handed out (flat tensors, and lists of
        per-param views), by name."""
        self.handed = tensors

    def rebind(self, build: Callable[[], dict[str, object]]) -> dict[str, object]:
        """After buffers were replaced: builds the tensors anew over the
        current buffers and re-points every one handed out before in place
        at its new memory. Returns the registry (the old identities)."""
        before = self.handed
        fresh = build()
        with torch.no_grad():
            for name, new in fresh.items():
                old = before.get(name)
                if old is None:
                    before[name] = new
                elif isinstance(old, list):
                    for o, n in zip(old, new):
                        o.data = n
                else:
                    old.data = new
        return before

    # ---- moving between tiers ---------------------------------------------------------

    def movable(self, kinds) -> list[tuple[str, str, object]]:
        """(region, kind, buffer) of every buffer of the kinds."""
        return [(name, region.kind, self.buffers[name]) for name, region in REGIONS.items()
                if region.kind in kinds and self.buffers[name] is not None]

    def replace(self, name: str, buffer) -> None:
        """Swaps in a region's new buffer; rebind() follows."""
        if self.buffers.get(name) is None or buffer.nbytes != self.buffers[name].nbytes:
            raise ValueError(f"region {name!r} cannot take a buffer of {buffer.nbytes} bytes")
        self.buffers[name] = buffer

    def nbytes_by_tier(self) -> dict[str, dict[str, int]]:
        """{memory_report kind: {tier: bytes}}."""
        report: dict[str, dict[str, int]] = {}
        for name, region in REGIONS.items():
            entry = report.setdefault(region.report, {})
            buffer = self.buffers[name]
            if buffer is not None:
                entry[buffer.tier] = entry.get(buffer.tier, 0) + buffer.nbytes
        return report
