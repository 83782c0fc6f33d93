"""Per-rank bodies of the tests of ZeroAdamW under accelerate's wrapper and
torch.distributed.checkpoint's state-dict API (importable by spawned ranks)."""
import copy

import torch
import torch.distributed as dist

import rlhfz

STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))


def _optimizer(kind, model, stage):
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    if stage == 3:      # every param sharded, however small
        return rlhfz.ZeroAdamW(model, lr=0.01, stage=3, param_persistence_threshold=0)
    return rlhfz.ZeroAdamW(model.parameters(), lr=0.01, stage=stage)


def _batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=gen)


def _train(model, opt, steps, first, rank, backward=None):
    for step in range(first, first + steps):
        opt.zero_grad()
        loss = model(_batch(step, rank)).square().mean()
        (backward or (lambda l: l.backward()))(loss)
        opt.step()


def _whole(model):
    if dist.is_initialized() and dist.get_world_size() > 1:
        return {name: t.clone() for name, t in rlhfz.iter_full_params(model)}
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def accelerated(rank, world_size, kind, stage):
    """Through accelerate's prepare(): training, the wrapper's state_dict /
    load_state_dict round trip, and training on after it."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    accelerator = Accelerator(cpu=True)
    model = _model()
    model, opt = accelerator.prepare(model, _optimizer(kind, model, stage))
    assert isinstance(opt, AcceleratedOptimizer)
    _train(model, opt, STEPS, 0, rank, accelerator.backward)
    saved = opt.state_dict()
    _train(model, opt, 1, STEPS, rank, accelerator.backward)
    opt.load_state_dict(saved)
    lrs = [group["lr"] for group in opt.param_groups]
    _train(model, opt, 2, STEPS + 1, rank, accelerator.backward)
    return {"params": _whole(model), "steps": sorted(int(s["step"]) for s in
                                                     opt.state_dict()["state"].values()),
            "lrs": lrs}


def distributed_checkpoint(rank, world_size, kind, stage):
    """torch.distributed.checkpoint.state_dict: get_optimizer_state_dict
    after some steps, set_optimizer_state_dict into a fresh optimizer over a
    model with the same weights, then both train on."""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    model = _model()
    opt = _optimizer(kind, model, stage)
    _train(model, opt, STEPS, 0, rank)
    # a copy, as a checkpoint on disk is: torch's load_state_dict keeps the
    # tensors it is given when their dtype and device already fit
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    outcome = {"keys": sorted(saved["state"]),
               "groups": [sorted(g["params"]) for g in saved["param_groups"]]}
    fresh = _model()
    fresh_opt = _optimizer(kind, fresh, stage)
    if stage != 3:          # (sharded params are only whole inside a forward)
        with torch.no_grad():
            for p, q in zip(fresh.parameters(), model.parameters()):
                p.copy_(q)
    try:
        set_optimizer_state_dict(fresh, fresh_opt, saved)
    except Exception as error:      # noqa: BLE001 (the test reads what was refused)
        outcome["refused"] = f"{type(error).__name__}: {error}"
        return outcome
    _train(model, opt, 2, STEPS, rank)
    _train(fresh, fresh_opt, 2, STEPS, rank)
    outcome["continued"] = _whole(model)
    outcome["resumed"] = _whole(fresh)
    return outcome
