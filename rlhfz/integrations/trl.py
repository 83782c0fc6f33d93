"""TRL's unwrap_model_for_generation, on rlhfz's stage 3.

Same signature and meaning as trl.models.utils.unwrap_model_for_generation:
the model comes out of its accelerate / DDP wrappers, gradient checkpointing
is off while it generates, gather_deepspeed3_params=True gathers the whole
model for the context (False: stays sharded, gathered unit by unit), and
generation_kwargs override the generation config for the context. Unlike
TRL's, everything is restored when the block raises.

zero_sync_callbacks(handler) gives TRL's SyncRefModelCallback (sync_ref_model)
rlhfz's blend where either model is sharded: TRL's own mixes p.data param by
param, which for a sharded param is an empty placeholder.
"""
from __future__ import annotations

import contextlib
import functools

from ..generation import gather_for_generation, stage3_of, unwrap_model
from ..model_state import blend_params


@functools.lru_cache(maxsize=None)
def _sync_callback_class():
    from trl.trainer.callbacks import SyncRefModelCallback

    class ZeroSyncRefModelCallback(SyncRefModelCallback):
        """TRL's SyncRefModelCallback; with a sharded policy or reference
        model, the blend runs shard by shard on every rank."""

        @staticmethod
        def sync_target_model(model, target_model, alpha):
            if stage3_of(model) is None and stage3_of(target_model) is None:
                return SyncRefModelCallback.sync_target_model(model, target_model, alpha)
            blend_params(target_model, model, alpha)

    return SyncRefModelCallback, ZeroSyncRefModelCallback


def zero_sync_callbacks(handler) -> None:
    """TRL's SyncRefModelCallback among a Trainer's callbacks (its
    CallbackHandler) replaced by one that can blend sharded models."""
    try:
        trl_class, zero_class = _sync_callback_class()
    except ImportError:          # no TRL: no such callback
        return
    for i, callback in enumerate(handler.callbacks):
        if type(callback) is trl_class:
            handler.callbacks[i] = zero_class(ref_model=callback.ref_model,
                                              accelerator=callback.accelerator)


@contextlib.contextmanager
def _generation_config(model, generation_kwargs):
    if generation_kwargs is None or not hasattr(model, "generation_config"):
        yield
        return
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    from transformers import GenerationConfig
    original = target.generation_config
    config = GenerationConfig.from_dict(original.to_dict())
    config.update(**generation_kwargs)
    target.generation_config = config
    try:
        yield
    finally:
        target.generation_config = original


@contextlib.contextmanager
def unwrap_model_for_generation(model, accelerator=None, gather_deepspeed3_params: bool = True,
                                generation_kwargs: dict | None = None):
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else unwrap_model(model)
    unwrapped = unwrap_model(unwrapped)
    # transformers' modules checkpoint where their gradient_checkpointing
    # flag is set: turned off here and back on at the end, each module keeps
    # the options it was enabled with (use_reentrant, every_n_layers,
    # offload). Disabling and re-enabling through the model would re-enable
    # with transformers' defaults instead.
    checkpointing = [m for m in unwrapped.modules() if getattr(m, "gradient_checkpointing", False)
                     is True]
    for module in checkpointing:
        module.gradient_checkpointing = False
    try:
        with gather_for_generation(unwrapped, enabled=bool(gather_deepspeed3_params)), \
                _generation_config(unwrapped, generation_kwargs):
            yield unwrapped
    finally:
        for module in checkpointing:
            module.gradient_checkpointing = True
