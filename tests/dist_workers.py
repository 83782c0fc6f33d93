"""Per-rank bodies of the multi-process tests (importable by spawned ranks)."""
import contextlib
import math
import os

import torch
import torch.distributed as dist
# bound as a script's top binds them, before any optimizer is built
from torch.nn.utils import clip_grad_norm_ as bound_clip_grad_norm_
from torch.nn.utils import clip_grad_value_ as bound_clip_grad_value_

import rlhfz

GLOBAL_BATCH = 24          # divides evenly by 1, 2, 3 and 4 ranks, times 2 micro-batches


def make_model(seed=0):
    torch.manual_seed(seed)
    # odd sizes, so shard boundaries fall inside params
    return torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.Tanh(),
                               torch.nn.Linear(129, 61), torch.nn.Tanh(),
                               torch.nn.Linear(61, 7))


def groups(model):
    params = list(model.parameters())
    return [{"params": params[:2], "lr": 2e-3, "weight_decay": 0.1},
            {"params": params[2:], "weight_decay": 0.0}]


def batches(steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, 37, generator=gen),
             torch.randn(GLOBAL_BATCH, 7, generator=gen)) for _ in range(steps)]


def train(model, opt, data, rank=0, world_size=1, clip=None, micro_batches=1):
    """Each rank takes its slice of every global batch; the mean over ranks
    of the per-rank mean losses is the global mean. With micro-batches, the
    slice is split further and the grads accumulate."""
    per_rank = GLOBAL_BATCH // world_size
    losses = []
    for x, y in data:
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        loss = 0.0
        for xm, ym in zip(xs.chunk(micro_batches), ys.chunk(micro_batches)):
            part = torch.nn.functional.mse_loss(model(xm), ym) / micro_batches
            part.backward()
            loss = loss + part.detach()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        global_loss = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(global_loss)
            global_loss /= world_size
        losses.append(global_loss.item())
    return losses


def stage_parity(rank, world_size, steps, clip, stage=1, micro_batches=1, bucket_bytes=None):
    if bucket_bytes is not None:
        os.environ["RLHFZ_BUCKET_BYTES"] = str(bucket_bytes)
    model = make_model()
    opt = rlhfz.ZeroAdamW(groups(model), lr=1e-3, stage=stage)
    losses = train(model, opt, batches(steps), rank, world_size, clip=clip,
                   micro_batches=micro_batches)
    report = opt.memory_report()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "report": report, "numel": sum(p.numel() for p in model.parameters()),
            "buckets": len(opt.engine.buckets), "state_dict": opt.state_dict(),
            "shard_grad_bytes": sum(b.flat_grad_shard.numel() * 4 for b in opt.engine.buckets),
            "max_bucket_bytes": max(b.layout.padded_numel * 4 for b in opt.engine.buckets),
            "max_shard_bytes": max(b.layout.shard_numel * 4 for b in opt.engine.buckets)}


def save_then_continue(rank, world_size, path, steps_before, steps_after):
    model = make_model()
    opt = rlhfz.ZeroAdamW(groups(model), lr=1e-3, stage=1)
    data = batches(steps_before + steps_after)
    train(model, opt, data[:steps_before], rank, world_size)
    sd = opt.state_dict()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": sd}, path)
    dist.barrier()
    train(model, opt, data[steps_before:], rank, world_size)
    return [p.detach().clone() for p in model.parameters()]


def load_then_continue(rank, world_size, path, steps_before, steps_after):
    saved = torch.load(path, weights_only=True)
    model = make_model(seed=123)
    model.load_state_dict(saved["model"])
    opt = rlhfz.ZeroAdamW(groups(model), lr=0.5, stage=1)
    opt.load_state_dict(saved["optim"])
    data = batches(steps_before + steps_after)
    train(model, opt, data[steps_before:], rank, world_size)
    return [p.detach().clone() for p in model.parameters()]


def mismatched_calls(rank, world_size, what):
    """Ranks that enter different collectives, or one that never arrives:
    an error, not a hang. Returns the message each rank got."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "5"
    from rlhfz.comm import CollectiveMismatchError
    model = make_model()
    opt = rlhfz.ZeroAdamW(groups(model), lr=1e-3, stage=1)
    model(torch.randn(2, 37)).sum().backward()
    try:
        if what == "state_dict_vs_step":
            opt.state_dict() if rank == 0 else opt.step()
        elif what == "clip_vs_step":
            opt.clip_grad_norm_(1.0) if rank == 0 else opt.step()
        elif what == "absent":
            if rank == 0:
                opt.step()
            else:
                import time
                time.sleep(10)      # never enters the step
    except CollectiveMismatchError as error:
        return str(error)
    return None


def built_differently(rank, world_size, what):
    """Ranks that construct differently: the error names what differs (or
    the group that could not be made), within the timeout, before any
    backward. Returns (type name, message) or None."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "5"
    model = make_model()
    try:
        if what == "stage":
            rlhfz.ZeroAdamW(groups(model), stage=2 if rank == 0 else 1)
        elif what == "bucket_bytes":
            rlhfz.ZeroAdamW(groups(model), stage=2, bucket_bytes=(1 << 20) << rank)
        elif what == "wrap":
            wrap = [torch.nn.Linear] if rank == 0 else [torch.nn.Tanh, torch.nn.Linear]
            rlhfz.shard_model(model, wrap=wrap, param_persistence_threshold=0)
        elif what == "second_optimizer":
            rlhfz.ZeroAdamW(groups(model), stage=2)
            if rank == 0:
                rlhfz.ZeroAdamW(groups(make_model()), stage=2)
            else:
                import time
                time.sleep(10)      # never builds the second
    except Exception as error:      # noqa: BLE001 (the test reads its type)
        return type(error).__name__, str(error)
    return None


