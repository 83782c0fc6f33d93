"""ZeroAdamW where torch's ecosystem hands optimizers around: accelerate's
AcceleratedOptimizer wrapper, and torch.distributed.checkpoint's
get/set_optimizer_state_dict. torch.optim.AdamW through the same calls is
the contract."""
import pytest
import torch

import contract_workers as workers
from rlhfz.launch import run_ranks


def _close(ours, theirs, rtol=1e-5, atol=1e-6):
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [0, 2])
def test_accelerate_wraps_it_as_it_wraps_torch_adamw(stage):
    theirs, = run_ranks(workers.accelerated, 1, "torch", 0)
    ours, = run_ranks(workers.accelerated, 1, "rlhfz", stage)
    _close(ours["params"], theirs["params"])
    assert ours["steps"] == theirs["steps"] and ours["lrs"] == theirs["lrs"]


@pytest.mark.parametrize("stage", [0, 2])
def test_dcp_optimizer_state_dict_round_trips_in_one_process(stage):
    theirs, = run_ranks(workers.distributed_checkpoint, 1, "torch", 0)
    ours, = run_ranks(workers.distributed_checkpoint, 1, "rlhfz", stage)
    assert "refused" not in ours, ours.get("refused")
    assert ours["keys"] == theirs["keys"] and ours["groups"] == theirs["groups"]
    _close(ours["resumed"], ours["continued"], rtol=0, atol=0)
    _close(ours["resumed"], theirs["resumed"])


def test_dcp_optimizer_state_dict_round_trips_across_ranks_at_stage_2():
    for rank, ours in enumerate(run_ranks(workers.distributed_checkpoint, 2, "rlhfz", 2)):
        assert "refused" not in ours, ours.get("refused")
        assert ours["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"], rank
        _close(ours["resumed"], ours["continued"], rtol=0, atol=0)


def test_dcp_into_a_fresh_stage_3_optimizer_is_refused_clearly():
    """DCP initializes a fresh optimizer's state with a step on zero grads
    made by zeros_like(param): at stage 3, outside a forward, a param is a
    0-element placeholder, so that grad cannot be taken as the param's."""
    for outcome in run_ranks(workers.distributed_checkpoint, 2, "rlhfz", 3):
        assert outcome["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert "placeholder" in outcome.get("refused", ""), outcome.get("refused")
        assert "load_state_dict" in outcome["refused"]
