"""The CPU step with low-precision moments: rlhfz's state_dtype fp32, bf16 and
int8 against torch's fused AdamW (fp32 moments) and the 8-bit AdamWs of
torchao and bitsandbytes, in the same interleaved rounds.

The setup of a training script: 50M fp32 params in 8 nn.Parameters, 2
threads, nonfinite=None (torch's semantics: no NaN check, like for like).
Each entry records its step time, its speed against torch fused, and the
bytes of moments it keeps per param (scales and maps included). fp32
traffic is 28 bytes per param; bf16 moments make it 20 and int8 about 16,
ceilings of 1.4x and 1.75x.

The same rounds time rlhfz's traffic bound (_C.adamw_traffic_bound) at each
state width: the step's loads and stores with no AdamW arithmetic. torch
fused's time over its bf16 and int8 times is the most that fewer bytes can
buy against torch on this machine at the time: the real ceilings beside the
nominal ones, which move with the VM's memory.

A peer that does not run here is recorded with the reason.

Run: python -m pytest benchmarks/test_bench_state_dtype.py -q
"""
import gc

import torch

import rlhfz
from rlhfz import _C
from cpu_timing import fresh_grads, interleaved_best

TENSORS, ROUNDS, THREADS = 8, 10, 2
# 50M params in tensors of whole 256-element blocks: torchao quantizes only
# tensors whose size its block divides (others keep fp32 moments)
PARAMS = TENSORS * (50_000_000 // TENSORS // 256 * 256)
SLOW_ROUNDS = 3             # for a peer many times slower than the rest


def _params():
    params = [torch.nn.Parameter(torch.randn(PARAMS // TENSORS)) for _ in range(TENSORS)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def _moment_bytes(opt) -> int:
    """Bytes of everything an optimizer keeps per param besides the step
    count: tensors, and the codes and scales inside tensor subclasses."""
    total = 0
    for state in opt.state.values():
        for name, value in state.items():
            if name == "step" or not isinstance(value, torch.Tensor):
                continue
            # a tensor subclass (torchao's) reports its inner tensors by name
            names = (value.__tensor_flatten__()[0] if hasattr(value, "__tensor_flatten__")
                     else [])
            inner = [getattr(value, attr) for attr in names]
            total += sum(t.nbytes for t in inner) if inner else value.nbytes
    return total


def _peers() -> tuple[dict, dict]:
    """({name: optimizer}, {name: why it does not run})."""
    made, missing = {}, {}
    try:
        from torchao.optim import AdamW8bit
        made["torchao_adamw8bit"] = AdamW8bit(_params(), lr=1e-3)
    except Exception as error:          # absent, or no CPU path in this version
        missing["torchao_adamw8bit"] = f"{type(error).__name__}: {error}"[:200]
    try:
        import bitsandbytes
        made["bitsandbytes_adamw8bit"] = bitsandbytes.optim.AdamW8bit(_params(), lr=1e-3)
    except Exception as error:
        missing["bitsandbytes_adamw8bit"] = f"{type(error).__name__}: {error}"[:200]
    return made, missing


# the stored width of each state's moments (int8's scales add 4 bytes a block)
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


def _traffic_floors() -> dict:
    """{"floor_<dtype>": one pass of the traffic bound at that moment width}."""
    master, grad = torch.zeros(PARAMS), torch.zeros(PARAMS)
    moments = {dtype: (torch.zeros(PARAMS, dtype=width), torch.zeros(PARAMS, dtype=width))
               for dtype, width in MOMENT_DTYPES.items()}
    return {f"floor_{dtype}": (lambda m=m, v=v: _C.adamw_traffic_bound(master, grad, m, v))
            for dtype, (m, v) in moments.items()}


def _stepper(opt):
    def step():
        fresh_grads(opt)
        opt.step()
    return step


def test_state_dtypes_against_torch_and_8bit_peers(benchmark):
    benchmark.group = "adamw-cpu-state-dtype-50M"
    saved_threads = torch.get_num_threads(), rlhfz.get_num_threads()
    torch.set_num_threads(THREADS)
    rlhfz.set_num_threads(THREADS)
    try:
        opts = {f"rlhfz_{dtype}": rlhfz.ZeroAdamW(_params(), lr=1e-3, nonfinite=None,
                                                  state_dtype=dtype)
                for dtype in ("fp32", "bf16", "int8")}
        opts["torch_fused"] = torch.optim.AdamW(_params(), lr=1e-3, fused=True)
        peers, missing = _peers()
        fns = {name: _stepper(opt) for name, opt in opts.items()}
        floors = _traffic_floors()
        best = interleaved_best({**fns, **floors}, ROUNDS)
        slow = {name: _stepper(opt) for name, opt in peers.items()}
        for name, opt in peers.items():
            try:
                best.update(interleaved_best({name: slow[name]}, SLOW_ROUNDS))
            except Exception as error:
                missing[name] = f"{type(error).__name__}: {error}"[:200]
        benchmark.extra_info["traffic_floor"] = {
            dtype: {"ms": round(best[f"floor_{dtype}"] * 1e3, 2),
                    "vs_fp32_floor": round(best["floor_fp32"] / best[f"floor_{dtype}"], 3),
                    "vs_torch_fused": round(best["torch_fused"] / best[f"floor_{dtype}"], 3)}
            for dtype in MOMENT_DTYPES}
        for name in floors:
            del best[name]
        for name, seconds in best.items():
            opt = opts.get(name) or peers[name]
            benchmark.extra_info[name] = {
                "ms": round(seconds * 1e3, 2),
                "vs_torch_fused": round(best["torch_fused"] / seconds, 3),
                "moment_bytes_per_param": round(_moment_bytes(opt) / PARAMS, 3)}
        for name, opt in opts.items():
            if name.startswith("rlhfz"):
                report = opt.memory_report()
                benchmark.extra_info[name]["memory_report_moments_per_param"] = round(
                    sum(sum(report[k].values()) for k in ("exp_avg", "exp_avg_sq")) / PARAMS, 3)
        benchmark.extra_info["not_run"] = missing
        benchmark.extra_info["params"] = PARAMS
        benchmark.extra_info["threads"] = THREADS
        benchmark.pedantic(fns["rlhfz_int8"], rounds=3, iterations=1)
    finally:
        torch.set_num_threads(saved_threads[0])
        rlhfz.set_num_threads(saved_threads[1])
        gc.collect()
