"""Stage 2 memory on 2 gloo ranks (CPU): the grad bytes each rank holds
(memory_report(): the grad shard and the reducer's two staging slots) and
the process's peak RSS, for a 35M GPT-2 with a 32k vocabulary
tied to the head (its 65.5 MB embedding is one param, far above the bucket
cap), at the default cap and at 8 MiB. A few training steps, fp32.

Beside it, DeepSpeed's ZeRO-2 engine on its CPU accelerator trains the same
model on the same data for the same steps, with the same AdamW settings
(DeepSpeedCPUAdam, no clipping) and DeepSpeed's default buckets (reduce and
all-gather: 5e8 elements, contiguous grads, no overlap); it skips, with the
reason, where DeepSpeed is not installed. Peak RSS is per process, so each
case runs in fresh processes of its own; rss_after_imports is the part that
the libraries' imports (torch, transformers, rlhfz or deepspeed) take.

Run: python -m pytest benchmarks/test_bench_stage2_memory.py
"""
import pytest

import stage2_memory_workers
from peers import deepspeed_cpu_adam_or_skip
from rlhfz.launch import run_ranks

pytest.importorskip("transformers")

_peak_rss: dict[str, list] = {}       # case -> peak RSS of each rank, for the cases after it


@pytest.mark.parametrize("impl, bucket_bytes", [("rlhfz", None), ("rlhfz", 8 << 20),
                                                ("deepspeed_zero2", None)],
                         ids=["default-cap", "cap-8MiB", "deepspeed-zero2"])
def test_stage2_grad_memory_2_ranks(benchmark, impl, bucket_bytes):
    if impl == "deepspeed_zero2":
        deepspeed_cpu_adam_or_skip()
    benchmark.group = "stage2-memory-gloo-2ranks"
    results = []
    benchmark.pedantic(lambda: results.append(run_ranks(stage2_memory_workers.train, 2, impl,
                                                        bucket_bytes, timeout=900)),
                       rounds=1, iterations=1)
    ranks = results[-1]
    case = impl if bucket_bytes is None else f"{impl}_cap_{bucket_bytes}"
    _peak_rss[case] = [r["peak_rss"] for r in ranks]
    benchmark.extra_info.update(
        largest_param=ranks[0]["largest_param"], peak_rss=max(_peak_rss[case]),
        peak_rss_per_rank=_peak_rss[case],
        rss_after_imports=max(r["rss_after_imports"] for r in ranks),
        # the peak reached by the end of: the model's build, the optimizer's, the first step
        peak_rss_after={k: max(r["peak_rss_after"][k] for r in ranks)
                        for k in ranks[0]["peak_rss_after"]},
        # every case run so far, this one included, to read side by side
        peak_rss_by_case={k: max(v) for k, v in _peak_rss.items()})
    if impl == "deepspeed_zero2":
        benchmark.extra_info.update(
            master_partition_bytes=ranks[0]["master_partition_bytes"],
            grad_partition_bytes=ranks[0]["grad_partition_bytes"],
            reduce_bucket_bytes=ranks[0]["reduce_bucket_bytes"])
        return
    grads = max(r["grads"] for r in ranks)
    per_rank = ranks[0]["param_bytes"] / 2
    benchmark.extra_info.update(grads_bytes=grads, grads_over_shard=grads - per_rank,
                                bound=per_rank + 2 * (32 << 20))
    assert grads <= per_rank + 2 * (32 << 20)
