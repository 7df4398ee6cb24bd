"""The router and the connector run alone on hosts: they, and what they share (common/), import
nothing from the deploy tooling or the CLI. Checked on the source, so a lazy import counts too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDALONE = ("router", "connector", "common")
FORBIDDEN = ("kvpush.deploy", "kvpush.cli")


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from ..deploy import x` inside kvpush.router is kvpush.deploy too
            names.append(node.module if node.level == 0 else "kvpush." + node.module if node.level == 2 else node.module)
    return names


@pytest.mark.parametrize("package", STANDALONE)
def test_standalone_packages_import_nothing_from_deploy_or_cli(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    leaks = [f"{path.relative_to(ROOT)}: {name}" for path in files for name in imported_modules(path)
             if name.startswith(FORBIDDEN)]
    assert leaks == []


def test_the_check_sees_a_forbidden_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from kvpush.deploy.plan.plan import build_plan\nfrom ..cli import main\n")
    assert sorted(imported_modules(path)) == ["kvpush.cli", "kvpush.deploy.plan.plan"]
