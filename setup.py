"""Build of rlhfz._C: C11 sources from csrc/ and kernels/, SIMD kernels with
their own ISA flags, and CUDA sources through nvcc when it is present.

Environment:
  RLHFZ_CUDA=auto|0|1      auto: build the CUDA parts if nvcc is found
  RLHFZ_CUDA_ARCHS="80;90" compute capabilities to generate code for
  CUDA_HOME                where to look for nvcc and libcudart_static
  RLHFZ_SANITIZE=1         AddressSanitizer + UBSan build for the CPU only, with
                           $CC (clang or gcc); python needs the ASan runtime in
                           LD_PRELOAD (tools/sanitize/run.py sets both)
"""
import os
import platform
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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
    return sorted(os.path.join(folder, name) for name in os.listdir(path)
                  if name.endswith(suffix))


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


def _cuda_mode():
    """The CUDA toolkit to build with, or None to build for the CPU only."""
    mode = os.environ.get("RLHFZ_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"RLHFZ_CUDA must be auto, 0 or 1, not {mode!r}")
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


class BuildExt(build_ext):
    """Compiles SIMD and CUDA objects first, then lets setuptools link them in."""

    def build_extension(self, ext):
        objects = []
        if IS_X86_64:
            for source, flags in SIMD_SOURCES.items():
                objects += self.compiler.compile(
                    [source], output_dir=self.build_temp,
                    include_dirs=ext.include_dirs, macros=ext.define_macros,
                    extra_postargs=COMMON_CFLAGS + ["-fPIC"] + flags)
        cuda_home = _cuda_mode()
        if cuda_home is not None:
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
        os.makedirs(self.build_temp, exist_ok=True)
        objects = []
        for source in _sources("kernels", ".cu"):
            out = os.path.join(self.build_temp,
                               os.path.basename(source).replace(".cu", ".cu.o"))
            cmd = [nvcc, "-c", source, "-o", out, "-O3", "-std=c++17",
                   "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Ikernels"] + gencode
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd, cwd=ROOT)
            objects.append(out)
        return objects


C_SOURCES = _sources("csrc", ".c") + [s for s in _sources("kernels", ".c")
                                      if s not in SIMD_SOURCES]
DEFINES = [("RLHFZ_HAVE_X86_SIMD", "1")] if IS_X86_64 else []

setup(
    ext_modules=[Extension(
        "rlhfz._C",
        sources=C_SOURCES,
        include_dirs=["csrc", "kernels"],
        define_macros=DEFINES,
        extra_compile_args=COMMON_CFLAGS,
        # dlopen: the NCCL library
        extra_link_args=["-pthread", "-ldl"] + (_sanitize_link_flags() if SANITIZE else []),
    )],
    cmdclass={"build_ext": BuildExt},
)
