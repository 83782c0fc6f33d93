"""The main job (python -m rlhfz demo), shortened."""
import torch

from rlhfz import demo


def test_demo_learns_and_tracks_torch():
    lines = []
    result = demo.run(steps=60, log_every=20, print_fn=lines.append)
    ours, ref = result["losses"]["rlhfz"], result["losses"]["torch"]
    assert ours[-1] < 0.7 * ours[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-4, atol=0)
    assert result["relative_param_diff"] < 1e-3
    assert any("memory report" in line for line in lines)
    assert set(result["memory_report"]) == {"params", "grads", "master", "exp_avg", "exp_avg_sq"}
