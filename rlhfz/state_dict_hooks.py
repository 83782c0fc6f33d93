"""model.state_dict() and load_state_dict() on a sharded model: real
tensors, not placeholders.

A stage-3 param is an empty placeholder between uses, so torch's own
state_dict would hand out placeholders. The hooks installed here, on every
module that holds sharded params, gather the real tensors instead, unit by
unit, which makes model.state_dict() a collective that every rank calls.
With keep_vars=True the params themselves come back, as torch gives them.

model.load_state_dict(whole tensors) writes each rank's part of every
sharded param into its shards (no collective: every rank loads its own
copy of the dict, as every rank of a DDP model does); torch's own copy then
meets the placeholder, which it leaves as it is.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref

import torch

_DEPTH = threading.local()


def gathered_values(record, ids: set, keep: bool, call: str) -> dict[int, torch.Tensor]:
    """{id(param): whole CPU copy} for the sharded params in ids (a
    collective: every rank gathers the units that hold them, one at a time,
    and keeps copies only with keep)."""
    stage3 = record.stage3
    record.comm.agree(call, {"params": len(ids)})
    out = {}
    with torch.no_grad():
        for index, (_, buckets) in enumerate(stage3.units):
            if not any(id(p) in ids for b in buckets for p in b.params):
                continue
            stage3.gather_many([index])
            try:
                if keep:
                    for bucket in buckets:
                        for p in bucket.params:
                            if id(p) in ids:
                                out[id(p)] = p.detach().to("cpu", copy=True)
            finally:
                stage3.release(index)
    return out


@contextlib.contextmanager
def placeholders_kept():
    """Within it, state_dict() of a sharded module gathers nothing (no
    collective) and leaves placeholders: for a caller on one rank that reads
    the keys alone, such as PEFT's save given the values it writes."""
    _DEPTH.kept = getattr(_DEPTH, "kept", 0) + 1
    try:
        yield
    finally:
        _DEPTH.kept -= 1


def install_hooks(record) -> None:
    """State-dict hooks on every module that holds sharded params (and the
    model): the outermost call gathers what its dict holds as placeholders."""
    ref = weakref.ref(record)
    owners = {id(p) for p in record.model.parameters()}
    for module in record.model.modules():
        if module is record.model or any(id(p) in owners
                                          for p in module.parameters(recurse=False)):
            module.register_state_dict_pre_hook(_enter)
            module.register_state_dict_post_hook(_gather_placeholders(ref))
            module.register_load_state_dict_pre_hook(_load_into_shards(ref))


def _enter(module, prefix, keep_vars) -> None:
    stack = getattr(_DEPTH, "stack", None)
    if stack is None:
        stack = _DEPTH.stack = []
    if _state_dict_calls() <= 1:
        # the outermost call: what is on the stack was left by a call that
        # raised midway, and would make this one look like an inner call
        stack.clear()
    stack.append(bool(keep_vars))


_STATE_DICT_CODE = torch.nn.Module.state_dict.__code__


def _state_dict_calls() -> int:
    """How many Module.state_dict calls this thread is inside now."""
    count, frame = 0, sys._getframe(1)
    while frame is not None:
        count += frame.f_code is _STATE_DICT_CODE
        frame = frame.f_back
    return count


def _gather_placeholders(ref):
    def hook(module, state_dict, prefix, local_metadata) -> None:
        stack = _DEPTH.stack
        keep_vars = stack.pop()
        record = ref()
        if stack or keep_vars or record is None or record.stage3 is None or \
                getattr(_DEPTH, "kept", 0):
            return                   # an inner call, or the params themselves wanted
        slots = record.sharded_slots()
        pending = {}
        for name, p in module.named_parameters(prefix=prefix.rstrip("."),
                                               remove_duplicate=False):
            value = state_dict.get(name)
            if value is None or id(p) not in slots:
                continue
            bucket, index = slots[id(p)]
            if value.numel() != bucket.layout.slots[index].numel:
                pending[name] = p
        if not pending:
            return
        try:
            record.state_dict_control.agree("model.state_dict", {"params": len(pending)})
        except Exception as error:         # noqa: BLE001 (what to do instead, with the cause)
            raise RuntimeError(
                "model.state_dict() of a sharded model gathers its params, so every rank "
                "must call it; a save from one rank alone cannot. Call "
                "rlhfz.full_state_dict(model) on every rank (rank 0 gets the tensors), or "
                "rlhfz.save_pretrained / rlhfz.save_checkpoint, which every rank calls. "
                f"({error})") from error
        values = gathered_values(record, {id(p) for p in pending.values()}, True,
                                 "model.state_dict")
        for name, p in pending.items():
            state_dict[name] = values[id(p)].to(p.device)
    return hook


def _load_into_shards(ref):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
             unexpected_keys, error_msgs) -> None:
        record = ref()
        if record is None or record.stage3 is None:
            return
        slots = record.sharded_slots()
        loads = {}
        for name, p in module.named_parameters(recurse=False):
            key = prefix + name
            value = state_dict.get(key)
            if value is None or id(p) not in slots:
                continue
            bucket, index = slots[id(p)]
            if bucket.gathered is not None:
                continue             # whole now: torch copies into it, release keeps it
            whole = torch.Size(bucket.layout.slots[index].shape)
            shape = value.shape if isinstance(value, torch.Tensor) else None
            if local_metadata.get("assign_to_params_buffers") and id(p) in record.trained:
                error_msgs.append(
                    f"{key}: load_state_dict(assign=True) would give the module a new, whole "
                    f"Parameter that no optimizer trains (torch's AdamW would not train it "
                    f"either), while the sharded one went on training unused: load without "
                    f"assign=True, which writes the values into the shards")
            elif shape != whole:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{shape} from checkpoint, the shape in current model is "
                                  f"{whole}.")
            else:
                loads.setdefault(id(bucket), (bucket, []))[1].append((index, value))
            # torch copies the placeholder onto itself (with assign=True it sets
            # the same Parameter again), so its own size check passes
            state_dict[key] = p
        for bucket, values in loads.values():
            bucket.load_whole(values)
    return hook
