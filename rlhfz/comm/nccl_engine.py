"""The native NCCL data engine: collectives on rlhfz's stream, in C.

torch.distributed stays the default engine and the fallback
(ZeroAdamW(collectives="torch")). With collectives="nccl" the data
collectives (reduce-scatter, all-gather, all-reduce) go through
rlhfz._C.NcclComm on device tensors instead, which it borrows through
DLPack and checks (dtype, device, sizes, overlap) as the kernels do:

- libnccl.so.2 is loaded once, preferring the copy torch already loaded,
  then $RLHFZ_NCCL_LIBRARY, then the nvidia-nccl wheel's;
- the unique id is made on rank 0 and sent over the communicator's gloo
  control group (under rlhfz's collective timeout), with each rank's word
  that its library, device and stream are ready: a rank that failed there
  fails every rank at once, where NCCL's blocking init would wait for it;
- each collective runs on rlhfz's own CUDA stream: it first waits (an
  event, no host block) for the work torch's current stream has queued,
  and the returned work's wait() makes torch's current stream wait for the
  collective in turn, then waits for it on the host too: a collective the
  watchdog aborts raises there, before anything reads what it left (a
  device-side wait alone returns at once, and torch would go on to read
  the half-written result without a word); NcclComm keeps the tensors it
  borrowed until the collective is done on that stream;
- NCCL never gives up on a peer that died: its kernels wait for it, and so
  does the host when it next synchronizes. A watchdog thread therefore
  watches every collective in flight and NCCL's asynchronous error; past
  RLHFZ_COLLECTIVE_TIMEOUT, or on an error, it aborts the communicator
  (ncclCommAbort ends the waiting), and the next call raises
  CollectiveError;
- destroy() is explicit, never left to a destructor.

Agreement, presence masks and norms stay on the gloo control plane, as with
the torch engine. Every CUDA call goes through the device backend
(engine/backends.py), so the same code runs on the simulated runtime.
"""
from __future__ import annotations

import threading
import time

import torch

from .. import _C
from .control import CollectiveError, ControlPlane, collective_timeout
from .nccl_library import load


def _name(tensor: torch.Tensor) -> str:
    """The dtype as NCCL messages name it: float32, not torch.float32."""
    return str(tensor.dtype).removeprefix("torch.")


class _NativeWork:
    """A collective queued on rlhfz's stream; wait() joins it to torch's
    current stream, waits for it on the host (the GIL released) and raises
    what the watchdog found."""

    def __init__(self, comm: "NcclEngine", done):
        self.comm, self.done = comm, done

    def wait(self) -> None:
        if self.done is None:
            return
        done, self.done = self.done, None
        done.wait(self.comm.torch_stream())
        done.synchronize()         # returns once done, or once the watchdog's abort ends it
        # An error NCCL flagged (a size mismatch, say) ends the collective
        # without its result: asked now, not at the watchdog's next look.
        self.comm.watchdog.poll()
        self.comm.raise_if_failed()


class _Watchdog:
    """Watches a communicator's collectives in flight (each with the event
    recorded after it) and its asynchronous error."""

    POLL_S = 0.05

    def __init__(self, comm: "NcclEngine"):
        self.comm = comm
        self.lock = threading.Lock()
        self.in_flight: list[tuple] = []       # (done event, started, what)
        self.error: CollectiveError | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rlhfz-nccl-watchdog", daemon=True)
        self.thread.start()

    def watch(self, what: str) -> list:
        """Watches a collective from before its launch: anything that blocks
        between the launch and its event (a cudaFree synchronizes the
        device) is then under the timeout too. Its event goes in the
        returned entry once recorded; until then it counts as in flight."""
        entry = [None, time.monotonic(), what]
        with self.lock:
            self.in_flight.append(entry)
        return entry

    def forget(self, entry: list) -> None:
        """A collective whose launch failed: nothing is in flight for it."""
        with self.lock:
            self.in_flight = [e for e in self.in_flight if e is not entry]

    def _pending(self) -> list:
        return [e for e in self.in_flight if e[0] is None or not e[0].query()]

    def _run(self) -> None:
        while not self.stopping.wait(self.POLL_S):
            if self.poll():
                return

    def poll(self) -> bool:
        """One look; True once it has aborted the communicator."""
        with self.lock:
            self.in_flight = self._pending()
            oldest = self.in_flight[0] if self.in_flight else None
        nccl = self.comm.nccl
        if not nccl.alive:
            return False
        try:
            nccl.check()           # aborts the communicator on an asynchronous error
        except RuntimeError as error:
            self.fail(f"an NCCL operation failed ({error})")
            return True
        if self.error is not None:
            return True
        if oldest is not None and time.monotonic() - oldest[1] > collective_timeout():
            # the error first: the abort ends the waits, which then look for it
            self.fail(f"{oldest[2]} did not complete within {collective_timeout():.0f} s "
                       f"(RLHFZ_COLLECTIVE_TIMEOUT): not every rank of the "
                       f"{self.comm.world_size} took part (one died, hangs, or is in another "
                       f"call); the NCCL communicator was aborted")
            try:
                nccl.abort()       # ends the kernels waiting on the missing rank
            except RuntimeError:
                pass
            return True
        return False

    def fail(self, what: str) -> None:
        with self.lock:
            if self.error is None:
                self.error = self.comm.control.lost(what)

    def busy(self) -> bool:
        with self.lock:
            self.in_flight = self._pending()
            return bool(self.in_flight)

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join()


