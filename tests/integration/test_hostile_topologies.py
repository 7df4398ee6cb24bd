"""Hostile topology files through the real CLI: each one is refused with exit 2 and one line.

Every file runs `kvpush plan FILE` in its own process, bounded to 5 s of CPU (RLIMIT_CPU) and
2 GiB of address space: a hang or a memory bomb ends in a signal, not in a stuck suite, and the
bound does not depend on how loaded the shared machine is. The files run two at a time.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CPU_BOUND_S = 5
MEMORY_BOUND = 2 << 30
WALL_BACKSTOP_S = 120  # only for a process that sleeps forever; the CPU bound is the real one
KVPUSH = [sys.executable, "-m", "kvpush.cli.main"]

BASE = "name: t\nmodel: {path: /m}\nprefill: [{}]\ndecode: [{}]\n"


def with_lines(*lines: str) -> str:
    """BASE plus top-level lines (a later key would duplicate, so BASE's own keys are not given again)."""
    return BASE + "".join(line + "\n" for line in lines)


def instance(fields: str) -> str:
    return f"name: t\nmodel: {{path: /m}}\nprefill: [{{{fields}}}]\ndecode: [{{}}]\n"


def host(fields: str) -> str:
    return f"name: t\nmodel: {{path: /m}}\nhosts: {{a: {{{fields}}}}}\nprefill: [{{}}]\ndecode: [{{}}]\n"


def router(fields: str) -> str:
    return with_lines(f"router: {{{fields}}}")


def alias_bomb() -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    return with_lines(*lines)


# (id, file content (text, or bytes written as is), a fragment the error line must contain)
HOSTILE: list[tuple[str, str | bytes, str]] = [
    # structure
    ("alias-bomb", alias_bomb(), "alias bomb"),
    ("recursive-list-alias", with_lines("extra: &x [*x]"), "alias that contains itself"),
    ("recursive-map-alias", with_lines("extra: &x {again: *x}"), "alias that contains itself"),
    ("self-merge", with_lines("connector: &c {<<: *c, type: kvpush}"), "duplicate key"),
    ("deep-flow-nesting", "a: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than"),
    ("deep-block-nesting", "".join(" " * i + f"k{i}:\n" for i in range(100)) + " " * 100 + "v\n", "nested more than"),
    ("two-megabytes", "name: t\n#" + "x" * (2 << 20) + "\n", "larger than"),
    ("fifty-megabytes-sparse", None, "larger than"),  # made by truncate(), see _write
    ("not-utf8", b"name: t\nmodel: {path: /m\xff\xfe}\n", "UTF-8"),
    ("binary-garbage", bytes(range(256)) * 4, "t"),
    ("top-level-list", "[]\n", "must be a YAML mapping"),
    ("two-documents", "name: a\n---\nname: b\n", "invalid YAML"),
    ("python-object-tag", with_lines("env: !!python/object/apply:os.system ['true']"), "is not allowed"),
    ("python-scalar-tag", with_lines("env: !!python/name:os.system"), "invalid YAML"),
    ("set-tag", with_lines("env: !!set {a, b}"), "is not allowed"),
    ("mapping-as-key", with_lines("? [a, b]\n: 1"), "used as a key"),
    ("duplicate-key", with_lines("router: {}", "router: {}"), "duplicate key"),
    ("integer-of-5000-digits", instance("kv_cache_gib: " + "9" * 5000), "cannot be read"),
    # numbers
    ("kv-cache-1e26", instance("kv_cache_gib: 1e26"), "kv_cache_gib"),
    ("kv-cache-float-1e26", instance("kv_cache_gib: 1.0e+26"), "kv_cache_gib"),
    ("kv-cache-float-1e6", instance("kv_cache_gib: 1.0e+6"), "less than or equal to 65536"),
    ("kv-cache-inf", instance("kv_cache_gib: .inf"), "kv_cache_gib"),
    ("transfer-timeout-inf", with_lines("connector: {transfer_timeout_s: .inf}"), "finite"),
    ("decode-timeout-nan", router("decode_timeout_s: .nan"), "finite"),
    ("prefill-timeout-1e30", router("prefill_timeout_s: 1e30"), "prefill_timeout_s"),
    ("connect-timeout-negative", router("connect_timeout_s: -1"), "connect_timeout_s"),
    ("tensor-parallel-billion", instance("tensor_parallel_size: 1000000000"), "tensor_parallel_size"),
    ("data-parallel-1e9", instance("data_parallel_size: 1e9"), "data_parallel_size"),
    ("max-prompt-chars-1e12", router("max_prompt_chars: 1e12"), "max_prompt_chars"),
    ("max-model-len-1e12", "name: t\nmodel: {path: /m, max_model_len: 1e12}\nprefill: [{}]\ndecode: [{}]\n", "max_model_len"),
    ("tiny-hidden-size-1e9", "name: t\nmodel: {path: /m, tiny: {hidden_size: 1000000000}}\nprefill: [{}]\ndecode: [{}]\n",
     "hidden_size"),
    ("gpu-index-99999", "name: t\nplatform: cuda\nmodel: {path: /m}\nprefill: [{devices: [99999]}]\ndecode: [{devices: [1]}]\n",
     "devices"),
    ("cores-0-to-a-billion", instance('cpu_cores: "0-999999999"'), "cpu_cores"),
    ("ssh-port-99999", host("address: 10.0.0.1, ssh_port: 99999"), "ssh_port"),
    # addresses
    ("address-ipv6-loopback", host('address: "::1"'), "IPv6"),
    ("address-unicode", host('address: "hóst.example"'), "non-ASCII"),
    ("address-with-port", host('address: "host:99999"'), "not an IPv4 address or a DNS name"),
    ("address-with-user", host('address: "root@host"'), "not an IPv4 address or a DNS name"),
    ("address-url", host('address: "http://host"'), "not an IPv4 address or a DNS name"),
    ("address-bad-ipv4", host("address: 300.1.1.1"), "not a valid IPv4"),
    ("address-space", host('address: "a b"'), "not an IPv4 address or a DNS name"),
    ("address-300-chars", host("address: " + "a." * 150 + "b"), "not an IPv4 address or a DNS name"),
    ("bind-not-an-ip", router("bind: not-an-ip"), "not an IP address"),
    ("bind-with-port", router('bind: "127.0.0.1:8000"'), "not an IP address"),
    # paths and names
    ("nul-in-model-path", 'name: t\nmodel: {path: "/m\\0/x"}\nprefill: [{}]\ndecode: [{}]\n', "NUL"),
    ("nul-in-workdir", host('address: 10.0.0.1, workdir: "/w\\0"'), "NUL"),
    ("newline-in-workdir", host('address: 10.0.0.1, workdir: "/w\\nrm -rf ~"'), "control character"),
    ("newline-in-user", host('address: 10.0.0.1, user: "root\\nx"'), "control character"),
    ("space-in-served-name", 'name: t\nmodel: {path: /m, served_name: "a b"}\nprefill: [{}]\ndecode: [{}]\n', "space"),
    # environment and keys
    ("env-key-dash", with_lines('env: {"-i": "1"}'), "not an environment variable name"),
    ("env-key-equals", with_lines('env: {"A=B": "1"}'), "not an environment variable name"),
    ("instance-env-key-digit", instance('env: {"1ABC": "1"}'), "not an environment variable name"),
    ("env-vllm-api-key", with_lines("env: {VLLM_API_KEY: x}"), "set by kvpush"),
    ("extra-args-api-key", instance('extra_args: ["--api-key=x"]'), "set by kvpush"),
    ("extra-config-secret-file", with_lines("connector: {extra_config: {secret_file: /tmp/x}}"), "set by kvpush"),
    # the connector would then dial any address, or take any engine
    ("extra-config-peers-null", with_lines("connector: {extra_config: {peer_side_channels: null}}"), "set by kvpush"),
    ("extra-config-peers-empty", with_lines("connector: {extra_config: {peer_side_channels: {}}}"), "set by kvpush"),
    ("extra-config-allowed-engines", with_lines("connector: {extra_config: {allowed_engines: []}}"), "set by kvpush"),
    ("extra-config-date", with_lines("connector: {extra_config: {when: 2001-01-01}}"), "date"),
    ("extra-config-inf", with_lines("connector: {extra_config: {limit: .inf}}"), "finite"),
    ("api-key-env-dash", router('api_key_env: "-x"'), "not an environment variable name"),
    ("two-api-key-sources", router("api_key_env: K, api_key_file: /k"), "keep one"),
]


def _write(path: Path, case_id: str, content: str | bytes | None) -> None:
    if content is None:
        with open(path, "wb") as f:
            f.write(b"name: t\n")
            f.truncate(50 << 20)  # sparse: 50 MB that cost no disk
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_BOUND_S, CPU_BOUND_S))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BOUND, MEMORY_BOUND))


