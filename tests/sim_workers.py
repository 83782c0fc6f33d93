"""Per-rank bodies of the end-to-end runs on the simulated device
(importable by spawned ranks). The same function runs with params on the
CPU (the SIMD kernels) and, under RLHFZ_SIM_DEVICE, on a simulated device
(the CUDA kernels, compiled for the host): the math is the same, so the
results must be the same bits."""
import os

import torch

import rlhfz
from native_nccl_workers import Net

STEPS = 8


def _batch(step, rank, world_size, dtype):
    gen = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(12, 37, generator=gen)
    y = torch.randn(12, 5, generator=gen)
    part = slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)
    return x[part].to(dtype), y[part].to(dtype)


def _build(stage, dtype, options):
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2,
                          weight_decay=0.05, stage=stage, param_persistence_threshold=0,
                          wrap=(torch.nn.Sequential,) if stage == 3 else None, **options)
    return model, opt


def train(rank, world_size, stage, dtype_name, scenario, workdir, options):
    """STEPS steps with a scenario in the middle; returns every param,
    gathered, and what the scenario saw."""
    dtype = getattr(torch, dtype_name)
    model, opt = _build(stage, dtype, options)
    seen = {"backend": type(opt.backend).__name__}
    for step in range(STEPS):
        x, y = _batch(step, rank, world_size, dtype)
        opt.zero_grad()
        # two micro-batches (the second adds to reduced grads) and a clip
        # that always bites (folded into the step where grads are sharded)
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (torch.nn.functional.mse_loss(model(xm).float(), ym.float()) / 2).backward()
        opt.clip_grad_norm_(0.01)
        opt.step()
        if step != STEPS // 2:
            continue
        if scenario == "offload-cpu":
            rlhfz.offload(model, opt, to="cpu")
            seen["offloaded"] = opt.placement()
            rlhfz.reload(model, opt)
        elif scenario == "offload-disk":
            path = os.path.join(workdir, f"rank{rank}")
            os.makedirs(path, exist_ok=True)
            opt.offload(to="disk", path=path)
            seen["offloaded"] = opt.placement()
            opt.reload()
        elif scenario == "generate":
            probe, _ = _batch(99, 0, 1, dtype)
            for mode in (dict(), dict(enabled=False), dict(budget_bytes=4096)):
                with torch.no_grad(), rlhfz.gather_for_generation(model, **mode) as m:
                    seen[f"generate {mode}"] = m(probe).float()
        elif scenario == "checkpoint":
            path = os.path.join(workdir, "checkpoint")
            rlhfz.save_checkpoint(path, model, opt)
            opt.close()
            model, opt = _build(stage, dtype, options)
            rlhfz.load_checkpoint(path, model, opt)
    seen["placement"] = opt.placement()
    with rlhfz.gather_for_generation(model):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt.close()
    return {"params": params, "seen": seen}
