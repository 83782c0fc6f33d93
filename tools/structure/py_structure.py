"""The Python layer's structure, measured: import circles, the largest
class and file, reads of another module's underscore names, and the places
that compute shard splits.

    python3 tools/structure/py_structure.py [PACKAGE_DIR]      (default: rlhfz)

Exits non-zero if there is an import circle or an underscore read across
modules. Function-local imports count as imports: deferring one hides a
circle from the interpreter, not from the reader.
"""
from __future__ import annotations

import ast
import os
import sys

from c_calls import strongly_connected


def modules(root: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py under the package root."""
    package = os.path.basename(os.path.abspath(root))
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.dirname(os.path.abspath(root)))
            dotted = rel[:-3].replace(os.sep, ".")
            if dotted.endswith(".__init__"):
                dotted = dotted[:-len(".__init__")]
            found[dotted] = path
    return {k: v for k, v in found.items() if k == package or k.startswith(package + ".")}


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """The package's modules that `name` imports (anywhere in the file)."""
    tree = ast.parse(open(path).read(), path)
    is_package = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve(name, is_package, node.level, node.module) if node.level
                    else node.module or "")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module. Edges from
    a package to its own submodules are left out: that is how a package
    re-exports, and the submodule does not run the package again."""
    edges = {n: {m for m in targets if not m.startswith(n + ".")} for n, targets in graph.items()}
    return strongly_connected(edges)


def defined_underscore_names(path: str) -> set[str]:
    """Underscore names a module defines: module-level, class members and
    attributes assigned on self."""
    tree = ast.parse(open(path).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def underscore_reads(known: dict[str, str]) -> list[str]:
    """`x._name` (x not self or cls) or `from .m import _name` where _name
    belongs to another module of the package, not the reader."""
    own = {name: defined_underscore_names(path) for name, path in known.items()}
    everyone = set().union(*own.values()) if own else set()
    found = []
    for name, path in known.items():
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                target = node.value
                if isinstance(target, ast.Name) and target.id in ("self", "cls"):
                    continue
                if node.attr in everyone and node.attr not in own[name]:
                    found.append(f"{path}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") \
                            and alias.name != "_C":
                        found.append(f"{path}:{node.lineno}: import {alias.name}")
    return found


def _mentions(node: ast.AST, word: str) -> bool:
    text = ast.unparse(node).lower()
    return word in text


def shard_split_sites(known: dict[str, str]) -> list[str]:
    """Code that computes which elements a rank owns: rank times a shard
    size, a divmod by a shard size, or a bucket's length over the world size."""
    sites = []
    for name, path in known.items():
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                sides = (node.left, node.right)
                hit = (any(_mentions(s, "rank") or _mentions(s, "owner") for s in sides)
                       and any(_mentions(s, "shard") for s in sides))
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                hit = _mentions(node.right, "world_size") and (
                    _mentions(node.left, "numel") or _mentions(node.left, "padded"))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "divmod" and len(node.args) == 2:
                hit = _mentions(node.args[1], "shard")
            if hit:
                sites.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return sites


def largest(known: dict[str, str]):
    files = sorted(((sum(1 for _ in open(p)), p) for p in known.values()), reverse=True)
    classes = []
    for path in known.values():
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{path}:{node.name}"))
    return files[0], max(classes)


def main(argv) -> int:
    root = argv[1] if len(argv) > 1 else "rlhfz"
    known = modules(root)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    circles = cycles(graph)
    reads = underscore_reads(known)
    sites = shard_split_sites(known)
    (file_lines, file_path), (class_lines, class_name) = largest(known)
    print(f"modules: {len(known)}")
    print(f"import circles: {len(circles)}")
    for circle in circles:
        print("  " + " <-> ".join(circle))
    print(f"largest file: {file_path} ({file_lines} lines)")
    print(f"largest class: {class_name} ({class_lines} lines)")
    print(f"underscore names read across modules: {len(reads)}")
    for read in reads:
        print("  " + read)
    where = sorted({site.split(":")[0] for site in sites})
    print(f"modules that compute shard splits: {len(where)} ({', '.join(where)})")
    for site in sites:
        print("  " + site)
    return 1 if circles or reads else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
