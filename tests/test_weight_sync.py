"""Weight sync from a stage-3 training group to plain receivers: ranks 0
and 1 train, ranks 2 and 3 receive over a group of rank 0 and themselves."""
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sync_workers as workers
from rlhfz.launch import run_ranks
from rlhfz.weight_sync import (PIECE_ALIGN, SyncBucket, check_plan, lands_whole,
                                plan_buckets)


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


def test_plan_cuts_large_tensors_and_aligns_every_piece():
    specs = [((3, 5), torch.float32), ((1000,), torch.bfloat16), ((0,), torch.float32),
             ((7,), torch.int64), ((33, 33), torch.float32), ((60,), torch.float32)]
    buckets = plan_buckets(specs, 512)
    assert check_plan([(b.nbytes, b.pieces) for b in buckets], specs, 512)[1] is None
    sent = {i: 0 for i in range(len(specs))}
    for used, pieces, source in buckets:
        assert used <= 512
        end = 0
        for index, start, count, offset in pieces:
            assert offset % PIECE_ALIGN == 0 and offset >= end
            assert start == sent[index]          # in order, no element twice or skipped
            sent[index] += count
            end = offset + count * _itemsize(specs[index][1])
        assert end == used
        whole = torch.Size(specs[pieces[0][0]][0]).numel() * _itemsize(specs[pieces[0][0]][1])
        # a tensor of half a bucket or more goes alone, in chunks of a bucket
        direct = source is not None
        assert direct == (whole >= 256) and (not direct or len(pieces) == 1)
        assert lands_whole(SyncBucket(used, pieces), specs) == (len(pieces) == 1)
    for index, (shape, _) in enumerate(specs):
        assert sent[index] == torch.Size(shape).numel()
    assert sum(source is not None for _, _, source in buckets) == 4 + 9   # 2000, 4356 bytes
    one = plan_buckets(specs, 1 << 20)
    assert len(one) == 1 and one[0].source is None
    low = plan_buckets(specs, 512, direct_bytes=61)
    assert [b.pieces[0][0] for b in low if b.source] == [1] * 4 + [4] * 9 + [5]
    assert [[p[0] for p in b.pieces] for b in low if not b.source] == [[0], [3]]


def test_plan_sends_tensors_that_lie_back_to_back_as_they_lie():
    f32 = torch.float32
    specs = [((16,), f32), ((10,), f32), ((30,), f32), ((8,), f32), ((300,), f32), ((4,), f32)]
    # 0, 1, 2 lie in memory "a" with a 24-byte gap; 3 lies far on; 4 is large; 5 elsewhere
    homes = [("a", 0), ("a", 64), ("a", 128), ("a", 128 + 120 + 8192), ("a", 9000), None]
    buckets = plan_buckets(specs, 1024, homes=homes)
    assert buckets[0] == SyncBucket(248, [(0, 0, 16, 0), (1, 0, 10, 64), (2, 0, 30, 128)],
                                    ("range", "a", 0))
    # too far from the run to join it, too small alone (< 1024 / 8): packed
    assert [b.pieces for b in buckets if b.source is None] == [[(3, 0, 8, 0)], [(5, 0, 4, 0)]]
    assert [b.source for b in buckets[1:] if b.source] == [("tensor", 4)] * 2   # 1200 bytes
    assert check_plan([(b.nbytes, b.pieces) for b in buckets], specs, 1024)[1] is None
    # a run is cut where it would pass a bucket, and each part starts its own range
    cut = plan_buckets([((20,), f32)] * 3, 192, homes=[("a", 0), ("a", 80), ("a", 160)])
    assert cut == [SyncBucket(160, [(0, 0, 20, 0), (1, 0, 20, 80)], ("range", "a", 0)),
                   SyncBucket(80, [(2, 0, 20, 0)], ("range", "a", 160))]
    # another memory, or a misaligned offset, starts a new run
    split = plan_buckets(specs[:3], 1024, homes=[("a", 0), ("b", 64), ("b", 130)])
    assert [b.source for b in split] == [None]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 70), st.sampled_from([torch.float32, torch.bfloat16,
                                                                 torch.int64]),
                          st.integers(0, 3), st.integers(0, 40)), max_size=12),
       st.integers(PIECE_ALIGN, 600))
