"""A PEFT LoRA model in the form transformers saves: the adapters folded in.

save_pretrained(..., adapters="merged") writes what merge_and_unload() then
save_pretrained would, without changing the model: each LoRA layer's base
weight plus its active adapters' delta weights (PEFT's own get_delta_weight),
under the base model's names, and each modules_to_save module's copy in use
in place of the original. The adapters' own params are left out. What PEFT
merges some other way is refused, never left out.
"""
from __future__ import annotations

import torch


def is_peft(module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def _refused(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what}, which rlhfz does not merge as PEFT does: send or save "
                               f"it with adapters='only', or merge_and_unload() first")


def _mergeable_layers() -> tuple:
    """The LoRA layers whose merge is the base weight plus get_delta_weight."""
    from peft.tuners.lora import layer
    return tuple(getattr(layer, name) for name in ("Linear", "Embedding", "Conv1d", "Conv2d",
                                                   "Conv3d") if hasattr(layer, name))


def _mergeable_adapters(name: str, module) -> list:
    """The active adapters of a LoRA layer not merged into it yet (as
    merge_and_unload picks them), once the layer is one merged as the base
    weight plus get_delta_weight."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    if type(module) not in _mergeable_layers():
        raise _refused(f"{name} is a {type(module).__module__}.{type(module).__qualname__}")
    if isinstance(module.base_layer, BaseTunerLayer):
        raise _refused(f"{name} holds one PEFT layer inside another")
    if getattr(module.get_base_layer(), "groups", 1) != 1:
        raise _refused(f"{name} is a grouped convolution")
    adapters = [a for a in module.active_adapters
                if (a in module.lora_A or a in module.lora_embedding_A)
                and a not in module.merged_adapters]
    for adapter in adapters:
        if adapter in getattr(module, "lora_variant", {}) or \
                getattr(module, "lora_bias", {}).get(adapter):
            raise _refused(f"adapter {adapter!r} of {name} is a LoRA variant (DoRA, a LoRA bias)")
    return adapters


def merge_plan(peft_model):
    """(base model, {id(base weight): (layer, adapters)}, rename): rename(name)
    is the name a tensor of the base model's state dict takes once merged
    (as merge_and_unload leaves it), or None for one it drops: the adapters'
    own, and the copies of a modules_to_save module not in use."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
    config = getattr(peft_model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        raise _refused(f"the model's adapter is a prompt ({config.peft_type})")
    base = peft_model.get_base_model()
    merges = {}
    moves = {}              # {module prefix: the prefix its tensors take, or None: dropped}
    wrappers = ()           # modules_to_save prefixes: what lies in them is decided there
    for name, module in base.named_modules():
        prefix = name + "."
        if isinstance(module, ModulesToSaveWrapper):
            # the copy forward uses: the active adapter's, else the original
            active = [a for a in module.active_adapters if a in module.modules_to_save]
            kept = module.modules_to_save[active[0]] if active else module.original_module
            if any(isinstance(m, BaseTunerLayer) for m in kept.modules()):
                raise _refused(f"{name} is a modules_to_save module with PEFT layers in it")
            moves[prefix] = None
            moves[prefix + (f"modules_to_save.{active[0]}." if active else "original_module.")] = \
                prefix
            wrappers += (prefix,)
        elif isinstance(module, AuxiliaryTrainingWrapper):
            raise _refused(f"{name} is a {type(module).__module__}.{type(module).__qualname__}")
        elif isinstance(module, BaseTunerLayer) and not name.startswith(wrappers):
            adapters = _mergeable_adapters(name, module)
            moves[prefix] = None
            moves[prefix + "base_layer."] = prefix
            if adapters:
                merges[id(module.get_base_layer().weight)] = (module, adapters)

    def rename(tensor_name: str) -> str | None:
        """The longest module prefix that moves decides."""
        parts = tensor_name.split(".")
        for end in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:end]) + "."
            if prefix in moves:
                to = moves[prefix]
                return None if to is None else to + tensor_name[len(prefix):]
        return tensor_name
    return base, merges, rename


def merged(weight: torch.Tensor, layer, adapters) -> torch.Tensor:
    """The base weight with the adapters' deltas added, as PEFT merges them
    (merge_and_unload's merge): an embedding's delta is cast to the
    weight's dtype first; a linear or convolution layer's is added as it
    is, so fp32 adapters on a bf16 base (PEFT's autocast_adapter_dtype) are
    added in fp32 and rounded once."""
    from peft.tuners.lora import layer as lora_layer
    cast_first = isinstance(layer, lora_layer.Embedding)
    value = weight.detach().clone()
    with torch.no_grad():
        for adapter in adapters:
            delta = layer.get_delta_weight(adapter)
            value += delta.to(value.dtype) if cast_first else delta
    return value


def active_adapter_names(peft_model) -> set:
    """The state-dict names of the tensors a PEFT model's active adapters
    hold: their own weights (`<prefix>*.<adapter>`, e.g. lora_A.default)
    and the modules_to_save copies in use (modules_to_save.<adapter>)."""
    # the tuner's (LoraModel: "lora_"), of a PeftModel or of the tuner itself
    prefix = getattr(getattr(peft_model, "base_model", None), "prefix", None)
    if not isinstance(prefix, str):
        prefix = getattr(peft_model, "prefix", None)
    prefix = prefix if isinstance(prefix, str) and prefix else None
    active = set(getattr(peft_model, "active_adapters", None) or ())
    names = set()
    for name in peft_model.state_dict(keep_vars=True):
        parts = name.split(".")
        if any(part in active and (parts[i - 1] == "modules_to_save"
                                   or (prefix and parts[i - 1].startswith(prefix)))
               for i, part in enumerate(parts) if i):
            names.add(name)
    return names


def adapter_units(layer, unit_of: dict) -> set:
    """Units that hold the layer's adapter params (gathered for a merge)."""
    return {unit_of[id(p)] for name, p in layer.named_parameters()
            if "lora_" in name and id(p) in unit_of}
