"""Hybrid sharding over a torch DeviceMesh, as FSDP2's HSDP takes it.

A 2-D mesh (dims "replicate" and "shard", or unnamed in that order) shards
every bucket within each shard group, the mesh's rows, and replicates the
shards across groups: rank (r, s) holds shard s, as rank (r', s) does.

- Params are gathered within the shard group only, so a gather never
  crosses the slow link between groups.
- Grads are reduce-scattered within the shard group, then each shard is
  averaged across its replicas: one all-reduce of the grad shard crosses
  the replicate dimension per step. The mean of the groups' means is the
  mean over every rank, as the groups are equal.
- Stage 1 keeps whole grads: reduce-scatter, the shard's all-reduce
  across replicas, then an all-gather within the group, so here too only
  the grad shard crosses.
- Agreement, statuses and presence masks span the whole mesh in two hops,
  within the group and then across replicas; norms sum over the shard
  group alone, whose shards every replica holds alike.

A mesh over every rank of the job gets gloo groups of rlhfz's own for
each dimension (every rank makes them all). A mesh over some of the job's
ranks (a training group beside generation workers) is built on by its
members alone, so rlhfz runs on the mesh's own groups there (ControlPlane).

On gloo a collective in phases (_Chain) starts its replicate phase once its
shard phase is done, from the next collective call or a wait, never
earlier than the chains before it: every rank issues each group's
collectives in one order, whatever finished first where.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.layout import rank_range, shard_size
from .communicator import Communicator

DIMENSIONS = ("replicate", "shard")


def mesh_dims(mesh) -> tuple[int | None, int]:
    """(the replicate dimension or None, the shard dimension) of a mesh,
    checked: 1-D shards over it; 2-D replicates over its first dimension and
    shards over its second, or by the names "replicate" and "shard"."""
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh "
                        f"(init_device_mesh makes one), not {type(mesh).__name__}")
    if mesh.ndim == 1:
        return None, 0
    if mesh.ndim != 2:
        raise ValueError(f"a device mesh of {mesh.ndim} dimensions: rlhfz takes 1 (shard) or 2 "
                         f"(replicate, shard)")
    names = mesh.mesh_dim_names
    if names is None:
        return 0, 1
    if sorted(names) != sorted(DIMENSIONS):
        raise ValueError(f"a 2-D device mesh's dimensions are named {tuple(names)}; rlhfz "
                         f"reads {DIMENSIONS} (mesh_dim_names=('replicate', 'shard')), or "
                         f"leave them unnamed to replicate over the first and shard over "
                         f"the second")
    return names.index("replicate"), names.index("shard")


def check_mesh_order(grid: list[list[int]]) -> None:
    """Refuses a mesh whose ranks torch's groups would number across the
    layout: a group numbers its ranks in ascending order, not the mesh's, so
    in [[0, 3], [2, 1]] ranks 0 and 2 replicate each other while holding
    shards 0 and 1 (averaging different shards' grads, with no error), and
    ranks 0 and 1 both lead their replicas. grid: (replicas, shard ranks)."""
    shard_of = {r: sorted(row).index(r) for row in grid for r in row}
    replica_of = {r: sorted(column).index(r) for column in zip(*grid) for r in column}
    crossed = ([list(c) for c in zip(*grid) if len({shard_of[r] for r in c}) > 1]
               + [row for row in grid if len({replica_of[r] for r in row}) > 1])
    if crossed:
        raise ValueError(
            f"the device_mesh {grid} (replicas x shard ranks) orders its ranks so that the "
            f"ranks {crossed[0]} would hold different shards or replicas: torch numbers a "
            f"group's ranks in ascending order, not the mesh's. Order each shard group's "
            f"ranks alike in every replica, as init_device_mesh does ([[0, 1], [2, 3]])")


def check_mesh_device(mesh, device: torch.device) -> None:
    """The mesh's groups carry the params' device's tensors (nccl for CUDA)."""
    if device.type in ("cpu", "cuda") and mesh.device_type != device.type:
        raise ValueError(f"the device mesh is a {mesh.device_type!r} mesh but the params are on "
                         f"{device}: init_device_mesh({device.type!r}, ...)")


class _Chain:
    """A collective in phases; each phase starts once the one before is done.
    phases: [(crosses replicas, start(async_op) -> work or None)]."""

    def __init__(self, phases):
        self.phases = list(phases)
        self.work = None
        self._start_next()

    def _start_next(self) -> None:
        _, start = self.phases.pop(0)
        self.work = start(True)

    def _running(self) -> bool:
        return self.work is not None and not self.work.is_completed()

    def crossing_ahead(self) -> bool:
        """Its replicate phase is still to start."""
        return any(across for across, _ in self.phases)

    def advance(self, block: bool) -> bool:
        """Starts the replicate phase once what runs before it is done
        (waiting for it if block); False while it still runs."""
        while self.phases and self.phases[0][0]:
            if not block and self._running():
                return False
            if self.work is not None:
                self.work.wait()
            self._start_next()
        return True

    def finish(self) -> None:
        while True:
            if self.work is not None:
                work, self.work = self.work, None
                work.wait()
            if not self.phases:
                return
            self._start_next()


class _ChainWork:
    """What an async hybrid collective returns: wait() finishes it."""

    def __init__(self, comm: "HybridCommunicator", chain: _Chain):
        self.comm, self.chain = comm, chain

    def wait(self) -> None:
        chain, self.chain = self.chain, None
        if chain is not None:
            self.comm._advance(upto=chain)
            chain.finish()

    def is_completed(self) -> bool:
        return self.chain is None


class HybridCommunicator(Communicator):
    """Shards within this rank's group of a 2-D mesh and replicates across
    groups. rank and world_size are the shard group's (the layout's);
    replica and replicas place it across the groups."""

    def __init__(self, mesh, replicate_dim: int, shard_dim: int):
        grid = mesh.mesh if replicate_dim == 0 else mesh.mesh.T   # (replicas, shard ranks)
        check_mesh_order(grid.tolist())
        whole_job = mesh.size() == dist.get_world_size()
        super().__init__(mesh.get_group(shard_dim), rows=grid.tolist() if whole_job else None)
        try:
            self.across = Communicator(mesh.get_group(replicate_dim),
                                       rows=grid.T.tolist() if whole_job else None)
        except BaseException:
            super().destroy()
            raise
        self.mesh = mesh
        self.replica, self.replicas = self.across.rank, self.across.world_size
        self._order = [int(r) for r in grid.reshape(-1)]   # the leading rank first
        self._chains: list[_Chain] = []    # replicate phases not yet started, in order

    def destroy(self) -> None:
        self._advance(upto=self._chains[-1] if self._chains else None)
        self.across.destroy()
        super().destroy()

    @property
    def members(self) -> list[int]:
        return list(self._order)

    def traffic_by_dimension(self) -> dict[str, dict[str, int]]:
        return {"shard": dict(self.traffic), "replicate": dict(self.across.traffic)}

    # ---- the control plane: agreement over the whole mesh ---------------------------

    def agree(self, call: str, signature=None, within=None) -> None:
        """Within the group, then across replicas: two ranks that disagree
        meet in one of the hops (`within`, in the first alone: replicas
        gather their units apart, generating as many tokens as each needs)."""
        self.control.agree(call, signature if within is None else (signature, within))
        self.across.control.agree(call, signature)

    def statuses(self, value, call: str) -> list:
        """Every rank's value, replica by replica, the leading rank's first."""
        within = self.control.exchange(value, call)
        return [v for group in self.across.control.exchange(within, call) for v in group]

    def explain_failures(self, hint: str) -> None:
        super().explain_failures(hint)
        self.across.explain_failures(hint)

    def all_reduce_max_control(self, tensor: torch.Tensor, call: str) -> None:
        self.control.all_reduce_max(tensor, call)
        self.across.control.all_reduce_max(tensor, call)

    def count_control(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.across.control.all_reduce_sum_host(self.control.all_reduce_sum_host(tensor))

    def start_from_first_rank(self, tensors: list, call: str) -> None:
        """The leading rank's values everywhere: its group's first rank's
        within each group, then replica 0's across groups."""
        self.agree(call, [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in tensors])
        self.torch.broadcast_from_first(tensors)
        self.across.torch.broadcast_from_first(tensors)

    # ---- the data: within the group, then across replicas ---------------------------

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                       async_op: bool = False):
        within = super().reduce_scatter
        return self._chain([
            (False, lambda a: within(shard_out, full_in, async_op=a)),
            (True, lambda a: self.across.all_reduce_avg(shard_out, async_op=a))], async_op)

    def all_reduce_avg(self, tensor: torch.Tensor, async_op: bool = False):
        """Whole grads (stage 1): this rank's range reduced within the group,
        averaged across replicas, and gathered back within the group."""
        lo, hi = rank_range(self.rank, shard_size(tensor.numel(), self.world_size))
        mine = tensor[lo:hi]
        within, gather = super().reduce_scatter, super().all_gather
        return self._chain([
            (False, lambda a: within(mine, tensor, async_op=a)),
            (True, lambda a: self.across.all_reduce_avg(mine, async_op=a)),
            (False, lambda a: gather(tensor, mine, async_op=a))], async_op)

    def _chain(self, phases, async_op: bool):
        if not self.torch.gloo:
            # stream-ordered engines: wait() orders the streams, the host runs on
            work = None
            for _, start in phases:
                if work is not None:
                    work.wait()
                work = start(True)
            if not async_op:
                work.wait()
                return None
            return work
        self._advance()
        chain = _Chain(phases)
        if chain.crossing_ahead():
            self._chains.append(chain)
        work = _ChainWork(self, chain)
        if not async_op:
            work.wait()
            return None
        return work

    def _advance(self, upto: _Chain | None = None) -> None:
        """Starts chains' replicate phases in the order the chains began:
        every one up to `upto` (waiting on what they wait for), or else
        those ready now."""
        if upto is not None and upto not in self._chains:
            upto = None
        while self._chains:
            head = self._chains[0]
            if not head.advance(block=upto is not None):
                return
            self._chains.pop(0)
            if head is upto:
                return
