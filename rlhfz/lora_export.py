"""A PEFT LoRA model in the form transformers saves: the adapters folded in.

save_pretrained(..., adapters="merged") writes what merge_and_unload() then
save_pretrained would, without changing the model: each LoRA layer's base
weight plus its active adapters' delta weights (PEFT's own get_delta_weight),
under the base model's names. The adapters' own params are left out.
"""
from __future__ import annotations

import torch


def is_peft(module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def merge_plan(peft_model):
    """(base model, {id(base weight): (layer, adapters)}, ids of the adapters'
    params). Variants PEFT merges differently (DoRA, LoRA biases) are refused."""
    from peft.tuners.lora.layer import LoraLayer
    base = peft_model.get_base_model()
    merges, adapter_params = {}, set()
    for module in base.modules():
        if not isinstance(module, LoraLayer):
            continue
        adapter_params |= {id(p) for name, p in module.named_parameters()
                           if "lora_" in name}
        if getattr(module, "merged", False):
            continue                      # merged in place already: the weight holds it
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        for adapter in adapters:
            if adapter in getattr(module, "lora_variant", {}) or \
                    getattr(module, "lora_bias", {}).get(adapter):
                raise NotImplementedError(
                    f"adapter {adapter!r} is a LoRA variant (DoRA, a LoRA bias) that "
                    f"save_pretrained does not merge: save it with adapters='only'")
        if adapters:
            merges[id(module.get_base_layer().weight)] = (module, adapters)
    return base, merges, adapter_params


def base_name(name: str) -> str:
    """The name transformers gives a weight PEFT wrapped in a LoRA layer."""
    return name.replace(".base_layer.", ".")


def merged(weight: torch.Tensor, layer, adapters) -> torch.Tensor:
    """The base weight with the adapters' deltas added, as PEFT merges them."""
    value = weight.detach().clone()
    for adapter in adapters:
        value += layer.get_delta_weight(adapter).to(value.dtype)
    return value


def adapter_units(layer, unit_of: dict) -> set:
    """Units that hold the layer's adapter params (gathered for a merge)."""
    return {unit_of[id(p)] for name, p in layer.named_parameters()
            if "lora_" in name and id(p) in unit_of}
