"""Sharding across processes: gloo ranks, world sizes 1 to 4, against one
process of torch.optim.AdamW on the same global batches."""
import math
import os

import pytest
import torch

import dist_workers as workers
import rlhfz
from rlhfz.launch import run_ranks

STEPS = 50


def _reference(steps, clip=None):
    model = workers.make_model()
    opt = torch.optim.AdamW(workers.groups(model), lr=1e-3)
    data = workers.batches(steps)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()], opt.state_dict()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stages_match_single_process_adamw(world_size, stage):
    """50 steps; stage 2 with small buckets (several per group, so reduction
    order and overlap are exercised) and two micro-batches per step."""
    ref_losses, ref_params, ref_sd = _reference(STEPS, clip=1.0)
    if stage == 1:
        results = run_ranks(workers.stage_parity, world_size, STEPS, 1.0, 1)
    else:
        results = run_ranks(workers.stage_parity, world_size, STEPS, 1.0, 2, 2, 16 << 10)
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        for a, b in zip(result["params"], ref_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        # the consolidated state dict is torch's, on every rank
        sd = result["state_dict"]
        assert sorted(sd["state"]) == sorted(ref_sd["state"])
        for key, entry in ref_sd["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                # the first moment cancels where grads change sign: scale atol
                # to the tensor's magnitude
                atol = 1e-6 * entry[name].abs().max().item()
                torch.testing.assert_close(sd["state"][key][name], entry[name],
                                           rtol=1e-5, atol=atol)
            assert sd["state"][key]["step"].item() == entry["step"].item()
    # params are identical on every rank (all-gathered after each step)
    for result in results[1:]:
        for a, b in zip(result["params"], results[0]["params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_stage1_shards_optimizer_state(world_size):
    results = run_ranks(workers.stage_parity, world_size, 2, None)
    numel = results[0]["numel"]
    total = 8 * numel                          # exp_avg + exp_avg_sq, fp32, unsharded
    pad = 64                                   # one alignment unit, bytes
    for result in results:
        report = result["report"]
        state = sum(report[k]["host"] for k in ("exp_avg", "exp_avg_sq", "master"))
        assert state <= 1.02 * total / world_size + pad * 2 * result["buckets"], \
            (state, total / world_size)


def test_resume_at_other_world_sizes(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    before, after = 25, 25
    expected = run_ranks(workers.save_then_continue, 2, path, before, after)[0]
    for world_size in (1, 3, 4):
        results = run_ranks(workers.load_then_continue, world_size, path, before, after)
        for a, b in zip(results[0], expected):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("what,calls", [
    ("state_dict_vs_step", ("ZeroAdamW.state_dict", "ZeroAdamW.step")),
    ("clip_vs_step", ("ZeroAdamW.clip_grad_norm_", "ZeroAdamW.step")),
])
def test_inconsistent_collective_calls_name_both_calls(what, calls):
    """Each rank's error names its own call and the other rank's."""
    messages = run_ranks(workers.mismatched_calls, 2, what, timeout=120)
    for rank, message in enumerate(messages):
        assert message is not None, messages
        assert "ranks disagree" in message
        assert f"rank {rank} is in {calls[rank]}" in message, message
        assert f"rank {1 - rank} is in {calls[1 - rank]}" in message, message


def test_a_rank_that_never_arrives_fails_within_the_timeout():
    messages = run_ranks(workers.mismatched_calls, 2, "absent", timeout=120)
    assert messages[1] is None
    assert "rank 0 entered ZeroAdamW.step" in messages[0]
    assert "not every rank of the 2 did within 5 s" in messages[0]


@pytest.mark.parametrize("what,differs", [
    ("stage", "'stage': 2"), ("bucket_bytes", "'bucket_bytes': 1048576"),
    ("wrap", "torch.nn.modules.linear.Linear"),
])
def test_ranks_that_build_differently_are_told_what_differs(what, differs):
    """Options that shape the collectives (stage, bucket sizes, stage-3
    units) are agreed when the optimizer or sharded model is built: a
    mismatch was a timeout in the first backward, naming a reduce-scatter."""
    results = run_ranks(workers.built_differently, 2, what, timeout=120)
    for rank, result in enumerate(results):
        assert result is not None, results
        kind, message = result
        assert kind == "CollectiveMismatchError" and "ranks disagree" in message, message
        assert differs in message, message


def test_a_rank_that_builds_another_optimizer_alone_is_told_so():
    results = run_ranks(workers.built_differently, 2, "second_optimizer", timeout=120)
    assert results[1] is None
    kind, message = results[0]
    assert kind == "CollectiveMismatchError", message
    assert "could not make rlhfz's group" in message and "same order" in message, message


def test_run_ranks_says_what_happened_to_the_ranks():
    """Ranks that raised are not said to be late, and a rank whose process
    ended without a result is named with its exit code."""
    with pytest.raises(RuntimeError) as raised:
        run_ranks(workers.raise_or_exit, 2, {}, timeout=120)
    message = str(raised.value)
    assert message.startswith("world 2: ranks [0, 1] raised\n"), message
    assert "within" not in message and "rank 1 refuses" in message
    with pytest.raises(RuntimeError) as raised:      # one rank: no peer to fail beside it
        run_ranks(workers.raise_or_exit, 1, {0: 3}, timeout=120)
    message = str(raised.value)
    assert message == ("world 1: ranks [0] gave no result: their processes ended "
                       "(exit codes [3])"), message


def test_run_ranks_gives_each_rank_its_local_rank(monkeypatch):
    """All of run_ranks' ranks are on this machine: LOCAL_RANK is the rank,
    as torchrun sets it, and RLHFZ_SIM_DEVICE=local_rank puts each rank on
    the simulated device of that number (NCCL takes no two ranks on one)."""
    from rlhfz.engine.backends import simulated_device
    monkeypatch.setenv("LOCAL_RANK", "7")            # the caller's own is not the ranks'
    assert run_ranks(workers.local_rank_and_device, 3) == [("0", 0), ("1", 1), ("2", 2)]
    monkeypatch.setenv("RLHFZ_SIM_DEVICE", "local_rank")
    assert simulated_device() == 7
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match="RLHFZ_SIM_DEVICE=local_rank needs LOCAL_RANK"):
        simulated_device()
    monkeypatch.setenv("RLHFZ_SIM_DEVICE", "first")
    with pytest.raises(ValueError, match="a device ordinal or 'local_rank', not 'first'"):
        simulated_device()


@pytest.mark.parametrize("stage", [2, 3])
def test_every_rank_starts_from_the_first_ranks_values(stage):
    results = run_ranks(workers.start_from_first_rank, 3, stage)
    expected = list(workers.make_model(seed=0).parameters())
    for params in results:
        assert len(params) == len(expected)
        for got, want in zip(params, expected):
            assert torch.equal(got, want.detach())


def test_ranks_with_different_models_fail_at_construction():
    messages = run_ranks(workers.differently_shaped_models, 2, timeout=120)
    for rank, message in enumerate(messages):
        assert message is not None and "ZeroAdamW.add_param_group" in message, messages


def test_close_releases_the_optimizers_process_groups():
    for sockets in run_ranks(workers.sockets_after_close, 3):
        made = sockets["during"] - sockets["before"]
        assert made, sockets                           # the optimizer's own groups
        # none of them is left, nor any other new one (the default group's
        # connections may come and go with gloo's own timing)
        assert not sockets["after"] - sockets["before"], sockets


def test_a_collective_left_in_flight_is_finished_before_exit():
    """Else a gloo thread finishing it during interpreter shutdown needs the
    GIL to drop its tensors and aborts the process (SIGABRT, not exit 1)."""
    for result in run_ranks(workers.abandoned_collective_drained_at_exit, 2):
        assert result == {"tracked": 1, "after_sync": 0, "after_drain": 0, "gathered": True}


def test_stage2_holds_no_full_grads():
    """Stage 2 keeps grad shards and two staging slots of at most the bucket
    cap (a larger param goes through them in pieces): never the model's full
    grads."""
    cap = 16 << 10
    results = run_ranks(workers.stage_parity, 2, 2, None, 2, 1, cap)
    for result in results:
        grads = result["report"]["grads"]["host"]
        assert result["max_bucket_bytes"] > cap          # the first weight: pieced
        slot = min(result["max_bucket_bytes"], cap) // 4
        expected = result["shard_grad_bytes"] + 2 * slot * 4
        assert grads == expected, (grads, expected)
        assert result["shard_grad_bytes"] <= 1.02 * 4 * result["numel"] / 2 + 64 * result["buckets"]


def test_bucket_bytes_is_the_cap_on_buckets_and_staging():
    """ZeroAdamW(bucket_bytes=) splits groups into buckets of about that
    size and bounds staging by it, params larger than it included; the
    losses do not depend on it."""
    default, small = (run_ranks(workers.bucket_cap, 2, cap) for cap in (None, 8192))
    for ours, theirs in zip(small, default):
        assert ours["buckets"] > theirs["buckets"]
        assert ours["grads"] <= ours["shard_grad_bytes"] + 2 * 8192 + 8192 // 2
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]),
                                   rtol=1e-6, atol=0)
    model = workers.make_model()
    for bad in (100, 1.5, True, "32MB"):
        with pytest.raises(ValueError, match="bucket_bytes"):
            rlhfz.ZeroAdamW(model.parameters(), bucket_bytes=bad)


def test_ddp_wrapped_model_with_sharding_raises():
    messages = run_ranks(workers.ddp_with_sharding_raises, 2)
    assert all(m and "reduced twice" in m for m in messages), messages


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_params_with_fp32_master_shards(stage):
    results = run_ranks(workers.bf16_parity, 2, 30, stage)
    ref_params = workers.bf16_reference(30)
    for result in results:
        state = result["state_dict"]["state"]
        for i, (p, q) in enumerate(zip(result["params"], ref_params)):
            assert p.dtype == torch.bfloat16
            master = state[i]["master_param"]
            torch.testing.assert_close(master, q.detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(p, master.bfloat16())


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_save_then_load_at_other_world_sizes(tmp_path, stage):
    """One file per rank at world size 2; loaded at 1, 3 and 4 (resharded),
    continuing on the same global batches as the uninterrupted run."""
    before, after = 20, 15
    expected = run_ranks(workers.save_sharded_then_continue, 2, str(tmp_path), before, after,
                         stage)[0]
    for world_size in (1, 3, 4):
        results = run_ranks(workers.load_sharded_then_continue, world_size, str(tmp_path), 2,
                            before, after, stage if world_size > 1 else 0)
        for a, b in zip(results[0], expected):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_incomplete_sharded_state_is_refused():
    import rlhfz
    from rlhfz.optim import consolidate_sharded
    p = torch.nn.Parameter(torch.ones(3))
    opt = rlhfz.ZeroAdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    part = opt.sharded_state_dict()
    other = dict(part, rank=1, world_size=2)
    with pytest.raises(ValueError, match="every rank"):
        consolidate_sharded([dict(part, world_size=2)])
    with pytest.raises(ValueError, match="every rank"):
        consolidate_sharded([other, other])
    with pytest.raises(ValueError, match="expected a list"):
        consolidate_sharded([{"state": {}}])
    before = opt.state_dict()["state"][0]["exp_avg"].clone()
    opt.load_sharded_state_dict([part])
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before)


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_grads_reduced_in_fp32(stage):
    """reduce_dtype=float32 averages bf16 grads in fp32: the masters follow an
    fp32 AdamW fed the fp32 mean of the ranks' bf16 grads."""
    world, steps = 3, 10
    results = run_ranks(workers.bf16_reduce_dtype, world, steps, stage, torch.float32)
    torch.manual_seed(0)
    ref_params = [torch.nn.Parameter(torch.randn(s).bfloat16().float()) for s in [(37, 19), (19,)]]
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    for step in range(steps):
        for i, q in enumerate(ref_params):
            grads = [torch.randn(q.shape, generator=torch.Generator().manual_seed(
                1000 * step + 10 * i + r)).bfloat16().float() for r in range(world)]
            q.grad = torch.stack(grads).mean(0)
        ref.step()
    for result in results:
        assert result["shard_dtypes"] == ["torch.float32"]
        state = result["state_dict"]["state"]
        for i, q in enumerate(ref_params):
            torch.testing.assert_close(state[i]["master_param"], q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [3, 4])
def test_communicator_matches_the_collectives_definitions(world_size):
    for result in run_ranks(workers.communicator_primitives, world_size, 1000):
        for name, (got, expected) in result.items():
            if "bfloat16" in name and "gather" not in name:
                # summed in bf16 by gloo: within bf16 rounding of each partial sum
                torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2, msg=name)
            else:
                torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-6, atol=1e-6,
                                           msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_grads_accumulate_across_steps_without_zero_grad(stage):
    model = workers.make_model()
    opt = torch.optim.AdamW(workers.groups(model), lr=1e-3)
    first_grads = None
    for i, (x, y) in enumerate(workers.batches(2)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if i == 0:
            first_grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for result in run_ranks(workers.accumulate_across_steps, 3, stage):
        for a, b in zip(result["params"], model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-7)
        if stage == 1:
            for a, b in zip(result["grads_after_first"], first_grads):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("stage, dtype, ratio, bucket_bytes", [
    (1, torch.float32, None, 4096), (2, torch.float32, None, 4096),
    (3, torch.float32, None, 4096), (1, torch.bfloat16, 0.5, 4096),
    (2, torch.float32, 0.5, 4096), (3, torch.bfloat16, 1.0, 4096),
    (3, torch.float32, 0.3, 4096), (3, torch.float32, None, 64 << 20),
])
def test_memory_report_matches_the_estimate(stage, dtype, ratio, bucket_bytes):
    """`python -m rlhfz estimate` predicts what a rank really holds, the
    reducer's staging and offload's host copies included, up to alignment
    padding (on the CPU every tier is host memory, so kinds are compared
    whole). A stage-3 cap above every unit stages the largest unit."""
    for report, estimate in run_ranks(workers.report_against_estimate, 2, stage, dtype, ratio,
                                      bucket_bytes):
        for kind in report:
            got = sum(report[kind].values())
            expected = sum(estimate[kind].values())
            assert expected <= got <= expected * 1.05 + 64 * 4 * 4, (kind, got, expected)


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", [2, 3])
def test_params_without_grads_on_some_ranks(world_size, stage, clip):
    """A param with a grad on any rank steps with the others adding zeros (as
    DDP averages); one with a grad on no rank is skipped and gets no state.
    A clip before the step looks at the same reduced grads."""
    ref_params, ref_sd = workers.branchy_reference(world_size, 10, clip)
    for params, sd in run_ranks(workers.branchy_sharded, world_size, 10, stage, clip):
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert sorted(sd["state"]) == sorted(ref_sd["state"])
        assert len(sd["state"]) == 6        # trunk, shared, first: weight and bias


@pytest.mark.parametrize("world_size, stage, ratio", [(2, 1, 0.5), (2, 2, 0.5), (3, 2, 0.3)])
def test_host_resident_state_trains_bitwise_like_the_plain_optimizer(tmp_path, world_size,
                                                                     stage, ratio):
    results = run_ranks(workers.offload_parity, world_size, 6, stage, ratio, str(tmp_path))
    for result in results:
        plain, offloaded = result["plain"], result["offloaded"]
        for a, b in zip(plain["params"], offloaded["params"]):
            assert torch.equal(a, b)
        for key, entry in plain["state_dict"]["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(entry[name], offloaded["state_dict"]["state"][key][name])
    assert not any(os.listdir(tmp_path / name) for name in os.listdir(tmp_path))


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_post_hooks_see_the_whole_state(stage):
    """torch's state-dict post-hooks run once, on the dict the caller gets:
    every param's full state, gathered from the shards."""
    for rank, result in enumerate(run_ranks(workers.state_dict_hooks, 2, stage)):
        assert result["seen"] == result["shapes"], rank
        assert result["marked"] == rank


@pytest.mark.parametrize("stage", [1, 2])
def test_a_sharded_optimizer_across_ranks_refuses_copies_at_once(stage):
    for refusals in run_ranks(workers.copy_across_ranks, 2, stage):
        assert all(r is not None and "across processes cannot be copied" in r for r in refusals)



def _group_added_later_reference(norm_type):
    model = workers.make_model()
    model[4].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    norms = []

    def run(data):
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], 0.05, norm_type=norm_type)))
            opt.step()
    data = workers.batches(6)
    run(data[:3])
    model[4].requires_grad_(True)
    opt.add_param_group({"params": list(model[4].parameters()), "lr": 5e-3,
                         "weight_decay": 0.0})
    run(data[3:])
    return dict(model.named_parameters()), norms[3:]