def test_every_plan_covers_every_element_once_within_its_buckets(tensors, bucket_bytes):
    specs, homes, ends = [], [], {}
    for numel, dtype, memory, gap in tensors:
        specs.append(((numel,), dtype))
        if memory == 0:
            homes.append(None)
            continue
        itemsize = _itemsize(dtype)
        offset = -(-(ends.get(memory, 0) + gap) // itemsize) * itemsize
        homes.append((memory, offset))
        ends[memory] = offset + numel * itemsize
    buckets = plan_buckets(specs, bucket_bytes, homes=homes)
    checked, error = check_plan([(b.nbytes, b.pieces) for b in buckets], specs, bucket_bytes)
    assert error is None and len(checked) == len(buckets)
    for bucket in buckets:
        if bucket.source is not None and bucket.source[0] == "range":
            _, memory, lo = bucket.source
            for index, _, _, offset in bucket.pieces:
                assert homes[index] == (memory, lo + offset)


@pytest.mark.parametrize("plan,bucket_bytes,says", [
    ([(40, [(0, 0, 10, 0)])], 39, "holds 40 bytes"),
    ([(40, [(0, 0, 10, 4)])], 64, "outside"),
    ([(40, [(0, 0, 11, 0)])], 64, "outside"),
    ([(40, [(0, 0, 5, 2), (0, 5, 5, 20)])], 64, "outside"),        # not a float32 boundary
    ([(40, [(0, 0, 5, 0), (0, 5, 5, 16)])], 64, "overlap"),
    ([(48, [(0, 0, 10, 0)])], 64, "more than its pieces"),                # bytes at the end
    ([(44, [(0, 0, 10, 4)])], 64, "more than its pieces"),                # ... or the start
    ([(5000, [(0, 0, 5, 0), (0, 5, 5, 4980)])], 1 << 13, "more than its pieces"),  # a wide gap
    ([(4120, [(0, 0, 5, 0), (0, 5, 5, 4100)])], 1 << 13, None),            # a gap of 4080
    ([(20, [(0, 0, 5, 0)]), (24, [(0, 4, 6, 0)])], 64, "repeat"),
    ([(20, [(0, 0, 5, 0)])], 64, "skip"),
    ([(40, [(1, 0, 10, 0)])], 64, "names tensor 1"),
    ([(40, [(0, 0, 10)])], 64, "malformed"),
    ([(40, [(0, 0, True, 0)])], 64, "malformed"),
    ([40], 64, "not (bytes, pieces)"),
    ({"a": 1}, 64, "not a list"),
    ([(40, [(0, 0, 10, 0)])], None, "not a positive int"),
])
def test_a_plan_that_would_write_out_of_place_is_refused(plan, bucket_bytes, says):
    _, error = check_plan(plan, [((10,), torch.float32)], bucket_bytes)
    assert error is None if says is None else (error is not None and says in error), error


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
    # units go as they lie in their gathered memory; a cast goes through a buffer
    assert 0 < trainer["report"]["copied_bytes"] < trainer["report"]["bytes"] // 2
    assert trainer["bf16_report"]["copied_bytes"] == trainer["bf16_report"]["bytes"]
    assert trainer["bf16_report"]["bytes"] * 2 == trainer["report"]["bytes"]
    assert results[0]["gathered_after"] == results[1]["gathered_after"] == 0


def test_the_channel_carries_values_of_any_size_and_every_verdict():
    """And a frame that announces more than any manifest is refused."""
    from rlhfz.comm.channel import FRAME_BYTES
    results = run_ranks(workers.channel_round_trips, 3)
    sent = workers.frame_values(FRAME_BYTES)
    one, two = ["broadcast"], ["broadcast"] * 2        # a frame; a frame and the rest
    for rank in range(3):
        assert results[rank]["got"] == list(zip(sent, [one, one, one, two, two]))
        # a verdict with no message is one all-reduce; the messages go only when there are some
        gathered = ["all_reduce", "all_gather"]
        assert results[rank]["verdicts"][:3] == [(None, ["all_reduce"]),
                                                 ("rank 2: bad here", gathered),
                                                 ("rank 0: rank 0 says no", gathered)]
        long, calls = results[rank]["verdicts"][3]        # cut at a character's end
        assert calls == gathered and long.startswith("rank 0: ")
        assert 1000 < len(long) - 8 < len(workers.LONG_MESSAGE)
        assert workers.LONG_MESSAGE.startswith(long[8:])
        if rank != 1:
            assert "is not an rlhfz weight-sync sender" in results[rank]["refused"]


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


def test_a_checksum_mismatch_fails_everywhere_and_the_next_sync_mends_it():
    results = run_ranks(workers.sync_corrupted, 4)
    for rank in workers.TRAINERS:
        [error] = results[rank]["errors"]
        assert "a receiver's checksum did not match" in error and "rank 3" in error, error
    for rank in workers.RECEIVERS:
        [error] = results[rank]["errors"]
        assert "checksum mismatch" in error and "rank 3" in error and "CRC-32" in error, error
    sent = results[workers.SRC]["whole"]
    for rank in workers.RECEIVERS:
        got = results[rank]["whole"]
        assert all(torch.equal(got[name], value) for name, value in sent.items()), rank


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
    sends to the fifth; only the sender's shard group gathers. A failed
    sync of a stage-2 policy on the mesh raises on every rank."""
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
    for rank, result in enumerate(results):
        [error] = result["errors"]
        assert "not in this model" in error, (rank, error)


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


def test_stage3_sends_queue_back_to_back_within_two_units():
    """src posts each unit's send before it waits for the last unit's, so the
    wire never waits on src between units; the first units gather while the
    receivers check the manifest; and no more than two units are whole."""
    results = run_ranks(workers.sync_back_to_back, 4)
    sender = results[workers.SRC]
    for rank in workers.RECEIVERS:
        assert results[rank]["whole"].keys() == sender["whole"].keys()
        for name, value in sender["whole"].items():
            assert torch.equal(results[rank]["whole"][name], value), name
    events, sources = sender["events"], sender["sources"]
    at = {}
    for i, event in enumerate(events):
        at.setdefault(event, i)                 # where each first happened
    assert at[("gather", 0)] < at[("verdict", None)]
    following = [k for k in range(len(sources) - 1)      # unit to unit, from memory
                 if sources[k][0] and sources[k + 1][0] and sources[k][1] != sources[k + 1][1]]
    assert len(following) >= 3, sources
    for k in following:
        assert at[("post", k + 1)] < at[("done", k)], (k, events)
    assert 0 < sender["peak"] <= sender["two_units"]
    assert results[1]["events"] and all(kind == "gather" for kind, _ in results[1]["events"])


def test_whole_params_go_from_the_memory_that_holds_them():
    results = run_ranks(workers.sync_whole_params, 4)
    sender = results[workers.SRC]
    for rank in workers.RECEIVERS:
        for sent, got in zip(sender["whole"], results[rank]["whole"], strict=True):
            assert got.keys() == sent.keys()
            for name, value in sent.items():
                assert torch.equal(got[name], value), name
    for report in sender["reports"]:          # a checksum checked each; little packed
        assert 0 < report["copied_bytes"] < report["bytes"] // 4
    assert results[1]["reports"][0]["copied_bytes"] == 0      # the other trainer sent nothing


def test_only_what_is_packed_or_cast_takes_a_buffer():
    from rlhfz.weight_sync import _Sender
    model = workers.laid_back_to_front(workers.tiny_lm("gpt2", seed=7))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    cpu = torch.device("cpu")
    for dtype in (None, torch.bfloat16):
        sender = _Sender(model, "merged", dtype, 1 << 16)
        manifest = sender.manifest("merged", False)
        specs = [(tuple(shape), getattr(torch, name)) for _, shape, name in manifest["tensors"]]
        assert check_plan(manifest["buckets"], specs, 1 << 16)[1] is None
        ranges = [b for b in sender.buckets if b.source and b.source[0] == "range"]
        for bucket in sender.buckets:
            assert sender.copies(bucket, cpu) == (bucket.source is None or dtype is not None)
        if dtype is None:           # the params lie in one tensor: sent as they lie
            assert sum(b.nbytes for b in ranges) > 0.9 * total
        else:                       # cast on the way: every byte through a buffer
            assert not ranges


def _net(groups=1):
    """An embedding, a convolution and a linear layer, none of them transformers'."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 8)
            self.conv = torch.nn.Conv2d(8, 8, 3, groups=groups)
            self.head = torch.nn.Linear(8, 5)
    torch.manual_seed(0)
    return Net()


def test_a_merged_export_is_what_merge_and_unload_leaves_or_is_refused():
    """LoRA on embeddings, convolutions and linear layers, and modules_to_save,
    merged under merge_and_unload's names to the bit; what PEFT merges some
    other way is refused, not left out."""
    import copy
    peft = pytest.importorskip("peft")
    from rlhfz.lora_export import merged
    from rlhfz.pretrained import export_entries
    models = [workers.lora_variant(case)[0] for case in ("embedding", "modules_to_save")]
    models.append(peft.get_peft_model(_net(), peft.LoraConfig(
        r=2, target_modules=["emb", "conv", "head"], init_lora_weights=False)))
    for model in models:
        expected = copy.deepcopy(model).merge_and_unload().state_dict()
        _, entries, _ = export_entries(None, model)
        got = {name: merged(t, *merge) if merge else t for _, name, t, merge in entries}
        # tied tensors go once, under their first name, as transformers saves them
        assert got.keys() <= expected.keys() and len(entries) == len(
            {t.data_ptr() for t in expected.values()})
        for name, value in got.items():
            assert torch.equal(value, expected[name]), name
    refused = {
        "LoRA variant": lambda: peft.get_peft_model(workers.tiny_lm("gpt2"), peft.LoraConfig(
            r=2, target_modules=["c_fc"], fan_in_fan_out=True, use_dora=True)),
        "ia3.layer.Linear": lambda: peft.get_peft_model(workers.tiny_lm("llama"), peft.IA3Config(
            target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"])),
        "TrainableTokensWrapper": lambda: peft.get_peft_model(
            workers.tiny_lm("llama"), peft.LoraConfig(
                r=2, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [1]})),
        "grouped convolution": lambda: peft.get_peft_model(
            _net(groups=2), peft.LoraConfig(r=2, target_modules=["conv"])),
        "MultiheadAttention": lambda: peft.get_peft_model(
            torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2)),
            peft.LoraConfig(r=2, target_modules=["0"])),
    }
    for says, make in refused.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # PEFT's own, of layers it will not merge
            model = make()
        with pytest.raises(NotImplementedError, match=says) as caught:
            export_entries(None, model)
        assert "adapters='only'" in str(caught.value)


