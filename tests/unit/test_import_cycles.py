"""No two kvpush modules import each other, directly or through others: every import counts,
at the top, inside a function or under TYPE_CHECKING, so a cycle cannot hide behind a lazy import.
Checked on the source of every package pyproject.toml maps."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def modules_of(packages: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Every module by its dotted name: (file, whether it is a package's __init__)."""
    found = {}
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([package, *parts])] = (path, is_package)
    return found


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the kvpush modules it imports (`from pkg import mod` is an import of pkg.mod)."""
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_package, node)
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        targets.add(f"{base}.{alias.name}")
                    elif base in modules:
                        targets.add(base)
        targets.discard(module)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_module_imports_itself_through_others():
    modules = modules_of(package_dirs())
    assert "kvpush.deploy.plan.plan" in modules and "kvpush.router.app" in modules
    assert cycles(import_graph(modules)) == []


def test_the_check_sees_a_lazy_a_type_only_and_a_long_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text("import pkg.e\n")
    (pkg / "e.py").write_text("from pkg import c\n")
    (pkg / "f.py").write_text("from . import a, c\n")  # imports into cycles, is in none
    graph = import_graph(modules_of({"pkg": pkg}))
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.e"]]
