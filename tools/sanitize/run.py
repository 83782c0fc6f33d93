"""Runs rlhfz's tests with its C code under AddressSanitizer + UBSan, or
under valgrind memcheck, and fails on any report.

    python3 tools/sanitize/run.py asan [pytest args]       # default: tests/
    python3 tools/sanitize/run.py valgrind [pytest args]   # default: kernel, DLPack tests

Each variant builds its own copy of rlhfz._C under build/<variant>/ (the
in-place build stays untouched), next to symlinks to rlhfz/*.py, and runs
pytest from there. That directory then comes first on sys.path for pytest and
for every child: `-c` and `-m` children through the working directory, spawned
ranks through the parent's sys.path, scripts through PYTHONPATH.

asan: built with clang and its runtime (Debian's clang-14 and
libclang-rt-14-dev) where they are installed, else with gcc and libasan;
RLHFZ_SANITIZE_CC names a compiler. Reports go to
build/sanitize/reports/<run>/ (one file per process that had one), and any
such file fails the run. Leak detection is off (CPython and
torch keep memory at exit by design); valgrind looks for rlhfz's own leaks.

valgrind: the release build (CPU only), PYTHONMALLOC=malloc. Errors and
"definitely lost" blocks with a frame in rlhfz's .so (in any of their stacks)
fail the run; CPython's and glibc's own noise is suppressed by
valgrind-python.supp, and what is left outside rlhfz is listed, not counted.
"""
import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SUPPRESSIONS = os.path.join(HERE, "valgrind-python.supp")
# These import torch (bfloat16 tensors), which costs about two minutes under memcheck.
VALGRIND_DEFAULT_TESTS = ["tests/test_kernels.py", "tests/test_buffer_dlpack.py",
                          "tests/test_disk_tier.py"]


# The one line ASan writes when allocator_may_return_null lets an absurd
# request fail with NULL (the tests expect MemoryError there): not a report.
BENIGN_ASAN_LINE = re.compile(r"==\d+==WARNING: AddressSanitizer failed to allocate 0x[0-9a-f]+ bytes")


def _say(*args):
    print("[sanitize]", *args, flush=True)


def _build(variant: str, env: dict) -> str:
    """Builds rlhfz._C into build/<variant>/pkg/rlhfz and returns pkg/."""
    base = os.path.join(ROOT, "build", variant)
    pkg_root = os.path.join(base, "pkg")
    pkg = os.path.join(pkg_root, "rlhfz")
    built = glob.glob(os.path.join(pkg, "_C*.so"))
    sources = [os.path.join(ROOT, "setup.py")] + [
        p for folder in ("csrc", "kernels") for p in glob.glob(os.path.join(ROOT, folder, "*"))]
    if not built or os.path.getmtime(built[0]) < max(os.path.getmtime(p) for p in sources):
        _say(f"building rlhfz._C ({variant}) into {pkg_root}")
        stage = os.path.join(base, "stage")
        subprocess.check_call(
            [sys.executable, "setup.py", "-q", "build_ext", "--force",
             "--build-lib", stage, "--build-temp", os.path.join(base, "temp")],
            cwd=ROOT, env=env)
        # Renamed into place: a process still running the old .so keeps its mapping.
        os.makedirs(pkg, exist_ok=True)
        for path in glob.glob(os.path.join(stage, "rlhfz", "_C*.so")):
            os.replace(path, os.path.join(pkg, os.path.basename(path)))
    # Mirror the Python package as symlinks, so that edits show up without a rebuild.
    os.makedirs(pkg, exist_ok=True)
    wanted = {name for name in os.listdir(os.path.join(ROOT, "rlhfz"))
              if not name.startswith("_C") and name != "__pycache__"}
    for name in os.listdir(pkg):
        path = os.path.join(pkg, name)
        if os.path.islink(path) and name not in wanted:
            os.unlink(path)
    for name in wanted:
        path = os.path.join(pkg, name)
        if not os.path.islink(path):
            os.symlink(os.path.join(ROOT, "rlhfz", name), path)
    return pkg_root


def _pytest_args(args, default):
    """Paths given relative to the repository root, made absolute (pytest runs
    elsewhere); the default paths when only options are given."""
    out, paths = [], 0
    for arg in args:
        head = arg.split("::")[0]
        if not arg.startswith("-") and os.path.exists(os.path.join(ROOT, head)):
            arg = os.path.join(ROOT, arg)
            paths += 1
        out.append(arg)
    if not paths:
        out += [os.path.join(ROOT, path) for path in default]
    return ["-m", "pytest", "-p", "no:cacheprovider", *out]


PROBE = "import rlhfz; print(rlhfz._C.__file__, rlhfz.build_info()['simd'])\n"


