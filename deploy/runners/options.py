"""SSH settings, apart from the SSH runner so that reading them does not import paramiko."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SshOptions:
    known_hosts: str = "~/.ssh/known_hosts"
    config_file: str = "~/.ssh/config"  # Host blocks fill in what the topology leaves out (ssh_config.py)
    accept_new_host_keys: bool = False
    connect_timeout_s: float = 10.0
    auth_timeout_s: float = 10.0
    command_timeout_s: float = 120.0
