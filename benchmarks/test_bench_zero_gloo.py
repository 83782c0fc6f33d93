"""ZeRO stages 1 and 2 on 2 gloo ranks (CPU) against torch's
ZeroRedundancyOptimizer(AdamW) with DDP, for the same model, in one run.

Each rank times its own iterations (forward + backward + step) and its
optimizer step; the medians and per-rank memory go into extra_info: the
tensors each keeps (params, grads, optimizer state; for DDP, its grad buckets
too) and the growth of the process's resident memory over the run. The peer
runs twice: with DDP's defaults, and with gradient_as_bucket_view=True (grads
are views of DDP's buckets, one copy). The timed call is the whole 2-rank
run, spawn included, the same for every implementation. Both ranks share the
machine's 2 cores, one thread each.

Run: python -m pytest benchmarks/test_bench_zero_gloo.py
"""
import pytest

import zero_workers
from rlhfz.launch import run_ranks

STEPS, WARMUP = 20, 3


@pytest.mark.parametrize("impl", ["torch_zero", "torch_zero_bucket_view", "rlhfz_stage1",
                                  "rlhfz_stage2"])
def test_zero_gloo_2_ranks(benchmark, impl):
    benchmark.group = "zero-gloo-2ranks"
    results = []

    def run():
        results.append(run_ranks(zero_workers.run, 2, impl, STEPS, WARMUP, timeout=600))

    benchmark.pedantic(run, rounds=1, iterations=1)
    ranks = results[-1]
    benchmark.extra_info["params"] = ranks[0]["numel"]
    benchmark.extra_info["iter_ms"] = round(1e3 * max(r["iter_median_s"] for r in ranks), 2)
    benchmark.extra_info["step_ms"] = round(1e3 * max(r["step_median_s"] for r in ranks), 2)
    benchmark.extra_info["memory_per_rank"] = ranks[0]["memory"]
    benchmark.extra_info["memory_total_per_rank"] = sum(ranks[0]["memory"].values())
    benchmark.extra_info["rss_growth_per_rank"] = max(r["rss_growth"] for r in ranks)
