"""The deployment secret on the machine running kvpush and on the hosts, and the keys made from it.

- This machine keeps the secret at `<state dir>/<deployment>.secret` (0600): `up` makes it once,
  `up --rotate-secret` replaces it; `status` and `bench` derive the instances' key from it.
- `up` writes the plan's secret files (HostPlan.secret_files) on each host with mode 0600, their
  content on stdin (never in an argv), and restarts the processes whose files changed.
- A standalone Slurm script (`kvpush plan --slurm-script`) makes its own secret when the job
  starts and derives the same files from it (secret_content.py); the script holds none.
- `down` removes the secret files from the hosts (remove_secret_files); the secret kept here stays
  unless `down --forget-secret` asks (forget_local_secret), so a later `up` brings the same keys back.
- The router's client key comes from router.api_key_env (an environment variable here) or
  router.api_key_file (a file here); it reaches the router's host as a file too.
- The topology's `secrets` are read here the same way (read_user_secrets) and reach the vLLM
  instances in their env file, beside the instance key: a new value restarts them.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from kvpush.common import deployment_secret as ds
from kvpush.common.errors import UsageError
from kvpush.common.instance_auth import KEY_VARIABLE
from kvpush.deploy.plan.plan_model import HostPlan, Plan, SecretFilePlan
from kvpush.deploy.plan.private_file import private_write_command
from kvpush.deploy.runners import Runner, fan_out, values_or_raise
from kvpush.deploy.topology.placement import secret_paths_in
from kvpush.deploy.topology.topology import Topology
from kvpush.deploy.topology.topology_schema import SecretSource

from .changes import Changes
from .state import state_dir, write_private_atomically

API_KEY_VARIABLE = KEY_VARIABLE  # VLLM_API_KEY: vLLM's --api-key, and the instance key kvpush's middleware checks


def local_secret_path(deployment: str) -> Path:
    return state_dir() / f"{deployment}.secret"


def ensure_local_secret(deployment: str, rotate: bool = False) -> tuple[bytes, bool]:
    """This deployment's secret, and whether it is new: the one kept here, or a new one (none kept
    yet, or rotate)."""
    path = local_secret_path(deployment)
    if not rotate and os.path.lexists(path):
        return ds.read_secret(path), False
    secret = ds.new_secret()
    write_private_atomically(path, ds.secret_file_text(secret))
    return secret, True


def kept_secret(deployment: str) -> bytes | None:
    """The secret kept here, or None when `up` never made one (a deployment from before secrets)."""
    if not os.path.lexists(local_secret_path(deployment)):
        return None
    return ds.read_secret(local_secret_path(deployment))


def _valid_key(key: str, where: str) -> str:
    # It becomes an HTTP header value: printable ASCII without spaces, so nothing can be injected.
    if not key or not all(33 <= ord(c) <= 126 for c in key):
        raise UsageError(f"{where}: the router's API key must be printable ASCII without spaces; give another key")
    return key


HERE = ("on this machine", "export it here (kvpush delivers the key to the router's host as a file)",
        "give the path of a file on this machine")


def client_api_key(topo: Topology) -> str | None:
    """The key clients send to the router, read on this machine; None when the router takes none."""
    return read_client_key(topo.router.api_key_env, topo.router.api_key_file, HERE)


def read_client_key(api_key_env: str | None, api_key_file: str | None,
                    where: tuple[str, str, str] = HERE) -> str | None:
    """The router's client key from the variable api_key_env, else the file api_key_file, as the
    process reading it sees them; `where` says in error messages where that is (place, how to set
    the variable, where the file must be)."""
    place, export_hint, file_hint = where
    if api_key_env is not None:
        value = os.environ.get(api_key_env, "")
        if not value:
            raise UsageError(f"router.api_key_env: {api_key_env} is unset or empty {place}; {export_hint}")
        return _valid_key(value.strip(), f"router.api_key_env ({api_key_env})")
    if api_key_file is not None:
        try:
            key = ds.read_key_file(api_key_file, missing_hint=file_hint)
        except ds.SecretFileError as exc:
            raise UsageError(f"router.api_key_file: {exc}") from None
        return _valid_key(key, f"router.api_key_file ({api_key_file})")
    return None


SECRETS_HERE = ("on this machine", "export it here (kvpush delivers it to the instances' hosts in a 0600 file)",
                "give the path of a file on this machine")


def read_user_secrets(sources: dict[str, SecretSource], where: tuple[str, str, str] = SECRETS_HERE) -> dict[str, str]:
    """The topology's `secrets` values, by name, as the process reading them sees its environment
    and files (`where` as for read_client_key). An error names the secret and its source, never a value."""
    place, export_hint, file_hint = where
    values: dict[str, str] = {}
    for name, source in sources.items():
        field = f"secrets.{name}"
        if source.env is not None:
            value = os.environ.get(source.env, "")
            if not value:
                raise UsageError(f"{field}: {source.env} is unset or empty {place}; {export_hint}")
        else:
            assert source.file is not None
            try:
                value = ds.read_private_text(source.file, "secret file", missing_hint=file_hint)
            except ds.SecretFileError as exc:
                raise UsageError(f"{field}: {exc}") from None
            value = value[:-1] if value.endswith("\n") else value
            value = value[:-1] if value.endswith("\r") else value
            if not value:
                raise UsageError(f"{field}: {source.file} is empty; put the value in it")
        if "\0" in value:
            raise UsageError(f"{field}: the value has a NUL character, which no environment variable can hold")
        values[name] = value
    return values


def instance_env_text(instance_key: str, user_secrets: dict[str, str]) -> str:
    """The instances' env file: the instance key, then the user's secrets, as lines the launch's
    shell sources (each value one quoted word, whatever it holds)."""
    return f"{API_KEY_VARIABLE}={instance_key}\n" + "".join(
        f"{name}={shlex.quote(value)}\n" for name, value in sorted(user_secrets.items()))


@dataclass(frozen=True)
class AccessKeys:
    """The keys kvpush's own requests carry: to the router, and to the vLLM instances."""

    client: str | None = None
    instance: str | None = None

    @classmethod
    def of(cls, secret: bytes | None, client: str | None) -> AccessKeys:
        return cls(client, ds.derive_token(secret, ds.INSTANCE_API_KEY) if secret is not None else None)

    def headers(self, role: str) -> dict[str, str]:
        """Authorization for a request to a process of this role (router, prefill, decode)."""
        key = self.client if role == "router" else self.instance
        return {"Authorization": f"Bearer {key}"} if key else {}