def start_from_first_rank(rank, world_size, stage):
    """Each rank seeds its model differently; the optimizer starts every
    rank from rank 0's values. Returns the params after construction."""
    model = make_model(seed=rank)
    rlhfz.ZeroAdamW(model if stage == 3 else groups(model), lr=1e-3, stage=stage)
    if stage == 3:
        return [p.detach().clone() for _, p in rlhfz.iter_full_params(model)]
    return [p.detach().clone() for p in model.parameters()]


def differently_shaped_models(rank, world_size):
    from rlhfz.comm import CollectiveMismatchError
    model = make_model() if rank == 0 else torch.nn.Linear(37, 7)
    try:
        rlhfz.ZeroAdamW(model, stage=2)
    except CollectiveMismatchError as error:
        return str(error)
    return None


def sockets_after_close(rank, world_size):
    """The open sockets (inodes) before an optimizer, with it, and after its
    close(): a program that builds optimizers in a loop must not pile up
    groups."""
    from soak_workers import socket_inodes
    before = socket_inodes()
    model = make_model()
    opt = rlhfz.ZeroAdamW(groups(model), lr=1e-3, stage=2)
    train(model, opt, batches(2), rank, world_size)
    during = socket_inodes()
    opt.close()
    return {"before": before, "during": during, "after": socket_inodes()}


def abandoned_collective_drained_at_exit(rank, world_size):
    """An async all-gather dropped without a wait (as an exception leaves a
    prefetch) stays tracked until the exit hook waits for it; waited ones
    are not tracked."""
    from rlhfz import comm
    from rlhfz.comm import torch_engine
    c = comm.Communicator()
    n = 1 << 20
    full = torch.full((world_size * n,), float(rank))
    c.all_gather(torch.empty(world_size * 8), torch.ones(8))             # waited
    after_sync = torch_engine.in_flight()
    c.all_gather(full, full[rank * n:(rank + 1) * n], async_op=True)     # dropped
    tracked = torch_engine.in_flight()
    torch_engine.drain_at_exit()
    expected = torch.arange(world_size, dtype=torch.float32).repeat_interleave(n)
    out = {"tracked": tracked, "after_sync": after_sync, "after_drain": torch_engine.in_flight(),
           "gathered": bool(torch.equal(full, expected))}
    c.destroy()
    return out


def ddp_with_sharding_raises(rank, world_size):
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    try:
        rlhfz.ZeroAdamW(model, stage=1)
    except ValueError as error:
        return str(error)
    return None


def bf16_parity(rank, world_size, steps, stage):
    """bf16 params and grads, fp32 master shards: the masters follow an fp32
    AdamW given the same (bf16, averaged) grads."""
    torch.manual_seed(0)
    shapes = [(37, 19), (19,), (5, 3, 7), (1,)]
    start = [torch.randn(s) for s in shapes]
    params = [torch.nn.Parameter(t.bfloat16()) for t in start]
    opt = rlhfz.ZeroAdamW(params, lr=1e-2, weight_decay=0.1, stage=stage)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        # every rank gets the same grads, so their average is that grad
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in params], "state_dict": opt.state_dict()}


def bf16_reference(steps, edit_at=None):
    """bf16_parity's (and bf16_edits') run on fp32 params in one process:
    torch's AdamW on the values the masters should hold."""
    torch.manual_seed(0)
    shapes = [(37, 19), (19,), (5, 3, 7), (1,)]
    params = [torch.nn.Parameter(torch.randn(s).bfloat16().float()) for s in shapes]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == edit_at:
            with torch.no_grad():
                params[0][3:30].fill_(0.5)
            opt.state.clear()
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16().float()
        opt.step()
    return params


def bf16_edits(rank, world_size, steps, stage, edit_at):
    """bf16_parity, with a param written in place and the optimizer's state
    cleared on every rank at step edit_at."""
    torch.manual_seed(0)
    shapes = [(37, 19), (19,), (5, 3, 7), (1,)]
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    opt = rlhfz.ZeroAdamW(params, lr=1e-2, weight_decay=0.1, stage=stage)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == edit_at:
            with torch.no_grad():
                params[0][3:30].fill_(0.5)     # crosses the shard boundary
            opt.state.clear()
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in params], "state_dict": opt.state_dict()}


def backward_while_grads_offloaded(rank, world_size, stage):
    """A backward after offload(what=grads) refuses with what to do; after
    reload() training goes on."""
    model = make_model()
    opt = rlhfz.ZeroAdamW(groups(model), lr=1e-3, stage=stage)
    data = batches(3)
    train(model, opt, data[:1], rank, world_size)
    opt.offload(what=("grads",))
    x, y = data[1]
    shard = slice(rank, None, world_size)
    try:
        torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        refused = None
    except RuntimeError as error:
        refused = str(error)
    opt.reload()
    opt.zero_grad()
    train(model, opt, data[2:], rank, world_size)
    return refused


def module_zero_grad_reaches_shard_grads(rank, world_size, stage):
    """model.zero_grad() finds p.grad None at stages 2 and 3 (the grads live
    in shards), yet the grads start over as in torch: all of them, or a
    submodule's alone while the others accumulate across the step. lr 0, so
    every backward gives the same grads; a plain copy says what they are."""
    model = make_model()
    plain = make_model()
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=0.0, stage=stage)
    x, y = batches(1)[0]
    shard = slice(rank, None, world_size)
    torch.nn.functional.mse_loss(plain(x), y).backward()
    first_layer = sum(float(p.grad.square().sum()) for p in plain[0].parameters())
    rest = sum(float(p.grad.square().sum()) for p in plain.parameters()) - first_layer

    def backward():
        torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        return float(opt.clip_grad_norm_(float("inf")))

    norms = [backward()]
    opt.step()
    model.zero_grad()
    norms.append(backward())            # the new grads alone
    opt.step()
    model[0].zero_grad()
    norms.append(backward())            # the first layer's new, the rest twice over
    opt.step()
    expected = [(first_layer + rest) ** 0.5] * 2 + [(first_layer + 4 * rest) ** 0.5]
    opt.close()
    return norms, expected


