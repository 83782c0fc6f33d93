"""Hybrid sharding over a 2-D DeviceMesh: 4 gloo ranks as 2 replicas of 2
shard ranks, against one process of torch.optim.AdamW on the same global
batches; what crosses the replicate dimension, counted by the communicator;
checkpoints across layouts."""
import pytest
import torch

import dist_workers
import hybrid_workers as workers
import rlhfz
from rlhfz.launch import run_ranks
from test_distributed import _reference as mlp_reference
from test_stage3 import _reference_training as lm_reference, _relative

STEPS = 50
# alignment padding: each bucket rounds up to 64 bytes per rank (16 fp32 elements)
PAD_PER_BUCKET = 16 * 2


def _check_common(results, parity_params):
    """Replicas hold the same shards; each rank holds half of the state."""
    by_coords = {r["coords"]: r for r in results}
    assert sorted(by_coords) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for shard in (0, 1):
        mine, theirs = by_coords[(0, shard)], by_coords[(1, shard)]
        for a, b in zip(mine["shard_state"], theirs["shard_state"]):
            assert torch.equal(a, b)
    for result in results:
        padded, numel = result["padded"], result["numel"]
        assert 0 <= padded - numel <= PAD_PER_BUCKET * result["buckets"]
        # per rank: half of every bucket (total/2 + pad); fp32 params are
        # their own master but where a host part steps on a copy
        state = result["state_bytes"]
        assert state["exp_avg"] == state["exp_avg_sq"] == padded // 2 * 4
        assert state["master"] == result["host_master_bytes"]
        parity_params(result)


def _crossing(result):
    """Per step across the replicate dimension: one all-reduce of the grad shard, no gathers."""
    across = result["traffic"]["replicate"]
    assert across == {"reduce_scatter": 0, "all_gather": 0, "gather": 0,
                      "all_reduce": result["grad_shard_bytes"]}
    assert result["traffic"]["shard"]["all_gather"] > 0


@pytest.mark.parametrize("stage,options", [(1, {"offload": "cpu", "offload_ratio": 0.5}),
                                           (2, {"bucket_bytes": 16 << 10})])
def test_hybrid_stages_1_and_2_match_torch_adamw(stage, options):
    ref_losses, ref_params, ref_sd = mlp_reference(STEPS, clip=1.0)
    results = run_ranks(workers.mlp_parity, 4, stage, STEPS, options)

    def parity(result):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        for a, b in zip(result["params"], ref_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        sd = result["state_dict"]
        for key, entry in ref_sd["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                atol = 1e-6 * entry[name].abs().max().item()
                torch.testing.assert_close(sd["state"][key][name], entry[name], rtol=1e-5,
                                           atol=atol)
            assert sd["state"][key]["step"].item() == entry["step"].item()
        assert set(result["placement"].values()) == {"host"}
        # stage 1 too: its whole grads are reduced within the group, their
        # shard averaged across replicas, and gathered back within the group
        _crossing(result)

    _check_common(results, parity)
    for result in results[1:]:
        for a, b in zip(result["params"], results[0]["params"]):
            assert torch.equal(a, b)
    # one file per rank, every replica's included, reads back whole
    shards = [result["sharded"] for result in results]
    single = rlhfz.ZeroAdamW(dist_workers.groups(dist_workers.make_model()), lr=1e-3)
    single.load_sharded_state_dict(shards)
    for key, entry in single.state_dict()["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, results[0]["state_dict"]["state"][key][name]), (key, name)
    halves = [r["sharded"] for r in results if r["coords"] in ((0, 0), (1, 1))]
    with pytest.raises(ValueError, match="every rank's part exactly once"):
        single.load_sharded_state_dict(halves)


def test_hybrid_stage3_matches_torch_adamw_and_generates():
    ref_losses, ref_params, _ = lm_reference("gpt2", STEPS, False)
    fresh = workers.greedy(workers.tiny_lm("gpt2").eval())     # 8 new tokens
    results = run_ranks(workers.lm_parity, 4, STEPS, {})

    def parity(result):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        names = sorted(ref_params)
        mine = torch.cat([result["params"][n].reshape(-1) for n in names])
        theirs = torch.cat([ref_params[n].detach().reshape(-1) for n in names])
        assert _relative(mine, theirs) <= 1e-5
        assert torch.equal(result["before"], fresh)
        _crossing(result)

    _check_common(results, parity)
    for result in results:
        for mode, tokens in result["after"].items():
            assert torch.equal(tokens, results[0]["after"]["full"]), mode
        for name, value in result["params"].items():
            assert torch.equal(value, results[0]["params"][name])


def test_checkpoints_reshard_between_hybrid_and_plain_layouts(tmp_path):
    from checkpoint_workers import load_and_continue
    from test_checkpoint import assert_equal
    hybrid, plain = str(tmp_path / "hybrid"), str(tmp_path / "plain")
    results = run_ranks(workers.checkpoint_layouts, 4, hybrid, plain)
    first = results[0]
    for result in results:
        assert_equal(result["hybrid_saved"], first["hybrid_saved"])
        assert_equal(result["plain_loaded"], first["hybrid_saved"])
        assert_equal(result["hybrid_loaded"], first["hybrid_saved"])
        assert result["client"] == {"step": 3}
        # sums over other groupings round differently
        for final in ("plain_final", "hybrid_again_final"):
            assert_equal(result[final]["params"], first["hybrid_final"]["params"], atol=1e-4)
    # the first replica wrote them: one file per shard rank
    import json
    with open(f"{hybrid}/index.json") as f:
        index = json.load(f)
    assert index["world_size"] == 2 and len(index["files"]) == 2
    # the hybrid run's files hold 2 shards; one process reads them too
    single = load_and_continue(0, 1, hybrid, "gpt2", 2, torch.float32, {})
    assert_equal(single["loaded"], first["hybrid_saved"])


def test_meshes_are_checked_and_a_1d_mesh_is_a_process_group():
    results = run_ranks(workers.mesh_arguments, 2)
    outside = results[1]["errors"]["outside"]
    assert outside.startswith("ValueError") and "rank 1 is not in the device_mesh" in outside
    for result in results:
        errors = result["errors"]
        assert errors["not_a_mesh"].startswith("TypeError") and "DeviceMesh" in errors["not_a_mesh"]
        assert "('dp', 'fsdp')" in errors["names"] and "('replicate', 'shard')" in errors["names"]
        assert "3 dimensions" in errors["three_dims"]
        assert "DistributedDataParallel" in errors["one_shard_rank"]
        assert "not both" in errors["both"]
        assert errors["nccl"].startswith("ValueError") and "collectives=" in errors["nccl"]
        assert "device_mesh differs" in errors["other_mesh"]
        trained = result["trained"]
        for a, b, c in zip(trained["line"], trained["unnamed_row"], trained["group"]):
            assert torch.equal(a, c) and torch.equal(b, c)
        assert trained["line_dims"] == trained["group_dims"] == ["shard"]


def test_a_mesh_whose_groups_torch_numbers_across_the_layout_is_refused():
    results = run_ranks(workers.crossed_meshes, 4)
    for result in results:
        for what, error in result["refused"].items():
            assert error is not None and "ascending order" in error, (what, error)
        trained = list(result["trained"].values())
        for other in trained[1:]:
            for a, b in zip(trained[0], other):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for rank in range(1, 4):          # replicas alike
        for a, b in zip(results[0]["trained"]["[[0, 1], [2, 3]]"],
                        results[rank]["trained"]["[[0, 1], [2, 3]]"]):
            assert torch.equal(a, b)