class NcclEngine:
    """rlhfz._C.NcclComm over the ranks of a control plane, on one device."""

    def __init__(self, control: ControlPlane, backend):
        if backend is None or backend.tier != "device":
            raise ValueError("the native NCCL communicator needs params on a CUDA device")
        self.control = control
        self.rank, self.world_size = control.rank, control.world_size
        self.backend = backend
        self.index = backend.index
        self.stream = self._bootstrap(control, backend)
        try:
            self.watchdog = _Watchdog(self)
        except BaseException:
            self.nccl.abort()      # a half-built engine leaves no communicator behind
            raise

    def _bootstrap(self, control: ControlPlane, backend):
        """Makes the communicator and returns rlhfz's stream. An NCCL init
        waits for every rank (before 2.14 for ever), so whatever can fail
        on one rank alone (the library, the device, the stream, the unique
        id) is done first, and the ranks agree that all of it worked before
        any enters the init: a rank that failed raises its own error, the
        others a CollectiveError naming it, at once."""
        unique_id = stream = None
        failure = None
        try:
            load()
            with backend.device_guard():
                stream = _C.CudaStream(self.index)
            if self.rank == 0:
                unique_id = _C.nccl_unique_id()
        except Exception as error:                  # noqa: BLE001 - each rank says why
            failure = error
        reports = control.exchange(
            (None if failure is None else f"{type(failure).__name__}: {failure}", unique_id),
            "NcclComm bootstrap")
        failed = [(rank, why) for rank, (why, _) in enumerate(reports) if why is not None]
        if failed and stream is not None:
            stream.close()
        if failure is not None:
            raise failure
        if failed:
            raise control.lost("the NCCL communicator was not made, because "
                               + "; ".join(f"rank {rank} failed first: {why}"
                                           for rank, why in failed))
        try:
            # NCCL binds a communicator to the device current at init. The
            # init is non-blocking from NCCL 2.14: a rank that fails inside
            # it leaves the others polling until the timeout, not for ever.
            with backend.device_guard():
                self.nccl = _C.NcclComm(reports[0][1], self.world_size, self.rank, self.index,
                                        timeout=control.timeout_s)
        except TimeoutError as error:
            stream.close()
            raise control.lost(f"the NCCL communicator was not made ({error}; "
                               f"{control.timeout_name})") from error
        except BaseException:
            stream.close()
            raise
        return stream

    def torch_stream(self) -> int:
        return self.backend.stream()

    def raise_if_failed(self) -> None:
        if self.watchdog.error is not None:
            raise self.watchdog.error

    def _run(self, launch, what: str, async_op: bool):
        """launch(stream) queues the collective on rlhfz's stream, after the
        work torch's current stream has queued so far."""
        self.raise_if_failed()
        if not self.nccl.alive:
            raise self.control.lost(f"{what} cannot run: the NCCL communicator is "
                                    f"{self.nccl.state} after an earlier failure")
        ready = _C.CudaEvent(self.index)
        ready.record(self.torch_stream())
        ready.wait(self.stream)
        entry = self.watchdog.watch(what)
        try:
            launch(self.stream)
        except (ValueError, TypeError, BufferError):
            self.watchdog.forget(entry)          # refused before NCCL ran: nothing changed
            raise
        except (RuntimeError, TimeoutError) as error:
            # TimeoutError: NCCL left the call in progress past the timeout
            self.watchdog.forget(entry)
            self.watchdog.fail(f"{what} failed in NCCL ({error})")
            self.raise_if_failed()
        done = _C.CudaEvent(self.index)
        done.record(self.stream)
        entry[0] = done
        work = _NativeWork(self, done)
        if async_op:
            return work
        work.wait()
        return None

    # NcclComm checks the tensors (dtype, device, sizes, overlap) and raises
    # what is wrong; detach(): torch exports no tensor that requires grad.

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                       async_op: bool = False):
        send, recv = full_in.detach(), shard_out.detach()
        return self._run(lambda stream: self.nccl.reduce_scatter(send, recv, "avg", stream=stream),
                         f"reduce_scatter of {full_in.numel()} {_name(full_in)} elements", async_op)

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor,
                   async_op: bool = False):
        send, recv = shard_in.detach(), full_out.detach()
        return self._run(lambda stream: self.nccl.all_gather(send, recv, stream=stream),
                         f"all_gather of {full_out.numel()} {_name(full_out)} elements", async_op)

    def all_reduce_avg(self, tensor: torch.Tensor, async_op: bool = False):
        data = tensor.detach()
        return self._run(lambda stream: self.nccl.all_reduce(data, data, "avg", stream=stream),
                         f"all_reduce of {tensor.numel()} {_name(tensor)} elements", async_op)

    def destroy(self) -> None:
        """Destroys the NCCL communicator after its queued work; every rank
        calls it. The watchdog watches that work to its end, so a rank that
        died makes this wait no longer than the timeout (the communicator is
        aborted then, not destroyed)."""
        while self.watchdog.busy() and self.watchdog.error is None:
            time.sleep(_Watchdog.POLL_S)
        self.watchdog.stop()
        try:
            if self.nccl.alive:
                self.nccl.destroy()
        except RuntimeError as error:
            # an asynchronous error left it unusable: abort frees it instead
            self.nccl.abort()
            raise self.control.lost(f"destroying the NCCL communicator failed ({error}); it "
                                    f"was aborted instead") from error
        finally:
            self.stream.close()
