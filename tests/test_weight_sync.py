"""Weight sync from a stage-3 training group to plain receivers: ranks 0
and 1 train, ranks 2 and 3 receive over a group of rank 0 and themselves."""
import pytest
import torch

import sync_workers as workers
from rlhfz.launch import run_ranks
from rlhfz.weight_sync import PIECE_ALIGN, plan_buckets


def test_plan_cuts_large_tensors_and_aligns_every_piece():
    specs = [((3, 5), torch.float32), ((1000,), torch.bfloat16), ((0,), torch.float32),
             ((7,), torch.int64), ((33, 33), torch.float32), ((60,), torch.float32)]
    buckets = plan_buckets(specs, 512)
    sent = {i: 0 for i in range(len(specs))}
    for used, pieces, direct in buckets:
        assert used <= 512
        end = 0
        for index, start, count, offset in pieces:
            itemsize = torch.empty((), dtype=specs[index][1]).element_size()
            assert offset % PIECE_ALIGN == 0 and offset >= end
            assert start == sent[index]          # in order, no element twice or skipped
            sent[index] += count
            end = offset + count * itemsize
        assert end == used
        whole = torch.Size(specs[pieces[0][0]][0]).numel() * itemsize
        # a tensor of half a bucket or more goes alone, in chunks of a bucket
        assert direct == (whole >= 256) and (not direct or len(pieces) == 1)
    for index, (shape, _) in enumerate(specs):
        assert sent[index] == torch.Size(shape).numel()
    assert sum(direct for _, _, direct in buckets) == 4 + 9     # 2000 and 4356 bytes in chunks
    one = plan_buckets(specs, 1 << 20)
    assert len(one) == 1 and not one[0].direct
    # where "large" starts is the sender's to say (the manifest carries it)
    low = plan_buckets(specs, 512, direct_bytes=61)
    assert [b.pieces[0][0] for b in low if b.direct] == [1] * 4 + [4] * 9 + [5]
    assert [[p[0] for p in b.pieces] for b in low if not b.direct] == [[0], [2, 3]]


def test_a_sync_is_bit_exact_and_checked():
    results = run_ranks(workers.sync_exact, 4)
    trainer = results[0]
    for rank in (2, 3):
        got = results[rank]
        assert got["same_tensors"]                 # loaded in place
        assert got["whole"].keys() == trainer["whole"].keys()
        for name, value in trainer["whole"].items():
            assert torch.equal(got["whole"][name], value), name
            assert torch.equal(got["bf16"][name], value.to(torch.bfloat16)), name
        assert torch.equal(got["logits"], trainer["logits"])
        assert got["report"]["bytes"] == trainer["report"]["bytes"]
        assert got["report"]["buckets"] == trainer["report"]["buckets"] > 10
    assert trainer["report"]["buffer_bytes"] <= 2 * 4096
    assert trainer["bf16_report"]["bytes"] * 2 == trainer["report"]["bytes"]
    assert results[0]["gathered_after"] == results[1]["gathered_after"] == 0


def test_a_manifest_that_does_not_fit_fails_everywhere_and_writes_nothing():
    results = run_ranks(workers.sync_refused, 4)
    for rank, result in enumerate(results):
        assert len(result["errors"]) == (2 if rank in workers.TRAINERS else 3), rank
    for rank in workers.RECEIVERS:
        assert "rlhfz.weight_sync.v1" in results[rank]["errors"][2]
        assert "same rlhfz on both sides" in results[rank]["errors"][2]
    assert "same rlhfz" in results[workers.SRC]["format_verdict"]
    assert "in this model but not sent" in results[3]["errors"][0]        # the llama receiver
    assert "another receiver refused" in results[2]["errors"][0]
    assert "bfloat16" in results[2]["errors"][1] and "dtype=" in results[2]["errors"][1]
    for rank in (0, 1):
        assert "refused the manifest" in results[rank]["errors"][0]
    assert results[2]["untouched"] and results[3]["untouched"]


def test_lora_syncs_merged_and_adapters_alone():
    results = run_ranks(workers.sync_lora, 4)
    for rank in (2, 3):
        torch.testing.assert_close(results[rank]["logits"], results[0]["logits"],
                                   rtol=1e-5, atol=1e-5)
        assert results[rank]["adapters"].keys() == results[0]["adapters"].keys()
        for name, value in results[0]["adapters"].items():
            assert torch.equal(results[rank]["adapters"][name], value), name


def test_a_hybrid_sharded_sender_inside_a_larger_job():
    """A 2x2 mesh of 4 of the job's 5 ranks (built on by its members alone)
    sends to the fifth; only the sender's shard group gathers."""
    results = run_ranks(workers.hybrid_sender, 5)
    for name, value in results[0]["whole"].items():
        assert torch.equal(results[4]["whole"][name], value), name
        assert torch.equal(results[3]["whole"][name], value), name
    by_coords = {r["coords"]: r for r in results[:4]}
    # gathered onto the sender alone: its shard peer sends its whole shard
    # once, the sender nothing, and nothing crosses to or from the other replica
    nothing = {"shard": {"reduce_scatter": 0, "all_gather": 0, "gather": 0, "all_reduce": 0},
               "replicate": {"reduce_scatter": 0, "all_gather": 0, "gather": 0,
                             "all_reduce": 0}}
    peer = by_coords[(0, 1)]
    assert peer["sync_sent"]["shard"]["gather"] == peer["shard_bytes"] > 0
    assert dict(peer["sync_sent"], shard=dict(peer["sync_sent"]["shard"], gather=0)) == nothing
    for coords in [(0, 0), (1, 0), (1, 1)]:
        assert by_coords[coords]["sync_sent"] == nothing, coords


def test_a_sync_inside_generation_leaves_both_trainers_alike():
    results = run_ranks(workers.sync_in_generation, 4)
    policy, other = results[0], results[1]
    # gathered onto src alone: the other trainer sends its shards once, src nothing
    assert policy["sent"] == {"reduce_scatter": 0, "all_gather": 0, "gather": 0,
                              "all_reduce": 0}
    assert other["sent"] == dict(policy["sent"], gather=other["shard_bytes"])
    for trainer in (policy, other):
        assert trainer["held_after_sync"] == [True, True, True]
        assert not any(trainer["left"])
        assert trainer["gathered_after"] == 0
        for logits in trainer["logits"]:
            torch.testing.assert_close(logits, policy["logits"][0], rtol=0, atol=0)
    for rank in workers.RECEIVERS:
        for logits in results[rank]["logits"]:
            torch.testing.assert_close(logits, policy["logits"][0], rtol=1e-5, atol=1e-5)
