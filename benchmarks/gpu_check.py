"""make gpu-check / make gpu-sanitize: rlhfz on a real GPU, within a 30-minute window.

`make gpu-check` builds rlhfz in place (`setup.py build_ext --inplace`, nothing
installed: a GPU machine keeps its own CUDA torch and may have no network),
then runs this script. Each phase is its own pytest process under a
wall-clock limit; a phase cut off is recorded as such and the run goes on.

1. Benchmarks first, so that a short window still measures speed:
   - bench-adamw-100M, bench-adamw-1B: the CUDA AdamW step against torch's
     fused and foreach AdamW, with the device copy bound of the same run;
   - bench-offload: offload/reload GB/s against one pinned cudaMemcpy of the
     same bytes, and a step with host-resident optimizer state;
   - bench-offload-sweep: the same at 1, 4 and 8 GiB of state;
   - bench-offload-step-1B: a 1B-param step with its state on the device,
     half on the host, all on the host;
   - bench-nccl: rlhfz's native NCCL engine against torch.distributed's, per
     collective and in a stage-2 iteration (one GPU: a world of one rank).
   - bench-weight-sync-cpu: gloo weight sync on the machine's CPU cores; it
     needs no GPU, only more cores than a CI machine has.
   Stage-3 generation needs two ranks, so two GPUs under NCCL: it is not a
   phase while gpu-check runs on one (its CPU benchmark is the gloo one).
2. The GPU test files, one pytest run each (an import error in one cannot
   hide the others), weight sync from GPU memory (two ranks on the one GPU,
   over gloo), and the offload benchmark file once as a plain test.
   The kernel file's compute-sanitizer test is left to make gpu-sanitize.

`--sanitizer` (make gpu-sanitize) first checks that compute-sanitizer exists
and can run a small CUDA program here, then runs the kernel file's own
sanitizer test, memcheck over the GPU test files, and racecheck and synccheck
over the kernel tests.

pytest-timeout, where installed, limits each test as well (`--timeout`);
without it only the phase limits apply, and the plan says so. `--budget S`
caps the whole run: a phase that cannot start in time is recorded "not run".

Everything goes under --out DIR (else $RLHFZ_GPU_CHECK_OUT, else
build/gpu-check), in few files, as a GPU machine sends back at most 8:
  summary.md                   device, versions, each phase's status and
                               counts, the benchmark tables: Markdown for
                               benchmarks/RESULTS.md; rewritten after every phase
  gpu-check-artifacts.tar.gz   each finished phase's log.txt, junit.xml and
                               benchmark.json; repacked after every phase
  NN-phase/                    the running phase's files, folded into the
                               archive when it ends
(--sanitizer: sanitize-summary.md and gpu-sanitize-artifacts.tar.gz.) A run
killed part-way leaves every finished phase and the running one's log so far.

Exit status: 0 when every phase passed (speed targets are reported, not
enforced); 1 when any failed, was cut off or did not run; 2 when nothing
could run: no GPU that both torch and rlhfz can use, no pytest, or (with
--sanitizer) no working compute-sanitizer. `--dry-run` prints the plan,
runs nothing and exits 0.
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join("build", "gpu-check")
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2
# After a phase's limit: SIGINT lets pytest write its junit and benchmark
# files for what finished; SIGKILL follows if it has not exited by then.
GRACE_S = 20
SANITIZER_ERROR_EXIT = 99      # compute-sanitizer's exit status when it found errors
PROBE_LIMIT_S = 150            # compute-sanitizer --version, --help and a small run
# The sanitizer test spawns compute-sanitizer itself: gpu-sanitize runs it.
NOT_SANITIZER_TEST = ["-k", "not compute_sanitizer"]
# kernels are named rlhfz_<op>_kernel: race- and sync-check only ours, not torch's
RLHFZ_KERNELS = "kns=rlhfz_"

PROBE_PROGRAM = (
    "from rlhfz import _C; b = _C.Buffer(4096, tier='device'); "
    "_C.cuda_store(b, 0, b'\\0' * 4096); _C.cuda_scale_(b.view('float32', 0, (1024,)), 2.0); "
    "assert bytes(_C.cuda_fetch(b, 0, 4096)) == b'\\0' * 4096; print('rlhfz-sanitizer-probe-ok')")


@dataclass
class Phase:
    name: str
    kind: str                   # "bench", "test" or "sanitizer"
    target: str                 # the file pytest runs
    limit_s: int                # wall clock for the whole pytest process
    test_timeout_s: int         # pytest-timeout's limit per test
    args: list[str] = field(default_factory=list)
    tool: str | None = None     # compute-sanitizer --tool, for kind "sanitizer"
    kernel_filter: bool = False  # check rlhfz's kernels only
    needs_benchmark_plugin: bool = False
    env: dict[str, str] = field(default_factory=dict)


def _bench(name, target, limit_s, test_timeout_s, args=()):
    return Phase(name, "bench", target, limit_s, test_timeout_s, list(args),
                 needs_benchmark_plugin=True)


def _test(name, target, limit_s, test_timeout_s=60, args=(), plugin=False):
    return Phase(name, "test", target, limit_s, test_timeout_s, list(args),
                 needs_benchmark_plugin=plugin)


def _sanitize(name, tool, target, limit_s, kernel_filter=True):
    # without torch's caching allocator memcheck sees each tensor's real bounds
    env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"} if tool == "memcheck" else {}
    # tests run 10-100x slower under the tool: one stuck test still leaves time for the rest
    return Phase(name, "sanitizer", target, limit_s, min(120, limit_s - 10), NOT_SANITIZER_TEST,
                 tool=tool, kernel_filter=kernel_filter, env=env)


# Benchmarks first (18.5 minutes of limits; they took 2.5 on an H200), then
# the tests (12 minutes of limits; 1.8 on an H200 before the low-precision step's).
CHECK_PHASES = [
    # one process per size: a 1B run cut off still leaves the 100M table
    _bench("bench-adamw-100M", "benchmarks/test_bench_adamw_cuda.py", 120, 60, ["-k", "100M"]),
    _bench("bench-adamw-1B", "benchmarks/test_bench_adamw_cuda.py", 210, 150, ["-k", "1B"]),
    # the device <-> pinned comparisons at 1 GiB and a 32M step with host-resident state
    _bench("bench-offload", "benchmarks/test_bench_offload.py", 150, 60,
           ["-k", "not disk and not sweep and not 1B"]),
    # 1, 4 and 8 GiB of state each way against cudaMemcpy; a 1B step with state on the host
    _bench("bench-offload-sweep", "benchmarks/test_bench_offload.py", 240, 120, ["-k", "sweep"]),
    _bench("bench-offload-step-1B", "benchmarks/test_bench_offload.py", 240, 150, ["-k", "1B"]),
    _bench("bench-nccl", "benchmarks/test_bench_nccl_cuda.py", 150, 60),
    # on the CPU, the last benchmark: weight sync over gloo with a core for each
    # of its 4 ranks, which a 2-core machine cannot give (1.2 minutes there)
    _bench("bench-weight-sync-cpu", "benchmarks/test_bench_weight_sync.py", 150, 140),
    _test("test-cuda-buffers", "tests/test_cuda_buffers.py", 45),
    _test("test-cuda-collectives", "tests/test_cuda_collectives.py", 60),
    _test("test-cuda-kernels", "tests/test_cuda_kernels.py", 150, args=NOT_SANITIZER_TEST),
    _test("test-cuda-lowp-kernels", "tests/test_cuda_lowp_kernels.py", 60),
    _test("test-cuda-ops-args", "tests/test_cuda_ops_args.py", 45),
    _test("test-cuda-optim", "tests/test_cuda_optim.py", 120),
    _test("test-offload-cuda", "tests/test_offload_cuda.py", 90),
    _test("test-nccl", "tests/test_nccl.py", 90, test_timeout_s=80),
    # two ranks on the one GPU over gloo: device bytes staged through host memory
    _test("test-weight-sync-device", "tests/test_weight_sync_device.py", 150,
          test_timeout_s=120),
    # each benchmark once, as a test: the timings are the bench-offload phases'
    _test("test-bench-offload", "benchmarks/test_bench_offload.py", 60,
          args=["--benchmark-disable", "-k", "not sweep and not 1B"], plugin=True),
]

# With the probe, 30.5 minutes at most.
SANITIZE_PHASES = [
    # memcheck, racecheck, initcheck and synccheck over every kernel, without torch
    Phase("kernels-sanitizer-test", "test", "tests/test_cuda_kernels.py", 300, 290,
          ["-k", "compute_sanitizer"]),
    _sanitize("memcheck-cuda-kernels", "memcheck", "tests/test_cuda_kernels.py", 300),
    _sanitize("memcheck-cuda-buffers", "memcheck", "tests/test_cuda_buffers.py", 90),
    # rlhfz's kernels only: under memcheck every one of torch's kernels is
    # instrumented as it loads, and the optimizer file alone took over 180 s
    _sanitize("memcheck-cuda-optim", "memcheck", "tests/test_cuda_optim.py", 240),
    _sanitize("memcheck-offload-cuda", "memcheck", "tests/test_offload_cuda.py", 150),
    _sanitize("racecheck-cuda-kernels", "racecheck", "tests/test_cuda_kernels.py", 240),
    _sanitize("synccheck-cuda-kernels", "synccheck", "tests/test_cuda_kernels.py", 180),
    # the low-precision step: its loads and stores, and the int8 step's block max in shared memory
    _sanitize("memcheck-cuda-lowp-kernels", "memcheck", "tests/test_cuda_lowp_kernels.py", 90),
    _sanitize("racecheck-cuda-lowp-kernels", "racecheck", "tests/test_cuda_lowp_kernels.py", 90),
]


@dataclass
class Mode:
    """What one invocation runs and the names of its files in the output directory."""
    title: str
    summary_name: str
    archive_name: str
    phases: list[Phase]

    @property
    def archive_root(self) -> str:
        return self.archive_name.split(".")[0]


CHECK = Mode("make gpu-check", "summary.md", "gpu-check-artifacts.tar.gz", CHECK_PHASES)
SANITIZE = Mode("make gpu-sanitize", "sanitize-summary.md", "gpu-sanitize-artifacts.tar.gz",
                SANITIZE_PHASES)


@dataclass
class Result:
    status: str = "pending"
    seconds: float | None = None
    passed: int | None = None
    failed: int | None = None
    skipped: int | None = None
    sanitizer_errors: int | None = None
    note: str = ""


FAILING = {"failed", "error", "timed out", "interrupted", "no tests", "all skipped",
           "sanitizer errors", "not run"}


class Stopped(Exception):
    """SIGTERM or SIGINT reached this script: stop the phase, write what finished."""


# ---- the environment ----------------------------------------------------------------------

def _plugin(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _gpu_problem() -> str | None:
    """Why the GPU checks cannot run here, or None if they can."""
    if not _plugin("pytest"):
        return "pytest cannot be imported"
    try:
        import torch
    except ImportError as error:
        return f"torch cannot be imported ({error})"
    try:
        import rlhfz
    except ImportError as error:
        return f"rlhfz cannot be imported ({error}); make gpu-check builds it in place"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    info = rlhfz.build_info()
    if not info["cuda"]:
        reason = info.get("cuda_error") or "no reason given"
        if not info.get("cuda_compiled"):
            reason = "rlhfz was built without CUDA (no nvcc at build time, or RLHFZ_CUDA=0)"
        return f"rlhfz cannot use CUDA: {reason}"
    return None


def _cuda_version(code) -> str | None:
    """CUDA's integer version as a dotted one: 13000 -> 13.0."""
    return f"{code // 1000}.{code % 1000 // 10}" if isinstance(code, int) and code > 0 else None


