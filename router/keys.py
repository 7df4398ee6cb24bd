"""The router's API keys: the one clients must present, and the one it presents to the instances.

Each comes from an environment variable or from a file. A key file must be readable by its owner
only (as ssh insists for private keys): a key any local user can read protects nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvpush.common.deployment_secret import SecretFileError, read_key_file
from kvpush.common.errors import UsageError

from .config import RouterConfig


@dataclass(frozen=True)
class Keys:
    client: str | None = None  # what a client's `Authorization: Bearer` must carry; None: no check
    instance: str | None = None  # what the router sends to the instances; None: nothing

    @classmethod
    def same(cls, key: str | None) -> Keys:
        """One key for both sides (a router in front of instances started with its own key)."""
        return cls(key, key)


def _check_key(key: str, where: str) -> str:
    # The key goes into HTTP header lines: a control character or space would split or end one.
    if not key or any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise UsageError(f"{where}: the key must be printable ASCII without spaces (and not empty)")
    return key


def _from_env(name: str, field: str) -> str:
    key = os.environ.get(name, "")
    if not key:
        raise UsageError(f"router config: {field} names {name}, which is unset or empty; "
                         f"export it or remove {field} from the router config")
    return _check_key(key, f"router config: {field} {name}")


def _from_file(path: str, field: str) -> str:
    try:
        key = read_key_file(path, missing_hint="`kvpush up` writes it, or fix the path")
    except SecretFileError as exc:
        raise UsageError(f"router config: {field}: {exc}") from None
    return _check_key(key, f"router config: {field} {path}")


def _one_key(config: RouterConfig, prefix: str) -> str | None:
    env, path = getattr(config, f"{prefix}_env"), getattr(config, f"{prefix}_file")
    if env:
        return _from_env(env, f"{prefix}_env")
    if path:
        return _from_file(str(Path(path).expanduser()), f"{prefix}_file")
    return None


def resolve_keys(config: RouterConfig) -> Keys:
    """Both keys, read once at start; a key named but missing or unsafe is a configuration error."""
    client = _one_key(config, "api_key")
    instance = _one_key(config, "instance_api_key")
    return Keys(client, instance if instance is not None else client)
