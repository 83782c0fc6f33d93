"""Collectives across ranks: a control plane, and engines that move data.

    control.py        timeouts, agreement between ranks, mismatch detection, the errors
    torch_engine.py   data over torch.distributed (gloo pieces on the CPU, nccl on GPUs)
    nccl_engine.py    data over rlhfz's own NCCL communicator (collectives="nccl")
    nccl_library.py   finding libnccl.so.2
    communicator.py   a control plane and an engine over one process group
    hybrid.py         sharding within groups, replication across them (a 2-D DeviceMesh)
    channel.py        broadcasts from one rank over a group the caller made (weight sync)

A Communicator puts a control plane and an engine together behind one small
interface: agree / exchange on the control plane; reduce-scatter,
all-gather and all-reduce on flat tensors (views of rlhfz buffers) on the
engine; and the first rank's values to every rank at start. Every collective
rlhfz makes goes through it. A single process has none (communicator_for
gives None), so nothing there waits on anyone.
"""
from __future__ import annotations

import torch.distributed as dist

from .communicator import Communicator
from .control import CollectiveError, CollectiveMismatchError, collective_timeout

__all__ = ["CollectiveError", "CollectiveMismatchError", "Communicator",
           "NativeNcclCommunicator", "collective_timeout", "communicator_for"]


class NativeNcclCommunicator(Communicator):
    """A Communicator whose data moves on rlhfz's own NCCL communicator, on
    the device of `backend` (a CUDA or simulated CUDA backend)."""

    def __init__(self, process_group, backend):
        from .nccl_engine import NcclEngine
        super().__init__(process_group)
        try:
            self.data = NcclEngine(self.control, backend)
        except BaseException:
            super().destroy()
            raise
        self.backend = backend

    @property
    def nccl(self):
        return self.data.nccl

    def raise_if_failed(self) -> None:
        self.data.raise_if_failed()


def communicator_for(process_group, collectives: str = "torch", backend=None,
                     device_mesh=None) -> Communicator | None:
    """None in a single process (no collectives at all). collectives="nccl"
    gives rlhfz's own NCCL communicator on the device backend's device. A
    device mesh: 1-D shards over it, 2-D shards within its rows and
    replicates across them (hybrid.py)."""
    if device_mesh is not None:
        return _mesh_communicator(device_mesh, process_group, collectives, backend)
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) == 1:
        return None
    if collectives == "nccl":
        return NativeNcclCommunicator(process_group, backend)
    return Communicator(process_group)


def _mesh_communicator(mesh, process_group, collectives: str, backend):
    from .hybrid import HybridCommunicator, check_mesh_device, mesh_dims
    if process_group is not None:
        raise ValueError("pass process_group or device_mesh, not both: a mesh brings its groups")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a device_mesh needs torch.distributed initialized")
    replicate_dim, shard_dim = mesh_dims(mesh)
    if mesh.get_coordinate() is None:
        raise ValueError(f"rank {dist.get_rank()} is not in the device_mesh (ranks "
                         f"{mesh.mesh.flatten().tolist()}): only the mesh's ranks can shard "
                         f"over it; give this rank a mesh of its own, or no optimizer")
    if backend is not None:
        check_mesh_device(mesh, backend.device)
    if collectives != "torch":
        raise ValueError(f"collectives={collectives!r} with a device_mesh: hybrid sharding runs "
                         f"over torch.distributed (collectives='torch')")
    shard_ranks = mesh.size(shard_dim)
    if replicate_dim is None or mesh.size(replicate_dim) == 1:
        comm = communicator_for(mesh.get_group(shard_dim), collectives, backend)
        if comm is not None:
            comm.mesh = mesh
        return comm
    if shard_ranks == 1:
        raise ValueError(f"the mesh's shard dimension has one rank: that replicates the whole "
                         f"state on each of the {mesh.size(replicate_dim)} ranks and shards "
                         f"nothing; wrap the model in DistributedDataParallel instead")
    return HybridCommunicator(mesh, replicate_dim, shard_dim)