def _nccl_version(code) -> str | None:
    """NCCL's version, a tuple or NCCL_VERSION_CODE, as a dotted one: 23203 -> 2.32.3."""
    if isinstance(code, (tuple, list)):
        return ".".join(str(part) for part in code)
    if not isinstance(code, int) or code <= 0:
        return None
    if code >= 10000:                                        # NCCL >= 2.9
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _environment() -> dict:
    import torch

    import rlhfz
    info = rlhfz.build_info()
    props = torch.cuda.get_device_properties(0)
    try:
        torch_nccl = _nccl_version(torch.cuda.nccl.version())
    except Exception:          # a torch built without NCCL
        torch_nccl = None
    env = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0),
        "capability": f"sm_{props.major}{props.minor}",
        "memory_gib": round(props.total_memory / 2**30),
        "devices": torch.cuda.device_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "torch_nccl": torch_nccl,
        "rlhfz": info["version"],
        "rlhfz_cuda_runtime": _cuda_version(info.get("cuda_runtime_version")),
        "rlhfz_nccl": _nccl_version(info.get("nccl_version")) if info.get("nccl") else None,
        "rlhfz_nccl_error": None if info.get("nccl") else info.get("nccl_error"),
        "python": sys.version.split()[0],
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            env["driver"] = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    return env


