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


def huge_grad(rank, world_size, stage, nonfinite):
    """One grad element (on the last rank's shard) so large that exp_avg_sq
    would overflow int8's blocks: every rank refuses or skips the step
    alike, and nothing changes anywhere."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 256)
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), stage=stage,
                          state_dtype="int8", nonfinite=nonfinite)
    x = torch.randn(8, 64)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    before = opt.state_dict()["state"]
    with rlhfz.gather_for_generation(model) if stage == 3 else _nothing():
        params = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    hook = model.weight.register_hook(lambda g: g.index_put((torch.tensor([255]),
                                                             torch.tensor([63])),
                                                            torch.tensor(1e21)))
    model(x).square().mean().backward()
    hook.remove()
    try:
        opt.step()
        outcome = "stepped"
    except rlhfz.optim.NonFiniteGradError as error:
        outcome = str(error)
    after = opt.state_dict()["state"]
    with rlhfz.gather_for_generation(model) if stage == 3 else _nothing():
        same_params = all(torch.equal(p, q) for p, q in zip(params, model.parameters()))
    same_state = all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])
    return {"outcome": outcome, "same": same_params and same_state,
            "skipped": opt.skipped_steps}
