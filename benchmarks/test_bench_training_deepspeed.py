"""Training iterations on 2 gloo ranks (CPU): rlhfz ZeroAdamW at stages 2 and
3 against DeepSpeed's ZeRO-2 and ZeRO-3 engines on its CPU accelerator.

The model is a 27.2M-param GPT-2 (6 layers, 512 wide, 16k vocabulary tied to
the head), fp32, no dropout, the same initial weights everywhere; each rank
trains on its own fixed, seeded batch of 4 x 64 token ids with the model's LM
loss. One iteration is zero_grad, forward, backward and the optimizer step
(DeepSpeed: engine.backward and engine.step); both step AdamW with the same
hyper-parameters, DeepSpeed through DeepSpeedCPUAdam on its fp32 partition;
without clipping, and with a clip to global norm 1.0 (rlhfz's
clip_grad_norm_, DeepSpeed's gradient_clipping), as RLHF loops run. Each rank times its iterations after a warmup; the slowest
rank's median goes into extra_info as iter_ms.

Each implementation runs in processes of its own. The losses of every step
are recorded, and the second of a stage's pair to run checks that they agree
with the first's within 1e-4 (same weights, data and update; the kernels
round differently) and records the largest difference. DeepSpeed's cases
skip, with the reason, where it is not installed. Ranks share the machine's
cores, one thread each.

Run: python -m pytest benchmarks/test_bench_training_deepspeed.py
"""
import pytest

import training_workers
from peers import deepspeed_cpu_adam_or_skip
from rlhfz.launch import run_ranks

pytest.importorskip("transformers")

STEPS, WARMUP = 10, 2
# fp32 on both sides, but different reduction orders and AdamW kernels
LOSS_ATOL = 1e-4
_losses: dict[tuple, tuple[str, list]] = {}   # (stage, clip) -> (impl, rank 0's losses)


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["no-clip", "clip-1.0"])
@pytest.mark.parametrize("impl", ["rlhfz_stage2", "deepspeed_zero2", "rlhfz_stage3",
                                  "deepspeed_zero3"])
def test_training_iteration_2_ranks(benchmark, impl, clip):
    if impl.startswith("deepspeed"):
        deepspeed_cpu_adam_or_skip()
    benchmark.group = f"training-iteration-gloo-2ranks-{'clip' if clip else 'no-clip'}"
    results = []

    def run():
        results.append(run_ranks(training_workers.run, 2, impl, STEPS, WARMUP, clip,
                                 timeout=600))

    benchmark.pedantic(run, rounds=1, iterations=1)
    ranks = results[-1]
    losses = ranks[0]["losses"]
    benchmark.extra_info.update(
        params=ranks[0]["numel"], steps=STEPS, warmup=WARMUP,
        iter_ms=round(1e3 * max(r["iter_median_s"] for r in ranks), 2),
        loss_first=losses[0], loss_last=losses[-1], losses=losses)
    key = (int(impl[-1]), clip)
    if key in _losses:
        other, theirs = _losses[key]
        diff = max(abs(a - b) for a, b in zip(losses, theirs))
        benchmark.extra_info[f"loss_max_abs_diff_vs_{other}"] = diff
        assert diff <= LOSS_ATOL, f"{impl} and {other} disagree: {losses} vs {theirs}"
    else:
        _losses[key] = (impl, losses)