@pytest.mark.parametrize("stage,norm_type", [(1, 1.0), (2, float("inf")), (3, 2.0), (3, 3.0)])
def test_a_group_added_after_construction_trains_as_torch_at_every_stage(stage, norm_type):
    """add_param_group across ranks at stages 1-3, clipped with p-norms and
    the max norm as torch.nn.utils.clip_grad_norm_ clips."""
    params, norms = _group_added_later_reference(norm_type)
    for result in run_ranks(workers.group_added_later, 2, stage, norm_type):
        for name, value in result["params"].items():
            torch.testing.assert_close(value, params[name].detach(), rtol=2e-4, atol=2e-5)
        for ours, theirs in zip(result["norms"], norms):
            assert ours == pytest.approx(theirs, rel=1e-4)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_clip_folded_into_the_step_is_the_clip_torch_makes(world_size, stage):
    """Stages 2 and 3 apply a clip as the step reads the grads (param.grad is
    None there); a second clip, further grads, a step without new grads and
    a clip after the step all see the grads clipped, as torch's do."""
    expected = workers.clip_sequence_reference()
    for result in run_ranks(workers.clip_sequence, world_size, stage, 4 << 10):
        torch.testing.assert_close(torch.tensor(result["norms"]),
                                   torch.tensor(expected["norms"]), rtol=1e-5, atol=0)
        for got, want in zip(result["params"], expected["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("stage", [2, 3])
def test_module_zero_grad_clears_the_grads_in_the_shards(stage):
    for norms, expected in run_ranks(workers.module_zero_grad_reaches_shard_grads, 2, stage):
        assert norms == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("how", ["optimizer", "module"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_without_none_keeps_zero_grads_that_step(stage, how):
    for diffs in run_ranks(workers.zero_grads_kept_as_zeros, 2, stage, how):
        assert max(diffs.values()) < 1e-6, diffs


# (at stages 2 and 3 p.grad is None after backward: the grads are in the shards)
@pytest.mark.parametrize("stage, world_size", [(0, 1), (1, 1), (1, 2)])
def test_grads_kept_from_p_grad_keep_their_values_through_the_next_backward(stage, world_size):
    for out in run_ranks(workers.grads_kept_across_backwards, world_size, stage):
        assert out["kept_changed"] == 0.0, out
        assert out["diff"] < 1e-5, out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_grad_set_by_hand_after_backward_replaces_it_as_in_torch(stage):
    for out in run_ranks(workers.grads_set_by_hand_after_backward, 2, stage, "all"):
        assert out["refused"] is None and out["diff"] < 1e-6, out
    for out in run_ranks(workers.grads_set_by_hand_after_backward, 2, stage, "rank 0"):
        assert out["refused"] is not None and "on 1 of 2 ranks" in out["refused"], out
        assert out["unchanged"], out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_grad_set_by_hand_between_two_backwards_is_refused_before_the_second_takes_any(stage):
    for out in run_ranks(workers.grad_set_by_hand_between_backwards, 2, stage):
        assert out["refused"] is not None and "between two backwards" in out["refused"], out
        assert out["diff"] < 1e-6, out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hand_set_grad_of_another_dtype_is_refused_on_every_rank(stage):
    for refused in run_ranks(workers.grad_of_another_dtype, 2, stage):
        assert "has a grad of dtype torch.float64" in refused


@pytest.mark.parametrize("how", ["close", "drop", "constructor"])
def test_after_a_stage2_optimizer_goes_the_params_train_with_the_next_one(how):
    # (the two first steps differ from torch's by rounding, which Adam's
    # next steps carry on; an optimizer still taking the grads moves nothing)
    for diff in run_ranks(workers.after_the_optimizer_goes, 2, how):
        assert diff < 1e-4


@pytest.mark.parametrize("stage", [1, 2])
def test_two_optimizers_share_params_only_where_no_reducer_takes_the_grads(stage):
    for refused in run_ranks(workers.two_optimizers_over_shared_params, 2, stage):
        if stage == 1:
            assert refused is None
        else:
            assert "put both sets of params in one ZeroAdamW" in refused


def test_a_stage1_clip_scales_the_whole_mean_grad():
    for result in run_ranks(workers.stage1_clip_of_whole_grads, 2):
        assert result["clipped"] < 1e-7 and result["stepped"] < 1e-6, result


@pytest.mark.parametrize("world_size, no_sync", [(2, False), (3, False), (2, True)])
def test_stage1_grads_are_the_mean_when_backward_ends(world_size, no_sync):
    for result in run_ranks(workers.stage1_torch_clip_and_no_sync, world_size, no_sync):
        ours, torchs = result["norms"][0::2], result["norms"][1::2]
        assert ours == pytest.approx(torchs, rel=1e-5), result
        assert result["params"] < 5e-5, result       # an lr of 1e-2, three steps


def test_stage1_averages_after_a_backward_that_failed():
    assert run_ranks(workers.stage1_after_a_failed_backward, 2) == [(0.0, 1, 0), (0.0, 1, 0)]


def test_two_stage1_optimizers_average_whatever_order_grads_arrive_in(monkeypatch):
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", "30")
    results = run_ranks(workers.two_stage1_optimizers_in_one_backward, 2)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_backward_while_grads_are_offloaded_says_to_reload():
    for refused in run_ranks(workers.backward_while_grads_offloaded, 2, 2):
        assert refused is not None and "call reload()" in refused


@pytest.mark.parametrize("world_size, stage", [(2, 2), (3, 2), (2, 3), (3, 3)])
def test_torch_clips_reach_the_grads_in_the_shards(world_size, stage):
    """A script's torch.nn.utils.clip_grad_norm_(model.parameters(), ...)
    found no grads at stages 2 and 3 (p.grad is None): it returned 0 and the
    step took unclipped grads."""
    for result in run_ranks(workers.torch_clips_reach_shard_grads, world_size, stage):
        for step, (ours, theirs) in enumerate(result["norms"]):
            if theirs is None:                      # clip_grad_value_ returns None
                assert ours is None
                assert result["binds"][step] > 0.002, "the clip must bind to show anything"
            else:
                assert ours == pytest.approx(theirs, rel=1e-5), step
                assert theirs > 0.05
        # Adam turns fp32 rounding in grads near eps into ~1e-6 (lr 1e-3);
        # grads that were not clipped differ by ~4e-4
        assert result["diff"] < 5e-6, result
        for key in ("norm", "ours"):
            got, want = result["together"][key]
            assert got == pytest.approx(want, rel=1e-5), key
        assert result["together"]["theirs"] < 1e-9
        assert all("Nothing was clipped" in str(error) for error in result["early"]), result["early"]
        assert result["looks"] == [
            ("clip_grad_norm_", ["parameters", "max_norm", "norm_type", "error_if_nonfinite",
                                 "foreach"], True, True),
            ("clip_grad_value_", ["parameters", "clip_value", "foreach"], True, True)]
        assert result["after"] == result["before"]          # nothing was scaled


@pytest.mark.parametrize("stage", [2, 3])
def test_torch_clips_keep_torch_rules_at_their_edges(stage):
    """A NaN grad under the inf norm, bf16 grads, a frozen param, and grads
    beside the optimizer's that one rank alone has: each as torch on the
    same model whole (every rank takes the same batch)."""
    for result in run_ranks(workers.torch_clips_at_their_edges, 2, stage):
        (ours, theirs), (ours_raised, theirs_raised) = result["nan"]
        assert math.isnan(ours) and math.isnan(theirs), result["nan"]
        assert ours_raised == theirs_raised == "non-finite", result["nan"]
        for ours, theirs in result["bf16"]:             # bf16 values: equal, not close
            assert ours == theirs, result["bf16"]
        ours, theirs = result["frozen"]["norms"]      # fp32: within rounding
        assert ours == pytest.approx(theirs, rel=1e-5)
        assert result["frozen"]["diff"] < 1e-6, result["frozen"]
        ours, theirs = result["beside"]
        assert ours == pytest.approx(theirs, rel=1e-5)
        assert result["warned"] == [
            "`parameters` is an empty generator, no gradient clipping will occur."]
