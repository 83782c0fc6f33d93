"""Generation and weight export under stage 3.

gather_for_generation(model, enabled=True, budget_bytes=None) is a context
manager that every rank enters:
- enabled=True gathers every unit once, holds them for the whole context
  (the per-unit hooks stand aside) and re-shards on exit: the fastest
  generation, with the whole model in memory;
- enabled=False keeps the model sharded: each forward gathers unit by unit,
  one unit ahead, so memory stays at the shard plus two units;
- budget_bytes=B keeps the units that fit in B gathered for the whole
  context (in execution order) and gathers the rest unit by unit.
On any exit, an exception included, the hooks and shards are exactly as
before and the gathered memory is released. Contexts nest. On a model whose
optimizer is not at stage 3 across ranks it does nothing.

A sharded model's forward gathers, so every rank must run the same number
of forwards: transformers' generate does so for models it knows are sharded
(synced_gpus), and rlhfz's sharded models are marked for it
(synced_generation); while every unit is whole, they are not, since a
forward then gathers nothing. Values written into whole params inside the
context (model.load_state_dict) are kept: each rank writes its own part
into its shards as the units are released.

iter_full_params(model, bucket_bytes) yields (name, whole tensor) for every
param, gathering a few units at a time, for syncing weights into an
inference engine without the whole model in memory at once.

refuse_while_gathered(optimizer, action) guards what must not run while
params are gathered: a checkpoint load, an offload.
"""
from __future__ import annotations

import contextlib

import torch

_ATTRIBUTE = "_rlhfz_stage3"
# What transformers' generate reads (is_fsdp_managed_module) to keep every
# rank stepping until all are done (synced_gpus), as it does under FSDP and
# DeepSpeed ZeRO-3: a sharded forward gathers, so a rank that stopped early
# would leave the others' gathers unmatched.
_SYNCED_GENERATION = "_is_fsdp_managed_module"


# on every module inside a stage-3 model: the Stage3 of the model it is part of
_PART = "_rlhfz_stage3_part"


def mark_parts(model, stage3) -> None:
    """Every module under the sharded model knows whose part it is, so that
    gather_for_generation on one (a wrapper's policy) gathers the model."""
    for module in model.modules():
        if module is not model:
            setattr(module, _PART, stage3)


def synced_generation(model, on: bool) -> None:
    """Marks (or unmarks) a sharded model's modules for transformers'
    synced generation."""
    for module in model.modules():
        setattr(module, _SYNCED_GENERATION, on)


_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def unwrap_model(model, attribute: str = _ATTRIBUTE):
    """The module under torch.compile's wrapper (its _orig_mod) and DDP /
    DataParallel wrappers (their .module), stopping at one that carries
    `attribute` (rlhfz's record on the model). A model's own child named
    `module` is not a wrapper's."""
    for _ in range(8):
        compiled = getattr(model, "_orig_mod", None)
        if isinstance(compiled, torch.nn.Module):
            model = compiled
        elif not hasattr(model, attribute) and isinstance(model, _WRAPPERS):
            model = model.module
        else:
            break
    return model


def stage3_of(model):
    """The Stage3 hooks of a model's optimizer, or None (stages 0-2, one rank)."""
    return getattr(unwrap_model(model), _ATTRIBUTE, None)


def refuse_while_gathered(owner, action: str) -> None:
    """Raises RuntimeError while the stage-3 params of `owner` (an optimizer,
    or a sharded model's record) are gathered: shards loaded or moved under
    gathered params (`action`: "load", "offload") would disagree with the
    gathered copies a forward reads."""
    stage3 = getattr(owner, "stage3", None)
    if stage3 is not None and (stage3.suspended or stage3.keep or stage3.gathered_bytes()):
        raise RuntimeError("the model's params are gathered (a gather_for_generation context "
                           "is open, a forward is running, or a backward raised before it "
                           f"ended, until zero_grad()): {action} after it closes")


def _check(enabled, budget_bytes) -> None:
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, not {enabled!r}")
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
        raise ValueError(f"budget_bytes must be None or an int >= 0, not {budget_bytes!r}")


@contextlib.contextmanager
def gather_for_generation(model, enabled: bool = True, budget_bytes: int | None = None):
    _check(enabled, budget_bytes)
    # a part of a sharded model (a wrapper's policy beside its value head)
    # is gathered as that model, whose units it runs in
    stage3 = stage3_of(model) or getattr(unwrap_model(model), _PART, None)
    if stage3 is None:
        yield model
        return
    full = enabled and budget_bytes is None
    stage3.comm.agree("gather_for_generation",
                      {"mode": "full" if full else "budget" if budget_bytes is not None
                       else "unit by unit", "budget_bytes": budget_bytes})
    saved_keep, saved_limit = set(stage3.keep), stage3.limit
    root = stage3.root
    synced = getattr(root, _SYNCED_GENERATION, False)
    held = []
    try:
        stage3.limit = None if full else stage3.limits(budget_bytes)
        if full:
            stage3.hold_all()
            held.append(True)
            synced_generation(root, False)     # whole: a forward gathers nothing
        elif budget_bytes is not None:
            stage3.keep |= stage3.units_within(budget_bytes)
            stage3.gather_many(sorted(stage3.keep - saved_keep))
        yield model
    finally:
        if held:
            stage3.unhold_all()
            synced_generation(root, synced)
        stage3.keep, stage3.limit = saved_keep, saved_limit
        stage3.release_all()


def iter_full_params(model, bucket_bytes: int = 256 << 20):
    """Yields (name, tensor) for every param of the model, whole. Under
    stage 3 across ranks (a collective: every rank iterates to the end)
    units are gathered a few at a time, up to about bucket_bytes, and
    released once their params were yielded; each tensor stays valid as
    long as the caller holds it."""
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be an int > 0, not {bucket_bytes!r}")
    inner = unwrap_model(model)
    names = {}
    for name, p in inner.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    stage3 = stage3_of(model)
    if stage3 is None:
        for name, p in inner.named_parameters():
            yield name, p.detach()
        return
    stage3.comm.agree("iter_full_params", {"bucket_bytes": bucket_bytes})
    in_units = {id(p) for _, buckets in stage3.units for b in buckets for p in b.params}
    for name, p in inner.named_parameters():
        if id(p) not in in_units:
            yield name, p.detach()
    batch, size = [], 0
    indices = list(range(len(stage3.units)))
    try:
        for position, index in enumerate(indices):
            batch.append(index)
            size += stage3.unit_bytes(index)
            last = position == len(indices) - 1
            if size < bucket_bytes and not last:
                continue
            stage3.gather_many(batch)
            with torch.no_grad():
                for i in batch:
                    for bucket in stage3.units[i][1]:
                        for p in bucket.params:
                            yield names.get(id(p), f"<param {id(p)}>"), p.detach()
            for i in batch:
                stage3.release(i)
            batch, size = [], 0
    finally:
        stage3.release_all()
