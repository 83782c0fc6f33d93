"""Per-rank bodies of the hybrid-sharding tests (importable by spawned ranks):
a 2-D DeviceMesh, 2 replicas of 2 shard ranks, against torch AdamW."""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import checkpoint_workers
import dist_workers
import rlhfz
from stage3_workers import PROMPT, batches, lm_loss, tiny_lm

NEW_TOKENS = 8


def greedy(model):
    with torch.no_grad():
        return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              pad_token_id=0)


def mesh_2x2():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _grad_shard_bytes(opt) -> int:
    """The bytes of this rank's grad shards (what one all-reduce of them sends)."""
    return sum(b.flat_grad_shard.numel() * b.flat_grad_shard.element_size()
               for b in opt.engine.buckets if b.trainable)


def _state_bytes(opt) -> dict:
    report = opt.memory_report()
    return {kind: sum(report[kind].values()) for kind in ("master", "exp_avg", "exp_avg_sq")}


def _host_master_bytes(opt) -> int:
    """The host part's own master copy (offload="cpu"): fp32 elements of host parts."""
    return sum(b.shard.host_numel * 4 for b in opt.engine.buckets)


def _one_step_traffic(opt, step_fn) -> dict:
    """What each dimension's collectives carried during one step."""
    before = opt.comm.traffic_by_dimension()
    step_fn()
    after = opt.comm.traffic_by_dimension()
    return {dim: {k: after[dim][k] - before[dim][k] for k in after[dim]} for dim in after}


def _shard_state(opt) -> list:
    """This rank's shard of every bucket's moments and params (replicas hold the same)."""
    out = []
    for bucket in opt.engine.buckets:
        out.append(bucket.flat_param_shard.clone())
        for name in ("exp_avg", "exp_avg_sq"):
            device_part, host_part = bucket.state.parts[name]
            out.append(torch.cat([device_part.reshape(-1)] + (
                [host_part.reshape(-1)] if host_part is not None else [])).clone())
    return out


def mlp_parity(rank, world_size, stage, steps, options):
    """The MLP of the sharding tests on 4 data-parallel ranks at stage 1 or 2,
    offloaded and reloaded halfway."""
    mesh = mesh_2x2()
    model = dist_workers.make_model()
    opt = rlhfz.ZeroAdamW(dist_workers.groups(model), lr=1e-3, stage=stage, device_mesh=mesh,
                          **options)
    data = dist_workers.batches(steps + 1)
    half = steps // 2
    micro = 2 if stage == 2 else 1
    losses = dist_workers.train(model, opt, data[:half], rank, world_size, clip=1.0,
                                micro_batches=micro)
    opt.offload()
    placement = opt.placement()
    opt.reload()
    losses += dist_workers.train(model, opt, data[half:steps], rank, world_size, clip=1.0,
                                 micro_batches=micro)
    out = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
           "state_dict": opt.state_dict(), "placement": placement,
           "coords": (opt.comm.replica, opt.rank), "state_bytes": _state_bytes(opt),
           "host_master_bytes": _host_master_bytes(opt),
           "numel": sum(p.numel() for p in model.parameters()),
           "padded": sum(b.layout.padded_numel for b in opt.engine.buckets),
           "buckets": len(opt.engine.buckets), "shard_state": _shard_state(opt),
           "grad_shard_bytes": _grad_shard_bytes(opt), "sharded": opt.sharded_state_dict()}
    # one more step, its traffic counted (one micro-batch: one reduction)
    out["traffic"] = _one_step_traffic(opt, lambda: dist_workers.train(
        model, opt, data[steps:], rank, world_size, clip=1.0))
    return out


def lm_parity(rank, world_size, steps, options):
    """The tiny GPT-2 at stage 3 on 4 data-parallel ranks, offloaded and
    reloaded halfway; generation in every mode before and after training."""
    mesh = mesh_2x2()
    model = tiny_lm("gpt2")
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-3, param_persistence_threshold=64,
                          device_mesh=mesh, **options)
    model.eval()
    with rlhfz.gather_for_generation(model):
        before = greedy(model)
    model.train()

    def one_step(ids):
        opt.zero_grad()
        loss = lm_loss(model, ids[rank::world_size])
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world_size

    data = batches(steps + 1)
    losses = []
    for step, ids in enumerate(data[:steps]):
        if step == steps // 2:
            opt.offload()
            opt.reload()
        losses.append(one_step(ids))
    out = {"losses": losses, "before": before, "coords": (opt.comm.replica, opt.rank),
           "state_bytes": _state_bytes(opt), "host_master_bytes": _host_master_bytes(opt), "shard_state": _shard_state(opt),
           "numel": sum(b.layout.numel for b in opt.engine.buckets),
           "padded": sum(b.layout.padded_numel for b in opt.engine.buckets),
           "buckets": len(opt.engine.buckets), "grad_shard_bytes": _grad_shard_bytes(opt)}
    out["params"] = {name: t.clone() for name, t in rlhfz.iter_full_params(model, 8192)}
    model.eval()
    out["after"] = {}
    modes = {"full": {}, "unit": {"enabled": False},
             "budget": {"budget_bytes": opt.stage3.unit_bytes(0) * 2}}
    for mode, kwargs in modes.items():
        traffic = opt.comm.traffic_by_dimension()["replicate"]
        with rlhfz.gather_for_generation(model, **kwargs):
            out["after"][mode] = greedy(model)
        assert opt.comm.traffic_by_dimension()["replicate"] == traffic, mode
    model.train()
    out["traffic"] = _one_step_traffic(opt, lambda: one_step(data[steps]))
    return out


