"""Per-rank bodies of the checkpoint tests (importable by spawned ranks).

Every body trains on data derived only from the step number, so a run that
is saved and resumed can be compared with one that never stopped."""
import copy
import os

import torch

import rlhfz
from stage3_workers import batches, lm_loss, tiny_lm


def mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(37, 61), torch.nn.GELU(),
                                torch.nn.LayerNorm(61), torch.nn.Linear(61, 29))
    model.register_buffer("calls", torch.zeros(3))
    return model.to(dtype)


def build(kind, stage, dtype=torch.float32, **options):
    if kind == "mlp":
        model = mlp(dtype)
    else:
        model = tiny_lm(kind).to(dtype)
    opt = rlhfz.ZeroAdamW(model, lr=3e-3, weight_decay=0.1, stage=stage,
                          param_persistence_threshold=64, **options)
    return model, opt


def train(model, opt, kind, rank, world_size, first, last):
    for step in range(first, last):
        opt.zero_grad()
        if kind == "mlp":
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(12, 37, generator=gen).to(next(model.parameters()).dtype)
            loss = model(x[rank::world_size]).float().pow(2).mean()
        else:
            loss = lm_loss(model, batches(1, seed=step)[0][rank::world_size])
        loss.backward()
        if hasattr(opt, "clip_grad_norm_"):
            opt.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.add_(1)


def whole(model, opt):
    """The full params (by name) and the torch-format optimizer state."""
    params = {name: t.clone() for name, t in rlhfz.iter_full_params(model, 1 << 14)}
    return {"params": params, "optimizer": copy.deepcopy(opt.state_dict()),
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def save_and_continue(rank, world_size, path, kind, stage, dtype, options, steps=3):
    """Trains, saves, trains on: what was saved, and where it ended."""
    model, opt = build(kind, stage, dtype, **options)
    train(model, opt, kind, rank, world_size, 0, steps)
    rlhfz.save_checkpoint(path, model, opt, client_state={"step": steps})
    saved = whole(model, opt)
    train(model, opt, kind, rank, world_size, steps, 2 * steps)
    return {"saved": saved, "final": whole(model, opt)}


def load_and_continue(rank, world_size, path, kind, stage, dtype, options, steps=3):
    """Loads into a fresh model: what it holds then, and where it ends."""
    model, opt = build(kind, stage, dtype, **options)
    client = rlhfz.load_checkpoint(path, model, opt)
    loaded = whole(model, opt)
    train(model, opt, kind, rank, world_size, client["step"], client["step"] + steps)
    return {"loaded": loaded, "final": whole(model, opt), "client": client}


def one_rank_damaged(rank, world_size, path, kind, stage, dtype):
    """Rank 1 sees a damaged file (its own copy of the index points
    elsewhere): every rank raises, and every rank's state is unchanged."""
    model, opt = build(kind, stage, dtype)
    train(model, opt, kind, rank, world_size, 0, 2)
    before = whole(model, opt)
    target = path
    if rank == 1:
        import os
        import shutil
        target = path + "-rank1"
        shutil.copytree(path, target)
        generation = next(e for e in os.listdir(target) if e.startswith("g-"))
        victim = os.path.join(target, generation, "rank-00000-of-00002.safetensors")
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) - 5)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
    try:
        rlhfz.load_checkpoint(target, model, opt)
        error = None
    except rlhfz.CheckpointError as caught:
        error = str(caught)
    return {"error": error, "before": before, "after": whole(model, opt)}


def model_alone_of_a_sharded_model(rank, world_size, path):
    """At stage 3 the params live in the optimizer's shards: the model alone
    is saved from units gathered one at a time (a collective), and loads
    into another stage-3 model, whose optimizer's master weights follow."""
    model, opt = build("mlp", 3)
    train(model, opt, "mlp", rank, world_size, 0, 3)
    rlhfz.save_checkpoint(path, model)
    saved = rlhfz.full_state_dict(model, rank0_only=False)
    other, other_opt = build("mlp", 3)
    rlhfz.load_checkpoint(path, other)
    loaded = rlhfz.full_state_dict(other, rank0_only=False)
    train(model, opt, "mlp", rank, world_size, 3, 5)
    train(other, other_opt, "mlp", rank, world_size, 3, 5)
    after = rlhfz.full_state_dict(model, rank0_only=False)
    other_after = rlhfz.full_state_dict(other, rank0_only=False)
    return {"loaded": all(torch.equal(saved[k], loaded[k]) for k in saved),
            "keys": sorted(saved),
            # fresh moments on the other side: the two runs part, but both train
            "trained": all(not torch.equal(other_after[k], loaded[k]) for k in loaded
                           if "weight" in k) and len(after) == len(other_after)}


