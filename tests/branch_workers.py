"""Per-rank bodies of the tests where ranks take different branches
(importable by spawned ranks): a param gets a grad on some ranks only, or
after its bucket was reduced."""
import os

import torch
from torch.utils.checkpoint import checkpoint

import rlhfz

WIDTH = 32


class Block(torch.nn.Module):
    """A residual block with a branch (`extra`) that a forward may skip."""

    def __init__(self):
        super().__init__()
        self.main = torch.nn.Linear(WIDTH, WIDTH)
        self.extra = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, h, use_extra=False):
        h = h + torch.tanh(self.main(h))
        if use_extra:
            h = h + 0.5 * self.extra(h)
        return h


class BranchNet(torch.nn.Module):
    def __init__(self, blocks=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, WIDTH)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(blocks)])
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, ids, extra=(), order=None):
        h = self.embed(ids)
        for i in order or range(len(self.blocks)):
            h = self.blocks[i](h, use_extra=i in extra)
        return self.head(h).pow(2).mean()


class Pair(torch.nn.Module):
    """Two layers, the second (`b`) on a branch a forward may skip."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.b = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x, use_b=True):
        return self.a(x) + self.b(x) if use_b else self.a(x)


class SharedNet(torch.nn.Module):
    """One module used by two reentrant checkpointed segments: its grads
    come in two nested backwards, the second after its buckets may have
    been reduced. In the segments not in `extra` (all by default) it skips
    its branch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, WIDTH)
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(WIDTH) for _ in range(2)])
        self.head = torch.nn.Linear(WIDTH, 1)
        # registered last, so at stage 2 its buckets are the first launched
        self.shared = Pair()

    def segment(self, h, norm, use_b):
        return h + torch.tanh(self.shared(norm(h), use_b))

    def forward(self, ids, extra=None):
        h = self.embed(ids)
        for i, norm in enumerate(self.norms):
            h = checkpoint(self.segment, h, norm, extra is None or i in extra,
                           use_reentrant=True)
        return self.head(h).pow(2).mean()


MODELS = {"branch": BranchNet, "shared": SharedNet}


def batches(steps):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50, (8, 6), generator=gen) for _ in range(steps)]


