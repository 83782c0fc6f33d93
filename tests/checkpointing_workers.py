"""Per-rank bodies of the activation-checkpointing tests
(importable by spawned ranks)."""
import torch
from torch.utils.checkpoint import checkpoint

import rlhfz

WIDTH = 32


class PartlyCheckpointedBlock(torch.nn.Module):
    """A unit whose norm runs outside a reentrant checkpoint and whose MLP
    inside it: the MLP's grads come in a backward of its own, nested in the
    one that still needs the norm's weight (layer_norm keeps the param
    itself for its backward)."""

    def __init__(self, reentrant):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.a = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.b = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.reentrant = reentrant

    def mlp(self, x):
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x):
        h = self.norm(x)
        if self.reentrant is not None:
            return x + checkpoint(self.mlp, h, use_reentrant=self.reentrant)
        return x + self.mlp(h)


class FrozenEndsNet(torch.nn.Module):
    """Blocks between a frozen input projection and a frozen head (as a
    LoRA model's): the first grads of a backward come inside a checkpoint."""

    def __init__(self, reentrant, blocks=3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, WIDTH)
        self.blocks = torch.nn.ModuleList(PartlyCheckpointedBlock(reentrant)
                                          for _ in range(blocks))
        self.out = torch.nn.Linear(WIDTH, 1)
        self.inp.requires_grad_(False)
        self.out.requires_grad_(False)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).square().mean()


def batches(steps, rows=12):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 8, generator=gen) for _ in range(steps)]


def reference(steps, reentrant):
    """torch.optim.AdamW in one process on the whole batches."""
    model = FrozenEndsNet(reentrant)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for x in batches(steps):
        opt.zero_grad()
        model(x).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class _CountingComm:
    """The reducer's communicator, counting reduce-scatters."""

    def __init__(self, comm):
        self.comm, self.reduce_scatters = comm, 0

    def reduce_scatter(self, *args, **kwargs):
        self.reduce_scatters += 1
        return self.comm.reduce_scatter(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.comm, name)


class _CountingAverages:
    """Stage 1's end-of-backward averages of an engine, counted (one per
    bucket, as the reduce-scatters of stages 2 and 3)."""

    def __init__(self, engine):
        self.reduce_scatters = 0
        average = engine.average_grads

        def counted():
            self.reduce_scatters += sum(1 for b in engine.buckets if b.trainable)
            average()
        engine.average_grads = counted


def partly_checkpointed(rank, world_size, stage, reentrant, steps):
    """Trains on this rank's rows; the whole params, the reduce-scatters
    each backward issued, and the bytes still gathered after each step."""
    model = FrozenEndsNet(reentrant)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if stage == 3:
        opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=0)
    else:
        opt = rlhfz.ZeroAdamW(trainable, stage=stage, lr=1e-2)
    if stage == 1:
        # stage 1 averages whole buckets: one round of all-reduces a backward
        counting = _CountingAverages(opt.engine)
    else:
        counting = _CountingComm(opt.engine.reducer.comm)
        opt.engine.reducer.comm = counting
    per_backward, gathered = [], []
    for x in batches(steps):
        opt.zero_grad()
        counting.reduce_scatters = 0
        model(x[rank::world_size]).backward()
        per_backward.append(counting.reduce_scatters)
        if stage == 1:      # what the step would see: the mean, in p.grad
            per_backward[-1] = (per_backward[-1], [p.grad.clone() for p in trainable])
        opt.step()
        if stage == 3:
            gathered.append(opt.stage3.gathered_bytes())
    if stage == 3:
        params = {name: t.clone() for name, t in rlhfz.iter_full_params(model)}
    else:
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"params": params, "per_backward": per_backward, "gathered": gathered,
            "buckets": sum(1 for b in opt.engine.buckets if b.trainable)}