def save_sharded_then_continue(rank, world_size, directory, steps_before, steps_after, stage):
    model = make_model()
    opt = rlhfz.ZeroAdamW(groups(model), lr=1e-3, stage=stage)
    data = batches(steps_before + steps_after)
    train(model, opt, data[:steps_before], rank, world_size)
    torch.save(opt.sharded_state_dict(), f"{directory}/optim-rank{rank}.pt")
    if rank == 0:
        torch.save(model.state_dict(), f"{directory}/model.pt")
    dist.barrier()
    train(model, opt, data[steps_before:], rank, world_size)
    return [p.detach().clone() for p in model.parameters()]


def load_sharded_then_continue(rank, world_size, directory, saved_world, steps_before,
                               steps_after, stage):
    import glob
    model = make_model(seed=123)
    model.load_state_dict(torch.load(f"{directory}/model.pt", weights_only=True))
    opt = rlhfz.ZeroAdamW(groups(model), lr=0.5, stage=stage)
    shards = [torch.load(path, weights_only=True)
              for path in sorted(glob.glob(f"{directory}/optim-rank*.pt"))]
    assert len(shards) == saved_world
    opt.load_sharded_state_dict(shards)
    data = batches(steps_before + steps_after)
    train(model, opt, data[steps_before:], rank, world_size)
    return [p.detach().clone() for p in model.parameters()]


def bf16_reduce_dtype(rank, world_size, steps, stage, reduce_dtype):
    """Rank-dependent bf16 grads; returns the masters after `steps` steps."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in [(37, 19), (19,)]]
    opt = rlhfz.ZeroAdamW(params, lr=1e-2, stage=stage, reduce_dtype=reduce_dtype)
    for step in range(steps):
        for i, p in enumerate(params):
            gen = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
        opt.zero_grad()
    shard_dtypes = sorted({str(b.flat_grad_shard.dtype) for b in opt.engine.buckets})
    return {"state_dict": opt.state_dict(), "shard_dtypes": shard_dtypes}


def communicator_primitives(rank, world_size, piece_bytes):
    """Each flat collective against its definition, with gloo pieces small
    enough that every call is cut into many (uneven) pieces."""
    from rlhfz.comm import Communicator, torch_engine
    torch_engine.GLOO_PIECE_BYTES = piece_bytes
    comm = Communicator()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        shard = 1031
        gen = torch.Generator().manual_seed(7)
        everyone = [torch.randn(shard * world_size, generator=gen).to(dtype)
                    for _ in range(world_size)]
        full = everyone[rank].clone()
        mine = torch.empty(shard, dtype=dtype)
        comm.reduce_scatter(mine, full)
        expected = (torch.stack([t.float() for t in everyone]).sum(0) / world_size)
        out[f"reduce_scatter_{dtype}"] = (mine.float(),
                                          expected[rank * shard:(rank + 1) * shard])
        averaged = everyone[rank].clone()
        comm.all_reduce_avg(averaged, async_op=True).wait()
        out[f"all_reduce_avg_{dtype}"] = (averaged.float(), expected)
        gathered = torch.full((shard * world_size,), -1.0, dtype=dtype)
        comm.all_gather(gathered, everyone[rank][:shard])
        out[f"all_gather_{dtype}"] = (gathered, torch.cat([t[:shard] for t in everyone]))
        # onto each rank in turn, one in flight beside an all-gather
        for root in range(world_size):
            sent = comm.traffic["gather"]
            onto = torch.full((shard * world_size,), -1.0, dtype=dtype) if rank == root else None
            work = comm.gather_to(root, onto, everyone[rank][shard:2 * shard], async_op=True)
            beside = torch.empty(shard * world_size, dtype=dtype)
            comm.all_gather(beside, everyone[rank][:shard])
            work.wait()
            out[f"gather_beside_{root}_{dtype}"] = (beside,
                                                    torch.cat([t[:shard] for t in everyone]))
            sent = comm.traffic["gather"] - sent
            if rank == root:
                out[f"gather_to_{root}_{dtype}"] = (
                    onto, torch.cat([t[shard:2 * shard] for t in everyone]))
                out[f"gather_sent_by_root_{root}_{dtype}"] = (torch.tensor(sent),
                                                              torch.tensor(0))
            else:
                out[f"gather_sent_{root}_{dtype}"] = (torch.tensor(sent),
                                                      torch.tensor(shard * dtype.itemsize))
    return out


def bucket_cap(rank, world_size, bucket_bytes):
    """Buckets and the grad bytes a stage 2 rank holds, under the option."""
    model = make_model()
    opt = rlhfz.ZeroAdamW(groups(model), lr=1e-3, stage=2, bucket_bytes=bucket_bytes)
    losses = train(model, opt, batches(3), rank, world_size, micro_batches=2)
    return {"buckets": len(opt.engine.buckets), "losses": losses,
            "grads": opt.memory_report()["grads"]["host"],
            "shard_grad_bytes": sum(b.flat_grad_shard.numel() * 4 for b in opt.engine.buckets)}


def accumulate_across_steps(rank, world_size, stage):
    """Two steps with no zero_grad between them: the second step's grads are
    the first's plus the new ones, as with torch.optim.AdamW in one process.
    Under stage 1, p.grad holds the average over ranks after a step (as DDP
    leaves it)."""
    model = make_model()
    opt = rlhfz.ZeroAdamW(groups(model), lr=1e-3, stage=stage)
    per_rank = GLOBAL_BATCH // world_size
    grads_after_first = None
    for i, (x, y) in enumerate(batches(2)):
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
        if i == 0 and stage == 1:
            grads_after_first = [p.grad.clone() for p in model.parameters()]
    opt.step()     # no new grads: the same update again, not a second reduction
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads_after_first": grads_after_first}


def report_against_estimate(rank, world_size, stage, dtype=torch.float32, ratio=None,
                            bucket_bytes=4096):
    """memory_report() after a step, beside estimate_bytes for the same
    setup (ratio: offload="cpu" with that offload_ratio). The default cap
    is below every bucket, so staging is two caps; at stage 3 the estimate
    is given the largest unit, which a cap above it stages whole."""
    from rlhfz.estimate import estimate_bytes
    model = make_model().to(dtype)
    numel = sum(p.numel() for p in model.parameters())     # before stage 3 shards them
    offload = {} if ratio is None else {"offload": "cpu", "offload_ratio": ratio}
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), stage=stage,
                          param_persistence_threshold=0, bucket_bytes=bucket_bytes, **offload)
    largest = (max(sum(b.layout.numel for b in buckets) for _, buckets in opt.stage3.units)
               if stage == 3 else None)
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
    opt.step()
    report = opt.memory_report()
    opt.close()
    return report, estimate_bytes(numel, world_size, stage, str(dtype).split(".")[1],
                                  offload=offload.get("offload"), bucket_bytes=bucket_bytes,
                                  offload_ratio=1.0 if ratio is None else ratio,
                                  largest_unit=largest)


class Branchy(torch.nn.Module):
    """A trunk and three heads: `shared` is used by every rank, `first` only
    by rank 0, `unused` by nobody (so it never has a grad)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.trunk = torch.nn.Linear(37, 53)
        self.shared = torch.nn.Linear(53, 7)
        self.first = torch.nn.Linear(53, 7)
        self.unused = torch.nn.Linear(53, 7)

    def loss(self, x, y, rank):
        h = torch.tanh(self.trunk(x))
        out = self.shared(h) + (self.first(h) if rank == 0 else 0.0)
        return torch.nn.functional.mse_loss(out, y)


