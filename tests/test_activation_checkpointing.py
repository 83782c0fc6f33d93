"""Activation checkpointing (reentrant and not) under stages 2 and 3 across
ranks, against torch.optim.AdamW in one process."""
import pytest
import torch

import checkpointing_workers as workers
from rlhfz.launch import run_ranks


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_reentrant_checkpoint_inside_a_unit_reduces_once_per_backward(stage):
    """The first grads of each backward come inside a reentrant checkpoint
    (frozen head, as with LoRA). Its nested backward ending is not the end
    of the backward: stage 3 kept the unit's params for the norm outside
    the checkpoint (it raised: 'weight of shape [0]'), every checkpointed
    segment reduce-scattered every bucket again (zeros where none came), and
    stage 1 averaged every bucket once per segment."""
    steps, world_size = 3, 2
    expected = workers.reference(steps, True)
    results = run_ranks(workers.partly_checkpointed, world_size, stage, True, steps)
    for r in results:
        for name, value in expected.items():
            assert _relative(r["params"][name], value) <= 1e-5, name
        per_backward = r["per_backward"]
        if stage == 1:       # the ranks' p.grad: the same mean after each backward
            per_backward = [count for count, _ in per_backward]
            for (_, mine), (_, theirs) in zip(r["per_backward"], results[0]["per_backward"]):
                assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        # one reduction per bucket and backward, as without checkpointing
        assert per_backward == [r["buckets"]] * steps
        assert r["gathered"] == ([0] * steps if stage == 3 else [])


def _checkpointing(model):
    """Per module: whether it checkpoints, and with what."""
    return [(name, module.gradient_checkpointing,
             getattr(getattr(module, "_gradient_checkpointing_func", None), "keywords", None))
            for name, module in model.named_modules() if hasattr(module, "gradient_checkpointing")]


def test_unwrap_for_generation_gives_back_the_checkpointing_it_found():
    """Inside, no layer checkpoints; after, each layer checkpoints as before,
    with the same options (they were re-enabled with transformers' defaults:
    use_reentrant=True became False, every_n_layers=2 became every layer)."""
    pytest.importorskip("transformers")
    import warnings
    import stage3_workers
    from rlhfz.integrations.trl import unwrap_model_for_generation
    model = stage3_workers.tiny_lm("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True},
                                            every_n_layers=2)
    before = _checkpointing(model)
    assert [flag for _, flag, _ in before if flag] and not all(flag for _, flag, _ in before)
    with unwrap_model_for_generation(model, None) as unwrapped:
        assert unwrapped is model
        assert not any(flag for _, flag, _ in _checkpointing(model))
    assert _checkpointing(model) == before
    try:
        with unwrap_model_for_generation(model, None):
            raise RuntimeError("inference engine crashed")
    except RuntimeError:
        pass
    assert _checkpointing(model) == before