def observed_keys(deployment: str, topo: Topology | None) -> AccessKeys:
    """For commands that only look (status): the keys they can find, never an error for a missing one."""
    try:
        secret = kept_secret(deployment)
    except ds.SecretFileError:
        secret = None
    try:
        client = client_api_key(topo) if topo is not None else None
    except UsageError:
        client = None
    return AccessKeys.of(secret, client)


def secret_file_content(
    kind: str, secret: bytes, keys: AccessKeys, user_secrets: dict[str, str] | None = None
) -> bytes:
    """What the secret file of this kind holds (kinds: placement.SecretKind); user_secrets: the
    topology's `secrets` values, which the instances' env file carries."""
    if kind == "deployment-secret":
        return ds.secret_file_text(secret).encode()
    if kind == "instance-env":
        assert keys.instance is not None
        return instance_env_text(keys.instance, user_secrets or {}).encode()
    if kind == "router-upstream-key":
        return f"{keys.instance}\n".encode()
    if kind == "router-params-key":
        return f"{ds.derive_token(secret, ds.TRANSFER_PARAMS)}\n".encode()
    if kind == "router-client-key":
        assert keys.client is not None
        return f"{keys.client}\n".encode()
    raise ValueError(f"unknown secret file kind {kind!r}")


def write_private_file(runner: Runner, path: str, data: bytes) -> None:
    """Write data to path on the runner's host, readable by its owner only from the first byte."""
    runner.run(private_write_command(runner.expand(path)), timeout=30, stdin=data).check(f"writing {path}")


def remove_secret_files(runner: Runner, workdir: str) -> list[str]:
    """Remove the deployment's secret files from the runner's host (workdir: the deployment's
    directory there); returns the paths that were there."""
    paths = [runner.expand(p) for p in secret_paths_in(workdir)]
    words = " ".join(shlex.quote(p) for p in paths)
    result = runner.run(f"for f in {words}; do if [ -e \"$f\" ]; then rm -f \"$f\" && echo \"$f\" || exit 1; fi; done",
                        timeout=30).check("removing the secret files")
    return result.stdout.splitlines()


def forget_local_secret(deployment: str) -> bool:
    """Delete the secret kept on this machine; whether there was one."""
    path = local_secret_path(deployment)
    existed = os.path.lexists(path)
    path.unlink(missing_ok=True)
    return existed


class SecretDelivery:
    """The secret files of one `up`: which differ on the hosts, and writing them."""

    def __init__(self, plan: Plan, secret: bytes, keys: AccessKeys, user_secrets: dict[str, str] | None = None):
        self.plan, self.secret, self.keys, self.user_secrets = plan, secret, keys, user_secrets or {}

    def _wanted(self, host: HostPlan) -> list[tuple[SecretFilePlan, bytes]]:
        return [(f, secret_file_content(f.kind, self.secret, self.keys, self.user_secrets)) for f in host.secret_files]

    def stale(self, runners: dict[str, Runner]) -> dict[str, list[SecretFilePlan]]:
        """Per host: its secret files whose content there is not what this `up` would write."""
        def differing(host: HostPlan) -> list[SecretFilePlan]:
            runner = runners[host.name]
            return [f for f, data in self._wanted(host) if runner.read_file(f.path) != data]

        return values_or_raise(fan_out(self.plan.hosts, differing, name=lambda h: h.name))

    def write(self, runners: dict[str, Runner], stale: dict[str, list[SecretFilePlan]]) -> None:
        def write_host(host: HostPlan) -> None:
            paths = {f.path for f in stale.get(host.name, [])}
            for f, data in self._wanted(host):
                if f.path in paths:
                    write_private_file(runners[host.name], f.path, data)

        values_or_raise(fan_out([h for h in self.plan.hosts if stale.get(h.name)], write_host, name=lambda h: h.name))


def restart_users_of(stale: dict[str, list[SecretFilePlan]], changes: Changes) -> list[str]:
    """Running processes that read a stale file at start move from keep to restart; returns them."""
    users = {name for files in stale.values() for f in files for name in f.used_by}
    moved = [name for name in changes.keep if name in users]
    changes.keep = [name for name in changes.keep if name not in users]
    changes.restart += moved
    return moved
