"""The main job: train a small transformer with ZeroAdamW beside torch.optim.AdamW.

The model is a GPT built from a config (no downloads) and the data is a
synthetic next-token task it can learn in a few hundred steps. Both
optimizers see the same model and the same batches, so their losses and
parameters should agree to float32 rounding.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 96
    seq_len: int = 32
    dim: int = 64
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = True


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln_attn = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln_mlp = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(F.gelu(self.up(self.ln_mlp(x))))


class TinyGPT(nn.Module):
    """A small causal language model; the LM head is tied to the embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_out = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens, targets=None):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_out(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(cfg: GPTConfig, batch_size: int, generator: torch.Generator):
    """Arithmetic sequences modulo the vocabulary: learnable from context."""
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 6, (batch_size, 1), generator=generator)
    positions = torch.arange(cfg.seq_len + 1).unsqueeze(0)
    seq = (start + stride * positions) % cfg.vocab_size
    return seq[:, :-1], seq[:, 1:]


def param_groups(model: nn.Module, weight_decay: float):
    """Two groups, as LLM recipes use: decay matrices, not norms or biases."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def relative_difference_lists(params_a, params_b) -> float:
    """||a - b|| / ||b|| over all parameters. An elementwise maximum would be
    dominated by directions the loss ignores (attention's key bias): their
    grads are rounding noise, which Adam normalizes into full-size steps."""
    diff = sum(((a.detach() - b.detach()).double() ** 2).sum().item()
               for a, b in zip(params_a, params_b))
    norm = sum((b.detach().double() ** 2).sum().item() for b in params_b)
    return math.sqrt(diff / norm)


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _train(model, opt, sched, cfg, steps, batch_size, seed, rank=0, world_size=1,
           on_step=None):
    """Trains on `steps` global batches; each rank takes its slice. Returns
    the global mean losses and the seconds spent in opt.step()."""
    gen = torch.Generator().manual_seed(seed + 1)
    per_rank = batch_size // world_size
    losses, seconds = [], 0.0
    for step in range(1, steps + 1):
        tokens, targets = make_batch(cfg, batch_size, gen)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad(set_to_none=True)
        loss = model(tokens[mine], targets[mine])
        loss.backward()
        start = time.perf_counter()
        opt.step()
        seconds += time.perf_counter() - start
        sched.step()
        loss = loss.detach()
        if world_size > 1:
            torch.distributed.all_reduce(loss)
            loss /= world_size
        losses.append(loss.item())
        if on_step is not None:
            on_step(step)
    return losses, seconds


def _setup(seed, lr, steps, optimizer_factory):
    torch.manual_seed(seed)
    cfg = GPTConfig()
    model = TinyGPT(cfg)
    opt = optimizer_factory(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return cfg, model, opt, sched


# The params are checked against torch.optim.AdamW's after this step (or the
# last, if sooner). Training amplifies float32 rounding as it goes, the more
# the higher the lr: after 300 steps at the default lr a right optimizer
# differs by about 3e-4, after 1000 by 1e-3, at lr 2e-2 by 0.4. After 20
# steps it differs by about 2e-5 (8e-5 at lr 2e-2) on any world size and
# stage, while AdamW without its weight decay differs by 2e-3 and one with
# a 10% larger lr by 2e-2.
CHECK_STEP = 20
PARAM_TOLERANCE = 1e-3


class DemoCheckFailed(RuntimeError):
    """The demo ran, and ZeroAdamW did not do what torch.optim.AdamW does."""


def _snapshot_at(model, step: int, into: list):
    """An on_step for _train: the params after `step`, copied into `into`."""
    def on_step(done: int) -> None:
        if done == step:
            into[:] = [p.detach().clone() for p in model.parameters()]
    return on_step


def _rank_main(rank, world_size, steps, batch_size, lr, seed, stage):
    """One rank of the sharded run (spawned by rlhfz.launch.run_ranks)."""
    import functools

    import rlhfz
    factory = functools.partial(rlhfz.ZeroAdamW, stage=stage)
    cfg, model, opt, sched = _setup(seed, lr, steps, factory)
    checked = []
    losses, seconds = _train(model, opt, sched, cfg, steps, batch_size, seed, rank, world_size,
                             _snapshot_at(model, min(steps, CHECK_STEP), checked))
    return {"losses": losses, "step_seconds": seconds / steps,
            "memory_report": opt.memory_report(),
            "params": [p.detach().clone() for p in model.parameters()] if rank == 0 else None,
            "checked_params": checked if rank == 0 else None}


def _print_report(print_fn, title, report):
    total = sum(sum(tiers.values()) for tiers in report.values())
    print_fn(f"  {title:<12} total {_format_bytes(total):>11}   " + ", ".join(
        f"{kind} {_format_bytes(sum(tiers.values()))}" for kind, tiers in report.items()))


def launched_by_torchrun() -> bool:
    """True in a process that torchrun (or another env:// launcher) started."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                               "MASTER_PORT"))


def run_world_size(world_size: int) -> int:
    """The ranks a run has: in a process torchrun started, its WORLD_SIZE
    (the launcher's wins), else world_size."""
    if not launched_by_torchrun():
        return world_size
    text = os.environ["WORLD_SIZE"]
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"WORLD_SIZE={text!r} (set by the launcher) must be a whole number of "
                         f"ranks, at least 1")
    return value


def check_run(steps: int, batch_size: int, world_size: int, stage: int) -> None:
    """A ValueError, before anything trains, for a run the demo cannot make."""
    if steps < 2:
        raise ValueError(f"{steps} steps are too few: the demo needs at least 2 steps, as it "
                         f"checks that the loss fell after the first")
    if stage == 0 and world_size > 1:
        raise ValueError(f"stage 0 does not shard, so it has no use for {world_size} ranks: "
                         f"pick stage 1 or 2, or one rank")
    if batch_size % world_size:
        raise ValueError(f"batch size {batch_size} does not divide over {world_size} ranks: "
                         f"pick a multiple of {world_size}")


def _ranks_under_torchrun(steps, batch_size, lr, seed, stage):
    """This process is one rank of a torchrun job (any number of nodes):
    train, then gather every rank's result to all."""
    import rlhfz
    import torch.distributed as dist
    dist.init_process_group("gloo")
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        rlhfz.set_num_threads(max(1, (os.cpu_count() or 1) // local))   # share the node's cores
        result = _rank_main(dist.get_rank(), dist.get_world_size(), steps, batch_size, lr, seed,
                            stage)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, result)
        return dist.get_rank(), ranks
    finally:
        dist.destroy_process_group()


def run(steps: int = 300, batch_size: int = 16, lr: float = 3e-3, seed: int = 0,
        log_every: int = 25, print_fn=print, world_size: int = 2, stage: int = 2) -> dict:
    """Trains with ZeroAdamW on `world_size` gloo ranks (stage `stage`), and
    the same global batches with torch.optim.AdamW in this process. Started
    by torchrun, each process is one rank instead (the launcher's world size
    wins) and rank 0 reports."""
    import rlhfz

    torchrun = launched_by_torchrun()
    world_size = run_world_size(world_size)
    check_run(steps, batch_size, world_size, stage)
    if world_size == 1:
        rank, ranks = 0, [_rank_main(0, 1, steps, batch_size, lr, seed, stage)]
    elif torchrun:
        rank, ranks = _ranks_under_torchrun(steps, batch_size, lr, seed, stage)
    else:
        from .launch import run_ranks
        threads = max(1, rlhfz.get_num_threads() // world_size)
        os.environ.setdefault("RLHFZ_NUM_THREADS", str(threads))   # share the cores
        rank, ranks = 0, run_ranks(_rank_main, world_size, steps, batch_size, lr, seed, stage,
                                   timeout=600)
    if rank != 0:
        return {"rank": rank}

    cfg, ref_model, ref_opt, ref_sched = _setup(seed, lr, steps, torch.optim.AdamW)
    nparams = sum(p.numel() for p in ref_model.parameters())
    info = rlhfz.build_info()
    launcher = "torchrun" if torchrun else "gloo"
    print_fn(f"rlhfz {info['version']} demo: TinyGPT {cfg.layers} layers x {cfg.dim} dims, "
             f"{nparams:,} params, {steps} steps, global batch {batch_size}x{cfg.seq_len}; "
             f"ZeroAdamW stage {stage} on {world_size} {launcher} rank(s) beside "
             f"torch.optim.AdamW in one process; simd={info['simd']} threads={info['threads']}")
    check_step, ref_checked = min(steps, CHECK_STEP), []
    ref_losses, ref_seconds = _train(ref_model, ref_opt, ref_sched, cfg, steps, batch_size, seed,
                                     on_step=_snapshot_at(ref_model, check_step, ref_checked))

    # The unsharded figure: the same optimizer, one process.
    _, _, single_opt, _ = _setup(seed, lr, steps, rlhfz.ZeroAdamW)
    unsharded = single_opt.memory_report()
    del single_opt

    losses = ranks[0]["losses"]
    print_fn(f"{'step':>5}  {'loss rlhfz':>10}  {'loss torch':>10}")
    for step in range(1, steps + 1):
        if step % log_every == 0 or step == 1 or step == steps:
            print_fn(f"{step:>5}  {losses[step - 1]:>10.4f}  {ref_losses[step - 1]:>10.4f}")
    step_ms = 1e3 * max(r["step_seconds"] for r in ranks)
    print_fn(f"optimizer step: rlhfz {step_ms:.3f} ms (slowest rank, collectives included), "
             f"torch.optim.AdamW {1e3 * ref_seconds / steps:.3f} ms (one process)")
    print_fn("memory owned by ZeroAdamW, per rank, beside the unsharded optimizer:")
    _print_report(print_fn, "unsharded", unsharded)
    for index, result in enumerate(ranks):
        _print_report(print_fn, f"rank {index}", result["memory_report"])
    diff = relative_difference_lists(ranks[0]["params"], list(ref_model.parameters()))
    checked = relative_difference_lists(ranks[0]["checked_params"], ref_checked)
    tail = losses[-10:]
    first, last = losses[0], sum(tail) / len(tail)
    later = (f", by {diff:.2e} after step {steps} (rounding that training amplifies)"
             if check_step < steps else "")
    print_fn(f"loss {first:.3f} -> {last:.3f} (mean of the last {len(tail)}); params differ from "
             f"torch.optim.AdamW's by {checked:.2e} relative (L2) after step {check_step} "
             f"(checked: at most {PARAM_TOLERANCE:.0e}){later}")
    if not checked <= PARAM_TOLERANCE:
        raise DemoCheckFailed(f"ZeroAdamW does not match torch.optim.AdamW: after step "
                              f"{check_step} the params differ by {checked:.2e} relative (L2), "
                              f"above {PARAM_TOLERANCE:.0e} (float32 rounding stays far below)")
    if not (math.isfinite(last) and last < first):
        raise DemoCheckFailed("the demo did not learn: the loss did not go down")
    return {"rank": 0, "losses": {"rlhfz": losses, "torch": ref_losses},
            "relative_param_diff": diff, "checked_param_diff": checked,
            "memory_report": ranks[0]["memory_report"], "unsharded_memory_report": unsharded,
            "rank_memory_reports": [r["memory_report"] for r in ranks]}
