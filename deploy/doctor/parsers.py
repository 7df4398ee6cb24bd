"""Pure parsers for the tools doctor runs on hosts. Each takes the tool's text, returns typed facts.

Tested on recorded outputs (tests/fixtures/doctor/). No decisions here: checks decide.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


class ParseError(ValueError):
    """The tool printed something this parser does not understand."""


# -- ulimit -------------------------------------------------------------------------------------


def parse_ulimit(text: str) -> int | None:
    """`ulimit -l` / `ulimit -n` output -> the number, or None for 'unlimited'."""
    value = text.strip().splitlines()[-1].strip() if text.strip() else ""
    if value == "unlimited":
        return None
    if not value.isdigit():
        raise ParseError(f"ulimit printed {value!r}, expected a number or 'unlimited'")
    return int(value)


# -- memory and disk ----------------------------------------------------------------------------


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo lines -> {key: bytes}."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+):\s+(\d+)(?:\s+kB)?$", line.strip())
        if m:
            found[m.group(1)] = int(m.group(2)) * (1024 if line.strip().endswith("kB") else 1)
    if not found:
        raise ParseError("no 'Key: value kB' lines in /proc/meminfo output")
    return found


@dataclass(frozen=True)
class DiskFree:
    filesystem: str
    available_bytes: int
    mount: str
    line: str


def parse_df(text: str) -> list[DiskFree]:
    """`df -Pk PATH...` (POSIX format, 1K blocks) -> one entry per path line."""
    rows = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 6 or not parts[3].isdigit():
            continue
        rows.append(DiskFree(parts[0], int(parts[3]) * 1024, " ".join(parts[5:]), line))
    if not rows:
        raise ParseError("df printed no filesystem lines")
    return rows


# -- fabric -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FiProvider:
    provider: str
    fabric: str | None
    domain: str | None
    lines: tuple[str, ...]


def parse_fi_info(stdout: str) -> list[FiProvider]:
    """`fi_info -p PROV` -> the provider entries it lists (empty when it found none)."""
    providers: list[FiProvider] = []
    current: dict[str, str] | None = None
    lines: list[str] = []

    def close() -> None:
        if current is not None:
            providers.append(
                FiProvider(current["provider"], current.get("fabric"), current.get("domain"), tuple(lines))
            )

    for raw in stdout.splitlines():
        line = raw.strip()
        m = re.match(r"^(\w+):\s*(.*)$", line)
        if not m:
            continue
        key, value = m.group(1), m.group(2).strip()
        if key == "provider":
            close()
            current, lines = {"provider": value}, [line]
        elif current is not None and key in ("fabric", "domain", "type", "protocol", "version"):
            current[key] = value
            lines.append(line)
    close()
    return providers


def fi_info_error(stdout: str, stderr: str) -> str | None:
    """The libfabric error line, e.g. 'fi_getinfo: -61' (-FI_ENODATA: no such provider/device)."""
    for line in (stderr + "\n" + stdout).splitlines():
        if line.strip().startswith("fi_getinfo"):
            return line.strip()
    return None


def parse_ls_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def parse_ibv_devices(stdout: str) -> list[str]:
    """`ibv_devices` table -> device names ('Failed to get IB devices list' prints no table)."""
    devices = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] not in ("device", "------") and re.fullmatch(r"[0-9a-fA-F]{16}", parts[1]):
            devices.append(parts[0])
    return devices


def parse_proc_modules(text: str) -> set[str]:
    return {line.split()[0] for line in text.splitlines() if line.strip()}


# -- nvidia-smi ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_used_mib: int
    memory_total_mib: int
    bus_id: str
    line: str


def _csv_fields(line: str) -> list[str]:
    return [f.strip() for f in line.split(",")]


def parse_nvidia_gpus(stdout: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,pci.bus_id --format=csv,noheader,nounits`."""
    gpus = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        f = _csv_fields(line)
        if len(f) != 6 or not f[0].isdigit():
            raise ParseError(f"unexpected nvidia-smi line: {line!r}")
        gpus.append(Gpu(int(f[0]), f[1], f[2], int(f[3]), int(f[4]), f[5], line))
    return gpus


@dataclass(frozen=True)
class GpuProcess:
    gpu_uuid: str
    pid: int
    name: str
    used_mib: int | None
    line: str


