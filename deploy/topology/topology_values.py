"""Checks for single topology values: the file may be hostile, and each value ends up in an argv,
an environment, a URL or a path on some host.

Each check raises ValueError with the words that follow a field name (what is wrong, the fix), as
pydantic validators do; the annotated types at the end attach them to the schema's fields. Core
lists ("0-3,8", per TP rank "0-1|2-3") are parsed here too.
"""
from __future__ import annotations

import ipaddress
import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

from kvpush.common.instance_auth import PUBLIC_PATHS_VARIABLE

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # POSIX: what `env` and `export` take as a name
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
MAX_HOSTNAME = 253
MAX_PATH = 4096
MAX_NAME = 256
MAX_CORE = 4095  # above any host's core numbers; bounds what a range like '0-999999999' would allocate

# Set by kvpush from the deployment secret (docs/security.md): a topology that set them too would
# hand vLLM a key the router does not know, or point the connector at another secret.
API_KEY_ENV = "VLLM_API_KEY"
API_KEY_FLAG = "--api-key"
PUBLIC_PATHS_ENV = PUBLIC_PATHS_VARIABLE  # the instances' open paths: instance_public_paths sets it
# kv_connector_extra_config entries kvpush's connector takes its security from: which secret proves
# a peer, which engines may connect and where decode dials each prefill. kvpush derives them from
# the deployment; the topology's connector.extra_config may not set them.
KVPUSH_SECURITY_KEYS = {
    "secret_file": "the deployment secret's path on each host",
    "allowed_engines": "the engines of this deployment that may connect",
    "peer_side_channels": "where decode dials each prefill engine, and nowhere else",
    "side_channel_host": "the address the side channel listens on and names to peers",
    "side_channel_port": "the side channel's port, from the instance's side_channel_port",
}


def _has_control(value: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in value)


def host_address(value: str) -> str:
    """An IPv4 address or a DNS name: no port, user, scheme or non-ASCII letters."""
    if not value.isascii():
        raise ValueError("has non-ASCII characters; give an IPv4 address or a DNS name "
                         "(an international name in its xn-- form)")
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.version == 6:
            raise ValueError("is an IPv6 address; kvpush's side channel listens on IPv4 only, "
                             "give an IPv4 address or a DNS name (127.0.0.1 for this machine)")
        return value
    if re.fullmatch(r"[0-9.]+", value):
        raise ValueError("is not a valid IPv4 address; each of its four parts is 0-255")
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if len(value) > MAX_HOSTNAME or not all(_LABEL.match(label) for label in labels):
        raise ValueError("is not an IPv4 address or a DNS name (letters, digits, '-' and '.' only); "
                         "give the port in ssh_port and the user in user")
    return value


def bind_address(value: str) -> str:
    """An IP address to listen on (IPv4 or IPv6; 0.0.0.0 or :: for every interface)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError("is not an IP address to listen on; give one such as 127.0.0.1, 0.0.0.0 or ::") from None
    return value


def url_host(address: str) -> str:
    """An address as it goes between http:// and :port (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def path(value: str) -> str:
    if _has_control(value):
        raise ValueError("has a control character (newline, tab, ...); give a plain path")
    if len(value) > MAX_PATH:
        raise ValueError(f"is longer than {MAX_PATH} characters; give a shorter path")
    return value


def plain_name(value: str) -> str:
    """A user name or a served model name: no spaces or control characters."""
    if _has_control(value) or any(c.isspace() for c in value):
        raise ValueError("has a space or control character; give a plain name")
    if len(value) > MAX_NAME:
        raise ValueError(f"is longer than {MAX_NAME} characters; give a shorter name")
    return value


def env_name(value: str) -> str:
    if not ENV_NAME.match(value) or len(value) > MAX_NAME:
        raise ValueError(f"{value[:60]!r} is not an environment variable name (letters, digits and '_', "
                         "not starting with a digit); rename it")
    return value


def env_strings(value: Any) -> Any:
    """An `env` mapping as strings, as YAML's scalars would be written in a shell: true -> "true",
    1 -> "1", null -> "" (anything but a mapping is left for the type check to refuse)."""
    if isinstance(value, dict):
        return {k: ("" if v is None else str(v).lower() if isinstance(v, bool) else str(v)) for k, v in value.items()}
    return value


def env_map(value: dict[str, str]) -> dict[str, str]:
    for key in value:
        env_name(key)
        if key == API_KEY_ENV:
            raise ValueError(f"{API_KEY_ENV} is set by kvpush (the instances' key, made from the deployment "
                             "secret); remove it, and give the router's key with router.api_key_env or api_key_file")
        if key == PUBLIC_PATHS_ENV:
            raise ValueError(f"{PUBLIC_PATHS_ENV} is set by kvpush; give the open paths in instance_public_paths")
    return value


