"""Builds rlhfz against the simulated CUDA runtime and NCCL stand-in (sim/)
and runs tests on it: CI's GPU.

    python3 tools/sim/run.py [--coverage] [--chaos SEED] [pytest args]

The simulated build (RLHFZ_CUDA=sim) is installed with pip into a virtual
environment of its own, build/sim-venv (system site-packages give it torch
and the test tools; its own come first), so the production build in the
tree can never stand in for it: the tests run from outside the tree, and
tests/conftest.py holds rlhfz.__file__ to that environment. The
environment also gets RLHFZ_NCCL_LIBRARY, set before any test process
starts (build_info() loads NCCL at import), naming the NCCL stand-in.

--coverage builds with gcov instrumentation (under build/sim-coverage) and
Python coverage of every process, then reports both: line coverage of the
CUDA-facing C (csrc/cuda_*.c, memory_tiers.c, nccl_comm.c, nccl_library.c), of
the device code (kernels/*.cu), and of the simulated runtime, with each uncovered
line listed in build/sim-coverage/uncovered.txt.
--chaos SEED sets RLHFZ_SIM_CHAOS: random delays on every stream.
--chaos-seeds "1 2 ..." runs the tests once per seed and lists each run's
outcome (make test-chaos).
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# RLHFZ_SIM_VENV and RLHFZ_SIM_BUILD_BASE move the environment and the build,
# so that two runs can go at once.
VENV = os.environ.get("RLHFZ_SIM_VENV") or os.path.join(ROOT, "build", "sim-venv")
DEFAULT_TESTS = ["tests/test_sim_runtime.py"]
# What the coverage figures are of: the C that talks to CUDA and NCCL, and the device code.
C_COVERED = [r"csrc/cuda_.*\.c", r"csrc/memory_tiers\.c", r"csrc/nccl_comm\.c",
             r"csrc/nccl_library\.c", r"kernels/.*\.cu", r"kernels/.*\.cuh"]
SIM_COVERED = [r"sim/runtime/.*\.cpp", r"sim/nccl/.*\.cpp"]
PYTHON_COVERED = ["engine/backends.py", "engine/bucket.py", "engine/engine.py",
                  "engine/storage.py", "engine/state.py", "comm/nccl_engine.py",
                  "comm/torch_engine.py", "migrate.py", "optim.py", "reducer.py"]


def _say(*args):
    print("[sim]", *args, flush=True)


def _venv_python():
    return os.path.join(VENV, "bin", "python")


def _site_packages(python):
    return subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip()


def _install(coverage: bool):
    if not os.path.exists(_venv_python()):
        _say(f"creating {VENV}")
        subprocess.check_call([sys.executable, "-m", "venv", "--system-site-packages", VENV])
    env = dict(os.environ, RLHFZ_CUDA="sim", RLHFZ_SIM_COVERAGE="1" if coverage else "0")
    env.pop("PYTHONPATH", None)
    _say("building and installing the simulated build (RLHFZ_CUDA=sim"
         f"{', gcov' if coverage else ''})")
    subprocess.check_call([_venv_python(), "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-build-isolation", "--force-reinstall",
                           "--disable-pip-version-check", ROOT], cwd=ROOT, env=env)


def _coverage_setup(site, data_dir):
    """Python coverage in every process: a hook that starts it where
    COVERAGE_PROCESS_START names a configuration."""
    os.makedirs(data_dir, exist_ok=True)
    for old in glob.glob(os.path.join(data_dir, ".coverage*")):
        os.remove(old)
    rc = os.path.join(data_dir, "coveragerc")
    with open(rc, "w") as f:
        f.write(f"[run]\nparallel = True\nsource = {os.path.join(site, 'rlhfz')}\n"
                f"data_file = {os.path.join(data_dir, '.coverage')}\n")
    # sitecustomize, not a .pth: a venv's .pth files run before the system
    # site-packages (where coverage is installed) are on sys.path
    stale = os.path.join(site, "rlhfz_sim_coverage.pth")
    if os.path.exists(stale):
        os.remove(stale)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write("import os\n\nif 'COVERAGE_PROCESS_START' in os.environ:\n"
                "    import coverage\n    coverage.process_startup()\n")
    return rc


def _gcov_reset(build_base):
    for path in glob.glob(os.path.join(build_base, "**", "*.gcda"), recursive=True):
        os.remove(path)


def _gcov_lines(build_base) -> dict:
    """{source: {line: count}}, every template instance of a line merged."""
    filters = [a for f in C_COVERED + SIM_COVERED for a in ("--filter", f)]
    # build_base as the one search path: other builds' counts must not mix in
    report = subprocess.run(["gcovr", "--root", ROOT, "--object-directory", build_base, *filters,
                             "--gcov-ignore-parse-errors=all", "--json", "-", build_base],
                            capture_output=True, text=True)
    if report.returncode != 0:
        raise RuntimeError(f"gcovr failed: {report.stderr[-2000:]}")
    import json
    lines: dict = {}
    for entry in json.loads(report.stdout).get("files", []):
        per_line = lines.setdefault(entry["file"], {})
        for line in entry["lines"]:
            if not line.get("gcovr/noncode"):
                number = line["line_number"]
                per_line[number] = max(per_line.get(number, 0), line["count"])
    return lines


def _gcov_report(build_base, out_dir):
    """A table per file (and the total of what the target is set for), and
    every uncovered line, written under out_dir."""
    import re
    lines = _gcov_lines(build_base)
    table, uncovered = [], []
    totals = {"target": [0, 0], "simulator": [0, 0]}
    for source in sorted(lines):
        counts = lines[source]
        covered = sum(1 for c in counts.values() if c > 0)
        group = "target" if any(re.fullmatch(f, source) for f in C_COVERED) else "simulator"
        totals[group][0] += covered
        totals[group][1] += len(counts)
        table.append(f"{source:40} {covered:6} / {len(counts):6}  "
                     f"{100.0 * covered / max(len(counts), 1):5.1f}%")
        missed = sorted(n for n, c in counts.items() if c == 0)
        if missed:
            uncovered.append(f"{source}: {', '.join(map(str, missed))}")
    for group, (covered, total) in totals.items():
        table.append(f"{'total (' + group + ')':40} {covered:6} / {total:6}  "
                     f"{100.0 * covered / max(total, 1):5.1f}%")
    text = "\n".join(table) + "\n"
    with open(os.path.join(out_dir, "gcov.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "uncovered.txt"), "w") as f:
        f.write("\n".join(uncovered) + "\n")
    print("line coverage (gcov):\n" + text)
    _say(f"uncovered lines: {os.path.join(out_dir, 'uncovered.txt')}")


def _python_report(python, rc, site, out_dir):
    env = dict(os.environ, COVERAGE_RCFILE=rc)
    subprocess.run([python, "-m", "coverage", "combine", "--quiet"], cwd=out_dir, env=env)
    include = ",".join(os.path.join(site, "rlhfz", name) for name in PYTHON_COVERED)
    report = subprocess.run([python, "-m", "coverage", "report", f"--include={include}",
                             "--show-missing"], cwd=out_dir, env=env, capture_output=True,
                            text=True)
    with open(os.path.join(out_dir, "python.txt"), "w") as f:
        f.write(report.stdout + report.stderr)
    print(report.stdout + report.stderr)


def _chaos_runs(command, run_dir, env, seeds) -> int:
    """The tests once per chaos seed; a table of the outcomes at the end."""
    import re
    import time
    rows, failed = [], 0
    for seed in seeds:
        _say(f"RLHFZ_SIM_CHAOS={seed}: " + " ".join(command))
        started = time.monotonic()
        run = subprocess.run(command, cwd=run_dir, env=dict(env, RLHFZ_SIM_CHAOS=seed),
                             capture_output=True, text=True)
        summary = next((line for line in reversed(run.stdout.splitlines())
                        if re.search(r"\d+ (passed|failed)", line)), "no summary")
        rows.append(f"seed {seed:>6}: {'ok  ' if run.returncode == 0 else 'FAIL'} "
                    f"{time.monotonic() - started:6.1f} s  {summary.strip('= ')}")
        if run.returncode != 0:
            failed += 1
            print(run.stdout[-6000:] + run.stderr[-3000:], flush=True)
        print(rows[-1], flush=True)
    print("\n".join(["chaos runs:"] + rows + [f"{len(seeds) - failed} of {len(seeds)} green"]))
    return 1 if failed else 0


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coverage", action="store_true")
    parser.add_argument("--chaos", metavar="SEED")
    parser.add_argument("--chaos-seeds", metavar="SEEDS")
    parser.add_argument("--no-install", action="store_true",
                        help="test the simulated build already installed")
    args, pytest_args = parser.parse_known_args(argv)
    build_base = os.environ.get("RLHFZ_SIM_BUILD_BASE") or os.path.join(
        ROOT, "build", "sim-coverage" if args.coverage else "sim")
    build_base = os.path.join(ROOT, build_base)
    if args.coverage:
        _gcov_reset(build_base)     # counts of an older build would not match its objects
    if not args.no_install:
        _install(args.coverage)
    python = _venv_python()
    site = _site_packages(python)
    out_dir = os.path.join(build_base, "reports")
    run_dir = os.path.join(build_base, "run")       # no rlhfz package here
    os.makedirs(run_dir, exist_ok=True)
    # torch's CPU threads would fight the simulated device's for 2 cores
    env = dict(os.environ, RLHFZ_EXPECT_INSTALLED_UNDER=os.path.realpath(VENV),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("PYTHONPATH", None)
    nccl = os.path.join(site, "rlhfz", "_sim", "libnccl.so.2")
    if os.path.exists(nccl):
        env["RLHFZ_NCCL_LIBRARY"] = nccl
    if args.chaos is not None:
        env["RLHFZ_SIM_CHAOS"] = args.chaos
    rc = None
    if args.coverage:
        rc = _coverage_setup(site, out_dir)
        env["COVERAGE_PROCESS_START"] = rc
        _gcov_reset(build_base)
    tests = [os.path.join(ROOT, t) if t.startswith("tests") else t
             for t in (pytest_args or DEFAULT_TESTS)]
    # a hang (a missing event, a deadlock) fails its test instead of the whole run
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ROOT,
               "--timeout=600", "--timeout-method=thread", *tests]
    if args.chaos_seeds:
        return _chaos_runs(command, run_dir, env, args.chaos_seeds.split())
    _say(" ".join(command))
    status = subprocess.call(command, cwd=run_dir, env=env)
    if args.coverage:
        _gcov_report(build_base, out_dir)
        _python_report(python, rc, site, out_dir)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