def checkpoint_layouts(rank, world_size, hybrid_path, plain_path):
    """Saved under hybrid sharding and loaded over every rank as one group,
    and the other way round, each run on to compare with one that never stopped."""
    build, train, whole = (checkpoint_workers.build, checkpoint_workers.train,
                           checkpoint_workers.whole)
    out = {}
    model, opt = build("gpt2", 3, device_mesh=mesh_2x2())
    train(model, opt, "gpt2", rank, world_size, 0, 3)
    out["hybrid_saved"] = whole(model, opt)
    rlhfz.save_checkpoint(hybrid_path, model, opt, client_state={"step": 3})
    train(model, opt, "gpt2", rank, world_size, 3, 5)
    out["hybrid_final"] = whole(model, opt)
    opt.close()

    model, opt = build("gpt2", 3)                        # the 4 ranks as one shard group
    rlhfz.load_checkpoint(hybrid_path, model, opt)
    out["plain_loaded"] = whole(model, opt)
    rlhfz.save_checkpoint(plain_path, model, opt, client_state={"step": 3})
    train(model, opt, "gpt2", rank, world_size, 3, 5)
    out["plain_final"] = whole(model, opt)
    opt.close()

    model, opt = build("gpt2", 2, device_mesh=mesh_2x2())   # back under the mesh, stage 2
    out["client"] = rlhfz.load_checkpoint(plain_path, model, opt)
    out["hybrid_loaded"] = whole(model, opt)
    train(model, opt, "gpt2", rank, world_size, 3, 5)
    out["hybrid_again_final"] = whole(model, opt)
    return out


def mesh_arguments(rank, world_size):
    """Meshes rlhfz refuses, each with its reason, and a 1-D mesh that trains
    as process_group=None does, bit for bit."""
    errors = {}

    def refused(name, build):
        try:
            build()
        except (ValueError, TypeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
        else:
            errors[name] = None

    params = lambda: dist_workers.make_model().parameters()      # noqa: E731
    line = init_device_mesh("cpu", (2,))
    column = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    row_unnamed = init_device_mesh("cpu", (1, 2))
    renamed = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "fsdp"))
    cube = init_device_mesh("cpu", (1, 1, 2))
    first_only = DeviceMesh("cpu", [0])
    if rank == 1:
        refused("outside", lambda: rlhfz.ZeroAdamW(params(), stage=2, device_mesh=first_only))
    refused("not_a_mesh", lambda: rlhfz.ZeroAdamW(params(), stage=2, device_mesh="mesh"))
    refused("names", lambda: rlhfz.ZeroAdamW(params(), stage=2, device_mesh=renamed))
    refused("three_dims", lambda: rlhfz.ZeroAdamW(params(), stage=2, device_mesh=cube))
    refused("one_shard_rank", lambda: rlhfz.ZeroAdamW(params(), stage=2, device_mesh=column))
    refused("both", lambda: rlhfz.ZeroAdamW(params(), stage=2, device_mesh=line,
                                            process_group=dist.group.WORLD))
    refused("nccl", lambda: rlhfz.ZeroAdamW(params(), stage=2, device_mesh=line,
                                            collectives="nccl"))
    sharded = rlhfz.shard_model(tiny_lm("gpt2"), device_mesh=line, param_persistence_threshold=64)
    refused("other_mesh", lambda: rlhfz.ZeroAdamW(sharded, stage=3, device_mesh=row_unnamed))
    data = dist_workers.batches(5)
    trained = {}
    for name, options in (("line", {"device_mesh": line}), ("unnamed_row", {"device_mesh":
                                                                            row_unnamed}),
                          ("group", {})):
        model = dist_workers.make_model()
        opt = rlhfz.ZeroAdamW(dist_workers.groups(model), lr=1e-3, stage=2, **options)
        dist_workers.train(model, opt, data, rank, world_size, clip=1.0)
        trained[name] = [p.detach().clone() for p in model.parameters()]
        trained[name + "_dims"] = sorted(opt.comm.traffic_by_dimension())
        opt.close()
    return {"errors": errors, "trained": trained}


def crossed_meshes(rank, world_size):
    """2 x 2 meshes in other orders than init_device_mesh's: those whose
    groups torch numbers alike in every replica train as the plain layout
    does; one that crosses them ([[0, 3], [2, 1]]: ranks 0 and 2 replicate
    each other holding shards 0 and 1) is refused by the optimizer and by
    shard_model, where it averaged different shards' grads without a word."""
    names = ("replicate", "shard")
    out = {"refused": {}, "trained": {}}
    crossed = DeviceMesh("cpu", [[0, 3], [2, 1]], mesh_dim_names=names)
    for what, build in (("optimizer", lambda: rlhfz.ZeroAdamW(
            dist_workers.make_model().parameters(), stage=2, device_mesh=crossed)),
            ("shard_model", lambda: rlhfz.shard_model(tiny_lm("gpt2"), device_mesh=crossed))):
        try:
            build()
            out["refused"][what] = None
        except ValueError as error:
            out["refused"][what] = str(error)
    data = dist_workers.batches(3)
    for layout in ([[0, 1], [2, 3]], [[3, 2], [1, 0]], [[0, 2], [1, 3]]):
        model = dist_workers.make_model()
        mesh = DeviceMesh("cpu", layout, mesh_dim_names=names)
        opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3, stage=2, device_mesh=mesh)
        dist_workers.train(model, opt, data, rank, world_size)
        out["trained"][str(layout)] = [p.detach().clone() for p in model.parameters()]
        opt.close()
    return out
