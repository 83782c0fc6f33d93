"""Per-rank bodies of the native NCCL engine's multi-process tests
(importable by spawned ranks): ZeroAdamW(collectives="nccl") beside
collectives="torch", and a rank that dies in the middle of a collective."""
import json
import os
import signal
import time

import torch

import rlhfz
from rlhfz.comm import CollectiveError

STEPS = 12


class Net(torch.nn.Module):
    """Odd sizes, so shard boundaries fall inside params; three blocks, so
    stage 3 has units to gather one at a time."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(37, 37), torch.nn.Tanh()) for _ in range(3))
        self.head = torch.nn.Linear(37, 5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(step, rank, world_size, dtype):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(12, 37, generator=gen)
    y = torch.randn(12, 5, generator=gen)
    per_rank = 12 // world_size
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[part].to(dtype), y[part].to(dtype)


def train(rank, world_size, collectives, stage, dtype_name):
    """Trains STEPS steps; returns the params (gathered at stage 3)."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage,
                          collectives=collectives, param_persistence_threshold=0,
                          wrap=(torch.nn.Sequential,) if stage == 3 else None)
    try:
        for step in range(STEPS):
            x, y = _batch(step, rank, world_size, dtype)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            opt.step()
        with rlhfz.gather_for_generation(model):
            params = {name: p.detach().float().clone() for name, p in model.named_parameters()}
        return {"params": params, "backend": type(opt.backend).__name__,
                "comm": type(opt.comm).__name__}
    finally:
        opt.close()


def torch_clips(rank, world_size, collectives, stage):
    """torch.nn.utils.clip_grad_norm_ and clip_grad_value_ as a script
    calls them, while the grads live in shards on the (simulated) devices
    and p.grad is None: against torch's AdamW and torch's clips of whole
    grads on the host. Returns the norms and the largest param difference."""
    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(0)
    plain = Net()
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-3, stage=stage,
                          collectives=collectives, param_persistence_threshold=0,
                          wrap=(torch.nn.Sequential,) if stage == 3 else None)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    norms = []
    try:
        for step in range(6):
            x, y = _batch(step, rank, world_size, torch.float32)
            whole_x, whole_y = _batch(step, 0, 1, torch.float32)
            opt.zero_grad()
            ref.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            torch.nn.functional.mse_loss(plain(whole_x), whole_y).backward()
            if step % 2:
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
                torch.nn.utils.clip_grad_value_(plain.parameters(), 0.01)
            else:
                # the 2-norm on rlhfz's kernels; others each param's, on torch's
                order = (2.0, "inf", 3.0)[step // 2]
                norms.append(
                    (float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, order)),
                     float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, order))))
            opt.step()
            ref.step()
        with rlhfz.gather_for_generation(model):
            ours = {name: p.detach().clone() for name, p in model.named_parameters()}
        diff = max(float((ours[name] - p.detach()).abs().max())
                   for name, p in plain.named_parameters())
        return {"norms": norms, "diff": diff, "backend": type(opt.backend).__name__,
                "bf16": _bf16_norms(collectives, stage)}
    finally:
        opt.close()


def _bf16_norms(collectives, stage):
    """torch's clip_grad_norm_ of bf16 grads in device shards, and of the
    same whole grads (every rank takes the whole batch): each param's norm
    rounded to bf16 before the norm of those, as torch rounds them."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(Net().to(torch.bfloat16))
    model, plain = models
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-3, stage=stage,
                          collectives=collectives, param_persistence_threshold=0,
                          wrap=(torch.nn.Sequential,) if stage == 3 else None)
    try:
        x, y = _batch(0, 0, 1, torch.bfloat16)
        for m in models:
            torch.nn.functional.mse_loss(m(x), y).backward()
        return [(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, order)),
                 float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9, order)))
                for order in (2.0, "inf")]
    finally:
        opt.close()


def _train_until_one_dies(model, opt, rank, world_size, victim, out_dir, before_death=None):
    """Trains 4 steps; at step 2 the victim SIGKILLs itself (after its
    forward, or, with before_death, after that and before the forward).
    Survivors write what they saw to out_dir (the victim never returns)."""
    started = None
    try:
        for step in range(4):
            x, y = _batch(step, rank, world_size, torch.float32)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y) if before_death is None else None
            if step == 2:
                if before_death is not None:
                    before_death(x)
                if rank == victim:
                    os.kill(os.getpid(), signal.SIGKILL)
                started = time.monotonic()
            if loss is None:
                loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        outcome = {"raised": None}
    except CollectiveError as error:
        outcome = {"raised": str(error), "after_s": time.monotonic() - started}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    return outcome


def die_mid_collective(rank, world_size, victim, out_dir):
    """Every rank trains; at step 2 the victim is SIGKILLed just before its
    grads' reduce-scatter, which the others are already in."""
    torch.manual_seed(0)
    model = Net()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=2, collectives="nccl")
    outcome = _train_until_one_dies(model, opt, rank, world_size, victim, out_dir)
    try:
        opt.close()
    except Exception as error:        # noqa: BLE001 (recorded: close must not hang)
        outcome["close"] = repr(error)
    return outcome


def collective_after_death(rank, world_size, victim, out_dir):
    """The native communicator alone: the victim dies right after the
    bootstrap; the others' all-reduce waits on it (NCCL never gives up) until
    the watchdog aborts the communicator, and the wait raises."""
    from rlhfz.engine import backend_for
    from rlhfz.comm import NativeNcclCommunicator
    comm = NativeNcclCommunicator(None, backend_for(torch.device("cpu")))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    tensor = comm.backend.empty(1000, torch.float32).fill_(float(rank))
    started = time.monotonic()
    try:
        comm.all_reduce_avg(tensor)
        outcome = {"raised": None}
    except CollectiveError as error:
        outcome = {"raised": str(error), "after_s": time.monotonic() - started,
                   "alive": comm.nccl.alive}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    comm.destroy()
    return outcome