def _plan(path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "1000"}  # one line stays one line: rich wraps at the terminal width
    return subprocess.run([*KVPUSH, "plan", str(path)], capture_output=True, text=True, errors="replace",
                          preexec_fn=_bounded, timeout=WALL_BACKSTOP_S, env=env, cwd=path.parent)


def test_there_are_at_least_forty_distinct_hostile_files():
    assert len(HOSTILE) >= 40 and len({case_id for case_id, _, _ in HOSTILE}) == len(HOSTILE)


def test_each_hostile_file_is_refused_with_exit_2_and_one_line(tmp_path):
    paths = []
    for case_id, content, _ in HOSTILE:
        path = tmp_path / f"{case_id}.yaml"
        _write(path, case_id, content)
        paths.append(path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_plan, paths))
    problems = []
    for (case_id, _, fragment), result in zip(HOSTILE, results):
        lines = result.stderr.strip().splitlines()
        if result.returncode != 2 or len(lines) != 1 or not lines[0].startswith("error: ") or result.stdout:
            problems.append(f"{case_id}: exit {result.returncode}, stderr {result.stderr[-300:]!r}, stdout {result.stdout[:100]!r}")
        elif "unexpected" in lines[0] or fragment not in lines[0]:
            problems.append(f"{case_id}: {lines[0][:300]!r} lacks {fragment!r} or says 'unexpected'")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("content", ["[]", "null", "garbage{"])
def test_corrupt_state_file_through_the_cli_is_one_line(tmp_path, content):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "t.json").write_text(content)
    result = subprocess.run([*KVPUSH, "status", "-d", "t"], capture_output=True, text=True, preexec_fn=_bounded,
                            timeout=WALL_BACKSTOP_S, env={**os.environ, "KVPUSH_STATE_DIR": str(state_dir), "COLUMNS": "1000"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "unexpected" not in lines[0], result.stderr
    assert f"{state_dir / 't.json'}: not a kvpush deployment state" in lines[0] and ".bad" in lines[0]