def branchy_reference(world_size, steps, clip=None):
    """One process, the same global objective: the mean of the ranks' losses."""
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_rank = GLOBAL_BATCH // world_size
    for x, y in batches(steps):
        opt.zero_grad()
        total = sum(model.loss(x[r * per_rank:(r + 1) * per_rank],
                               y[r * per_rank:(r + 1) * per_rank], r)
                    for r in range(world_size)) / world_size
        total.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def branchy_sharded(rank, world_size, steps, stage, clip=None):
    os.environ["RLHFZ_BUCKET_BYTES"] = str(4 << 10)     # several buckets under stage 2
    model = Branchy()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage)
    per_rank = GLOBAL_BATCH // world_size
    for x, y in batches(steps):
        opt.zero_grad()
        model.loss(x[rank * per_rank:(rank + 1) * per_rank],
                   y[rank * per_rank:(rank + 1) * per_rank], rank).backward()
        if clip is not None:       # a look at the grads before the step's own
            opt.clip_grad_norm_(clip)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def offload_parity(rank, world_size, steps, stage, ratio, directory):
    """The same training twice on every rank: once with the optimizer state
    partly on the host (offload="cpu", offload_ratio=ratio) and cycled to
    disk and back every other step, once plain. Returns both results."""
    data = batches(steps)
    out = {}
    for name, options in (("plain", {}), ("offloaded", dict(offload="cpu", offload_ratio=ratio))):
        model = make_model()
        opt = rlhfz.ZeroAdamW(groups(model), lr=1e-3, stage=stage, **options)
        per_rank = GLOBAL_BATCH // world_size
        for step, (x, y) in enumerate(data):
            sl = slice(rank * per_rank, (rank + 1) * per_rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            if options and step % 2:
                path = os.path.join(directory, f"rank{rank}")
                os.makedirs(path, exist_ok=True)
                rlhfz.offload(model, opt, to="disk", path=path)
                rlhfz.reload(model, opt)
        out[name] = {"params": [p.detach().clone() for p in model.parameters()],
                     "state_dict": opt.state_dict(), "report": opt.memory_report()}
    return out


def state_dict_hooks(rank, world_size, stage):
    """What torch's state-dict post-hook sees across ranks: the whole state."""
    model = make_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3, stage=stage)
    train(model, opt, batches(1), rank, world_size)
    seen = {}

    def post(o, sd):
        seen.update({k: tuple(v["exp_avg"].shape) for k, v in sd["state"].items()})
        return {**sd, "marked": rank}
    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    return {"seen": seen, "marked": sd.get("marked"),
            "shapes": {i: tuple(p.shape) for i, p in enumerate(model.parameters())}}


def copy_across_ranks(rank, world_size, stage):
    """deepcopy and pickle of a sharded optimizer: refused at once, and the
    optimizer trains on as before."""
    import copy
    import pickle
    model = make_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3, stage=stage)
    train(model, opt, batches(1), rank, world_size)
    refusals = []
    for copier in (copy.deepcopy, pickle.dumps):
        try:
            copier(opt)
            refusals.append(None)
        except TypeError as error:
            refusals.append(str(error))
    train(model, opt, batches(1, seed=2), rank, world_size)
    return refusals


