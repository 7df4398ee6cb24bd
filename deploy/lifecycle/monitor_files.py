"""`kvpush monitor`: writes a deployment's Prometheus scrape config, its Grafana dashboard and
the key files the scrape config names (0600), into one directory."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from kvpush.common.errors import KvpushError, UsageError
from kvpush.deploy.plan.dashboard import dashboard
from kvpush.deploy.plan.monitor_config import (
    KeyKind,
    ScrapeTarget,
    scrape_config,
    scrape_targets,
)
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import Topology

from .secrets import AccessKeys, client_api_key, kept_secret
from .state import write_private_atomically

SCRAPE_CONFIG_FILE = "prometheus.yml"
DASHBOARD_FILE = "grafana-dashboard.json"
KEY_FILE_NAMES: dict[KeyKind, str] = {"router-client": "router-client.key", "instance": "instance.key"}


@dataclass
class MonitorFiles:
    scrape_config: Path
    dashboard: Path
    targets: list[ScrapeTarget]
    key_files: dict[str, Path] = field(default_factory=dict)  # key kind -> file (written here, or the topology's)


def _key_file(topo: Topology, kind: KeyKind, out_dir: Path) -> tuple[Path, bool]:
    """The file holding the key, and whether it is to be written here (else it is the topology's own)."""
    if kind == "router-client":
        if topo.router.api_key_file is not None:
            return Path(topo.router.api_key_file).expanduser().resolve(), False
        return out_dir / KEY_FILE_NAMES[kind], True
    return out_dir / KEY_FILE_NAMES[kind], True


def _key_value(topo: Topology, kind: KeyKind) -> str:
    if kind == "router-client":
        key = client_api_key(topo)  # an unset router.api_key_env is a one-line UsageError
        assert key is not None
        return key
    secret = kept_secret(topo.name)
    if secret is None:
        raise KvpushError(
            f"instance_public_paths: /metrics of {topo.name}'s instances needs the instance key, made from "
            f"the deployment secret `kvpush up` keeps on this machine, and there is none yet; run "
            "`kvpush up` first, or add /metrics to instance_public_paths"
        )
    instance = AccessKeys.of(secret, None).instance
    assert instance is not None
    return instance


def _router_address(router_url: str) -> str:
    parts = urlsplit(router_url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise UsageError(
            f"--router-url: '{router_url}' is not a router URL; give http://HOST:PORT, e.g. the one `kvpush tunnel` "
            "prints"
        )
    return parts.netloc


def write_monitor_files(topo: Topology, out_dir: Path, router_url: str | None = None) -> MonitorFiles:
    """`router_url` replaces the planned router target (a tunnel's local end, say)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out: {out_dir} is a file; give a directory (created if missing)")
    plan = build_plan(topo)
    targets = scrape_targets(topo, plan)
    if router_url is not None:
        address = _router_address(router_url)
        targets = [dataclasses.replace(t, address=address) if t.role == "router" else t for t in targets]
    out_dir = out_dir.resolve()
    key_files: dict[str, Path] = {}
    for kind in sorted({t.key for t in targets if t.key is not None}):
        path, ours = _key_file(topo, kind, out_dir)
        if ours:
            write_private_atomically(path, _key_value(topo, kind) + "\n")
        key_files[kind] = path
    config = scrape_config(topo.name, targets, {kind: str(path) for kind, path in key_files.items()})
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path, dashboard_path = out_dir / SCRAPE_CONFIG_FILE, out_dir / DASHBOARD_FILE
    header = (f"# Prometheus scrape config for kvpush deployment {topo.name}, from `kvpush monitor`:\n"
              f"#   prometheus --config.file={config_path}\n")
    config_path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    dashboard_path.write_text(json.dumps(dashboard(topo.name), indent=2) + "\n")
    return MonitorFiles(config_path, dashboard_path, targets, key_files)
