"""ruff and mypy over the product packages, as pyproject.toml configures them (the dev extra installs
both: scripts/setup.sh)."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
CHECKED = ["kvpush.cli", "kvpush.common", "kvpush.connector", "kvpush.deploy", "kvpush.router", "kvpush.bench"]


def tool(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        pytest.fail(f"{name} is not installed in {path.parent}; run scripts/setup.sh (it installs the dev extra)")
    return str(path)


def test_ruff_finds_nothing():
    folders = sorted({PACKAGE_DIRS[name].split("/")[0] for name in PACKAGE_DIRS})
    done = subprocess.run([tool("ruff"), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), *folders],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def source_tree() -> Path:
    """kvpush's packages under one `kvpush` folder, as installed (the folders here are named without
    the prefix): links, kept beside mypy's cache so that its incremental runs find the same paths."""
    tree = ROOT / ".mypy_cache" / "src" / "kvpush"
    tree.mkdir(parents=True, exist_ok=True)
    for name, folder in PACKAGE_DIRS.items():
        if name.count(".") != 1:
            continue  # a subpackage: under its parent's link
        link = tree / name.split(".", 1)[1]
        if not link.is_symlink() or os.readlink(link) != str(ROOT / folder):
            link.unlink(missing_ok=True)
            link.symlink_to(ROOT / folder, target_is_directory=True)
    return tree.parent


@pytest.mark.timeout(900)  # a first run without a cache reads every module: ~1.5 min on 2 cores
def test_mypy_finds_nothing():
    packages = [arg for name in CHECKED for arg in ("-p", name)]
    done = subprocess.run([tool("mypy"), "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
                           str(ROOT / ".mypy_cache"), *packages], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, MYPYPATH=str(source_tree())))
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