def group_added_later(rank, world_size, stage, norm_type):
    """The last layer frozen at first, then trained in a group added after
    construction; clipped with norm_type throughout. Whole params back."""
    model = make_model()
    model[4].requires_grad_(False)
    opt = rlhfz.ZeroAdamW(model if stage == 3 else
                          [p for p in model.parameters() if p.requires_grad],
                          lr=1e-3, stage=stage)
    data = batches(6)
    _train_clipped(model, opt, data[:3], rank, world_size, norm_type)
    model[4].requires_grad_(True)
    opt.add_param_group({"params": list(model[4].parameters()), "lr": 5e-3,
                         "weight_decay": 0.0})
    norms = _train_clipped(model, opt, data[3:], rank, world_size, norm_type)
    return {"params": {name: t.clone() for name, t in rlhfz.iter_full_params(model)},
            "norms": norms}


def _train_clipped(model, opt, data, rank, world_size, norm_type):
    per_rank = GLOBAL_BATCH // world_size
    norms = []
    for x, y in data:
        opt.zero_grad()
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        norms.append(float(opt.clip_grad_norm_(0.05, norm_type=norm_type)))
        opt.step()
    return norms


def clip_sequence(rank, world_size, stage, bucket_bytes):
    """Clips whose factor the step folds in, mixed with what must see the
    clipped grads: a second clip, more grads (first ones for some params,
    added ones for others), a step without new grads, a clip after a step.
    Returns every norm and the final params (see clip_sequence_reference)."""
    model = make_model()
    opt = rlhfz.ZeroAdamW(model, lr=1e-3, stage=stage, bucket_bytes=bucket_bytes)
    return _clip_sequence(model, opt, rank, world_size)


def clip_sequence_reference():
    model = make_model()
    return _clip_sequence(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 0, 1)


def _clip_sequence(model, opt, rank, world_size):
    per_rank = GLOBAL_BATCH // world_size
    data = [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
            for x, y in batches(3, seed=5)]
    if isinstance(opt, torch.optim.AdamW):
        def clip(max_norm):
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    else:
        def clip(max_norm):
            return float(opt.clip_grad_norm_(max_norm))
    norms = []
    x, _ = data[0]
    model[0](x).pow(2).mean().backward()     # the first layer only
    norms += [clip(0.1), clip(0.05)]
    x, y = data[1]
    torch.nn.functional.mse_loss(model(x), y).backward()    # added to the clipped grads
    norms.append(clip(0.2))
    opt.step()
    opt.step()                                # the same clipped grads again
    norms.append(clip(0.02))                  # what the steps left
    opt.zero_grad()
    x, y = data[2]
    torch.nn.functional.mse_loss(model(x), y).backward()
    norms.append(clip(0.3))
    opt.step()
    return {"norms": norms, "params": [p.detach().clone() for p in model.parameters()]}


def zero_grads_kept_as_zeros(rank, world_size, stage, how):
    """zero_grad(set_to_none=False), from the optimizer or the module, keeps
    a zero grad for every param that had one: in torch a param that gets no
    grad in the next backward still steps (weight decay and momentum). The
    last layer gets none in the last two steps. Every rank sees the whole
    batch, so the mean over ranks is one process's grad."""
    def run(model, opt):
        x, y = batches(1)[0]
        for step in range(4):
            if how == "module":
                model.zero_grad(set_to_none=False)
            else:
                opt.zero_grad(set_to_none=False)
            out = model[:4](x) if step >= 2 else model(x)
            (out.pow(2).mean() if step >= 2 else torch.nn.functional.mse_loss(out, y)).backward()
            opt.step()
        return {name: t.clone() for name, t in rlhfz.iter_full_params(model)} \
            if isinstance(opt, rlhfz.ZeroAdamW) else dict(model.named_parameters())

    model, plain = make_model(), make_model()
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage,
                          **({"param_persistence_threshold": 0} if stage == 3 else {}))
    ours = run(model, opt)
    theirs = run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    opt.close()
    return {name: float((ours[name] - theirs[name].detach()).abs().max()) for name in theirs}


def stage1_clip_of_whole_grads(rank, world_size):
    """At stage 1 p.grad holds the whole mean grad after the step's
    reduction: a clip scales all of it, as torch's clip of DDP's grads does,
    and a backward that adds to clipped grads is reduced with them."""
    model, plain = make_model(), make_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=1)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    (x, y), (x2, y2) = batches(2)
    shard = slice(rank, None, world_size)
    torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    opt.clip_grad_norm_(0.1)
    clipped = [p.grad.clone() for p in model.parameters()]
    torch.nn.functional.mse_loss(model(x2[shard]), y2[shard]).backward()
    opt.step()
    torch.nn.functional.mse_loss(plain(x), y).backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    expected = [p.grad.clone() for p in plain.parameters()]
    torch.nn.functional.mse_loss(plain(x2), y2).backward()
    ref.step()
    opt.close()
    return {"clipped": max(float((a - b).abs().max()) for a, b in zip(clipped, expected)),
            "stepped": max(float((a.grad - b.grad).abs().max())
                           for a, b in zip(model.parameters(), plain.parameters()))}


def grad_of_another_dtype(rank, world_size, stage):
    """A grad set by hand whose dtype p.grad.data changed, on the path that
    reduces hand-set grads at stages 2 and 3: refused before any collective."""
    model = make_model()
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[0].weight.grad.data = model[0].weight.grad.data.double()
    try:
        opt.step()
        refused = None
    except TypeError as error:
        refused = str(error)
    opt.close()
    return refused