def parse_nvidia_apps(stdout: str) -> list[GpuProcess]:
    """`nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits`."""
    apps = []
    for line in stdout.splitlines():
        if not line.strip() or line.startswith("No running"):
            continue
        f = _csv_fields(line)
        if len(f) < 4 or not f[1].isdigit():
            raise ParseError(f"unexpected nvidia-smi compute-apps line: {line!r}")
        apps.append(GpuProcess(f[0], int(f[1]), ",".join(f[2:-1]), int(f[-1]) if f[-1].isdigit() else None, line))
    return apps


LINK_RANK = {"X": 0, "PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}  # NV# links are GPU<->GPU


@dataclass
class TopoMatrix:
    """`nvidia-smi topo -m`: links between GPUs and NICs, CPU/NUMA affinity per GPU."""

    columns: list[str]
    links: dict[str, dict[str, str]] = field(default_factory=dict)  # row -> column -> link
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    numa_affinity: dict[str, str] = field(default_factory=dict)
    nic_names: dict[str, str] = field(default_factory=dict)  # NIC0 -> rdmap79s0
    row_lines: dict[str, str] = field(default_factory=dict)

    def nics(self) -> list[str]:
        return [c for c in self.columns if c.startswith(("NIC", "mlx", "rdma", "efa"))]

    def nearest_nic(self, gpu: str) -> tuple[str, str] | None:
        """(nic, link) with the best link from this GPU, or None when no NIC is listed."""
        row = self.links.get(gpu, {})
        candidates = [(LINK_RANK.get(row.get(n, "SYS"), 9), n, row.get(n, "?")) for n in self.nics()]
        if not candidates:
            return None
        _, nic, link = min(candidates)
        return nic, link


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def parse_nvidia_topo(text: str) -> TopoMatrix:
    """Real output underlines the header with ANSI escapes even when stdout is not a terminal,
    and GPU rows may carry an empty cell before 'GPU NUMA ID' (recorded on an H200 host)."""
    lines = ANSI_ESCAPE.sub("", text).splitlines()
    header_index = next((i for i, line in enumerate(lines) if re.match(r"^\s+GPU0\b", line)), None)
    if header_index is None:
        raise ParseError("no 'GPU0 ...' header line in nvidia-smi topo -m output")
    header = [c.strip() for c in lines[header_index].split("\t") if c.strip()]
    affinity_cols = [c for c in header if "Affinity" in c or "NUMA ID" in c]
    device_cols = [c for c in header if c not in affinity_cols]
    matrix = TopoMatrix(columns=device_cols)
    for line in lines[header_index + 1 :]:
        if not line.strip() or line.strip().startswith("Legend"):
            break
        cells = [c.strip() for c in line.split("\t")]
        row, values = cells[0], cells[1:]
        if not row:
            continue
        matrix.row_lines[row] = line
        matrix.links[row] = {col: values[i] for i, col in enumerate(device_cols) if i < len(values)}
        extra = values[len(device_cols) :]
        for i, col in enumerate(affinity_cols):
            if i < len(extra):
                if col == "CPU Affinity":
                    matrix.cpu_affinity[row] = extra[i]
                elif col == "NUMA Affinity":
                    matrix.numa_affinity[row] = extra[i]
    for line in lines:
        m = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)
        if m:
            matrix.nic_names[m.group(1)] = m.group(2)
    return matrix


# -- UCX ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UcxTls:
    raw: str
    negated: bool  # '^a,b' means "all transports except a and b"
    names: frozenset[str]

    def allows(self, transport: str) -> bool:
        """Whether UCX may use this transport (aliases: 'cuda' covers cuda_copy and cuda_ipc)."""
        family = {"cuda_copy": {"cuda", "cuda_copy"}, "cuda_ipc": {"cuda", "cuda_ipc"},
                  "tcp": {"tcp"}, "shm": {"shm", "sm", "posix", "sysv", "cma", "xpmem"}}.get(transport, {transport})
        listed = bool(family & self.names) or "all" in self.names
        return not listed if self.negated else listed


def parse_ucx_tls(value: str | None) -> UcxTls | None:
    """UCX_TLS as UCX reads it; None when unset (UCX picks every available transport)."""
    if value is None:
        return None
    text = value.strip()
    negated = text.startswith("^")
    names = frozenset(n.strip().lower() for n in text.lstrip("^").split(",") if n.strip())
    return UcxTls(value, negated, names)
