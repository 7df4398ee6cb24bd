"""SSH settings, apart from the SSH runner so that reading them does not import paramiko."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SSH_CONFIG = "~/.ssh/config"


@dataclass(frozen=True)
class SshOptions:
    # None: as the SSH config says (UserKnownHostsFile, else ~/.ssh/known_hosts); a file: that file alone
    known_hosts: str | None = None
    # None: what `ssh` reads (~/.ssh/config, then /etc/ssh/ssh_config); a file: that file alone, as `ssh -F`
    config_file: str | None = None
    accept_new_host_keys: bool = False  # StrictHostKeyChecking accept-new, whatever the config says
    connect_timeout_s: float = 10.0
    auth_timeout_s: float = 10.0
    command_timeout_s: float = 120.0
