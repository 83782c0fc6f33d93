"""torch.compile of a model that ZeroAdamW trains, at every stage: 20 steps
against eager torch.optim.AdamW. Stage 3's hooks run eagerly between graphs
(a graph break at each unit's edges). CI compiles with aot_eager; inductor
takes minutes on 2 cores and is marked slow."""
import pytest
import torch

import sharding_workers as workers
from rlhfz.launch import run_ranks

pytest.importorskip("transformers")

STEPS = 20


@pytest.mark.parametrize("stage, world_size", [(0, 1), (1, 2), (2, 2), (3, 2)])
def test_compiled_model_trains_like_eager_torch_adamw(stage, world_size):
    _check(stage, world_size, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("stage, world_size", [(2, 2), (3, 2)])
def test_inductor_compiled_model_trains_like_eager_torch_adamw(stage, world_size):
    _check(stage, world_size, "inductor")


def _check(stage, world_size, backend):
    ref_losses, ref_state = workers.reference_training(lambda m: m.parameters(), STEPS)
    if world_size == 1:
        result = workers.compiled_training(0, 1, stage, STEPS, backend)
    else:
        result = run_ranks(workers.compiled_training, world_size, stage, STEPS, backend,
                           timeout=1800)[0]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                               rtol=1e-4, atol=0)
    names = sorted(ref_state)
    mine = torch.cat([result["full"][n].reshape(-1) for n in names])
    theirs = torch.cat([ref_state[n].reshape(-1) for n in names])
    assert float((mine - theirs).norm() / theirs.norm()) <= 1e-4