def _heading(env: dict | None) -> str:
    if not env:
        return f"## {datetime.date.today().isoformat()}, GPU: none usable"
    nccl = env["rlhfz_nccl"] or f"unavailable ({env['rlhfz_nccl_error']})"
    driver = f", driver {env['driver']}" if env.get("driver") else ""
    return (f"## {env['date']}, GPU: {env['device']} ({env['capability']}, "
            f"{env['memory_gib']} GiB, {env['devices']} visible{driver}); torch {env['torch']} "
            f"(CUDA {env['torch_cuda']}, NCCL {env['torch_nccl'] or '-'}); rlhfz {env['rlhfz']} "
            f"(CUDA runtime {env['rlhfz_cuda_runtime']}, NCCL {nccl}); python {env['python']}")


# ---- compute-sanitizer ------------------------------------------------------------------------

def _find_sanitizer() -> str | None:
    candidates = [shutil.which("compute-sanitizer")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "compute-sanitizer"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def _sanitizer_errors(text: str) -> int | None:
    """Errors the tool reported, summed over the processes it watched."""
    counts = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    counts += [int(n) for n in
               re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", text)]
    return sum(counts) if counts else None


def _probe_sanitizer(sanitizer: str, env: dict, log) -> tuple[str | None, bool, str]:
    """(why compute-sanitizer cannot be used here or None, whether it takes
    --kernel-name, its version line); the outputs go to the log."""
    def run(args, timeout):
        log.write(f"$ {shlex.join(args)}\n")
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        output = proc.stdout + proc.stderr
        log.write(output + f"(exit {proc.returncode})\n\n")
        log.flush()
        return proc.returncode, output

    try:
        rc, output = run([sanitizer, "--version"], 30)
        if rc != 0:
            return f"`{sanitizer} --version` exited {rc}", True, ""
        version = next((line.strip() for line in output.splitlines() if "ersion" in line),
                       output.strip().splitlines()[-1] if output.strip() else "")
        version = version or os.path.basename(sanitizer)
        _, help_text = run([sanitizer, "--help"], 30)
        kernel_filter = "--kernel-name" in help_text
        rc, output = run([sanitizer, "--tool", "memcheck",
                          f"--error-exitcode={SANITIZER_ERROR_EXIT}", sys.executable, "-c",
                          PROBE_PROGRAM], PROBE_LIMIT_S - 60)
    except subprocess.TimeoutExpired as error:
        return f"`{shlex.join(error.cmd)}` did not finish in {error.timeout} s", True, ""
    except OSError as error:
        return f"{sanitizer} cannot be started ({error})", True, ""
    # errors found in the small program still prove the tool works: the phases report them
    if "rlhfz-sanitizer-probe-ok" not in output and _sanitizer_errors(output) is None:
        tail = "\n".join(output.strip().splitlines()[-15:])
        return (f"compute-sanitizer could not run a small rlhfz program (exit {rc}):\n{tail}",
                kernel_filter, version)
    return None, kernel_filter, version


# ---- phases -----------------------------------------------------------------------------------

@dataclass
class Context:
    out: str                    # absolute
    mode: Mode
    timeout_plugin: bool
    benchmark_plugin: bool
    sanitizer: str | None = None
    kernel_filter: bool = True
    env: dict | None = None
    sanitizer_version: str = ""


def _shown(path: str) -> str:
    """Paths under the repository relative to it: the commands run there."""
    relative = os.path.relpath(path, ROOT)
    return path if relative.startswith("..") else relative


def _phase_dir(ctx: Context, index: int, phase: Phase) -> str:
    return os.path.join(ctx.out, f"{index:02d}-{phase.name}")


def _files(phase: Phase) -> list[str]:
    return ["log.txt", "junit.xml"] + (["benchmark.json"] if phase.kind == "bench" else [])


def _test_timeout(phase: Phase, limit_s: float) -> int:
    """pytest-timeout's limit: the phase's, inside what is left of its wall clock."""
    return max(5, min(phase.test_timeout_s, int(limit_s) - 5))


def _command(ctx: Context, index: int, phase: Phase, limit_s: float) -> list[str]:
    where = _phase_dir(ctx, index, phase)
    command = [sys.executable, "-m", "pytest", phase.target, *phase.args, "-q", "-rs",
               "-p", "no:cacheprovider", f"--junitxml={_shown(os.path.join(where, 'junit.xml'))}"]
    if ctx.timeout_plugin:
        command.append(f"--timeout={_test_timeout(phase, limit_s)}")
    if phase.kind == "bench":
        command += ["-p", "gpu_check",
                    f"--benchmark-json={_shown(os.path.join(where, 'benchmark.json'))}",
                    "--benchmark-columns=median,min,max,rounds", "--benchmark-group-by=group"]
    if phase.kind == "sanitizer":
        wrapper = [ctx.sanitizer or "compute-sanitizer", "--tool", phase.tool,
                   f"--error-exitcode={SANITIZER_ERROR_EXIT}"]
        if phase.kernel_filter and ctx.kernel_filter:
            wrapper += ["--kernel-name", RLHFZ_KERNELS]
        command = wrapper + command
    return command


def _phase_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # the in-place build, for the processes the tests start themselves; benchmarks/
    # for this file as the benchmark phases' plugin (-p gpu_check)
    paths = [ROOT, os.path.join(ROOT, "benchmarks")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                 else []))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Interrupts the phase's process group, then kills what is left of it."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # also ranks and workers left behind
    except ProcessLookupError:
        pass
    proc.wait()


def _execute(command: list[str], env: dict, log_path: str, limit_s: float) -> tuple[int, bool]:
    """Runs command in its own process group, its output streamed to the
    console and to log_path as it comes. Returns (exit status, cut off)."""
    with open(log_path, "ab", buffering=0) as log:
        log.write(f"$ {shlex.join(command)}\n(limit {limit_s:.0f} s)\n\n".encode())
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)

        def pump():
            for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):
                log.write(chunk)
                try:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
                except (OSError, ValueError):
                    pass

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        cut_off = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            cut_off = True
            _stop_group(proc, GRACE_S)
        except Stopped:
            _stop_group(proc, 5)
            reader.join(timeout=5)
            log.write(b"\n(stopped: this script was interrupted)\n")
            raise
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # stray children of a finished pytest
        except (ProcessLookupError, PermissionError):
            pass
        reader.join(timeout=10)
        if cut_off:
            log.write(f"\n(cut off: the phase's limit of {limit_s:.0f} s was reached)\n".encode())
        return proc.returncode, cut_off