def test_lora_on_embeddings_and_modules_to_save_syncs_as_merge_and_unload_leaves_it():
    pytest.importorskip("peft")
    sender, receiver = run_ranks(workers.sync_lora_layers, 2)
    for case in ("embedding", "modules_to_save"):
        assert receiver[case].keys() == sender[case].keys()
        for name, value in sender[case].items():
            assert torch.equal(receiver[case][name], value), (case, name)
        adapters = case + " adapters"
        assert receiver[adapters].keys() == sender[adapters].keys()
        for name, value in sender[adapters].items():
            assert torch.equal(receiver[adapters][name], value), (case, name)


def test_a_receiver_that_cannot_be_written_is_refused_everywhere_and_the_group_goes_on():
    sender, *receivers = run_ranks(workers.sync_into_unwritable, 3)
    for errors in [sender["errors"]] + [r["errors"] for r in receivers]:
        assert len(errors) == 3, errors
        assert "meta device" in errors[0]
        assert "inference_mode" in errors[1]
        assert "unsharded model" in errors[2]
    assert all("refused the manifest" in e for e in sender["errors"])
    for receiver in receivers:
        assert receiver["untouched"]
        for name, value in sender["whole"].items():
            assert torch.equal(receiver["whole"][name], value), name


def test_a_sync_the_sender_refuses_fails_on_every_rank_at_once():
    results = run_ranks(workers.sync_refused_by_the_sender, 3)
    for rank, result in enumerate(results):
        assert len(result["errors"]) == 3, (rank, result["errors"])
        assert "bucket_bytes" in result["errors"][0] and "PEFT" in result["errors"][1]
        assert max(result["seconds"][:2] + result["seconds"][3:]) < 15, result["seconds"]
    assert all("the sender refused the sync" in e for e in results[2]["errors"])
    # a trainer in the sync group says why; the others hear that it refused
    assert "rank 1 is in the weight-sync group but is not src" in results[1]["errors"][2]
    assert "'refused': True" in results[0]["errors"][2]
    for name, value in results[0]["whole"].items():
        assert torch.equal(results[2]["whole"][name], value), name


