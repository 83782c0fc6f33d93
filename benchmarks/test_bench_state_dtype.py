"""The CPU step with low-precision moments: rlhfz's state_dtype fp32, bf16 and
int8 against torch's fused AdamW (fp32 moments) and the 8-bit AdamWs of
torchao and bitsandbytes, in the same interleaved rounds.

The setup of a training script: 50M fp32 params in 8 nn.Parameters, 2
threads, nonfinite=None (torch's semantics: no NaN check, like for like).
Each entry records its step time, its speed against torch fused, and the
bytes of moments it keeps per param (scales and maps included). fp32
traffic is 28 bytes per param; bf16 moments make it 20 and int8 about 16,
ceilings of 1.4x and 1.75x.

The same rounds time traffic_floor.c: a pass that moves each state width's
bytes with no AdamW arithmetic. torch fused's time over its bf16 and int8
times is the most that fewer bytes can buy against torch on this machine
at the time: the real ceilings beside the nominal ones, which move with the
VM's memory.

A peer that does not run here is recorded with the reason.

Run: python -m pytest benchmarks/test_bench_state_dtype.py -q
"""
import ctypes
import gc
import pathlib
import shutil
import subprocess

import torch

import rlhfz
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


FLOOR_SOURCE = pathlib.Path(__file__).with_name("traffic_floor.c")
STATE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


def _traffic_floor(build_dir) -> tuple[dict, str | None]:
    """({"floor_<dtype>": one pass}, None), or ({}, why it does not run)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return {}, "no C compiler to build traffic_floor.c"
    library = pathlib.Path(build_dir) / "traffic_floor.so"
    built = subprocess.run([compiler, "-std=gnu11", "-O3", "-march=native", "-shared",
                            "-fPIC", "-pthread", str(FLOOR_SOURCE), "-o", str(library)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        return {}, f"traffic_floor.c does not build: {built.stderr.strip()}"[:200]
    lib = ctypes.CDLL(str(library))
    lib.traffic_pass.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_size_t, ctypes.c_int,
                                                         ctypes.c_int]
    # master, grad, exp_avg, exp_avg_sq; a narrower state uses the front bytes
    tensors = [torch.zeros(PARAMS) for _ in range(4)]

    def one_pass(state_bytes):
        def run():
            pointers = [t.data_ptr() for t in tensors]
            if lib.traffic_pass(*pointers, PARAMS, state_bytes, THREADS) != 0:
                raise RuntimeError("traffic_pass refused its arguments")
        return run
    return {f"floor_{dtype}": one_pass(size) for dtype, size in STATE_BYTES.items()}, None


def _stepper(opt):
    def step():
        fresh_grads(opt)
        opt.step()
    return step


def test_state_dtypes_against_torch_and_8bit_peers(benchmark, tmp_path):
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
        floors, floor_missing = _traffic_floor(tmp_path)
        if floor_missing:
            missing["traffic_floor"] = floor_missing
        best = interleaved_best({**fns, **floors}, ROUNDS)
        slow = {name: _stepper(opt) for name, opt in peers.items()}
        for name, opt in peers.items():
            try:
                best.update(interleaved_best({name: slow[name]}, SLOW_ROUNDS))
            except Exception as error:
                missing[name] = f"{type(error).__name__}: {error}"[:200]
        if floors:
            benchmark.extra_info["traffic_floor"] = {
                dtype: {"ms": round(best[f"floor_{dtype}"] * 1e3, 2),
                        "vs_fp32_floor": round(best["floor_fp32"] / best[f"floor_{dtype}"], 3),
                        "vs_torch_fused": round(best["torch_fused"] / best[f"floor_{dtype}"], 3)}
                for dtype in STATE_BYTES}
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