def after_the_optimizer_goes(rank, world_size, how):
    """A stage-2 ZeroAdamW closed, dropped, or failed in its constructor:
    the params are the model's alone again, and torch's AdamW built next
    trains them as it trains a model that never had one."""
    data = batches(4)

    def run(model, opt, steps):
        for x, y in steps:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model, plain = make_model(), make_model()
    if how == "constructor":
        bad = [{"params": list(model.parameters())[:2]},
               {"params": list(model.parameters())[2:], "betas": (0.9, 1.5)}]
        try:
            rlhfz.ZeroAdamW(bad, lr=1e-2, stage=2)
        except ValueError:
            pass
    else:
        opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=2)
        run(model, opt, data[:2])
        run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), data[:2])
        if how == "close":
            opt.close()
        del opt
    run(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data[2:])
    run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), data[2:])
    return max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                          plain.parameters()))


def two_optimizers_over_shared_params(rank, world_size, stage):
    """A policy and a value head over one body, each with its own ZeroAdamW:
    at stage 2 the second is refused (the first's reducer takes the body's
    grads out of p.grad); at stage 1 both train as torch's would."""
    model = make_model()
    actor = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage)
    try:
        critic = rlhfz.ZeroAdamW(list(model[:2].parameters()), lr=1e-2, stage=stage)
    except ValueError as error:
        actor.close()
        return str(error)
    critic.close()
    actor.close()
    return None


def stage1_torch_clip_and_no_sync(rank, world_size, accumulate_in_no_sync):
    """At stage 1 p.grad holds the mean when each backward ends, as under
    DDP: torch's own clip_grad_norm_ between backward and step sees it.
    Micro-batches accumulate into the mean; inside no_sync() they stay
    local until the backward after it."""
    model, plain = make_model(), make_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=1)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    norms = []
    for x, y in batches(3):
        per_rank = GLOBAL_BATCH // world_size
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        pieces = list(zip(xs.chunk(2), ys.chunk(2)))
        first = opt.no_sync() if accumulate_in_no_sync else contextlib.nullcontext()
        with first:
            torch.nn.functional.mse_loss(model(pieces[0][0]), pieces[0][1]).div(2).backward()
        torch.nn.functional.mse_loss(model(pieces[1][0]), pieces[1][1]).div(2).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
        opt.step()
        opt.zero_grad()
        for xm, ym in zip(x.chunk(2 * world_size), y.chunk(2 * world_size)):
            torch.nn.functional.mse_loss(plain(xm), ym).div(2 * world_size).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)))
        ref.step()
        ref.zero_grad()
    opt.close()
    return {"norms": norms,
            "params": max(float((a - b).abs().max())
                          for a, b in zip(model.parameters(), plain.parameters()))}


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("failed in backward")


def stage1_after_a_failed_backward(rank, world_size):
    """A backward that raises after some grads arrived (an OOM caught, say)
    runs none of its end-of-backward callbacks; the next backward still
    averages p.grad across ranks when it ends, and the step forgets what
    the failed one left pending. Returns (the ranks' largest grad
    difference, the pending backwards after the failure, after the step)."""
    from rlhfz.engine import engine as engine_module
    pending = engine_module._AVERAGES.pending
    model = make_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=1)
    x = torch.randn(4, 37, generator=torch.Generator().manual_seed(rank))
    try:
        model[4](model[3](model[2](_FailsInBackward.apply(model[0](x))))).sum().backward()
    except RuntimeError:
        pass
    left = len(pending)
    opt.zero_grad()
    model(x).sum().backward()
    grad = model[4].weight.grad.clone()
    everyone = [torch.empty_like(grad) for _ in range(world_size)]
    dist.all_gather(everyone, grad)
    opt.step()
    opt.close()
    return max(float((g - everyone[0]).abs().max()) for g in everyone), left, len(pending)


