"""Generation under stage 3 on 2 gloo ranks (CPU): tokens/s and peak
gathered param bytes per rank for gather_for_generation's modes (whole
model, unit by unit, and budgets of 25, 50 and 75% of the model), against
the unsharded model run in the same processes in turn with them; and
iter_full_params throughput. A 12-block GPT-2 built from a config, greedy,
64 new tokens for a batch of 16 (a rollout); every mode's tokens are checked equal to the
unsharded model's. Both ranks share the machine's 2 cores, one thread each.

Run: python -m pytest benchmarks/test_bench_generation.py
"""
import pytest

import generation_workers
from rlhfz.launch import run_ranks

pytest.importorskip("transformers")
ROUNDS = 5


def test_generation_modes_2_ranks(benchmark):
    benchmark.group = "stage3-generation-gloo-2ranks"
    results = []

    def run():
        results.append(run_ranks(generation_workers.run, 2, ROUNDS, timeout=1200))

    benchmark.pedantic(run, rounds=1, iterations=1)
    ranks = results[-1]
    slowest = {mode: min(r["tokens_per_s"][mode] for r in ranks)
               for mode in ranks[0]["tokens_per_s"]}
    benchmark.extra_info["tokens_per_s"] = {k: round(v, 1) for k, v in slowest.items()}
    benchmark.extra_info["vs_unsharded"] = {k: round(v / slowest["unsharded"], 3)
                                            for k, v in slowest.items()}
    benchmark.extra_info["peak_param_bytes"] = ranks[0]["peak_bytes"]
    for key in ("model_bytes", "shard_bytes", "unit_bytes", "export_bytes"):
        benchmark.extra_info[key] = ranks[0][key]
    benchmark.extra_info["iter_full_params_GBps"] = round(min(r["export_gbps"] for r in ranks), 3)
