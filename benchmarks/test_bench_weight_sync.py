"""Weight sync from 2 stage-3 trainers to 2 receivers over gloo (CPU), in
one run: rlhfz's bucketed sync against a raw broadcast of the same bytes
and against a per-parameter sync (OpenRLHF's way), rounds interleaved. At
stage 3 the trainers must gather what they send: a raw all-gather of the
same bytes followed by the raw broadcast is measured too, and a raw
point-to-point gather onto the sender (what rlhfz moves on gloo) followed
by it. At stage 2 the params are whole on every trainer, which leaves
rlhfz's own cost. From one stage-2 trainer to one receiver, the two
processes have a core each even on a 2-core machine: rlhfz's cost without
four ranks sharing two cores.

extra_info: each way's median seconds and GB/s, rlhfz's fraction of the raw
broadcast's bandwidth (target 0.8), the per-param sync's, and the sender's
peak resident memory above its start during each way. The timed call is the
whole run of every rank, spawn included.

Run: python -m pytest benchmarks/test_bench_weight_sync.py
"""
import pytest
import torch

import weight_sync_workers
from rlhfz.launch import run_ranks

ROUNDS = 8


@pytest.mark.parametrize("stage", [3, 2])
@pytest.mark.parametrize("size,bucket_mib", [("medium", 32)])
def test_weight_sync_2_trainers_to_2_receivers(benchmark, size, bucket_mib, stage):
    _measure(benchmark, size, bucket_mib, stage, world_size=4, trainers=2)


@pytest.mark.parametrize("size,bucket_mib", [("medium", 32)])
def test_weight_sync_1_trainer_to_1_receiver(benchmark, size, bucket_mib):
    """Whole params (stage 2) from one trainer to one receiver: a core for
    each on a 2-core machine, so rlhfz's own cost shows alone."""
    _measure(benchmark, size, bucket_mib, 2, world_size=2, trainers=1)


def _measure(benchmark, size, bucket_mib, stage, world_size, trainers):
    benchmark.group = f"weight-sync-{size}"
    results = []

    def run():
        results.append(run_ranks(weight_sync_workers.run, world_size, size, ROUNDS,
                                 bucket_mib << 20, stage, trainers, timeout=900))

    benchmark.pedantic(run, rounds=1, iterations=1)
    ranks = results[-1]
    sender = ranks[weight_sync_workers.SRC]
    for rank in weight_sync_workers.roles(world_size, trainers)[1]:      # bit for bit
        for name, value in sender["weights"].items():
            assert torch.equal(ranks[rank]["weights"][name], value), name
    total = sender["bytes"]
    info = benchmark.extra_info
    info["bytes"] = total
    info["params"] = sender["params"]
    info["bucket_bytes"] = bucket_mib << 20
    for way, seconds in sender["median_s"].items():
        info[f"{way}_s"] = round(seconds, 4)
        info[f"{way}_GBps"] = round(total / seconds / 1e9, 3)
    info["rlhfz_fraction_of_raw"] = round(sender["median_s"]["raw"] / sender["median_s"]["rlhfz"], 3)
    info["per_param_fraction_of_raw"] = round(sender["median_s"]["raw"]
                                              / sender["median_s"]["per_param"], 3)
    for serial in ("gather_then_raw", "gather_onto_src_then_raw"):
        if serial in sender["median_s"]:
            info[f"rlhfz_fraction_of_{serial}"] = round(
                sender["median_s"][serial] / sender["median_s"]["rlhfz"], 3)
    info["sender_peak_extra_bytes"] = sender["peak_extra"]