def secret_name(value: str) -> str:
    """A `secrets:` name: the environment variable the instances see."""
    env_name(value)
    if value in (API_KEY_ENV, PUBLIC_PATHS_ENV):
        raise ValueError(f"{value} is set by kvpush (the instances' key and open paths); give your secret another name")
    return value


def extra_args(value: list[str]) -> list[str]:
    for arg in value:
        if arg == API_KEY_FLAG or arg.startswith(API_KEY_FLAG + "="):
            raise ValueError(f"{API_KEY_FLAG} is set by kvpush (the instances' key, made from the deployment "
                             "secret); remove it, and give the router's key with router.api_key_env or api_key_file")
    return value


def _json_value(value: Any, where: str) -> None:
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}; give a finite number")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _json_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where} has the key {key!r}; keys must be text")
            _json_value(item, f"{where}.{key}")
        return
    raise ValueError(f"{where} is a {type(value).__name__}; give text, a number, true/false, a list or a mapping")


def kvpush_security_key_problem(key: str) -> str | None:
    """Why connector.extra_config may not set `key` (None: it may)."""
    if key in KVPUSH_SECURITY_KEYS:
        return f"{key} is set by kvpush ({KVPUSH_SECURITY_KEYS[key]}); remove it"
    return None


def extra_config(value: dict[str, Any]) -> dict[str, Any]:
    """Goes to vLLM as JSON inside --kv-transfer-config: JSON values only (kvpush's own security
    keys are refused at their own line by topology_security)."""
    for key, item in value.items():
        _json_value(item, key)
    return value


def rank_core_lists(text: str) -> list[set[int]]:
    """'0-1|2-3' -> [{0, 1}, {2, 3}]: the cores of each TP rank."""
    return [parse_core_list(group) for group in str(text).split("|")]


def core_list_text(cores: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (what taskset takes)."""
    out: list[str] = []
    run: list[int] = []
    for core in sorted(cores):
        if run and core == run[-1] + 1:
            run.append(core)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [core]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_core_list(text: str) -> set[int]:
    """'0-3,8' -> {0,1,2,3,8}; per-rank lists ('0|1') give their union; raises ValueError with a fix hint."""
    cores: set[int] = set()
    if "|" in str(text):
        for group in rank_core_lists(text):
            cores |= group
        return cores
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"'{text}' is not a core list; write e.g. '0' or '0-3,8'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi > MAX_CORE:
            raise ValueError(
                f"core {hi} in '{part}' is above {MAX_CORE}; give the core numbers of this host (see `nproc`)"
            )
        if hi < lo:
            raise ValueError(f"range '{part}' runs backwards; write the low core first")
        cores.update(range(lo, hi + 1))
    return cores


# -- the checks as annotated types for the schema's fields ----------------------------------------


def _not_bool(value: Any) -> Any:
    # YAML reads `port: true` as a bool, and pydantic would take it as 1.
    if isinstance(value, bool):
        raise ValueError("is true/false, not a number; give a number")
    return value


def not_blank(fix: str) -> AfterValidator:
    def check(value: str) -> str:
        if not value.strip():
            raise ValueError(f"is empty; {fix}")
        return value

    return AfterValidator(check)


IntNotBool = Annotated[int, BeforeValidator(_not_bool)]
NumberNotBool = Annotated[float, BeforeValidator(_not_bool)]
PathText = Annotated[str, AfterValidator(path)]
PlainName = Annotated[str, AfterValidator(plain_name)]
EnvMap = Annotated[
    dict[str, str],
    BeforeValidator(env_strings, json_schema_input_type=dict[str, str | int | float | bool | None]),
    AfterValidator(env_map),
]
ExtraArgs = Annotated[list[str], AfterValidator(extra_args)]
HostAddressText = Annotated[str, not_blank("give the host's IP address or DNS name"), AfterValidator(host_address)]


def _valid_core_list(value: str) -> str:
    if "|" in value:
        raise ValueError(f"'{value}' has per-rank lists ('|'); give one core list like '0-3,8' here")
    parse_core_list(value)  # raises ValueError with the reason
    return value


def _valid_rank_core_lists(value: str) -> str:
    for group in value.split("|"):
        if not group.strip():
            raise ValueError(f"'{value}' has an empty rank core list; write one list per rank, e.g. '0|1' or '0-1|2-3'")
        parse_core_list(group)
    return value


def _core_number_as_text(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("is true/false, not a core list; give cores like \"0-3,8\"")
    return str(value) if isinstance(value, int) else value  # `cpu_cores: 3` unquoted


CoreList = Annotated[str, BeforeValidator(_core_number_as_text, json_schema_input_type=str | int),
                     AfterValidator(_valid_core_list)]  # "0-3,8"
# One core list per TP rank, '|'-separated as VLLM_CPU_OMP_THREADS_BIND takes them: "0-1|2-3"
RankCoreLists = Annotated[str, BeforeValidator(_core_number_as_text, json_schema_input_type=str | int),
                          AfterValidator(_valid_rank_core_lists)]
