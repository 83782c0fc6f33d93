"""Generation under stage 3 on 2 gloo ranks (CPU): tokens/s and peak
gathered param bytes per rank for gather_for_generation's modes (whole
model, unit by unit, and byte budgets), against the unsharded model run in
the same processes in turn with them; and iter_full_params throughput.
Models built from configs, greedy; every mode's tokens are checked equal to
the unsharded model's. Both ranks share the machine's 2 cores, one thread each.

For the last two models DeepSpeed ZeRO-3 (CPU accelerator, the same gloo
group, fp32, param persistence threshold 1000 like rlhfz's) generates beside
them in the same rounds, as the mode deepspeed_zero3. DeepSpeed is optional:
without it the rlhfz modes still run, and extra_info["deepspeed"] says why
its mode is missing.

- gpt2-small: 12 blocks, width 128, vocab 512; 64 new tokens for 16 prompts;
- gpt2-35m-tied: 6 blocks, width 512, a 32k vocabulary tied to the head
  (the root unit is 47% of the bytes); 24 new tokens for 4 prompts;
- llama-untied: the same shape, Llama-style, embedding and head apart.
The last two also run budgets of 0 to 100% of the model, for the table of
tokens/s against budget.

Run: python -m pytest benchmarks/test_bench_generation.py
"""
import pytest

import generation_workers
from peers import deepspeed_missing_reason
from rlhfz.launch import run_ranks

pytest.importorskip("transformers")
ROUNDS = {"gpt2-small": 5, "gpt2-35m-tied": 3, "llama-untied": 3}
DEEPSPEED_MODELS = ("gpt2-35m-tied", "llama-untied")


@pytest.mark.parametrize("name", list(generation_workers.MODELS))
def test_generation_modes_2_ranks(benchmark, name):
    benchmark.group = f"stage3-generation-gloo-2ranks-{name}"
    budgets = (25, 50, 75) if name == "gpt2-small" else generation_workers.BUDGETS
    deepspeed = False
    if name in DEEPSPEED_MODELS:
        # decided here, so the ranks never try an import that fails
        reason = deepspeed_missing_reason()
        deepspeed = reason is None
        benchmark.extra_info["deepspeed"] = (
            f"ZeRO-3: {generation_workers.DEEPSPEED_CONFIG}" if deepspeed
            else f"skipped: {reason}")
    results = []

    def run():
        results.append(run_ranks(generation_workers.run, 2, ROUNDS[name], name, budgets,
                                 deepspeed, timeout=3000))

    benchmark.pedantic(run, rounds=1, iterations=1)
    ranks = results[-1]
    slowest = {mode: min(r["tokens_per_s"][mode] for r in ranks)
               for mode in ranks[0]["tokens_per_s"]}
    benchmark.extra_info["tokens_per_s"] = {k: round(v, 1) for k, v in slowest.items()}
    benchmark.extra_info["vs_full"] = {k: round(v / slowest["full"], 3)
                                       for k, v in slowest.items()}
    benchmark.extra_info["vs_unsharded"] = {k: round(v / slowest["unsharded"], 3)
                                            for k, v in slowest.items()}
    benchmark.extra_info["peak_param_bytes"] = ranks[0]["peak_bytes"]
    for key in ("model_bytes", "shard_bytes", "unit_bytes", "root_bytes", "export_bytes"):
        benchmark.extra_info[key] = ranks[0][key]
    benchmark.extra_info["iter_full_params_GBps"] = round(min(r["export_gbps"] for r in ranks), 3)