def _counts(junit_path: str, log_path: str) -> dict | None:
    """passed / failed (with errors) / skipped from the junit file, or from
    pytest's closing line when the file is missing."""
    try:
        root = ET.parse(junit_path).getroot()
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        total = {key: sum(int(s.get(key, 0)) for s in suites)
                 for key in ("tests", "failures", "errors", "skipped")}
        failed = total["failures"] + total["errors"]
        return dict(passed=total["tests"] - failed - total["skipped"], failed=failed,
                    skipped=total["skipped"])
    except (OSError, ET.ParseError, ValueError):
        pass
    try:
        with open(log_path, errors="replace") as f:
            lines = [line for line in f if re.search(r"\d+ (passed|failed|error|skipped)", line)
                     and re.search(r" in [\d.]+s", line)]
    except OSError:
        return None
    if not lines:
        return None
    found = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)",
                                                    lines[-1])}
    return dict(passed=found.get("passed", 0),
                failed=found.get("failed", 0) + found.get("error", 0) + found.get("errors", 0),
                skipped=found.get("skipped", 0))


def _status(phase: Phase, rc: int, cut_off: bool, result: Result) -> str:
    if cut_off:
        return "timed out"
    if phase.kind == "sanitizer" and (rc == SANITIZER_ERROR_EXIT or result.sanitizer_errors):
        return "sanitizer errors"
    if rc == 5:
        return "no tests"
    if rc not in (0, 1):        # a collection error, an internal or usage error, a signal
        return "error"
    if rc == 1 or (result.failed or 0) > 0:
        return "failed"
    if result.passed == 0 and (result.skipped or 0) > 0:
        return "all skipped"     # on a GPU machine a GPU phase that runs nothing is broken
    return "passed"


def _run_phase(ctx: Context, index: int, phase: Phase, limit_s: float) -> Result:
    where = _phase_dir(ctx, index, phase)
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(where)
    log_path = os.path.join(where, "log.txt")
    command = _command(ctx, index, phase, limit_s)
    print(f"\n==== {phase.name} (limit {limit_s:.0f} s): {shlex.join(command)}", flush=True)
    result = Result(status="running")
    start = time.monotonic()
    try:
        rc, cut_off = _execute(command, _phase_env(phase.env), log_path, limit_s)
    except OSError as error:
        with open(log_path, "a") as f:
            f.write(f"cannot start: {error}\n")
        return Result("error", time.monotonic() - start, note=f"cannot start: {error}")
    except Stopped as stop:
        result = Result("interrupted", time.monotonic() - start, note=str(stop))
        result.__dict__.update(_counts(os.path.join(where, "junit.xml"), log_path) or {})
        return result
    result.seconds = time.monotonic() - start
    result.__dict__.update(_counts(os.path.join(where, "junit.xml"), log_path) or {})
    if phase.kind == "sanitizer":
        with open(log_path, errors="replace") as f:
            result.sanitizer_errors = _sanitizer_errors(f.read())
    result.status = _status(phase, rc, cut_off, result)
    if cut_off:
        result.note = f"cut off after {limit_s:.0f} s"
    elif result.status in ("error", "failed", "no tests", "sanitizer errors"):
        result.note = f"exit {rc}"
    return result


