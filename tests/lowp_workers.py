"""Rank functions for tests/test_low_precision_states.py (run_ranks needs
them importable)."""
import torch

import rlhfz
from dist_workers import make_model

STEPS = 6


def full_batch(steps=STEPS, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 37, generator=gen), torch.randn(16, 7, generator=gen))
            for _ in range(steps)]


def train_same_batch(rank, world_size, stage, state_dtype, offload_ratio=None):
    """Every rank takes the whole batch: the averaged grads are then the
    single process's exactly (at power-of-two world sizes), so what the
    moments' storage does is all that could differ."""
    model = make_model()
    offload = {} if offload_ratio is None else {"offload": "cpu", "offload_ratio": offload_ratio}
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage,
                          state_dtype=state_dtype, param_persistence_threshold=0, **offload)
    for x, y in full_batch():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    state = opt.state_dict()
    with rlhfz.gather_for_generation(model) if stage == 3 else _nothing():
        params = [p.detach().float().clone() for p in model.parameters()]
    return {"params": params,
            "state": {k: {n: v.clone() for n, v in e.items()} for k, e in state["state"].items()}}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def save_or_resume(rank, world_size, stage, state_dtype, path, resume):
    """The first half of train_same_batch, saved; or the second half, from
    that checkpoint (written at any world size and stage)."""
    model = make_model()
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage,
                          state_dtype=state_dtype, param_persistence_threshold=0)
    data = full_batch()
    half = len(data) // 2
    if resume:
        rlhfz.load_checkpoint(path, model, opt)
    for x, y in (data[half:] if resume else data[:half]):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if not resume:
        rlhfz.save_checkpoint(path, model, opt)
        return None
    state = opt.state_dict()
    with rlhfz.gather_for_generation(model) if stage == 3 else _nothing():
        params = [p.detach().float().clone() for p in model.parameters()]
    return {"params": params,
            "state": {k: {n: v.clone() for n, v in e.items()} for k, e in state["state"].items()}}
