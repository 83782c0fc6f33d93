"""Build of rlhfz._C: C11 sources from csrc/ and kernels/, SIMD kernels with
their own ISA flags, and CUDA sources through nvcc when it is present.

Environment:
  RLHFZ_CUDA=auto|0|1|sim  auto: build the CUDA parts if nvcc is found; sim: build
                           them for the host, against the simulated CUDA runtime
                           and NCCL stand-in of sim/ (no GPU, no driver, no nvcc),
                           under build/sim, shipped in rlhfz/_sim/
  RLHFZ_SIM_COVERAGE=1     with sim: instrument the C, C++ and CUDA sources for gcov
  RLHFZ_SIM_BUILD_BASE     with sim: the build directory (build/sim, build/sim-coverage)
  RLHFZ_CUDA_ARCHS="80;90" compute capabilities to generate code for (plus PTX
                           of the last, for newer GPUs)
  CUDA_HOME                where to look for nvcc and libcudart_static
  RLHFZ_SANITIZE=1         AddressSanitizer + UBSan build for the CPU only, with
                           $CC (clang or gcc); python needs the ASan runtime in
                           LD_PRELOAD (tools/sanitize/run.py sets both)
"""
import concurrent.futures
import os
import platform
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

try:
    from setuptools.modified import newer_group
except ImportError:                     # setuptools before 69
    from distutils.dep_util import newer_group

ROOT = os.path.dirname(os.path.abspath(__file__))
IS_X86_64 = platform.machine().lower() in ("x86_64", "amd64")

# Each SIMD kernel file is compiled alone with its ISA flags, so that the rest
# of the library runs on any x86-64; the dispatcher picks a level at run time.
SIMD_SOURCES = {
    "kernels/adamw_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "kernels/adamw_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl",
                               "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}
COMMON_CFLAGS = ["-std=c11", "-O3", "-fvisibility=hidden", "-pthread",
                 "-Wall", "-Wextra", "-Wno-unused-parameter",
                 "-Wno-missing-field-initializers", "-Wno-cast-function-type"]
SANITIZE = os.environ.get("RLHFZ_SANITIZE", "0").strip() == "1"
# -O1 keeps stack traces readable; later flags override -O3 above.
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                  "-fno-omit-frame-pointer", "-g", "-O1"]


def _sanitize_link_flags():
    """clang links its shared runtime, which holds UBSan's too. gcc links
    UBSan in and hidden: a shared libubsan would bind to the preloaded
    libasan's copy of the report-path setter and ignore UBSAN_OPTIONS=log_path."""
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if "clang" in os.path.basename(compiler):
        return SANITIZE_FLAGS + ["-shared-libsan"]
    return SANITIZE_FLAGS + ["-static-libubsan", "-Wl,--exclude-libs,ALL"]


if SANITIZE:
    COMMON_CFLAGS = COMMON_CFLAGS + SANITIZE_FLAGS


def _sources(folder, suffix):
    path = os.path.join(ROOT, folder)
    if not os.path.isdir(path):
        return []
    return sorted(os.path.join(folder, name) for name in os.listdir(path)
                  if name.endswith(suffix) and os.path.isfile(os.path.join(path, name)))


