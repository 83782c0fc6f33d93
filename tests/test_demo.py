"""The main job (python -m rlhfz demo), shortened: 2 gloo ranks, stage 2."""
import pytest
import torch

from rlhfz import demo


def test_demo_learns_tracks_torch_and_shards_memory():
    lines = []
    result = demo.run(steps=60, log_every=20, print_fn=lines.append)
    ours, ref = result["losses"]["rlhfz"], result["losses"]["torch"]
    assert ours[-1] < 0.7 * ours[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-4, atol=0)
    assert result["relative_param_diff"] < 1e-3
    assert any("memory owned by ZeroAdamW" in line for line in lines)
    total = lambda report: sum(sum(t.values()) for t in report.values())
    unsharded = total(result["unsharded_memory_report"])
    for report in result["rank_memory_reports"]:
        assert total(report) < unsharded
        assert report["exp_avg"]["host"] <= 0.51 * result["unsharded_memory_report"]["exp_avg"]["host"]


def test_a_short_demo_averages_the_steps_it_took():
    """Fewer than 10 steps: the mean is over the steps there are (a sum
    over 3 divided by 10 read as learning whatever the losses were)."""
    lines = []
    result = demo.run(steps=3, log_every=1, print_fn=lines.append)
    losses = result["losses"]["rlhfz"]
    summary = next(line for line in lines if "mean of the last" in line)
    assert f"-> {sum(losses) / 3:.3f} (mean of the last 3)" in summary, summary


@pytest.mark.parametrize("arguments, message", [
    ({"steps": 1}, "needs at least 2 steps"),
    ({"stage": 0, "world_size": 2}, "stage 0 does not shard"),
    ({"batch_size": 5, "world_size": 2}, "does not divide over 2 ranks"),
])
def test_a_run_the_demo_cannot_make_is_refused_before_training(arguments, message):
    with pytest.raises(ValueError, match=message):
        demo.run(print_fn=None, **arguments)


def _without_weight_decay(zero_adamw):
    """ZeroAdamW with a quiet defect: its groups' weight decay dropped."""
    class Broken(zero_adamw):
        def __init__(self, params, **options):
            super().__init__([dict(group, weight_decay=0.0) for group in params], **options)
    return Broken


def test_the_demo_fails_when_zero_adamw_does_not_match_torch(monkeypatch, capsys):
    """The loss falls all the same; the params compared with torch's after
    20 steps are what catch it, in the library and on the command line."""
    import rlhfz
    from rlhfz.__main__ import main
    monkeypatch.setattr(rlhfz, "ZeroAdamW", _without_weight_decay(rlhfz.ZeroAdamW))
    with pytest.raises(demo.DemoCheckFailed, match="does not match torch.optim.AdamW: after "
                                                   "step 20 the params differ by"):
        demo.run(steps=20, world_size=1, print_fn=lambda *a: None)
    assert main(["demo", "--steps", "20", "--world-size", "1"]) == 1
    err = capsys.readouterr().err
    assert "python -m rlhfz demo: error: ZeroAdamW does not match" in err and "Traceback" not in err


def test_the_demo_checks_the_params_early_and_reports_the_last_step_too():
    lines = []
    result = demo.run(steps=25, world_size=1, print_fn=lines.append)
    summary = next(line for line in lines if "params differ" in line)
    assert f"by {result['checked_param_diff']:.2e} relative (L2) after step 20" in summary
    assert f"by {result['relative_param_diff']:.2e} after step 25" in summary
    assert result["checked_param_diff"] < 1e-4
