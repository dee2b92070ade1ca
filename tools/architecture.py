"""The shape of the sparsekit package: its import graph, cycles, layer order, sizes, import time.

    python tools/architecture.py [--root DIR] [--json OUT] [--no-time]

prints lines per module, the functions over 80 lines, the import cycles (strongly connected
groups of modules, imports inside functions included), imports that point up the layer order,
and the wall time of ``import sparsekit`` beyond ``import torch`` (median of three fresh
interpreters). ``--root`` reads another checkout (for a before/after comparison); the import
time is measured there too. tests/test_architecture.py asserts the graph properties with the
same functions.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Layers, highest first: a module may import from its own layer or a lower one, never a higher.
# ``nn`` holds what prune, quant and accel all use (calibration, selection, shards, timing).
# The public API (the top-level package, lazy) re-exports accel, quant, prune, io and models and
# sits between them and the run app, which may use it; ``__main__`` (the command) is on top.
LAYERS = {
    "sparsekit.run": 5,
    "sparsekit.accel": 4,
    "sparsekit.quant": 3,
    "sparsekit.prune": 2,
    "sparsekit.nn": 1.5,
    "sparsekit.io": 1,
    "sparsekit.models": 1,
    "sparsekit.data": 1,
}
CORE = 0  # sparsekit.errors, progress, _compat, registry, checks, imports, reporting
FACADE = 4.5  # sparsekit (the __init__)
MAIN = 6  # sparsekit.__main__
LONG_FUNCTION = 80


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package under ``root``."""
    out = {}
    for path in sorted((root / "sparsekit").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if "_data" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (inside functions too; not
    under ``if TYPE_CHECKING``). ``from pkg import sub`` counts the submodule. Importing
    ``a.b.c`` also runs ``a`` and ``a.b``: those count too, except the importer's own parents.
    In the top-level package, module names in strings count as well: the lazy public API
    names the modules it imports on first use that way."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    is_package = path.name == "__init__.py"
    named: set[str] = set()
    for node in ast.walk(tree):
        if (name == "sparsekit" and isinstance(node, ast.Constant)
                and isinstance(node.value, str) and node.value in known):
            named.add(node.value)
        if not isinstance(node, ast.Import | ast.ImportFrom) or _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = name.split(".")
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([base] if base else []))
        submodules = {f"{base}.{alias.name}" for alias in node.names} & known
        named.update(submodules)
        if len(submodules) < len(node.names):  # a name defined in ``base`` itself
            named.add(base)
    own_parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    out = set()
    for target in named:
        if not target.startswith("sparsekit"):
            continue
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and (prefix == target or prefix not in own_parents):
                out.add(prefix)
    out.discard(name)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (see :func:`imports`)."""
    mods = modules(root)
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def layer(module: str) -> int:
    if module == "sparsekit":
        return FACADE
    if module == "sparsekit.__main__":
        return MAIN
    for prefix, rank in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return CORE


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a lower layer imports a higher one."""
    return sorted((a, b) for a, deps in graph.items() for b in deps if layer(b) > layer(a))


def line_counts(root: Path = ROOT) -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in modules(root).items()}


def long_functions(root: Path = ROOT, limit: int = LONG_FUNCTION) -> list[tuple[str, int]]:
    """(module:function, lines) for every function or method longer than ``limit`` lines
    (decorators and docstring included), longest first."""
    out = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - start + 1
                if length > limit:
                    out.append((f"{name}:{node.name}", length))
    return sorted(out, key=lambda item: -item[1])


_TIMER = """
import sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import sparsekit; t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def import_seconds(root: Path = ROOT, repeats: int = 3) -> dict[str, float]:
    """Median wall time of ``import torch`` and of ``import sparsekit`` after it, each in a
    fresh interpreter with ``root`` first on the path."""
    torch_s, sparsekit_s = [], []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", _TIMER], capture_output=True, text=True,
                              check=True, cwd=root, env={"PYTHONPATH": str(root), "PATH": ""})
        a, b = map(float, done.stdout.split())
        torch_s.append(a)
        sparsekit_s.append(b)
    return {"torch_s": statistics.median(torch_s), "sparsekit_beyond_torch_s":
            statistics.median(sparsekit_s)}


def measure(root: Path = ROOT, timing: bool = True) -> dict:
    graph = import_graph(root)
    lines = line_counts(root)
    out = {
        "modules": len(lines),
        "lines": sum(lines.values()),
        "lines_per_module": dict(sorted(lines.items(), key=lambda item: -item[1])),
        "functions_over_80_lines": long_functions(root),
        "import_cycles": cycles(graph),
        "upward_imports": upward_imports(graph),
    }
    if timing:
        out["import_time"] = import_seconds(root)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to read")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--no-time", action="store_true", help="skip the import timing")
    args = parser.parse_args(argv)
    m = measure(args.root.resolve(), timing=not args.no_time)
    print(f"{m['modules']} modules, {m['lines']} lines; largest:")
    for name, n in list(m["lines_per_module"].items())[:10]:
        print(f"  {n:5d}  {name}")
    print(f"functions over {LONG_FUNCTION} lines: {len(m['functions_over_80_lines'])}")
    for name, n in m["functions_over_80_lines"]:
        print(f"  {n:5d}  {name}")
    print(f"import cycles: {len(m['import_cycles'])}")
    for group in m["import_cycles"]:
        print("  " + " <-> ".join(group))
    print(f"upward imports: {len(m['upward_imports'])}")
    for a, b in m["upward_imports"]:
        print(f"  {a} -> {b}")
    if "import_time" in m:
        t = m["import_time"]
        print(f"import torch {t['torch_s']:.2f} s; import sparsekit beyond torch "
              f"{t['sparsekit_beyond_torch_s']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(m, indent=1) + "\n")


if __name__ == "__main__":
    main()