def _native_comm():
    from rlhfz.engine import backend_for
    from rlhfz.comm import NativeNcclCommunicator
    return NativeNcclCommunicator(None, backend_for(torch.device("cpu")))


def _outcome(call) -> str | None:
    try:
        call()
    except CollectiveError as error:
        return str(error)
    return None


def mismatched_sizes_then_destroy(rank, world_size):
    """The ranks all-reduce different sizes: NCCL flags the communicator's
    error and the collective ends without a result. The first wait raises
    (before anything reads the tensor); destroy() then raises too, after
    releasing everything it holds."""
    comm = _native_comm()
    tensor = comm.backend.empty(1000 + rank, torch.float32).fill_(float(rank + 1))
    first = _outcome(lambda: comm.all_reduce_avg(tensor))
    second = _outcome(lambda: comm.all_reduce_avg(comm.backend.empty(8, torch.float32)))
    destroyed = _outcome(comm.destroy)
    return {"first": first, "second": second, "destroy": destroyed,
            "stream_closed": comm.data.stream.handle == 0,
            "control_released": comm.control.released}


def refused_constructor(rank, world_size):
    """A ZeroAdamW(collectives="nccl") that refuses its arguments after it
    made its communicator leaves no communicator or watchdog behind."""
    import threading
    model = Net()
    try:
        rlhfz.ZeroAdamW([{"params": list(model.parameters())[:2]},
                         {"params": list(model.parameters())[2:], "lr": -1.0}],
                        stage=2, collectives="nccl")
        refused = None
    except ValueError as error:
        refused = str(error)
    watchdogs = [t for t in threading.enumerate() if t.name == "rlhfz-nccl-watchdog"]
    return {"refused": refused, "watchdogs": len(watchdogs)}


def one_device_for_all(rank, world_size):
    """ZeroAdamW(collectives="nccl") with every rank on one device: what
    the constructor raises (NCCL refuses the communicator), and whether a
    communicator or watchdog was left behind."""
    import threading
    import time
    model = Net()
    started = time.monotonic()
    try:
        rlhfz.ZeroAdamW(model.parameters(), stage=2, collectives="nccl")
        raised = None
    except Exception as error:      # noqa: BLE001 - the test checks which
        raised = f"{type(error).__name__}: {error}"
    watchdogs = [t for t in threading.enumerate() if t.name == "rlhfz-nccl-watchdog"]
    return {"raised": raised, "after_s": time.monotonic() - started, "watchdogs": len(watchdogs)}


def bootstrap_fails_on_one_rank(rank, world_size, failing_rank):
    """The failing rank cannot make rlhfz's stream, before any NCCL init:
    what each rank's communicator raises, how soon, and whether a watchdog
    or a communicator was left behind (NCCL's blocking init would wait for
    the failing rank for ever)."""
    from rlhfz import _C
    if rank == failing_rank:
        _C.cuda_sim_inject("cudaStreamCreateWithFlags:1")
    return _communicator_outcome()


def _communicator_outcome():
    """Makes a native communicator: what it raised, how soon, and whether a
    watchdog or a communicator was left behind."""
    import threading
    import time
    from rlhfz.comm import NativeNcclCommunicator
    from rlhfz.engine import backend_for
    backend = backend_for(torch.device("cpu"))
    started = time.monotonic()
    try:
        comm = NativeNcclCommunicator(None, backend)
        raised = None
    except Exception as error:      # noqa: BLE001 - the test checks which
        raised = f"{type(error).__name__}: {error}"
    else:
        comm.destroy()
    watchdogs = [t for t in threading.enumerate() if t.name == "rlhfz-nccl-watchdog"]
    return {"raised": raised, "after_s": time.monotonic() - started, "watchdogs": len(watchdogs)}


def init_fails_on_one_rank(rank, world_size, failing_rank):
    """Every rank gets past the bootstrap; the failing rank's NCCL init
    itself fails (its first CUDA call inside it). The others are inside
    theirs, waiting for it: what each raises, and how soon."""
    from rlhfz import _C
    if rank == failing_rank:
        made = _C.NcclComm

        def failing(*args, **kwargs):
            _C.cuda_sim_inject("cudaGetDevice:1")
            return made(*args, **kwargs)
        _C.NcclComm = failing
    return _communicator_outcome()


def gather_then_peer_dies(rank, world_size, victim, out_dir):
    """Stage 3: the ranks gather for generation (the buffers it frees are
    released later, from a pending call), then the victim dies before the
    next forward. The survivor raises within the timeout."""
    torch.manual_seed(0)
    model = Net()
    opt = rlhfz.ZeroAdamW(model, lr=1e-2, stage=3, collectives="nccl",
                          param_persistence_threshold=0)

    def generate(x):
        with rlhfz.gather_for_generation(model):
            model(x)
    return _train_until_one_dies(model, opt, rank, world_size, victim, out_dir, generate)


def launch_fails(rank, world_size, failing_rank):
    """A collective NCCL refuses at launch (a CUDA call inside it fails) is a
    CollectiveError on that rank, with params and state unchanged."""
    from rlhfz import _C
    torch.manual_seed(0)
    model = Net()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=2, collectives="nccl")
    x, y = _batch(0, rank, world_size, torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    if rank == failing_rank:
        _C.cuda_sim_inject("cudaLaunchHostFunc:1")
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        raised = None
    except CollectiveError as error:
        raised = str(error)
    return {"raised": raised, "unchanged": all(torch.equal(p, b) for p, b in
                                               zip(model.parameters(), before)),
            "state": len(opt.state)}