def _check_imported(so: str, pkg_root: str, env: dict, scratch: str, prefix=()):
    """The build under test is the one a `-c` child and a script child import."""
    script = os.path.join(scratch, "probe_import.py")
    with open(script, "w") as f:
        f.write(PROBE)
    env = {k: v for k, v in env.items() if k != "VALGRIND_OPTS"}    # memcheck options
    for how in (["-c", PROBE], [script]):
        probe = subprocess.run([*prefix, sys.executable, *how], cwd=pkg_root, env=env,
                               capture_output=True, text=True)
        out = probe.stdout.strip()
        if probe.returncode != 0 or not out.startswith(so + " "):
            raise SystemExit(f"{how[0]}: imported {out!r}, not the build under test {so}\n"
                             f"{probe.stderr[-2000:]}")
    os.unlink(script)
    _say(f"imported: {out}")


def _reports_dir(variant: str) -> str:
    """A new directory per run, so that two runs never mix their reports."""
    path = os.path.join(ROOT, "build", variant, "reports",
                        time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    os.makedirs(path)
    return path


def _print_file_name(compiler: str, name: str) -> str:
    """The library the compiler would link for name, or "" if it has none."""
    path = subprocess.run([compiler, f"-print-file-name={name}"], check=True,
                          capture_output=True, text=True).stdout.strip()
    return os.path.realpath(path) if os.path.isabs(path) and os.path.exists(path) else ""


def _asan_toolchain():
    """(compiler, its ASan runtime): RLHFZ_SANITIZE_CC if set, else clang
    with its runtime (Debian's clang-14 and libclang-rt-14-dev), else gcc
    with libasan."""
    wanted = os.environ.get("RLHFZ_SANITIZE_CC")
    for compiler in [wanted] if wanted else ["clang", "clang-14", "gcc"]:
        if not shutil.which(compiler):
            continue
        runtime = _print_file_name(compiler, f"libclang_rt.asan-{platform.machine()}.so"
                                   if "clang" in compiler else "libasan.so")
        if runtime:
            return compiler, runtime
        if wanted:
            raise SystemExit(f"{compiler} has no shared ASan runtime")
    raise SystemExit(f"no compiler with an ASan runtime: {wanted or 'clang, clang-14, gcc'}")


def run_asan(args) -> int:
    compiler, runtime = _asan_toolchain()
    _say(f"compiler {compiler}, runtime {runtime}")
    build_env = dict(os.environ, RLHFZ_SANITIZE="1", CC=compiler,
                     LDSHARED=f"{compiler} -shared")
    build_env.pop("RLHFZ_CUDA", None)
    pkg_root = _build("sanitize-" + os.path.basename(compiler), build_env)
    so = glob.glob(os.path.join(pkg_root, "rlhfz", "_C*.so"))[0]
    ldd = subprocess.run(["ldd", so], check=True, capture_output=True, text=True).stdout
    if os.path.basename(runtime).split(".so")[0] not in ldd:
        raise SystemExit(f"{so} does not link {runtime}:\n{ldd}")
    libstdcxx = _print_file_name("gcc", "libstdc++.so")
    reports = _reports_dir("sanitize")
    env = dict(os.environ)
    # Reports name their source lines only through a symbolizer: clang's own, if any.
    symbolizer = os.path.join(os.path.dirname(os.path.realpath(shutil.which(compiler))),
                              "llvm-symbolizer")
    if os.path.exists(symbolizer) and "ASAN_SYMBOLIZER_PATH" not in env:
        env["ASAN_SYMBOLIZER_PATH"] = symbolizer
    env.update(
        # Python is not instrumented: the ASan runtime must be loaded first. libstdc++
        # too, or ASan finds no __cxa_throw to forward to and aborts on torch's C++ throws.
        LD_PRELOAD=os.pathsep.join(filter(None, [runtime, libstdcxx,
                                                 os.environ.get("LD_PRELOAD")])),
        # allocator_may_return_null: tests ask for absurd sizes and expect MemoryError.
        # quarantine_size_mb: tests check that RSS drops when buffers are freed, which
        # ASan's default 256 MiB of quarantine would hold; freed big buffers are then
        # unmapped at once, so a late access still faults and is reported.
        ASAN_OPTIONS=":".join(filter(None, [
            f"log_path={reports}/report", "detect_leaks=0", "allocator_may_return_null=1",
            "quarantine_size_mb=16", os.environ.get("ASAN_OPTIONS")])),
        UBSAN_OPTIONS=":".join(filter(None, [
            f"log_path={reports}/report", "print_stacktrace=1", "halt_on_error=1",
            os.environ.get("UBSAN_OPTIONS")])),
        # Every Python object through malloc: ASan then sees refcount errors too.
        PYTHONMALLOC=os.environ.get("PYTHONMALLOC", "malloc"),
        PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")])),
    )
    _check_imported(so, pkg_root, env, reports)
    _say(f"LD_PRELOAD={env['LD_PRELOAD']}")
    start = time.monotonic()
    code = subprocess.call([sys.executable, *_pytest_args(args, ["tests"])], cwd=pkg_root, env=env)
    _say(f"pytest exited {code} after {time.monotonic() - start:.0f} s")
    found = []
    for path in sorted(glob.glob(os.path.join(reports, "*"))):
        with open(path, errors="replace") as f:
            text = f.read()
        if all(BENIGN_ASAN_LINE.fullmatch(line) for line in text.splitlines() if line):
            continue
        found.append(path)
        print(f"==== {path}\n{text}", flush=True)
    _say(f"{len(found)} sanitizer report file(s) in {reports}")
    return code or (1 if found else 0)


def _frames(node):
    return [(f.findtext("obj") or "", f.findtext("fn") or "?", f.findtext("file") or "",
             f.findtext("line") or "") for f in node.iter("frame")]


def _valgrind_verdict(xml_files, so_name):
    ours, others, leaks = [], [], 0
    for path in xml_files:
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as exc:       # a process killed mid-write
            _say(f"unreadable {path}: {exc}")
            ours.append((path, "unreadable valgrind output", []))
            continue
        for error in root.iter("error"):
            kind = error.findtext("kind")
            what = error.findtext("what") or error.findtext("xwhat/text") or kind
            frames = _frames(error)
            if any(os.path.basename(obj) == so_name for obj, *_ in frames):
                ours.append((path, what, frames))
            elif kind.startswith("Leak_"):
                leaks += 1
            else:
                others.append((path, what, frames))
    return ours, others, leaks


def _describe(what, frames, limit=12):
    lines = [f"  {what}"]
    for obj, fn, file, line in frames[:limit]:
        where = f"{file}:{line}" if file else os.path.basename(obj)
        lines.append(f"      {fn} ({where})")
    return "\n".join(lines)


def run_valgrind(args) -> int:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind is not installed")
    build_env = dict(os.environ, RLHFZ_CUDA="0")
    build_env.pop("RLHFZ_SANITIZE", None)
    pkg_root = _build("valgrind", build_env)
    so = glob.glob(os.path.join(pkg_root, "rlhfz", "_C*.so"))[0]
    reports = _reports_dir("valgrind")
    env = dict(os.environ, PYTHONMALLOC="malloc",
               PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")])))
    for name in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS"):
        env.pop(name, None)
    # sys.executable, not "python3": that may be a shell shim, which valgrind would check instead.
    command = [valgrind, "--tool=memcheck", "--error-exitcode=97", f"--suppressions={SUPPRESSIONS}",
               "--num-callers=40", "--leak-check=full", "--show-leak-kinds=definite",
               "--errors-for-leak-kinds=definite", "--child-silent-after-fork=yes", "--xml=yes",
               f"--xml-file={reports}/memcheck.%p.xml", f"--log-file={reports}/memcheck.%p.log",
               sys.executable]
    # valgrind hides AVX-512 from cpuid: the AVX2 (or scalar) kernels are the ones checked.
    _check_imported(so, pkg_root, env, reports, prefix=(valgrind, "-q", "--tool=none"))
    start = time.monotonic()
    junit = os.path.join(reports, "junit.xml")
    code = subprocess.call(command + _pytest_args(args, VALGRIND_DEFAULT_TESTS)
                           + [f"--junitxml={junit}"], cwd=pkg_root, env=env)
    _say(f"valgrind + pytest exited {code} after {time.monotonic() - start:.0f} s")
    ours, others, leaks = _valgrind_verdict(
        sorted(glob.glob(os.path.join(reports, "memcheck.*.xml"))), os.path.basename(so))
    for path, what, frames in others[:20]:
        print(f"outside rlhfz ({os.path.basename(path)}), not counted:\n{_describe(what, frames)}")
    for path, what, frames in ours:
        print(f"IN RLHFZ ({os.path.basename(path)}):\n{_describe(what, frames, 40)}")
    _say(f"{len(ours)} error(s) or definite leak(s) in rlhfz; outside it, not counted: "
         f"{len(others)} error(s) and {leaks} definite leak(s); logs in {reports}")
    if ours:
        return 1
    if code != 97:
        return code
    # 97: valgrind saw errors, all outside rlhfz (listed above); pytest's own verdict is in junit.
    suite = ET.parse(junit).getroot().find("testsuite")
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    _say(f"pytest: {suite.get('tests')} tests, {failed} failed or errored")
    return 1 if failed else 0


def main(argv) -> int:
    if not argv or argv[0] not in ("asan", "valgrind"):
        print(__doc__)
        return 2
    return run_asan(argv[1:]) if argv[0] == "asan" else run_valgrind(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
