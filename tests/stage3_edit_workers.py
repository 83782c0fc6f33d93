"""Per-rank bodies of tests/test_stage3_edits.py (importable by spawned ranks)."""
import warnings

import torch

import rlhfz
from stage3_workers import batches, lm_loss, tiny_lm

LR = 1e-2


def new_values(model, seed=11):
    """A whole state dict of other values for the model's params."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) * 0.05
            for name, p in tiny_lm("llama").named_parameters()}


def train_steps(model, opt, steps, rank=0, world_size=1):
    """Each rank its slice of the same global batches; returns the losses."""
    losses = []
    for ids in batches(steps):
        opt.zero_grad()
        loss = lm_loss(model, ids[rank::world_size])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def reference(write, steps_before=2, steps_after=3):
    """The same sequence on an unsharded model and torch's AdamW."""
    model = tiny_lm("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train_steps(model, opt, steps_before)
    write(model, None)
    return train_steps(model, opt, steps_after), {k: v.detach().clone()
                                                  for k, v in model.state_dict().items()}


def sharded_run(rank, world_size, write_name, steps_before=2, steps_after=3):
    model = tiny_lm("llama")
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=LR, param_persistence_threshold=0)
    train_steps(model, opt, steps_before, rank, world_size)
    WRITES[write_name](model, opt)
    losses = train_steps(model, opt, steps_after, rank, world_size)
    return losses, rlhfz.full_state_dict(model, rank0_only=False)


def _assign(model, opt):
    values = new_values(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("q_proj.weight") or name.endswith("norm.weight"):
                p.data = values[name].clone()


def _load(model, opt):
    model.load_state_dict(new_values(model), strict=False)


def _load_inside(model, opt):
    """Some units whole (the budget's), the rest sharded."""
    context = (rlhfz.gather_for_generation(model, budget_bytes=40_000) if opt is not None
               else torch.no_grad())
    with context:
        model.load_state_dict(new_values(model), strict=False)


def _copy_inside(model, opt):
    values = new_values(model)
    context = (rlhfz.gather_for_generation(model) if opt is not None
               else torch.no_grad())
    with context, torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.copy_(
            values["model.layers.1.mlp.up_proj.weight"])
        model.model.norm.weight.mul_(0.5)


WRITES = {"p.data = t": _assign, "load_state_dict": _load,
          "load_state_dict in gather_for_generation(budget)": _load_inside,
          "copy_ in gather_for_generation": _copy_inside}


def cast_round_trip(rank, world_size):
    """The cast is refused when asked for, with every param as it was; a
    move to the device the model is on runs; training goes on."""
    model = tiny_lm("llama")
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=LR, param_persistence_threshold=0)
    before = {name: (p.dtype, tuple(p.shape)) for name, p in model.named_parameters()}
    buffers = {name: b.dtype for name, b in model.named_buffers()}
    try:
        model.to(torch.bfloat16)
        error = None
    except RuntimeError as raised:
        error = str(raised)
    unchanged = (before == {name: (p.dtype, tuple(p.shape))
                            for name, p in model.named_parameters()}
                 and buffers == {name: b.dtype for name, b in model.named_buffers()})
    model.to(torch.device("cpu"))
    losses = train_steps(model, opt, 2, rank, world_size)
    return error, unchanged, losses


def load_assign(rank, world_size):
    model = tiny_lm("llama")
    rlhfz.ZeroAdamW(model, stage=3, lr=LR, param_persistence_threshold=0)
    try:
        model.load_state_dict(new_values(model), assign=True)
    except RuntimeError as error:
        return str(error)
    return None


def size_mismatch(rank, world_size):
    model = tiny_lm("llama")
    rlhfz.ZeroAdamW(model, stage=3, lr=LR, param_persistence_threshold=0)
    try:
        model.load_state_dict({"model.norm.weight": torch.zeros(7)}, strict=False)
    except RuntimeError as error:
        return str(error)
    return None


PROMPTS = [torch.tensor([[5, 17, 23, 42, 8]]), torch.tensor([[9, 3, 77, 1, 60]])]


def generate(model, prompt, eos):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=16, eos_token_id=eos, pad_token_id=0)


def uneven_generation(rank, world_size, eos, mode):
    """Each rank its own prompt: one stops at eos long before the other."""
    model = tiny_lm("llama")
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=LR, param_persistence_threshold=0)
    options = {"unit": dict(enabled=False), "budget": dict(budget_bytes=4000),
               "full": dict(enabled=True)}[mode]
    with rlhfz.gather_for_generation(model, **options):
        out = generate(model, PROMPTS[rank], eos)
    train_steps(model, opt, 1, rank, world_size)      # the ranks go on together
    return out