def two_stage1_optimizers_in_one_backward(rank, world_size):
    """Two optimizers' grads arrive in a rank-dependent order: each rank
    averages them in the order the optimizers were made, as two DDP modules
    would agree."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opts = [rlhfz.ZeroAdamW(m.parameters(), lr=1e-2, stage=1) for m in (first, second)]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    ys = [first(x), second(x)] if rank == 0 else [second(x), first(x)][::-1]
    (ys[0].sum() * (rank + 1) + ys[1].sum()).backward()
    grads = [p.grad.clone() for m in (first, second) for p in m.parameters()]
    for opt in opts:
        opt.step()
        opt.close()
    return grads


def raise_or_exit(rank, world_size, exits):
    """Rank r raises, or (where exits names it) ends its process at once
    with that code, sending nothing."""
    if rank in exits:
        os._exit(exits[rank])
    if exits:
        return rank
    raise ValueError(f"rank {rank} refuses")


def local_rank_and_device(rank, world_size):
    """The LOCAL_RANK run_ranks gave this rank, and the simulated device
    RLHFZ_SIM_DEVICE=local_rank picks from it."""
    from rlhfz.engine.backends import simulated_device
    os.environ["RLHFZ_SIM_DEVICE"] = "local_rank"
    return os.environ.get("LOCAL_RANK"), simulated_device()


def torch_clips_reach_shard_grads(rank, world_size, stage):
    """torch.nn.utils.clip_grad_norm_ and clip_grad_value_ called as a plain
    script calls them, at stages 2 and 3 where p.grad is None after
    backward: the norms torch returns for whole grads, and the params of
    torch AdamW after torch's clips, for norms of order 2 and inf (and the
    deprecated clip_grad_norm), values over every param and over one
    layer's, norms over some params alone, and both clips as bound before
    any optimizer was built; a norm over the params beside another model's
    grads, as torch takes it over both. torch's own clip_grad_norm_ body,
    or clip_grads_with_norm_ over the params, is refused and scales
    nothing."""
    import warnings
    model, plain = make_model(), make_model()
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-3, stage=stage,
                          **({"param_persistence_threshold": 0} if stage == 3 else {}))
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    shard = slice(rank, None, world_size)
    clips = [lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05),
             lambda m: torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.01,
                                                      norm_type=float("inf")),
             lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.002),
             lambda m: torch.nn.utils.clip_grad_value_(m[2].parameters(), 0.001),
             lambda m: torch.nn.utils.clip_grad_norm(m.parameters(), 0.03),
             # one layer's norm, then one over a layer and another's weight
             # only (their shard ranges cut through the buckets), then the
             # whole norm after the part was clipped
             lambda m: torch.nn.utils.clip_grad_norm_(m[2].parameters(), 0.02),
             lambda m: bound_clip_grad_norm_(m.parameters(), 0.03),
             lambda m: bound_clip_grad_value_(m.parameters(), 0.0015),
             lambda m: (torch.nn.utils.clip_grad_norm_([m[0].weight, *m[4].parameters()], 0.002,
                                                       norm_type=float("inf")),
                        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.04))[1]]
    norms, binds = [], []
    for step, (x, y) in enumerate(batches(2 * len(clips))):
        clip = clips[step % len(clips)]
        opt.zero_grad()
        ref.zero_grad()
        torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        # the clip binds on the whole grads: a clip that reached nothing would show
        binds.append(max(float(p.grad.abs().max()) for p in plain.parameters()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)    # clip_grad_norm is deprecated
            ours, theirs = clip(model), clip(plain)
        norms.append((None if ours is None else float(ours),
                      None if theirs is None else float(theirs)))
        opt.step()
        ref.step()
    x, y = batches(1, seed=7)[0]
    torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    before = float(opt.clip_grad_norm_(float("inf")))
    early = []
    for clip in (lambda: torch.nn.utils.clip_grad_norm_.__wrapped__(model.parameters(), 1e-4),
                 lambda: torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1e-4,
                                                              torch.tensor(5.0))):
        try:
            clip()
            early.append(None)
        except ValueError as error:
            early.append(str(error))
    after = float(opt.clip_grad_norm_(float("inf")))
    # a norm over the params and another model's grads together: torch's over both
    beside = float(torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]))
    kept = [p.grad.clone() for p in plain.parameters()]
    together = float(torch.nn.utils.clip_grad_norm_([*model.parameters(), *plain.parameters()],
                                                    1e-4))
    coef = 1e-4 / (together + 1e-6)
    together_check = {"norm": (together, math.hypot(after, beside)),
                      "ours": (float(opt.clip_grad_norm_(float("inf"))), after * coef),
                      "theirs": max(float((p.grad - k * coef).abs().max())
                                    for p, k in zip(plain.parameters(), kept))}
    import inspect
    wrappers = [getattr(torch.nn.utils, name) for name in ("clip_grad_norm_", "clip_grad_value_")]
    # rlhfz's, under torch's names and signatures, in both places torch exports them from
    looks = [(f.__name__, list(inspect.signature(f).parameters), hasattr(f, "__wrapped__"),
              f is getattr(torch.nn.utils.clip_grad, f.__name__)) for f in wrappers]
    ours = dict(rlhfz.iter_full_params(model)) if stage == 3 else dict(model.named_parameters())
    diff = max(float((ours[name].detach() - p.detach()).abs().max())
               for name, p in plain.named_parameters())
    opt.close()
    return {"norms": norms, "binds": binds, "diff": diff, "together": together_check, "looks": looks, "early": early, "before": before, "after": after}


def torch_clips_at_their_edges(rank, world_size, stage):
    """torch's clips over sharded grads where torch's rules are finest: a NaN
    in a later shard under the inf norm (Python's max dropped it), 16-bit
    grads (torch rounds each tensor's norm to the grad's dtype before the
    norm of those), a value clip over a model with a frozen param (torch's
    own refuses a list without grads), a norm beside a head whose grads
    only rank 0 has (the way was chosen from this rank's grads), and
    torch's warning for an empty generator after the optimizer is gone.
    Every rank takes the same batch, so the mean grads are each rank's own
    and torch's values on the same model whole are exact references."""
    import gc
    import warnings
    out = {}

    def same_model(frozen=False):
        made = [make_model() for _ in range(2)]
        for m in made:
            m[0].bias.requires_grad_(not frozen)
        return made

    def sharded(model):
        trained = [p for p in model.parameters() if p.requires_grad]
        return rlhfz.ZeroAdamW(model if stage == 3 else trained, lr=1e-3, stage=stage,
                               **({"param_persistence_threshold": 0} if stage == 3 else {}))

    def backward(models):
        x, y = batches(1, seed=3)[0]
        for m in models:
            torch.nn.functional.mse_loss(m(x), y).backward()

    # NaN in the last param's grads, behind shards of finite ones
    model, plain = same_model()
    opt = sharded(model)
    backward([model, plain])
    last = opt.param_groups[0]["params"][-1]
    opt.clip_grads_with_norm_(1.0, torch.tensor(float("nan")), params=[last])
    plain[4].bias.grad.fill_(float("nan"))
    rows = []
    for error_if_nonfinite in (False, True):
        row = []
        for m in (model, plain):
            try:
                row.append(float(torch.nn.utils.clip_grad_norm_(
                    m.parameters(), 1.0, "inf", error_if_nonfinite=error_if_nonfinite)))
            except RuntimeError as error:
                row.append("non-finite" if "non-finite" in str(error) else str(error))
        rows.append(row)
    out["nan"] = rows
    opt.close()

    # 16-bit grads: each tensor's norm rounded to bf16, then the norm of those
    # (seed 4's 2-norm was a bf16 step off when the exact norm was rounded once)
    out["bf16"] = []
    for seed in range(8):
        model, plain = make_model(seed).bfloat16(), make_model(seed).bfloat16()
        opt = sharded(model)
        x, y = batches(1, seed=seed)[0]
        for m in (model, plain):
            torch.nn.functional.mse_loss(m(x.bfloat16()), y.bfloat16()).backward()
        out["bf16"] += [(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, order)),
                         float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9, order)))
                        for order in (2.0, "inf", 3.0)]
        opt.close()

    # a frozen param beside the optimizer's, under a value clip and a norm
    model, plain = same_model(frozen=True)
    opt = sharded(model)
    backward([model, plain])
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    torch.nn.utils.clip_grad_value_(plain.parameters(), 1e-3)
    norms = (float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)),
             float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)))
    opt.step()
    torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-3).step()
    ours = dict(rlhfz.iter_full_params(model)) if stage == 3 else dict(model.named_parameters())
    out["frozen"] = {"norms": norms,
                     "diff": max(float((ours[name].detach() - p.detach()).abs().max())
                                 for name, p in plain.named_parameters())}
    opt.close()

    # a head whose grads only rank 0 has, in one clip with the optimizer's params
    model, _ = same_model()
    head = torch.nn.Linear(7, 1)
    opt = sharded(model)
    x, y = batches(1, seed=3)[0]
    hidden = model(x)
    loss = torch.nn.functional.mse_loss(hidden, y)
    if rank == 0:
        loss = loss + head(hidden).pow(2).mean()
    loss.backward()
    body = float(opt.get_total_norm())
    beside = (float(torch.nn.utils.get_total_norm([p.grad for p in head.parameters()]))
              if rank == 0 else 0.0)
    out["beside"] = (float(torch.nn.utils.clip_grad_norm_([*model.parameters(),
                                                          *head.parameters()], 1e9)),
                     math.hypot(body, beside))
    opt.close()

    del opt
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_((p for p in ()), 1.0)
    out["warned"] = [str(w.message) for w in caught]
    return out


