"""The layering docs/ARCHITECTURE.md describes holds: no import circle in
rlhfz/, no module reading another's underscore names, shard splits computed
in engine/layout.py alone, every __shared__ array of the kernels declared
through one macro, and (where the build's objects are at hand) no circle of
C files calling each other."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools", "structure")
sys.path.insert(0, TOOLS)

import py_structure  # noqa: E402


@pytest.fixture(scope="module")
def package():
    path = os.path.join(ROOT, "rlhfz")
    return py_structure.modules(path)


def test_no_import_circle(package):
    graph = {name: py_structure.imports(name, path, package) for name, path in package.items()}
    assert py_structure.cycles(graph) == []


def test_the_engine_imports_nothing_above_it(package):
    for name, path in package.items():
        if name.startswith("rlhfz.engine"):
            above = {m for m in py_structure.imports(name, path, package)
                     if m != "rlhfz" and not m.startswith("rlhfz.engine")}
            assert not above, f"{name} imports {above}"


def test_no_module_reads_another_modules_underscore_names(package):
    assert py_structure.underscore_reads(package) == []


def test_shard_splits_are_computed_in_one_module(package):
    sites = py_structure.shard_split_sites(package)
    assert sites and {site.split(":")[0] for site in sites} == {
        os.path.join(ROOT, "rlhfz", "engine", "layout.py")}, sites


def test_the_checker_finds_a_circle_and_an_underscore_read(tmp_path):
    """The checks above cannot pass by finding nothing."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import helper\n_hidden = 1\n")
    (pkg / "b.py").write_text("def helper():\n    from . import a\n    return a._hidden\n")
    modules = py_structure.modules(str(pkg))
    graph = {n: py_structure.imports(n, p, modules) for n, p in modules.items()}
    assert py_structure.cycles(graph) == [["pkg.a", "pkg.b"]]
    assert len(py_structure.underscore_reads(modules)) == 1


def test_every_shared_array_of_the_kernels_is_declared_through_the_macro():
    """RLHFZ_SHARED_ARRAY makes an array read as NaN at each block's start on
    the simulated device, as a GPU promises nothing of it; one declared bare
    would keep the last block's values there, which no GPU guarantees."""
    bare = []
    for path in sorted(glob.glob(os.path.join(ROOT, "kernels", "*.cu*"))):
        if os.path.basename(path) == "cuda_check.cuh":      # the macro itself
            continue
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if "__shared__" in line and not line.lstrip().startswith(("/*", "*", "//")):
                    bare.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not bare, "declare these through RLHFZ_SHARED_ARRAY:\n" + "\n".join(bare)


@pytest.mark.skipif(not glob.glob(os.path.join(ROOT, "build", "temp.*", "csrc", "*.o")),
                    reason="no object files of an in-tree build (build/temp.*) to read")
def test_no_circle_of_c_files_calling_each_other():
    done = subprocess.run([sys.executable, os.path.join(TOOLS, "c_calls.py")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "cycles: none" in done.stdout, done.stdout + done.stderr