def save_inside_a_gather(rank, world_size, path):
    """A value written into a gathered stage-3 param inside
    gather_for_generation: a checkpoint of the optimizer taken there is
    refused; the model alone, and one taken after, hold the value."""
    model, opt = build("mlp", 3)
    train(model, opt, "mlp", rank, world_size, 0, 2)
    refused = None
    with rlhfz.gather_for_generation(model):
        with torch.no_grad():
            model[0].weight.fill_(0.5)
        try:
            rlhfz.save_checkpoint(os.path.join(path, "inside"), model, opt)
        except RuntimeError as error:
            refused = str(error)
        rlhfz.save_checkpoint(os.path.join(path, "model-inside"), model)
    rlhfz.save_checkpoint(os.path.join(path, "after"), model, opt)
    found = {}
    for name in ("model-inside", "after"):
        other, other_opt = build("mlp", 3)
        rlhfz.load_checkpoint(os.path.join(path, name), other,
                              other_opt if name == "after" else None)
        found[name] = bool((rlhfz.full_state_dict(other, rank0_only=False)["0.weight"]
                            == 0.5).all())
    return {"refused": refused, "found": found,
            "inside_written": os.path.exists(os.path.join(path, "inside"))}


def consolidated_of_another_state_dtype(rank, world_size, path):
    """A consolidated checkpoint whose optimizer kept int8 moments, loaded
    across processes into an fp32 one, which cannot change form there: it
    is refused before the model's params are written."""
    model, opt = build("mlp", 2, state_dtype="int8")
    train(model, opt, "mlp", rank, world_size, 0, 2)
    rlhfz.save_consolidated(path, model, opt)
    target, target_opt = build("mlp", 2)
    train(target, target_opt, "mlp", rank, world_size, 5, 6)
    before = whole(target, target_opt)
    try:
        rlhfz.load_checkpoint(path, target, target_opt)
        error = None
    except rlhfz.CheckpointError as caught:
        error = str(caught)
    return {"error": error, "before": before, "after": whole(target, target_opt)}


def _two_optimizer_model(seed, stage, dtype=torch.float32, **options):
    """A model whose first layer one ZeroAdamW trains and whose last layer
    another does; at stage 3 both over one sharded model."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 4)).to(dtype)
    if stage == 3:
        rlhfz.shard_model(model, param_persistence_threshold=0)
    first = rlhfz.ZeroAdamW(model[0].parameters(), lr=1e-2, stage=stage)
    last = rlhfz.ZeroAdamW(model[2].parameters(), lr=1e-2, stage=stage, **options)
    return model, first, last


def _whole(model, stage):
    if stage == 3:
        return {k: v.clone() for k, v in rlhfz.full_state_dict(model, rank0_only=False).items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def checkpoint_beside_another_optimizer(rank, world_size, path, stage, dtype, options):
    """save_checkpoint(path, model, first) while a second ZeroAdamW trains
    the rest of the model: the checkpoint holds that rest whole (never a
    stage-3 placeholder), and loading it puts those values where the second
    optimizer steps from (its fp32 master, its host part), as a
    load_state_dict or p.copy_() would."""
    def train(model, first, last, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(6, 8, generator=gen)[rank::world_size].to(dtype)
            first.zero_grad()
            last.zero_grad()
            model(x).float().pow(2).mean().backward()
            first.step()
            last.step()

    model, first, last = _two_optimizer_model(0, stage, dtype, **options)
    train(model, first, last, 3, 1)
    rlhfz.save_checkpoint(path, model, first)
    saved = _whole(model, stage)
    train(model, first, last, 3, 2)
    rlhfz.load_checkpoint(path, model, first)
    loaded = _whole(model, stage)
    for group in last.param_groups:
        group["lr"] = 0.0          # no update: what it steps from shows
    for group in first.param_groups:
        group["lr"] = 0.0
    train(model, first, last, 1, 3)
    stepped = _whole(model, stage)
    fresh = _two_optimizer_model(7, stage, dtype, **options)
    rlhfz.load_checkpoint(path, fresh[0], fresh[1])
    into_fresh = _whole(fresh[0], stage)
    for opt in (first, last, fresh[1], fresh[2]):
        opt.close()

    def apart(values):
        return max(float((values[k].float() - saved[k].float()).abs().max()) for k in saved)
    return {"loaded": apart(loaded), "stepped": apart(stepped), "fresh": apart(into_fresh),
            "shapes": {k: list(v.shape) for k, v in into_fresh.items()}}
