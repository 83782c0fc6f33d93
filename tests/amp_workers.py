"""Per-rank bodies of the GradScaler tests (importable by spawned ranks)."""
import warnings

import torch

import rlhfz


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 4))


def scaled_training(rank, world_size, stage, steps=24, inf_at=(5, 11), clip_every=2,
                    recipe="rlhfz"):
    """Trains with torch.amp.GradScaler on the CPU; Inf losses at inf_at.
    ZeroAdamW when stage is not None, else torch.optim.AdamW (the reference,
    one process, whole batch). recipe="torch": ZeroAdamW clipped by torch's
    recipe (scaler.unscale_(opt), torch.nn.utils.clip_grad_norm_), not by
    the optimizer's own calls."""
    warnings.simplefilter("ignore", FutureWarning)
    m = model()
    opt = (rlhfz.ZeroAdamW(m, lr=1e-2, stage=stage) if stage is not None
           else torch.optim.AdamW(m.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=4)
    scales = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = m(x[rank::world_size]).pow(2).mean()
        if step in inf_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if step % clip_every == 0:
            if stage is None or recipe == "torch":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            else:
                opt.unscale_(scaler)
                opt.clip_grad_norm_(0.5)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    params = {n: t.clone() for n, t in rlhfz.iter_full_params(m)}
    return {"params": params, "scales": scales,
            "skipped": getattr(opt, "skipped_steps", None)}


def inf_then_clamped(rank, world_size, stage):
    """scaler.unscale_ finds an Inf on rank 0 alone; clip_grad_value_ then
    makes every grad finite. As in torch, the Inf found counts: the step is
    skipped on every rank and the scale backs off."""
    m = model()
    opt = rlhfz.ZeroAdamW(m, lr=1e-2, stage=stage)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    before = [p.detach().clone() for p in m.parameters()]
    scaler.scale(m(torch.randn(8, 16)).pow(2).mean()).backward()
    if rank == 0:
        m[0].weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_value_(m.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return {"moved": any(not torch.equal(p, b) for p, b in zip(m.parameters(), before)),
            "scale": scaler.get_scale(), "skipped": opt.skipped_steps, "state": len(opt.state)}


def clip_after_an_unscale_that_reached_nothing(rank, world_size, stage):
    """At stages 2 and 3 param.grad is None after backward. The scaler's
    unscale_, as bound before the optimizer was built (rlhfz's wrap of it
    comes with the optimizer), reaches nothing, so a clip after it
    measures scaled grads."""
    warnings.simplefilter("ignore", FutureWarning)
    m = model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    unscale = scaler.unscale_
    opt = rlhfz.ZeroAdamW(m, lr=1e-2, stage=stage)
    scaler.scale(m(torch.randn(8, 16)).pow(2).mean()).backward()
    unscale(opt)
    opt.clip_grad_norm_(0.5)
    before = {n: t.clone() for n, t in rlhfz.iter_full_params(m)}
    try:
        scaler.step(opt)
        error = None
    except RuntimeError as caught:
        error = str(caught)
    after = {n: t.clone() for n, t in rlhfz.iter_full_params(m)}
    return {"error": error, "unchanged": all(torch.equal(before[n], after[n]) for n in before),
            "state": len(opt.state)}


def disabled_scaler(rank, world_size, stage):
    """GradScaler(enabled=use_amp) with use_amp False: opt.unscale_ does
    nothing, as scaler.unscale_ does, and training goes on as without it."""
    m = model()
    opt = rlhfz.ZeroAdamW(m, lr=1e-2, stage=stage)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    scaler.scale(m(torch.randn(8, 16)).pow(2).mean()).backward()
    opt.unscale_(scaler)
    opt.clip_grad_norm_(0.5)
    scaler.step(opt)
    scaler.update()
    return len(opt.state)


def a_rank_without_grads(rank, world_size):
    """Stage 1 under no_sync: rank 1 had no batch, so scaler.unscale_
    reached no grads there. Every rank decides alike that the grads were
    unscaled: the mean is not divided by the scale a second time."""
    warnings.simplefilter("ignore", FutureWarning)
    m = model()
    opt = rlhfz.ZeroAdamW(m, lr=1e-2, stage=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    with opt.no_sync():
        if rank == 0:
            scaler.scale(m(x).pow(2).mean()).backward()
        else:
            scaler.scale(torch.zeros(()))
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return {name: state["exp_avg"].clone() for name, state in
            zip(range(len(opt.state)), opt.state_dict()["state"].values())}
