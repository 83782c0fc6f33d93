"""Activation checkpointing (reentrant and not) under stages 2 and 3 across
ranks, against torch.optim.AdamW in one process."""
import pytest
import torch

import checkpointing_workers as workers
from rlhfz.launch import run_ranks


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_reentrant_checkpoint_inside_a_unit_reduces_once_per_backward(stage):
    """The first grads of each backward come inside a reentrant checkpoint
    (frozen head, as with LoRA). Its nested backward ending is not the end
    of the backward: stage 3 kept the unit's params for the norm outside
    the checkpoint (it raised: 'weight of shape [0]'), and every checkpointed
    segment reduce-scattered every bucket again (zeros where none came)."""
    steps, world_size = 3, 2
    expected = workers.reference(steps, True)
    results = run_ranks(workers.partly_checkpointed, world_size, stage, True, steps)
    for r in results:
        for name, value in expected.items():
            assert _relative(r["params"][name], value) <= 1e-5, name
        # one reduce-scatter per bucket and backward, as without checkpointing
        assert r["per_backward"] == [r["buckets"]] * steps
        assert r["gathered"] == ([0] * steps if stage == 3 else [])
