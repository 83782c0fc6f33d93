"""The main job: train a small transformer with ZeroAdamW beside torch.optim.AdamW.

The model is a GPT built from a config (no downloads) and the data is a
synthetic next-token task it can learn in a few hundred steps. Both
optimizers see the same model and the same batches, so their losses and
parameters should agree to float32 rounding.
"""
from __future__ import annotations

import copy
import math
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


def relative_difference(model_a: nn.Module, model_b: nn.Module) -> float:
    """||a - b|| / ||b|| over all parameters. An elementwise maximum would be
    dominated by directions the loss ignores (attention's key bias): their
    grads are rounding noise, which Adam normalizes into full-size steps."""
    diff = sum(((a - b).double() ** 2).sum().item()
               for a, b in zip(model_a.parameters(), model_b.parameters()))
    norm = sum((b.double() ** 2).sum().item() for b in model_b.parameters())
    return math.sqrt(diff / norm)


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def run(steps: int = 300, batch_size: int = 16, lr: float = 3e-3, seed: int = 0,
        log_every: int = 25, print_fn=print) -> dict:
    """Train twice from the same start, with ZeroAdamW and torch.optim.AdamW."""
    import rlhfz

    torch.manual_seed(seed)
    cfg = GPTConfig()
    model_rlhfz = TinyGPT(cfg)
    model_torch = copy.deepcopy(model_rlhfz)
    nparams = sum(p.numel() for p in model_rlhfz.parameters())
    opt_rlhfz = rlhfz.ZeroAdamW(param_groups(model_rlhfz, 0.1), lr=lr, betas=(0.9, 0.95))
    opt_torch = torch.optim.AdamW(param_groups(model_torch, 0.1), lr=lr, betas=(0.9, 0.95))
    sched_rlhfz = torch.optim.lr_scheduler.CosineAnnealingLR(opt_rlhfz, T_max=steps)
    sched_torch = torch.optim.lr_scheduler.CosineAnnealingLR(opt_torch, T_max=steps)

    info = rlhfz.build_info()
    print_fn(f"rlhfz {info['version']} demo: TinyGPT {cfg.layers} layers x {cfg.dim} dims, "
             f"{nparams:,} params, {steps} steps, batch {batch_size}x{cfg.seq_len}; "
             f"simd={info['simd']} threads={info['threads']} cuda={info['cuda']}")
    print_fn(f"{'step':>5}  {'loss rlhfz':>10}  {'loss torch':>10}  {'rel |dp|':>9}  "
             f"{'opt ms rlhfz':>12}  {'opt ms torch':>12}")
    gen = torch.Generator().manual_seed(seed + 1)
    times = {"rlhfz": 0.0, "torch": 0.0}
    losses = {"rlhfz": [], "torch": []}
    for step in range(1, steps + 1):
        tokens, targets = make_batch(cfg, batch_size, gen)
        for name, model, opt, sched in (("rlhfz", model_rlhfz, opt_rlhfz, sched_rlhfz),
                                        ("torch", model_torch, opt_torch, sched_torch)):
            opt.zero_grad(set_to_none=True)
            loss = model(tokens, targets)
            loss.backward()
            start = time.perf_counter()
            opt.step()
            times[name] += time.perf_counter() - start
            sched.step()
            losses[name].append(loss.item())
        if step % log_every == 0 or step == 1 or step == steps:
            diff = relative_difference(model_rlhfz, model_torch)
            print_fn(f"{step:>5}  {losses['rlhfz'][-1]:>10.4f}  {losses['torch'][-1]:>10.4f}  "
                     f"{diff:>9.2e}  {1e3 * times['rlhfz'] / step:>12.3f}  "
                     f"{1e3 * times['torch'] / step:>12.3f}")
    report = opt_rlhfz.memory_report()
    print_fn("memory report (bytes owned by ZeroAdamW, by kind and tier):")
    for kind, tiers in report.items():
        print_fn(f"  {kind:<11} " + ", ".join(f"{tier}: {_format_bytes(n)}"
                                              for tier, n in tiers.items()))
    diff = relative_difference(model_rlhfz, model_torch)
    first, last = losses["rlhfz"][0], sum(losses["rlhfz"][-10:]) / 10
    speedup = times["torch"] / times["rlhfz"]
    print_fn(f"loss {first:.3f} -> {last:.3f} (mean of the last 10); params differ from "
             f"torch.optim.AdamW's by {diff:.2e} relative (L2); optimizer step "
             f"{speedup:.2f}x torch's")
    if not (math.isfinite(last) and last < first):
        raise RuntimeError("the demo did not learn: the loss did not go down")
    return {"losses": losses, "relative_param_diff": diff, "memory_report": report,
            "step_seconds": {k: v / steps for k, v in times.items()}}
