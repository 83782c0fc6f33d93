"""make gpu-check: every GPU test, then the GPU benchmarks, and a summary table.

Runs `pytest -m gpu tests` (the CUDA kernels, the optimizer on CUDA, device
Buffers, NCCL), then the benchmarks in benchmarks/test_bench_*cuda*.py with
--benchmark-json, and prints per benchmark: median ms, GB/s (AdamW's 28
bytes per param), the fraction of the copy bound measured in the same run,
and the speedup over torch's fused AdamW of the same size.

Exit status: 0 when the tests and benchmarks ran and passed (speed targets
are reported, not enforced); 1 when any failed; 2 when there is no GPU that
both torch and rlhfz can use, so nothing ran.

`make gpu-check` builds rlhfz in place without touching dependencies, so a
GPU machine keeps its own CUDA build of torch.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = "tests"
BENCHMARKS = sorted(os.path.relpath(path, ROOT) for path in
                    glob.glob(os.path.join(ROOT, "benchmarks", "test_bench_*cuda*.py")))
EXIT_NO_GPU = 2


def _gpu_problem() -> str | None:
    """Why the GPU checks cannot run here, or None if they can."""
    try:
        import torch
    except ImportError as error:
        return f"torch cannot be imported ({error})"
    try:
        import rlhfz
    except ImportError as error:
        return f"rlhfz cannot be imported ({error}); run make install"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    info = rlhfz.build_info()
    if not info["cuda"]:
        reason = info.get("cuda_error") or "no reason given"
        if not info.get("cuda_compiled"):
            reason = "rlhfz was built without CUDA (no nvcc at build time, or RLHFZ_CUDA=0)"
        return f"rlhfz cannot use CUDA: {reason}"
    return None


def _describe() -> None:
    import torch

    import rlhfz
    info = rlhfz.build_info()
    props = torch.cuda.get_device_properties(0)
    print(f"device: {torch.cuda.get_device_name(0)} (sm_{props.major}{props.minor}, "
          f"{props.total_memory / 2**30:.0f} GiB), {torch.cuda.device_count()} visible")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); rlhfz {info['version']} "
          f"(CUDA runtime {info.get('cuda_runtime_version')}, NCCL "
          f"{info.get('nccl_version') if info.get('nccl') else 'unavailable'}); "
          f"python {sys.version.split()[0]}")


def _run(title: str, args: list[str]) -> int:
    command = [sys.executable, "-m", "pytest", *args]
    print(f"\n==== {title}: {' '.join(command[1:])}", flush=True)
    return subprocess.call(command, cwd=ROOT)


def _summary(json_path: str) -> list[str]:
    """The table's lines, from pytest-benchmark's json (extra_info carries
    the implementation, size, GB/s and fraction of the bound)."""
    try:
        with open(json_path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return ["(no benchmark results were written)"]
    rows = []
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        rows.append({"implementation": info.get("implementation", bench["name"]),
                     "size": info.get("size", ""), "ms": bench["stats"]["median"] * 1e3,
                     "gbps": info.get("gbps"), "fraction": info.get("fraction_of_bound"),
                     "params": info.get("params", 0)})
    if not rows:
        return ["(no benchmarks ran: see the skip reasons above)"]
    fused = {r["size"]: r["ms"] for r in rows if r["implementation"] == "torch_fused"}
    rows.sort(key=lambda r: (r["params"], r["implementation"]))

    def cell(value, fmt):
        return format(value, fmt) if value is not None else "-"

    header = ("implementation", "size", "median ms", "GB/s", "of copy bound", "vs torch fused")
    table = [header]
    for r in rows:
        speedup = (fused[r["size"]] / r["ms"]
                   if r["size"] in fused and r["implementation"] != "copy_bound" else None)
        table.append((r["implementation"], r["size"], cell(r["ms"], ".3f"), cell(r["gbps"], ".1f"),
                      cell(r["fraction"], ".3f"), cell(speedup, ".3f") + ("x" if speedup else "")))
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) if i < 2 else str(v).rjust(w)
                       for i, (v, w) in enumerate(zip(line, widths))) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))

    for r in rows:
        if r["implementation"] == "rlhfz_kernel" and r["size"] == "1B":
            fraction, speedup = r["fraction"], fused.get("1B") and fused["1B"] / r["ms"]
            lines.append("")
            lines.append(f"targets at 1B (reported, not enforced): fraction of copy bound "
                         f"{cell(fraction, '.3f')} (>= 0.9: "
                         f"{'met' if fraction and fraction >= 0.9 else 'MISSED'}), speedup vs "
                         f"torch fused {cell(speedup, '.3f')} (>= 1.1: "
                         f"{'met' if speedup and speedup >= 1.1 else 'MISSED'})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tests", action="store_true", help="run only the benchmarks")
    parser.add_argument("--no-bench", action="store_true", help="run only the tests")
    args = parser.parse_args(argv)

    problem = _gpu_problem()
    if problem is not None:
        unrun = ([] if args.no_tests else [f"pytest -m gpu {TESTS}"]) + \
                ([] if args.no_bench else BENCHMARKS)
        print(f"gpu-check: NOT RUN: {problem}.\nThese checks did not run: "
              f"{', '.join(unrun) or 'none asked for'}.\nRun make gpu-check on a machine with "
              f"a CUDA GPU, with rlhfz built there by nvcc.", file=sys.stderr)
        return EXIT_NO_GPU
    _describe()

    failed = []
    if not args.no_tests:
        rc = _run("GPU tests", ["-m", "gpu", TESTS, "-q", "-rs"])
        if rc != 0:
            failed.append(f"GPU tests (pytest exit {rc}"
                          f"{': no tests collected' if rc == 5 else ''})")
    summary = []
    if not args.no_bench:
        with tempfile.TemporaryDirectory() as tmp:
            json_path = os.path.join(tmp, "benchmarks.json")
            rc = _run("GPU benchmarks", [*BENCHMARKS, "-q", "-rs", f"--benchmark-json={json_path}",
                                         "--benchmark-columns=median,min,max,rounds",
                                         "--benchmark-group-by=group"])
            if rc != 0:
                failed.append(f"GPU benchmarks (pytest exit {rc})")
            summary = _summary(json_path)

    if summary:
        print("\n==== summary (medians; GB/s counts 28 bytes per param; bound: device copy)")
        print("\n".join(summary))
    print()
    if failed:
        print("gpu-check: FAILED: " + "; ".join(failed))
        return 1
    print("gpu-check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
