"""rlhfz's own NCCL communicator: collectives on rlhfz's stream, in C.

torch.distributed stays the default engine and the fallback
(ZeroAdamW(collectives="torch")). With collectives="nccl" the data
collectives (reduce-scatter, all-gather, all-reduce) go through
rlhfz._C.NcclComm on device buffers instead:

- libnccl.so.2 is loaded once, preferring the copy torch already loaded,
  then $RLHFZ_NCCL_LIBRARY, then the nvidia-nccl wheel's;
- the unique id is made on rank 0 and broadcast over the communicator's
  gloo control group (under rlhfz's collective timeout);
- each collective runs on rlhfz's own CUDA stream: it first waits (an
  event, no host block) for the work torch's current stream has queued,
  and the returned work's wait() makes torch's current stream wait for the
  collective in turn;
- an NCCL error aborts the communicator (no hang) and raises; destroy() is
  explicit, never left to a destructor.

Agreement, presence masks and norms stay on the gloo control group, as with
the torch engine.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C
from .comm import CollectiveMismatchError, Communicator
from .nccl_library import load

_NCCL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class _NativeWork:
    """A collective queued on rlhfz's stream; wait() joins it to torch's
    current stream (no host block) and surfaces NCCL's asynchronous errors."""

    def __init__(self, comm: "NativeNcclCommunicator", done, keep):
        self.comm, self.done, self.keep = comm, done, keep

    def wait(self) -> None:
        if self.done is None:
            return
        self.done.wait(self.comm.torch_stream())
        self.done, self.keep = None, None
        self.comm.nccl.check()


class NativeNcclCommunicator(Communicator):
    def __init__(self, process_group, device: torch.device):
        super().__init__(process_group)
        if device is None or device.type != "cuda":
            raise ValueError(f"the native NCCL communicator needs a CUDA device, not {device}")
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        load()
        unique_id = [_C.nccl_unique_id() if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(unique_id, src=self._global[0], group=self._control)
        except RuntimeError as error:
            raise self._absent("NcclComm bootstrap", error) from error
        # NCCL binds a communicator to the device current at init.
        with torch.cuda.device(self.index):
            self.nccl = _C.NcclComm(unique_id[0], self.world_size, self.rank, self.index)
        self.stream = _C.CudaStream(self.index)

    def torch_stream(self) -> int:
        return torch.cuda.current_stream(self.index).cuda_stream

    def _run(self, launch, keep, async_op: bool):
        if not self.nccl.alive:
            raise CollectiveMismatchError(f"the NCCL communicator is {self.nccl.state}")
        ready = _C.CudaEvent(self.index)
        ready.record(self.torch_stream())
        ready.wait(self.stream)
        launch(self.stream.handle)
        done = _C.CudaEvent(self.index)
        done.record(self.stream)
        work = _NativeWork(self, done, keep)
        if async_op:
            return work
        work.wait()
        return None

    @staticmethod
    def _dtype(tensor: torch.Tensor) -> str:
        if tensor.dtype not in _NCCL_DTYPES:
            raise TypeError(f"the native NCCL path carries float32, bfloat16 and float16, "
                            f"not {tensor.dtype}")
        if not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError("the native NCCL path needs contiguous CUDA tensors")
        return _NCCL_DTYPES[tensor.dtype]

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                       async_op: bool = False):
        dtype = self._dtype(full_in)
        if shard_out.dtype != full_in.dtype or full_in.numel() != shard_out.numel() * self.world_size:
            raise ValueError("reduce_scatter: full_in must hold world_size shards of shard_out's "
                             "dtype")
        return self._run(lambda stream: self.nccl.reduce_scatter(
            full_in.data_ptr(), shard_out.data_ptr(), shard_out.numel(), dtype, "avg", stream),
            (shard_out, full_in), async_op)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor,
                   async_op: bool = False):
        dtype = self._dtype(full_out)
        if shard_in.dtype != full_out.dtype or full_out.numel() != shard_in.numel() * self.world_size:
            raise ValueError("all_gather: full_out must hold world_size shards of shard_in's dtype")
        return self._run(lambda stream: self.nccl.all_gather(
            shard_in.data_ptr(), full_out.data_ptr(), shard_in.numel(), dtype, stream),
            (full_out, shard_in), async_op)

    def all_reduce_avg(self, tensor: torch.Tensor, async_op: bool = False):
        dtype = self._dtype(tensor)
        return self._run(lambda stream: self.nccl.all_reduce(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), dtype, "avg", stream),
            (tensor,), async_op)

    def destroy(self) -> None:
        """Destroys the NCCL communicator after its queued work; every rank calls it."""
        if self.nccl.alive:
            self.stream.synchronize()
            self.nccl.destroy()
        self.stream.close()
        super().destroy()