def test_a_side_that_never_joins_fails_the_other_within_the_collective_timeout():
    sender, receiver = run_ranks(workers.sync_beside_an_absent_side, 2, timeout=120)
    for waiting, absent in ((receiver, 0), (sender, 1)):
        error, seconds = waiting[absent]
        assert "RLHFZ_COLLECTIVE_TIMEOUT 4 s" in error, error
        assert seconds < 3 * 4 + 2, seconds


def test_every_trainer_raises_when_a_sync_fails_at_stages_1_and_2():
    for rank, errors in enumerate(run_ranks(workers.sync_at_stages_1_and_2, 3)):
        assert len(errors) == 2, (rank, errors)
        assert all("not in this model" in e for e in errors), errors


def test_a_sync_into_a_tensor_a_graph_saved_fails_its_backward():
    """Straight into the tensor's memory, or through a buffer, as after
    load_state_dict."""
    _, receiver = run_ranks(workers.sync_under_a_graph, 2)
    for error in receiver:
        assert error is not None and "modified by an inplace operation" in error, error


def test_a_compiled_model_syncs_under_its_own_names():
    sender, receiver = run_ranks(workers.sync_compiled, 2)
    for sent, got in zip(sender, receiver, strict=True):
        assert got.keys() == sent.keys()
        for name, value in sent.items():
            assert torch.equal(got[name], value), name


