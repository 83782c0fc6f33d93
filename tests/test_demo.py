"""The main job (python -m rlhfz demo), shortened: 2 gloo ranks, stage 2."""
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
