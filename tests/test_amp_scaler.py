"""torch.amp.GradScaler drives ZeroAdamW as it drives torch.optim.AdamW:
unscaling (also of sharded grads, which param.grad does not hold), Inf/NaN
steps skipped on every rank at once, the same scale after every step."""
import pytest
import torch

from rlhfz.launch import run_ranks

import amp_workers as workers


def _close(a, b):
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def reference():
    return workers.scaled_training(0, 1, None)


@pytest.mark.parametrize("stage", [0, 2])
def test_one_process_follows_torch(reference, stage):
    out = workers.scaled_training(0, 1, stage)
    assert out["scales"] == reference["scales"]
    assert out["skipped"] == 2
    _close(out["params"], reference["params"])


@pytest.mark.parametrize("recipe", ["rlhfz", "torch"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ranks_follow_torch(reference, stage, recipe):
    """recipe "torch": scaler.unscale_(opt) and torch.nn.utils.clip_grad_norm_,
    as a torch script clips, reach the grads in the shards at stages 2 and 3."""
    results = run_ranks(workers.scaled_training, 2, stage, 24, (5, 11), 2, recipe)
    for rank in (0, 1):
        assert results[rank]["scales"] == reference["scales"]
        assert results[rank]["skipped"] == 2
        _close(results[rank]["params"], reference["params"])


@pytest.mark.parametrize("stage, world_size", [(0, 1), (1, 2)])
def test_an_inf_the_scalers_unscale_found_skips_the_step(stage, world_size):
    results = run_ranks(workers.inf_then_clamped, world_size, stage)
    for out in results:
        assert out == {"moved": False, "scale": 2.0 ** 11, "skipped": 1, "state": 0}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_clip_after_the_scalers_unscale_of_sharded_grads_is_refused(stage):
    for out in run_ranks(workers.clip_after_an_unscale_that_reached_nothing, 2, stage):
        assert out["error"] is not None and "optimizer.unscale_(grad_scaler)" in out["error"]
        assert out["unchanged"] and out["state"] == 0


@pytest.mark.parametrize("stage, world_size", [(0, 1), (2, 2)])
def test_a_disabled_scaler_unscales_nothing(stage, world_size):
    assert run_ranks(workers.disabled_scaler, world_size, stage) == [4] * world_size


def test_a_rank_the_scaler_reached_no_grads_on_does_not_unscale_again():
    m = workers.model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    m(x).pow(2).mean().backward()
    # the mean over two ranks, one with no grads; AdamW's first exp_avg is 0.1 of it
    expected = [0.1 * p.grad / 2 for p in m.parameters()]
    for out in run_ranks(workers.a_rank_without_grads, 2):
        for got, want in zip(out.values(), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