def _find_cuda_home():
    """A toolkit directory holding bin/nvcc (an nvcc on PATH may be a wrapper script)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return home
    return None


def _find_cudart_static(cuda_home):
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                os.path.join("targets", "sbsa-linux", "lib")):
        path = os.path.join(cuda_home, sub, "libcudart_static.a")
        if os.path.isfile(path):
            return path
    return None


SIMULATED = os.environ.get("RLHFZ_CUDA", "auto").strip().lower() == "sim"
SIM_COVERAGE = SIMULATED and os.environ.get("RLHFZ_SIM_COVERAGE", "0").strip() == "1"
# The simulated runtime's own libraries, shipped next to _C (found through its rpath).
SIM_PACKAGE_DIR = os.path.join("rlhfz", "_sim")
# The .cu files as host C++: no FMA contraction (the kernels' rounding is
# spelled out), no strict aliasing (vector loads reinterpret), every typed
# access checked for its alignment (a GPU faults where x86 would not; the
# simulator's handler makes it the device's sticky error), and the
# simulator's cuda_runtime.h first on the include path.
SIM_CXXFLAGS = ["-x", "c++", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing",
                "-fsanitize=alignment",
                "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unknown-pragmas",
                "-Isim/include", "-Ikernels"]
# -fprofile-abs-path: gcov finds the sources from any working directory
COVERAGE_FLAGS = ["--coverage", "-fprofile-update=atomic", "-fprofile-abs-path", "-O0", "-g"]


def _cuda_mode():
    """The CUDA toolkit to build with, "sim" for the simulated runtime, or
    None to build for the CPU only."""
    mode = os.environ.get("RLHFZ_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1", "sim"):
        raise SystemExit(f"RLHFZ_CUDA must be auto, 0, 1 or sim, not {mode!r}")
    if mode == "sim":
        if SANITIZE:
            raise SystemExit("RLHFZ_SANITIZE=1 builds for the CPU only; unset RLHFZ_CUDA=sim")
        return "sim"
    if SANITIZE:
        if mode == "1":
            raise SystemExit("RLHFZ_SANITIZE=1 builds for the CPU only; unset RLHFZ_CUDA=1")
        return None
    if mode == "0":
        return None
    home = _find_cuda_home()
    if home is None or _find_cudart_static(home) is None:
        if mode == "1":
            raise SystemExit("RLHFZ_CUDA=1 but no CUDA toolkit with nvcc and "
                             "libcudart_static.a was found (set CUDA_HOME)")
        print("rlhfz: no CUDA toolkit found; building for the CPU only", flush=True)
        return None
    return home


def _run_all(commands):
    """Runs compiler commands in parallel (setuptools' -j parallelises only
    across extensions, and each .cu file takes nvcc seconds)."""
    def run(cmd):
        print(" ".join(cmd), flush=True)
        subprocess.check_call(cmd, cwd=ROOT)
    workers = min(len(commands), os.cpu_count() or 1) or 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(run, cmd) for cmd in commands]:
            future.result()


def _cxx():
    return os.environ.get("CXX") or shutil.which("c++") or "g++"


class Build(build):
    """The simulated build lives under build/sim, apart from the real one."""

    def initialize_options(self):
        super().initialize_options()
        if SIMULATED:
            self.build_base = os.environ.get("RLHFZ_SIM_BUILD_BASE") or os.path.join(
                "build", "sim-coverage" if SIM_COVERAGE else "sim")


class BuildExt(build_ext):
    """Compiles SIMD and CUDA objects first, then lets setuptools link them in."""

    def build_extension(self, ext):
        # Up to date: compile nothing (setuptools would skip only its own
        # link, leaving objects compiled here newer than the module, whose
        # coverage notes would then not match the code that runs).
        ext_path = self.get_ext_fullpath(ext.name)
        if not self.force and os.path.exists(ext_path) and not newer_group(
                list(ext.sources) + list(ext.depends or []), ext_path, "newer"):
            return
        objects = []
        extra_cflags = COVERAGE_FLAGS if SIM_COVERAGE else []
        if IS_X86_64:
            for source, flags in SIMD_SOURCES.items():
                objects += self.compiler.compile(
                    [source], output_dir=self.build_temp,
                    include_dirs=ext.include_dirs, macros=ext.define_macros,
                    extra_postargs=COMMON_CFLAGS + ["-fPIC"] + flags + extra_cflags)
        cuda_home = _cuda_mode()
        if cuda_home == "sim":
            sim_dir = self._sim_dir()
            self._build_simulator(sim_dir)
            objects += self._compile_simulated_cuda()
            ext.define_macros.append(("RLHFZ_WITH_CUDA", "1"))
            ext.extra_compile_args = list(ext.extra_compile_args or []) + extra_cflags
            ext.extra_link_args += [f"-L{sim_dir}", "-lcudasim", "-Wl,-rpath,$ORIGIN/_sim",
                                    "-lstdc++"] + (["--coverage"] if SIM_COVERAGE else [])
        elif cuda_home is not None:
            objects += self._compile_cuda(cuda_home)
            ext.define_macros.append(("RLHFZ_WITH_CUDA", "1"))
            # cudart is linked statically so that import works with no driver;
            # it opens libcuda itself, lazily, on first use.
            ext.extra_link_args += [_find_cudart_static(cuda_home), "-lstdc++", "-ldl", "-lrt",
                                    "-lpthread"]
        ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)

    def _compile_cuda(self, cuda_home):
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
        archs = [a.strip() for a in os.environ.get("RLHFZ_CUDA_ARCHS", "80;90").split(";")
                 if a.strip()]
        gencode = []
        for arch in archs:
            gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        # PTX of the newest arch too: a later GPU JIT-compiles it.
        gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
        os.makedirs(self.build_temp, exist_ok=True)
        commands, objects = [], []
        for source in _sources("kernels", ".cu"):
            out = os.path.join(self.build_temp,
                               os.path.basename(source).replace(".cu", ".cu.o"))
            # -lineinfo: source lines in compute-sanitizer's and profilers' reports
            commands.append([nvcc, "-c", source, "-o", out, "-O3", "-std=c++17", "-lineinfo",
                             "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Ikernels"] + gencode)
            objects.append(out)
        _run_all(commands)
        return objects

    # ---- the simulated runtime (RLHFZ_CUDA=sim) ----------------------------------------

    def _sim_dir(self):
        base = ROOT if self.inplace else self.build_lib
        path = os.path.join(base, SIM_PACKAGE_DIR)
        os.makedirs(path, exist_ok=True)
        return path

    def _build_simulator(self, sim_dir):
        """libcudasim.so (the runtime) and libnccl.so.2 (the NCCL stand-in,
        linked to the same runtime, so both see the same devices and streams)."""
        flags = ["-std=c++17", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter",
                 "-Isim/include"] + (COVERAGE_FLAGS if SIM_COVERAGE else ["-O2", "-g"])
        temp = os.path.join(self.build_temp, "sim")
        os.makedirs(temp, exist_ok=True)
        libraries = {"libcudasim.so": ("sim/runtime", []),
                     "libnccl.so.2": ("sim/nccl", [f"-L{sim_dir}", "-lcudasim",
                                                   "-Wl,-rpath,$ORIGIN"])}
        for name, (folder, link) in libraries.items():
            sources = _sources(folder, ".cpp")
            if not sources:
                continue
            objects = [os.path.join(temp, os.path.basename(src) + ".o") for src in sources]
            _run_all([[_cxx(), "-c", src, "-o", obj] + flags
                      for src, obj in zip(sources, objects)])
            output = os.path.join(sim_dir, name)
            cmd = [_cxx(), "-shared", "-o", output, f"-Wl,-soname,{name}"] + objects + link + \
                  ["-pthread"] + (["--coverage"] if SIM_COVERAGE else [])
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd, cwd=ROOT)

    def _compile_simulated_cuda(self):
        flags = SIM_CXXFLAGS + ["-fvisibility=hidden"] + \
                (COVERAGE_FLAGS if SIM_COVERAGE else ["-O2"])
        os.makedirs(self.build_temp, exist_ok=True)
        commands, objects = [], []
        for source in _sources("kernels", ".cu"):
            out = os.path.join(self.build_temp,
                               os.path.basename(source).replace(".cu", ".sim.o"))
            commands.append([_cxx()] + flags + ["-c", source, "-o", out])   # -x c++ first
            objects.append(out)
        _run_all(commands)
        return objects


C_SOURCES = _sources("csrc", ".c") + [s for s in _sources("kernels", ".c")
                                      if s not in SIMD_SOURCES]
# What a rebuild must notice besides C_SOURCES: headers, CUDA sources, the simulator.
DEPENDS = _sources("csrc", ".h") + [s for s in _sources("kernels", "") if s not in C_SOURCES] + \
    ([s for folder in ("sim/include", "sim/runtime", "sim/nccl") for s in _sources(folder, "")]
     if SIMULATED else [])
DEFINES = [("RLHFZ_HAVE_X86_SIMD", "1")] if IS_X86_64 else []

setup(
    ext_modules=[Extension(
        "rlhfz._C",
        sources=C_SOURCES,
        depends=DEPENDS,
        include_dirs=["csrc", "kernels"],
        define_macros=DEFINES,
        extra_compile_args=COMMON_CFLAGS,
        # dlopen: the NCCL library
        extra_link_args=["-pthread", "-ldl"] + (_sanitize_link_flags() if SANITIZE else []),
    )],
    cmdclass={"build": Build, "build_ext": BuildExt},
)
