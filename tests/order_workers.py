"""Per-rank bodies of the reduction-order tests (importable by spawned
ranks): stage 2 with param groups the way transformers' Trainer makes them."""
import torch

import rlhfz

WIDTH = 64


class Stack(torch.nn.Module):
    def __init__(self, blocks=6):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH))
            for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x.pow(2).mean()


def groups(model):
    """Weights decay; biases and norm weights (1-D) do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    exempt = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": exempt, "weight_decay": 0.0}]


def inputs(steps, rank):
    gen = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, WIDTH, generator=gen) for _ in range(steps)]


def reference(world_size, steps):
    model = Stack()
    opt = torch.optim.AdamW(groups(model), lr=1e-2)
    batches = [inputs(steps, r) for r in range(world_size)]
    for step in range(steps):
        opt.zero_grad()
        (sum(model(b[step]) for b in batches) / world_size).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train(rank, world_size, steps):
    """The params after training, and for each backward the number of grads
    that had come when each reduce-scatter was issued."""
    model = Stack()
    opt = rlhfz.ZeroAdamW(groups(model), stage=2, lr=1e-2, bucket_bytes=16 << 10)
    events = []
    issue = opt.comm.reduce_scatter

    def reduce_scatter(*args, **kwargs):
        events.append("reduce")
        return issue(*args, **kwargs)
    opt.comm.reduce_scatter = reduce_scatter
    for p in model.parameters():        # after rlhfz's own hooks
        p.register_post_accumulate_grad_hook(lambda _: events.append("grad"))
    grads_at = []
    for x in inputs(steps, rank):
        opt.zero_grad()
        del events[:]
        model(x).backward()
        seen, at = 0, []
        for event in events:
            seen += event == "grad"
            if event == "reduce":
                at.append(seen)
        grads_at.append((at, seen))
        opt.step()
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()},
            "grads_at": grads_at}