def grads_kept_across_backwards(rank, world_size, stage):
    """PCGrad-style: each task's grads kept from p.grad, zero_grad between,
    and their sum set back before the step. torch's next backward makes new
    grad tensors, so the kept ones keep their values; rlhfz's bucket views
    must not change under them. Against torch's AdamW on the whole batch."""
    data = batches(3)
    model, plain = make_model(), make_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    per_rank = GLOBAL_BATCH // world_size
    changed = 0.0
    for x, y in data:
        for net, optimizer, part in ((model, opt, slice(rank * per_rank, (rank + 1) * per_rank)),
                                     (plain, ref, slice(None))):
            kept = []
            for task in (0, 1):
                optimizer.zero_grad()        # set_to_none: the next backward makes new grads
                out = net(x[part])
                loss = torch.nn.functional.mse_loss(out, y[part]) if task == 0 \
                    else out.abs().mean()
                loss.backward()
                kept.append([p.grad for p in net.parameters()])
                if net is model and task == 0:
                    values = [g.clone() for g in kept[0]]
            if net is model:
                changed = max([changed] + [float((g - v).abs().max())
                                           for g, v in zip(kept[0], values)])
            for p, a, b in zip(net.parameters(), *kept):
                p.grad = a + b
            optimizer.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                          plain.parameters()))
    opt.close()
    return {"kept_changed": changed, "diff": diff}


def grads_set_by_hand_after_backward(rank, world_size, stage, who):
    """p.grad = t after backward: torch replaces backward's grad with t.
    At stages 2 and 3 backward's grad is already reduced into the shards;
    set on every rank (who: all), t (here the same everywhere) replaces
    it; set on some ranks only, every rank refuses alike, nothing changed."""
    model, plain = make_model(), make_model()
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    per_rank = GLOBAL_BATCH // world_size
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
    torch.nn.functional.mse_loss(plain(x), y).backward()
    replacement = torch.linspace(-1, 1, 7)
    if who == "all" or rank == 0:
        model[4].bias.grad = replacement.clone()
    plain[4].bias.grad = replacement.clone()
    before = [p.detach().clone() for p in rlhfz.full_state_dict(model, rank0_only=False).values()] \
        if stage == 3 else [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
        refused = None
    except ValueError as error:
        refused = str(error)
    ref.step()
    after = list(rlhfz.full_state_dict(model, rank0_only=False).values()) if stage == 3 \
        else list(model.parameters())
    out = {"refused": refused,
           "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
           "diff": max(float((a - b).abs().max()) for a, b in zip(after, plain.parameters()))}
    opt.close()
    return out


def grad_set_by_hand_between_backwards(rank, world_size, stage):
    """Backward, p.grad = t, backward again (one accumulation): torch's
    assignment drops the first backward's grad, which at stages 2 and 3 is
    already in the shards. Refused at the second backward, before it takes
    anything; with the grad let go, the accumulation goes on as torch's."""
    model, plain = make_model(), make_model()
    opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    (x1, y1), (x2, y2) = batches(2)
    per_rank = GLOBAL_BATCH // world_size
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    for x, y in ((x1, y1), (x2, y2)):
        (torch.nn.functional.mse_loss(plain(x), y) / 2).backward()
    torch.nn.functional.mse_loss(model(x1[part]), y1[part]).div(2).backward()
    model[4].bias.grad = torch.ones(7)
    try:
        torch.nn.functional.mse_loss(model(x2[part]), y2[part]).div(2).backward()
        refused = None
    except ValueError as error:
        refused = str(error)
    model[4].bias.grad = None
    torch.nn.functional.mse_loss(model(x2[part]), y2[part]).div(2).backward()
    opt.step()
    ref.step()
    after = list(rlhfz.full_state_dict(model, rank0_only=False).values()) if stage == 3 \
        else list(model.parameters())
    out = {"refused": refused,
           "diff": max(float((a - b).abs().max()) for a, b in zip(after, plain.parameters()))}
    opt.close()
    return out