def test_on_gloo_every_byte_leaves_src_once_and_each_receiver_passes_on_a_share():
    """gloo's broadcast sends every byte from src to each receiver. Down
    chains that take turns, src sends each piece once, to the receiver that
    leads it, which passes it on to the other: each receiver sends on the
    pieces it led, piece for piece. Buckets go in pieces, large tensors'
    straight into them and the rest through a buffer; only the manifest,
    the checksum and the verdicts are broadcasts (each one frame)."""
    from rlhfz.comm.channel import FRAME_BYTES
    src, first, last = run_ranks(workers.sync_down_the_chain, 3)
    for receiver in (first, last):
        assert receiver["straight"] and receiver["through_a_buffer"], receiver
        for name, value in src["whole"].items():
            assert torch.equal(receiver["whole"][name], value), name

    def isends(rank, to=None):
        return [n for kind, peer, n in rank["sent"] if kind == "isend" and to in (None, peer)]
    assert isends(src) == [n for kind, _, n in src["sent"] if kind == "isend"]
    assert isends(first, to=1) == [] and isends(last, to=2) == [] and not isends(first, to=0)
    assert isends(first) == isends(src, to=1) and isends(last) == isends(src, to=2)
    assert isends(src, to=1) and isends(src, to=2)
    sent = sum(isends(src))
    assert 2 * src["report"]["bytes"] <= sent < 2 * src["report"]["bytes"] * 1.01
    assert abs(sum(isends(first)) - sum(isends(last))) <= 12 << 10     # a piece apart at most
    assert max(isends(src)) == 12 << 10
    assert len(isends(src)) > 2 * src["report"]["buckets"]
    for rank in (src, first, last):
        assert all(n <= FRAME_BYTES for kind, _, n in rank["sent"] if kind == "broadcast")


@pytest.mark.parametrize("where", ["midway", "at_the_end"])
def test_a_receiver_down_the_chain_that_stops_fails_the_sender_and_the_others(where):
    """src hears only from the first receiver while the buckets move: the
    verdict at the end is how it learns that the last one holds them."""
    results = run_ranks(workers.sync_last_receiver_stops, 3, where, timeout=180)
    assert results[2]["error"] == "RuntimeError: the last receiver stops here", results[2]
    for rank in (0, 1):
        error = results[rank]["error"]
        assert error is not None and error.startswith("CollectiveError"), (rank, error)
        assert "RLHFZ_COLLECTIVE_TIMEOUT 5 s" in error, error
        assert results[rank]["seconds"] < 4 * 5 + 5, results[rank]
    if where == "midway":           # a group with transfers cut off is not used again
        again = results[1]["again"]
        assert again is not None and again.startswith("CollectiveError"), again
        assert "dist.new_group" in again, again


def test_extra_state_and_conjugate_weights_sync_and_what_cannot_be_sent_is_refused():
    sender, receiver = run_ranks(workers.sync_unusual_tensors, 2)
    assert receiver["amax"] == 7.0                  # torch's load_state_dict sets it so
    assert torch.equal(receiver["phase"], sender["phase"])
    assert torch.equal(receiver["into_conj"], sender["phase"])
    assert torch.equal(receiver["logits"], sender["logits"])
    for errors in (sender["errors"], receiver["errors"]):
        assert len(errors) == 3, errors
        assert "dense" in errors[0] and "meta device" in errors[1] and "extra state" in errors[2]
    assert all("the sender refused the sync" in e for e in receiver["errors"])


def test_a_closed_optimizer_leaves_the_model_syncing_over_its_own_group():
    first, second, receiver = run_ranks(workers.sync_after_the_optimizer_closed, 3)
    for stage in (3, 2):
        assert torch.equal(first[stage], second[stage])
        assert torch.equal(receiver[stage], first[stage])
        assert first[f"{stage} state_dict"] == second[f"{stage} state_dict"] > 0
    for stage in (3, 2):
        assert "was closed" in first[f"{stage} step"], first