def reference(kind, world_size, steps, extra_of):
    """torch AdamW in one process, on the mean of every rank's loss (the
    grads DDP averages)."""
    model = MODELS[kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in batches(steps):
        opt.zero_grad()
        losses = [model(ids[r::world_size], *_branches(extra_of, r))
                  for r in range(world_size)]
        (sum(losses) / world_size).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _logged(comm, log):
    """Records each data collective this rank issues, in order."""
    for name in ("reduce_scatter", "all_gather"):
        original = getattr(comm, name)

        def call(out, inp, *args, _original=original, _name=name, **kwargs):
            log.append((_name, inp.numel()))
            return _original(out, inp, *args, **kwargs)
        setattr(comm, name, call)


def _branches(extra_of, rank) -> tuple:
    """The rank's forward arguments: its branches, if it has any of its own."""
    return (extra_of[rank],) if rank in extra_of else ()


def train(rank, world_size, kind, stage, steps, extra_of, options=None):
    """Trains with this rank's branches; the whole params, each forward and
    backward's collectives in order, the reduce-scatters issued before the
    last all-gather of each (reductions overlapping backward), and how many
    times each backward reduced each bucket of the shared module."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "30"
    model = MODELS[kind]()
    options = dict(options or {})
    if options.pop("branch_group", False):
        # the branch's layer in a param group of its own: a bucket apart
        # (and the Pair one unit, which every rank runs whole)
        if stage == 3:
            rlhfz.shard_model(model, param_persistence_threshold=64, wrap=[Pair])
        branch = [p for name, p in model.named_parameters() if name.startswith("shared.b.")]
        rest = [p for name, p in model.named_parameters() if not name.startswith("shared.b.")]
        params = [{"params": rest}, {"params": branch}]
    else:
        params = model
        options["param_persistence_threshold"] = 64
    if options.pop("mesh", False):         # 2 replicas of 2 shard ranks
        from torch.distributed.device_mesh import DeviceMesh
        options["device_mesh"] = DeviceMesh("cpu", [[0, 1], [2, 3]],
                                            mesh_dim_names=("replicate", "shard"))
    opt = rlhfz.ZeroAdamW(params, stage=stage, lr=1e-2, **options)
    log, per_backward, overlapped, shared_reductions = [], [], [], []
    reducer = opt.engine.reducer if stage >= 2 else None
    if reducer is not None:
        _logged(opt.comm, log)
    shared = [p for name, p in model.named_parameters() if name.startswith("shared.")]
    shared_buckets = [b for b in opt.engine.buckets if any(p is q for p in b.params for q in shared)]
    for ids in batches(steps):
        opt.zero_grad()
        del log[:]
        before = [reducer.version(b) for b in shared_buckets] if reducer else []
        model(ids[rank::world_size], *_branches(extra_of, rank)).backward()
        if reducer is not None:
            shared_reductions.append([reducer.version(b) - v
                                      for b, v in zip(shared_buckets, before)])
        per_backward.append(list(log))
        gathers = [i for i, (name, _) in enumerate(log) if name == "all_gather"]
        overlapped.append(sum(1 for name, _ in log[:gathers[-1]] if name == "reduce_scatter")
                          if gathers else 0)
        opt.step()
    if stage == 3:
        params = rlhfz.full_state_dict(model, rank0_only=False)
    else:
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"params": params, "per_backward": per_backward, "overlapped": overlapped,
            "shared_reductions": shared_reductions}



class AuxNet(BranchNet):
    """BranchNet with an auxiliary head large enough to be a unit of its
    own, whose loss odd steps leave out on every rank (a value head that
    only some backwards reach)."""

    def __init__(self):
        super().__init__()
        self.aux = torch.nn.Linear(WIDTH, 80)

    def forward(self, ids, with_aux=True, aux_scale=0.1):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        loss = self.head(h).pow(2).mean()
        return loss + aux_scale * self.aux(h).pow(2).mean() if with_aux else loss


def two_optimizers(rank, world_size, steps):
    """A sharded AuxNet with the auxiliary head under an optimizer of its
    own; each step's bucket reductions by optimizer, and the whole params."""
    model = AuxNet()
    rlhfz.shard_model(model, param_persistence_threshold=64)
    aux = list(model.aux.parameters())
    rest = [p for name, p in model.named_parameters() if not name.startswith("aux.")]
    opts = [rlhfz.ZeroAdamW(rest, stage=3, lr=1e-2), rlhfz.ZeroAdamW(aux, stage=3, lr=1e-2)]

    def launches(opt):       # the reductions its buckets have had (they share a comm)
        return sum(opt.engine.reducer.version(b) for b in opt.engine.buckets)
    per_step = []
    for step, ids in enumerate(batches(steps)):
        for opt in opts:
            opt.zero_grad()
        before = [launches(opt) for opt in opts]
        model(ids[rank::world_size], step % 2 == 0).backward()
        per_step.append([launches(opt) - b for opt, b in zip(opts, before)])
        for opt in opts:
            opt.step()
    return {"params": rlhfz.full_state_dict(model, rank0_only=False), "per_step": per_step}


def aux_on_rank_0(rank, world_size, steps, remedy):
    """Stage 2, the auxiliary head under an optimizer of its own, its loss
    on rank 0 alone; with `remedy` the other ranks add 0 * that loss. The
    params, or the error each rank got."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "3"
    model = AuxNet()
    aux = list(model.aux.parameters())
    rest = [p for name, p in model.named_parameters() if not name.startswith("aux.")]
    opts = [rlhfz.ZeroAdamW(rest, stage=2, lr=1e-2), rlhfz.ZeroAdamW(aux, stage=2, lr=1e-2)]
    try:
        for ids in batches(steps):
            for opt in opts:
                opt.zero_grad()
            mine = ids[rank::world_size]
            loss = model(mine) if rank == 0 else \
                model(mine, remedy, aux_scale=0.0)
            loss.backward()
            for opt in opts:
                opt.step()
    except rlhfz.CollectiveError as error:
        return {"error": str(error)}
    return {"error": None, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def aux_on_rank_0_reference(world_size, steps):
    model = AuxNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in batches(steps):
        opt.zero_grad()
        losses = [model(ids[r::world_size], r == 0) for r in range(world_size)]
        (sum(losses) / world_size).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def two_optimizers_reference(world_size, steps):
    model = AuxNet()
    aux = list(model.aux.parameters())
    rest = [p for name, p in model.named_parameters() if not name.startswith("aux.")]
    opts = [torch.optim.AdamW(rest, lr=1e-2), torch.optim.AdamW(aux, lr=1e-2)]
    for step, ids in enumerate(batches(steps)):
        for opt in opts:
            opt.zero_grad()
        losses = [model(ids[r::world_size], step % 2 == 0) for r in range(world_size)]
        (sum(losses) / world_size).backward()
        for opt in opts:
            opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}



def units_skipped(rank, world_size, check):
    """Stage 3; in the second step, with `check` (RLHFZ_CHECK_UNITS), rank
    0 skips block 1 and rank 1 block 2 (LayerDrop with a seed per rank);
    without, rank 1 runs blocks 1 and 2 the other way round. Every rank's
    error, and whether it stepped."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "10"
    if check:
        os.environ["RLHFZ_CHECK_UNITS"] = "1"
    model = BranchNet()
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64)
    ids = batches(2)
    opt.zero_grad()
    model(ids[0][rank::world_size]).backward()
    opt.step()
    opt.zero_grad()
    try:
        orders = [(0, 2), (0, 1)] if check else [(0, 1, 2), (0, 2, 1)]
        model(ids[1][rank::world_size], order=orders[rank]).backward()
        opt.step()
    except rlhfz.comm.CollectiveError as caught:
        return {"error": f"{type(caught).__name__}: {caught}", "stepped": False}
    return {"error": None, "stepped": True}
