"""Stage 2 memory on 2 gloo ranks (CPU): the grad bytes each rank holds
(memory_report(): the grad shard, the reducer's two staging slots and its
scratch) and the process's peak RSS, for a 35M GPT-2 with a 32k vocabulary
tied to the head (its 65.5 MB embedding is one param, far above the bucket
cap), at the default cap and at 8 MiB. A few training steps, fp32.

Run: python -m pytest benchmarks/test_bench_stage2_memory.py
"""
import pytest

import stage2_memory_workers
from rlhfz.launch import run_ranks

pytest.importorskip("transformers")


@pytest.mark.parametrize("bucket_bytes", [None, 8 << 20], ids=["default-cap", "cap-8MiB"])
def test_stage2_grad_memory_2_ranks(benchmark, bucket_bytes):
    benchmark.group = "stage2-memory-gloo-2ranks"
    results = []
    benchmark.pedantic(lambda: results.append(run_ranks(stage2_memory_workers.train, 2, bucket_bytes, timeout=900)),
                       rounds=1, iterations=1)
    ranks = results[-1]
    grads = max(r["grads"] for r in ranks)
    per_rank = ranks[0]["param_bytes"] / 2
    benchmark.extra_info.update(
        grads_bytes=grads, grads_over_shard=grads - per_rank,
        bound=per_rank + 2 * (32 << 20), largest_param=ranks[0]["largest_param"],
        peak_rss=max(r["peak_rss"] for r in ranks))
    assert grads <= per_rank + 2 * (32 << 20)
