"""The file-level call graph of rlhfz._C's C and CUDA objects, and its cycles.

Reads each object file's defined and undefined symbols with `nm`, draws an
edge from A to B for every symbol A uses that B defines, and prints the
graph, its cycles (strongly connected components of more than one file) and
the largest source file by lines. Exits 1 if there is a cycle, 2 if it found
no objects (or no nm), else 0.

    python3 tools/structure/c_calls.py                  # the normal build under build/temp.*
    python3 tools/structure/c_calls.py DIR_OR_OBJECT... # e.g. build/sim/temp.linux-x86_64-cpython-311
    python3 tools/structure/c_calls.py --symbols        # name the symbols of every edge

Why objects and not sources: the linker's view is the one that counts. A
call through a header macro or an inline function shows up where it lands,
and nothing that the preprocessor drops (a CUDA-only path in a CPU build) is
counted. Run it on the build whose configuration you care about.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# nm's letters for symbols an object defines (upper case: visible to other objects)
DEFINED = set("TDBRGSCVWIiu")


def default_objects() -> list[str]:
    """The objects of the normal build: build/temp.*/ (csrc/, kernels/ and the .cu objects)."""
    found = []
    for temp in sorted(glob.glob(os.path.join(ROOT, "build", "temp.*"))):
        found += objects_under(temp)
    return found


def objects_under(path: str) -> list[str]:
    """The .o files under path. The simulated build also keeps the objects
    of its CUDA runtime and NCCL stand-in (separate libraries, not rlhfz._C)
    in a sim/ folder there: those are left out."""
    if os.path.isfile(path):
        return [path]
    found = []
    for folder, subfolders, names in os.walk(path):
        if folder == path and "sim" in subfolders:
            subfolders.remove("sim")
        found += [os.path.join(folder, name) for name in names if name.endswith(".o")]
    return sorted(found)


def label(obj: str, base: str) -> str:
    """The source file an object was compiled from, as the repository names it.
    setuptools keeps the source's folder (csrc/x.o); setup.py writes the .cu
    objects flat into the temp folder as x.cu.o (x.sim.o on the simulator)."""
    rel = os.path.relpath(obj, base)[:-2]
    for suffix in (".cu", ".sim"):
        if rel.endswith(suffix):
            return "kernels/" + os.path.basename(rel[:-len(suffix)]) + ".cu"
    return rel + ".c"


def symbols(nm: str, obj: str) -> tuple[set[str], set[str]]:
    """(defined, undefined) global symbols of an object."""
    out = subprocess.run([nm, "-g", "-P", obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[0], parts[1]
        if kind == "U":
            undefined.add(name)
        elif kind in DEFINED:
            defined.add(name)
    return defined, undefined


def build_graph(objects: list[tuple[str, str]], nm: str):
    """edges[a][b] = the symbols a uses that b defines. A symbol defined in
    several objects (C++ inline functions, templates) belongs to none."""
    defined_by, uses = {}, {}
    for name, obj in objects:
        defined, undefined = symbols(nm, obj)
        uses[name] = undefined
        for symbol in defined:
            defined_by.setdefault(symbol, set()).add(name)
    edges = {name: {} for name, _ in objects}
    for name, undefined in uses.items():
        for symbol in undefined:
            owners = defined_by.get(symbol, set())
            if len(owners) == 1:
                (owner,) = owners
                if owner != name:
                    edges[name].setdefault(owner, set()).add(symbol)
    return edges


def strongly_connected(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components of more than one node."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def source_root(path: str) -> str:
    """The checkout a build folder belongs to: the parent of the nearest
    enclosing build/ that sits beside a csrc/ (else this checkout)."""
    folder = os.path.abspath(path)
    while True:
        parent = os.path.dirname(folder)
        if os.path.basename(folder) == "build" and os.path.isdir(os.path.join(parent, "csrc")):
            return parent
        if parent == folder:
            return ROOT
        folder = parent


def line_count(root: str, source: str) -> int | None:
    path = os.path.join(root, source)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*",
                        help="object files or folders of them (default: build/temp.*)")
    parser.add_argument("--symbols", action="store_true", help="name the symbols of each edge")
    parser.add_argument("--source-root", help="where the sources of the objects are, for line "
                        "counts (default: the checkout the build folder is in)")
    args = parser.parse_args(argv)
    nm = shutil.which("nm")
    if nm is None:
        print("c_calls: nm (binutils) is not on PATH", file=sys.stderr)
        return 2
    objects = []
    for path in args.paths or [None]:
        if path is None:
            found = default_objects()
            base = lambda obj: os.path.join(ROOT, "build", os.path.relpath(obj, os.path.join(
                ROOT, "build")).split(os.sep)[0])
        else:
            found = objects_under(path)
            base = (lambda obj, folder=path: folder) if os.path.isdir(path) else (
                lambda obj: os.path.dirname(obj))
        objects += [(label(obj, base(obj)), obj) for obj in found]
    if not objects:
        where = " ".join(args.paths) or os.path.join(ROOT, "build", "temp.*")
        print(f"c_calls: no object files under {where} (build first: python3 setup.py "
              f"build_ext)", file=sys.stderr)
        return 2
    names = [name for name, _ in objects]
    if len(set(names)) != len(names):
        print("c_calls: several builds given at once (the same source twice): "
              + ", ".join(sorted({n for n in names if names.count(n) > 1})), file=sys.stderr)
        return 2
    edges = build_graph(objects, nm)

    print(f"file-level call graph of {len(objects)} objects (A -> B: A calls into B)")
    for name in sorted(edges):
        targets = edges[name]
        if not targets:
            print(f"  {name} -> (nothing)")
            continue
        parts = []
        for target in sorted(targets):
            used = targets[target]
            parts.append(f"{target} ({', '.join(sorted(used))})" if args.symbols
                         else f"{target} ({len(used)})")
        print(f"  {name} -> " + ", ".join(parts))

    cycles = strongly_connected(edges)
    if cycles:
        print(f"\ncycles: {len(cycles)}")
        for number, component in enumerate(cycles, 1):
            members = set(component)
            print(f"  cycle {number}: {len(component)} files: {', '.join(component)}")
            for name in component:
                for target, used in sorted(edges[name].items()):
                    if target in members:
                        print(f"    {name} -> {target}: {', '.join(sorted(used))}")
    else:
        print("\ncycles: none")

    root = args.source_root or source_root(objects[0][1])
    sizes = [(count, name) for name in names
             if name.endswith(".c") and (count := line_count(root, name)) is not None]
    if sizes:
        count, name = max(sizes)
        print(f"largest C file: {name} ({count} lines, in {root})")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