# ---- output: the archive and summary.md -------------------------------------------------------

def _replace(path: str, data: bytes) -> None:
    """Writes path whole or not at all: a kill leaves the old or the new file."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _pack(ctx: Context, directory: str | None, extra: dict[str, bytes] | None = None) -> None:
    """Adds a finished phase's directory (and in-memory files) to the archive,
    then removes the directory, so the output keeps a handful of files."""
    archive = os.path.join(ctx.out, ctx.mode.archive_name)
    root = ctx.mode.archive_root
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as new:
        if os.path.exists(archive):
            try:
                with tarfile.open(archive, "r:gz") as old:
                    for member in old.getmembers():
                        new.addfile(member, old.extractfile(member) if member.isfile() else None)
            except (OSError, tarfile.TarError, EOFError):
                pass     # a damaged archive from a killed run: start it again
        if directory and os.path.isdir(directory):
            new.add(directory, arcname=f"{root}/{os.path.basename(directory)}")
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size, info.mtime = len(data), int(time.time())
            new.addfile(info, io.BytesIO(data))
    _replace(archive, buffer.getvalue())
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def _cell(value, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def _markdown(header, rows) -> list[str]:
    return (["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
            + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows])


def _load(json_path: str) -> list[dict] | None:
    try:
        with open(json_path) as f:
            return json.load(f).get("benchmarks", [])
    except (OSError, ValueError, AttributeError):
        return None


def _adamw_table(benchmarks: list[dict]) -> list[str]:
    """The AdamW rows from pytest-benchmark's json (extra_info carries the
    implementation, size, GB/s and fraction of the bound)."""
    rows = []
    for bench in benchmarks:
        info = bench.get("extra_info", {})
        rows.append({"implementation": info.get("implementation", bench["name"]),
                     "size": info.get("size", ""), "ms": bench["stats"]["median"] * 1e3,
                     "gbps": info.get("gbps"), "fraction": info.get("fraction_of_bound"),
                     "params": info.get("params", 0)})
    fused = {r["size"]: r["ms"] for r in rows if r["implementation"] == "torch_fused"}
    rows.sort(key=lambda r: (r["params"], r["implementation"]))
    table = []
    for r in rows:
        speedup = (fused[r["size"]] / r["ms"]
                   if r["size"] in fused and r["implementation"] != "copy_bound" else None)
        table.append((r["implementation"], r["size"], _cell(r["ms"], ".3f"),
                      _cell(r["gbps"], ".1f"), _cell(r["fraction"], ".3f"),
                      _cell(speedup, ".3f") + ("x" if speedup else "")))
    lines = _markdown(("implementation", "size", "median ms", "GB/s", "fraction of bound",
                       "speedup vs torch fused"), table)
    for r in rows:
        if r["implementation"] == "rlhfz_kernel" and r["size"] == "1B":
            fraction, speedup = r["fraction"], fused.get("1B") and fused["1B"] / r["ms"]
            lines.append("")
            lines.append(f"Targets at 1B (reported, not enforced): fraction of the copy bound "
                         f"{_cell(fraction, '.3f')} (>= 0.9: "
                         f"{'met' if fraction and fraction >= 0.9 else 'MISSED'}), speedup vs "
                         f"torch fused {_cell(speedup, '.3f')} (>= 1.1: "
                         f"{'met' if speedup and speedup >= 1.1 else 'MISSED'}).")
    return lines


def _offload_table(benchmarks: list[dict]) -> list[str]:
    table = []
    for bench in benchmarks:
        info = bench.get("extra_info", {})
        name = bench["name"].removeprefix("test_")
        if "offload_ratio" in info:
            name = f"rlhfz step, offload_ratio={info['offload_ratio']}"
        fraction = info.get("fraction_of_raw_copy", 1.0 if name.startswith("raw_") else None)
        table.append((name, bench.get("group") or "", _cell(bench["stats"]["median"] * 1e3, ".3f"),
                      _cell(info.get("GB/s"), ".2f"), _cell(fraction, ".3f")))
    return _markdown(("implementation", "group", "median ms", "GB/s",
                      "fraction of bound (raw copy)"), table)


def _generation_table(benchmarks: list[dict]) -> list[str]:
    info = benchmarks[0].get("extra_info", {})
    tokens, ratio = info.get("tokens_per_s", {}), info.get("vs_unsharded", {})
    peaks = info.get("peak_param_bytes", {})
    table = [(mode, _cell(tokens[mode], ".1f"), _cell(ratio.get(mode), ".3f"),
              _cell(peaks.get(mode), "d")) for mode in tokens]
    lines = _markdown(("mode", "tokens/s (slowest rank)", "vs unsharded",
                       "peak gathered param bytes"), table)
    lines += ["", f"Model {info.get('model_bytes')} bytes, shard {info.get('shard_bytes')} bytes "
                  f"per rank; iter_full_params {info.get('iter_full_params_GBps')} GB/s."]
    return lines


def _extra_info_table(benchmarks: list[dict]) -> list[str]:
    """One row per benchmark: its median and the figures in its extra_info."""
    keys = []
    for bench in benchmarks:
        for key, value in bench.get("extra_info", {}).items():
            if key not in keys and key not in ("device", "torch"):
                keys.append(key)

    def shown(value):
        if isinstance(value, dict):
            return ", ".join(f"{k}: {v}" for k, v in value.items())
        return "-" if value is None else str(value)
    rows = [(bench["name"].removeprefix("test_"), _cell(bench["stats"]["median"] * 1e3, ".3f"))
            + tuple(shown(bench.get("extra_info", {}).get(key)) for key in keys)
            for bench in benchmarks]
    return _markdown(("benchmark", "median ms", *keys), rows)


# A benchmark phase feeds the table whose key is the longest its name starts with.
BENCH_TABLES = {
    "bench-adamw": ("AdamW step, fp32: median of the rounds; GB/s counts 28 bytes per param; "
                    "bound: the device's copy bandwidth, measured in the same run", _adamw_table),
    "bench-offload": ("Offload / reload, 1 GiB of optimizer state: GB/s counts the bytes moved "
                      "once; bound: one cudaMemcpy of the same bytes to or from pinned memory",
                      _offload_table),
    "bench-generation": ("Generation under stage 3, 2 gloo ranks (CPU): GPT-2, 12 blocks, "
                         "batch 16, 64 new tokens", _generation_table),
    "bench-offload-sweep": ("Offload / reload at 1, 4 and 8 GiB of state against one pinned "
                            "cudaMemcpy of the same bytes each way", _extra_info_table),
    "bench-offload-step-1B": ("A 1B-param step with the optimizer state on the device, half on "
                              "the host, all on the host", _extra_info_table),
    "bench-nccl": ("rlhfz's native NCCL engine against torch.distributed's, one GPU",
                   _extra_info_table),
    "bench-weight-sync-cpu": ("Weight sync over gloo on this machine's CPU cores: 2 trainers "
                              "(stage 3, then stage 2) to 2 receivers, a 118 MB GPT-2, against "
                              "a raw broadcast of the same bytes in the same run",
                              _extra_info_table),
}


def _table_key(phase: Phase) -> str | None:
    keys = [key for key in BENCH_TABLES if phase.name.startswith(key)]
    return max(keys, key=len) if keys else None


def _tables(collected: dict[str, list[dict] | None]) -> dict[str, list[str]]:
    """Each table from the benchmarks its phases wrote (None: no json at all)."""
    tables = {}
    for key, benchmarks in collected.items():
        if benchmarks is None:
            tables[key] = ["(no benchmark results were written: see the phase's log)"]
        elif not benchmarks:
            tables[key] = ["(no benchmarks ran: see the skip reasons in the phase's log)"]
        else:
            tables[key] = BENCH_TABLES[key][1](benchmarks)
    return tables


def _write_summary(ctx: Context, plan: list[tuple[int, Phase, float]], results: dict,
                   state: str, tables: dict[str, list[str]]) -> None:
    lines = [_heading(ctx.env), ""]
    limits = sum(limit for _, _, limit in plan)
    spent = sum(results[p.name].seconds or 0 for _, p, _ in plan)
    per_test = ("pytest-timeout per test" if ctx.timeout_plugin
                else "no per-test limit: pytest-timeout is not installed")
    lines.append(f"`{ctx.mode.title}`: {state}. The phases took {spent / 60:.1f} min of their "
                 f"{limits / 60:.1f} min of limits; {per_test}.")
    if ctx.mode is SANITIZE and ctx.sanitizer_version:
        filtered = ("memcheck, racecheck and synccheck check rlhfz's kernels only"
                    if ctx.kernel_filter else "this compute-sanitizer has no --kernel-name: "
                    "racecheck and synccheck check every kernel")
        lines.append(f"{ctx.sanitizer_version}: {filtered}.")
    lines.append("")
    header = ["phase", "command", "status", "seconds", "limit s", "passed", "failed", "skipped"]
    if ctx.mode is SANITIZE:
        header.append("sanitizer errors")
    rows = []
    for index, phase, limit in plan:
        r = results[phase.name]
        status = r.status + (f" ({r.note})" if r.note else "")
        target = phase.target + (" " + " ".join(shlex.quote(a) for a in phase.args)
                                 if phase.args else "")
        row = [phase.name, f"`{(phase.tool + ': ') if phase.tool else ''}{target}`", status,
               _cell(r.seconds, ".1f"), f"{limit:.0f}", _cell(r.passed, "d"),
               _cell(r.failed, "d"), _cell(r.skipped, "d")]
        if ctx.mode is SANITIZE:
            row.append(_cell(r.sanitizer_errors, "d"))
        rows.append(row)
    lines += _markdown(header, rows)
    for name, (title, _) in BENCH_TABLES.items():
        if name in tables:
            lines += ["", f"### {title}", ""] + tables[name]
    if os.path.exists(os.path.join(ctx.out, ctx.mode.archive_name)):
        what = "Logs, junit XML and benchmark JSON" if ctx.mode is CHECK else "Logs and junit XML"
        lines += ["", f"{what}: `{ctx.mode.archive_name}`."]
    _replace(os.path.join(ctx.out, ctx.mode.summary_name), ("\n".join(lines) + "\n").encode())


# ---- the plan ---------------------------------------------------------------------------------

def _out_dir(arg: str | None) -> str:
    return os.path.abspath(arg or os.environ.get("RLHFZ_GPU_CHECK_OUT") or
                           os.path.join(ROOT, DEFAULT_OUT))


def _select(mode: Mode, args) -> list[Phase]:
    phases = mode.phases
    if mode is CHECK:
        phases = [p for p in phases if not (args.no_bench and p.kind == "bench")
                  and not (args.no_tests and p.kind == "test")]
    if args.only:
        patterns = [p for part in args.only for p in part.split(",") if p]
        phases = [p for p in phases if any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    return phases


def _plan(phases: list[Phase], budget: float | None) -> list[tuple[int, Phase, float]]:
    """(index, phase, limit). A budget caps each limit; the time the phases
    before it actually took comes off when the phase starts (main), so
    phases that finish early leave their time to the ones after."""
    return [(index, phase, phase.limit_s if budget is None else min(phase.limit_s, budget))
            for index, phase in enumerate(phases, start=1)]


def _print_plan(ctx: Context, plan, budget) -> None:
    mode = ctx.mode
    total = sum(limit for _, _, limit in plan)
    by_kind = {}
    for _, phase, limit in plan:
        by_kind[phase.kind] = by_kind.get(phase.kind, 0) + limit
    kinds = ", ".join(f"{kind} {seconds:.0f} s" for kind, seconds in by_kind.items())
    within = f", within --budget {budget:.0f} s" if budget is not None else ""
    probe = f", after the {PROBE_LIMIT_S} s probe" if mode is SANITIZE else ""
    print(f"{mode.title}: {len(plan)} phases, in this order; their limits add up to "
          f"{total:.0f} s ({total / 60:.1f} min: {kinds}){probe}{within}.")
    print(f"A phase past its limit gets SIGINT (pytest then writes its junit and benchmark "
          f"files), SIGKILL {GRACE_S} s later; it is recorded as timed out and the next starts.")
    if ctx.timeout_plugin:
        print("Per test: pytest-timeout (--timeout, the phase's value below).")
    else:
        print("Per test: no limit: pytest-timeout is not installed (make deps installs it); "
              "the phase limits still apply.")
    if not ctx.benchmark_plugin:
        print("pytest-benchmark is not installed: the phases that need it will not run.")
    if mode is SANITIZE:
        where = ctx.sanitizer or "NOT FOUND (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
        print(f"compute-sanitizer: {where}"
              f"; first a probe (--version, --help, a small rlhfz program under memcheck; "
              f"{PROBE_LIMIT_S} s at most). --kernel-name {RLHFZ_KERNELS} is dropped where the "
              f"tool lacks it.")
    print(f"Environment of every phase: PYTHONPATH={_phase_env()['PYTHONPATH']} (the in-place "
          f"build, and this file as a plugin), PYTHONUNBUFFERED=1; cwd {ROOT}.")
    for index, phase, limit in plan:
        test_limit = f", {_test_timeout(phase, limit)} s per test" if ctx.timeout_plugin else ""
        env = "".join(f"{k}={v} " for k, v in phase.env.items())
        print(f"\n  {index:2d}. {phase.name} [{phase.kind}]: limit {limit:.0f} s{test_limit}")
        print(f"      {env}{shlex.join(_command(ctx, index, phase, limit))}")
        print(f"      writes {_shown(_phase_dir(ctx, index, phase))}/: {', '.join(_files(phase))}"
              f" (then into the archive)")
    print(f"\nOutput in {_shown(ctx.out)}/ (at most 8 files at any time):")
    tables = " and the benchmark tables" if mode is CHECK else ""
    print(f"  {mode.summary_name}: device, versions, every phase's status{tables} "
          f"(Markdown for benchmarks/RESULTS.md), rewritten after every phase")
    probe = f" and {mode.archive_root}/00-probe/log.txt" if mode is SANITIZE else ""
    print(f"  {mode.archive_name}: {mode.archive_root}/environment.json{probe}, and each "
          f"finished phase's files under {mode.archive_root}/NN-phase/, repacked after every "
          f"phase")
    print("  NN-phase/: the running phase's files, removed once packed")
    print(f"  build.log: make {mode.title.split()[-1]}'s build step, before this script")


# ---- main -------------------------------------------------------------------------------------

def _on_signal(signum, frame):
    # once is enough: the clean-up that follows must not be interrupted itself
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def _clear_previous(ctx: Context) -> None:
    """Removes this mode's files from an earlier run, nothing else."""
    for name in (ctx.mode.summary_name, ctx.mode.archive_name):
        for path in (os.path.join(ctx.out, name), os.path.join(ctx.out, name + ".tmp")):
            if os.path.exists(path):
                os.unlink(path)
    names = {p.name for p in ctx.mode.phases} | {"probe"}
    for entry in os.listdir(ctx.out):
        if re.fullmatch(r"\d\d-.+", entry) and entry[3:] in names:
            shutil.rmtree(os.path.join(ctx.out, entry), ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output directory (default: $RLHFZ_GPU_CHECK_OUT, "
                                      f"else {DEFAULT_OUT})")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the phases, commands, files and limits; run nothing")
    parser.add_argument("--sanitizer", action="store_true",
                        help="the compute-sanitizer phases (make gpu-sanitize) instead")
    parser.add_argument("--no-tests", action="store_true", help="skip the test phases")
    parser.add_argument("--no-bench", action="store_true", help="skip the benchmark phases")
    parser.add_argument("--only", action="append", metavar="PATTERN[,PATTERN]",
                        help="only the phases whose names match (fnmatch), e.g. 'bench-*'")
    parser.add_argument("--budget", type=float, metavar="SECONDS",
                        help="wall clock for all phases together; the last limits shrink to fit")
    args = parser.parse_args(argv)

    mode = SANITIZE if args.sanitizer else CHECK
    phases = _select(mode, args)
    if not phases:
        parser.error("no phase selected")
    plan = _plan(phases, args.budget)
    ctx = Context(out=_out_dir(args.out), mode=mode, timeout_plugin=_plugin("pytest_timeout"),
                  benchmark_plugin=_plugin("pytest_benchmark"),
                  sanitizer=_find_sanitizer() if args.sanitizer else None)
    if args.dry_run:
        _print_plan(ctx, plan, args.budget)
        print("\n(dry run: nothing was run or written)")
        return EXIT_OK

    sys.path.insert(0, ROOT)     # the in-place build, ahead of any installed rlhfz
    problem = _gpu_problem()
    if args.sanitizer and ctx.sanitizer is None:
        missing = "compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
        problem = f"{problem}; {missing}" if problem else missing
    if problem is not None:
        print(f"{mode.title.split()[-1]}: NOT RUN: {problem}.\nThese checks did not run: "
              f"{', '.join(p.name for p in phases)}.\nRun {mode.title} on a machine with "
              f"a CUDA GPU, with rlhfz built there by nvcc "
              f"(`python {_shown(__file__)}{' --sanitizer' if args.sanitizer else ''} --dry-run` "
              f"shows the plan).", file=sys.stderr)
        os.makedirs(ctx.out, exist_ok=True)
        _clear_previous(ctx)
        _write_summary(ctx, plan, {p.name: Result("not run") for _, p, _ in plan},
                       f"NOT RUN: {problem}", {})
        return EXIT_NO_GPU

    os.makedirs(ctx.out, exist_ok=True)
    _clear_previous(ctx)
    ctx.env = _environment()
    print(_heading(ctx.env), flush=True)
    _print_plan(ctx, plan, args.budget)
    sys.stdout.flush()
    extra = {"environment.json": json.dumps(ctx.env, indent=2).encode()}

    if args.sanitizer:
        probe_dir = os.path.join(ctx.out, "00-probe")
        os.makedirs(probe_dir, exist_ok=True)
        print("\n==== probe: compute-sanitizer --version, --help, a small program", flush=True)
        with open(os.path.join(probe_dir, "log.txt"), "w") as log:
            reason, ctx.kernel_filter, ctx.sanitizer_version = _probe_sanitizer(
                ctx.sanitizer, _phase_env(), log)
        _pack(ctx, probe_dir, extra)
        if not reason:
            print(f"{ctx.sanitizer_version or ctx.sanitizer}"
                  f"{'' if ctx.kernel_filter else ' (no --kernel-name: every kernel is checked)'}")
        else:
            print(f"gpu-sanitize: NOT RUN: {reason}", file=sys.stderr)
            _write_summary(ctx, plan, {p.name: Result("not run", note="no working "
                                                      "compute-sanitizer") for _, p, _ in plan},
                           f"NOT RUN: {reason.splitlines()[0]}", {})
            return EXIT_NO_GPU
    else:
        _pack(ctx, None, extra)

    results = {phase.name: Result() for _, phase, _ in plan}
    collected: dict[str, list[dict] | None] = {}
    tables: dict[str, list[str]] = {}
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    started = time.monotonic()
    stopped = None
    try:
        for index, phase, limit in plan:
            left = None if args.budget is None else args.budget - (time.monotonic() - started)
            if left is not None:
                limit = min(limit, left)
            if stopped:
                results[phase.name] = Result("not run", note=stopped)
                continue
            if phase.needs_benchmark_plugin and not ctx.benchmark_plugin:
                results[phase.name] = Result("not run", note="pytest-benchmark is not installed")
                continue
            if left is not None and limit < min(30, phase.limit_s):
                results[phase.name] = Result("not run", note="--budget spent")
                continue
            results[phase.name] = Result("running")
            _write_summary(ctx, plan, results, f"running {phase.name}", tables)
            results[phase.name] = _run_phase(ctx, index, phase, limit)
            if results[phase.name].status == "interrupted":
                stopped = results[phase.name].note
            key = _table_key(phase)
            if key:
                found = _load(os.path.join(_phase_dir(ctx, index, phase), "benchmark.json"))
                if found is not None or collected.get(key) is not None:
                    collected[key] = (collected.get(key) or []) + (found or [])
                else:
                    collected[key] = None
                tables = _tables(collected)
            _pack(ctx, _phase_dir(ctx, index, phase))
            _write_summary(ctx, plan, results, f"{phase.name} done", tables)
    except Stopped as stop:          # between phases
        stopped = str(stop)
        for index, phase, _ in plan:
            if results[phase.name].status in ("pending", "running"):
                results[phase.name] = Result("not run", note=stopped)
            if os.path.isdir(_phase_dir(ctx, index, phase)):
                _pack(ctx, _phase_dir(ctx, index, phase))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    failed = [f"{name} ({r.status}{': ' + r.note if r.note else ''})"
              for name, r in results.items() if r.status in FAILING]
    state = ("FAILED: " + "; ".join(failed)) if failed else "passed"
    _write_summary(ctx, plan, results, state, tables)
    with open(os.path.join(ctx.out, mode.summary_name)) as f:
        print("\n" + f.read())
    print(f"{mode.title.split()[-1]}: {state}\nfiles: {_shown(ctx.out)}/{mode.summary_name}, "
          f"{_shown(ctx.out)}/{mode.archive_name}")
    return EXIT_FAILED if failed else EXIT_OK


# ---- inside the benchmark phases: this file as a pytest plugin (-p gpu_check) -------------------

try:
    import pytest as _pytest
except ImportError:         # the driver itself runs without pytest, and says so
    _pytest = None

if _pytest is not None:
    @_pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_sessionfinish(session, exitstatus):
        """pytest-benchmark registers a benchmark before its first round, and
        writing the json fails for all when one has no rounds: one cut off by
        pytest-timeout or by the phase's limit. Drop those first."""
        benchmark_session = getattr(session.config, "_benchmarksession", None)
        benchmarks = getattr(benchmark_session, "benchmarks", None)
        if isinstance(benchmarks, list):
            benchmarks[:] = [b for b in benchmarks if b]     # falsy: no rounds recorded
        yield


if __name__ == "__main__":
    sys.exit(main())
