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


def die_mid_collective(rank, world_size, victim, out_dir):
    """Every rank trains; at step 2 the victim is SIGKILLed just before its
    grads' reduce-scatter, which the others are already in. Survivors write
    what they saw to out_dir (the victim never returns)."""
    torch.manual_seed(0)
    model = Net()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=2, collectives="nccl")
    started = None
    try:
        for step in range(4):
            x, y = _batch(step, rank, world_size, torch.float32)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == 2:
                if rank == victim:
                    os.kill(os.getpid(), signal.SIGKILL)
                started = time.monotonic()
            loss.backward()
            opt.step()
        outcome = {"raised": None}
    except CollectiveError as error:
        outcome = {"raised": str(error), "after_s": time.monotonic() - started}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
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
