"""The CLI in a real 80-column terminal (a pty under `script`): tables fit or turn into blocks, help
wraps, nothing is cut to `…`, and a cause is printed whole."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.cells import cell_len

from kvpush.cli.main import app
from kvpush.deploy.lifecycle.state import DeploymentState, HostRecord, ProcessRecord, save_state

pytestmark = pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) from util-linux for a pty")

KVPUSH = Path(sys.executable).parent / "kvpush"
COLUMNS = 80
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
LONG = "prefill-with-a-long-descriptive-name"


def in_terminal(*args: str, cwd: Path, env: dict[str, str] | None = None, columns: int = COLUMNS) -> tuple[int, list[str]]:
    """Run `kvpush ARGS` on a pty of `columns` columns; its exit code and the lines it showed, colours removed."""
    command = f"stty cols {columns} rows 100; exec {shlex.join([str(KVPUSH), *args])}"
    result = subprocess.run(["script", "-qec", command, "/dev/null"], capture_output=True, text=True, cwd=cwd,
                            env={**os.environ, **(env or {}), "COLUMNS": str(columns), "TERM": "xterm-256color"},
                            stdin=subprocess.DEVNULL, timeout=120)
    return result.returncode, ESCAPES.sub("", result.stdout).replace("\r\n", "\n").splitlines()


def assert_fits(lines: list[str]) -> None:
    assert not [line for line in lines if "…" in line], "\n".join(lines)
    assert not [line for line in lines if cell_len(line) > COLUMNS], "\n".join(lines)


@pytest.fixture
def recorded(tmp_path, state_dir) -> dict[str, str]:
    """Two deployments with long process names, their processes gone (pids no system hands out)."""
    for deployment in (LONG, "xpyd"):
        state = DeploymentState(deployment, hosts={"local": HostRecord(address="127.0.0.1", workdir=str(tmp_path))})
        for i, (name, role, port) in enumerate([(f"{deployment}-prefill-0", "prefill", 8100),
                                                (f"{deployment}-decode-0", "decode", 8200), ("router", "router", 8000)]):
            pid = 2**22 + 1 + i
            state.processes[name] = ProcessRecord(name, role, "local", pid, pid, None, port, f"http://127.0.0.1:{port}/health",
                                                  str(tmp_path / f"{name}.log"), "", 0.0)
        save_state(state)
    return {"KVPUSH_STATE_DIR": str(state_dir)}


def test_status_at_80_columns_shows_every_name_whole_and_says_state_once(recorded, tmp_path):
    code, lines = in_terminal("status", "-d", LONG, cwd=tmp_path, env=recorded)
    assert code == 1  # its processes are dead
    table = lines[:lines.index(next(line for line in lines if line.startswith(f"{LONG}-prefill-0:")))]
    assert_fits(table)
    for name in (f"{LONG}-prefill-0", f"{LONG}-decode-0", "router"):
        assert name in table, "\n".join(lines)
    assert "".join(table).count("state=dead") == 3
    assert not any("process" in line for line in table), "the header names the process column only once"


def test_status_in_a_wide_terminal_is_a_table_naming_each_column_once(recorded, tmp_path):
    code, lines = in_terminal("status", "-d", "xpyd", cwd=tmp_path, env=recorded, columns=160)
    header = next(line for line in lines if "process" in line)
    assert re.findall(r"\w+(?: cache)?", header) == ["process", "role", "host", "pid", "state", "health", "running",
                                                    "waiting", "KV cache", "uptime", "restarts"]
    assert any(line.split("│")[1].strip() == "xpyd-prefill-0" for line in lines if line.count("│") > 2)


def test_ls_at_80_columns_is_a_table_where_the_names_fit_and_blocks_where_not(recorded, tmp_path):
    code, lines = in_terminal("ls", cwd=tmp_path, env=recorded)
    assert code == 0
    assert_fits(lines)
    text = "\n".join(lines)
    assert f"\n{LONG}\n" in f"\n{text}\n" and "router=http://127.0.0.1:8000" in text  # a block per deployment
    assert f"{LONG}-prefill-0 (dead)" in re.sub(r"\n\s*", " ", text)  # wrapped at a space at most
    (Path(recorded["KVPUSH_STATE_DIR"]) / f"{LONG}.json").unlink()
    code, lines = in_terminal("ls", cwd=tmp_path, env=recorded)
    assert_fits(lines)
    assert [cell.strip() for cell in lines[1].split("┃")[1:5]] == ["deployment", "hosts", "processes", "router"]
    assert "xpyd" in lines[3]


@pytest.mark.parametrize("command", [[]] + [[c.name] for c in app.registered_commands], ids=lambda c: c[0] if c else "kvpush")
def test_help_at_80_columns_cuts_nothing(command, tmp_path):
    code, lines = in_terminal(*command, "--help", cwd=tmp_path)
    assert code == 0
    assert_fits(lines)
    if command == ["bench"]:
        text = " ".join(line.strip("│ ") for line in lines)
        for option in ("--accept-new-host-keys", "--no-engine-timings", "--input-len-spread"):
            assert option in text
        assert "nixl-pull-stock" in text  # the modes list, wrapped rather than cut


def test_doctor_at_80_columns_gives_each_unreachable_host_s_cause_whole_in_a_few_lines(tmp_path):
    """Two hosts whose sshd does not answer (closed ports on loopback): a section each, the cause whole."""
    (tmp_path / "two.yaml").write_text(
        "name: two\nmodel: {path: /m}\n"
        "hosts:\n  p5en-a: {address: 127.0.0.1, user: ubuntu, ssh_port: 1}\n  p5en-b: {address: 127.0.0.1, user: ubuntu, ssh_port: 2}\n"
        "prefill: [{host: p5en-a}]\ndecode: [{host: p5en-b}]\nrouter: {host: p5en-a}\n")
    code, lines = in_terminal("doctor", "two.yaml", "--connect-timeout", "5", cwd=tmp_path,
                              env={"KVPUSH_KNOWN_HOSTS": str(tmp_path / "known_hosts")})
    assert code == 1
    assert not [line for line in lines if "…" in line]
    text = "\n".join(lines)
    for host, port in (("p5en-a", 1), ("p5en-b", 2)):
        assert f"\nhost {host}  fail\n" in text
        cause = f"probe  host {host} (ubuntu@127.0.0.1:{port}): connection refused; is sshd running and listening on port {port}?"
        assert any(line.endswith(cause) for line in lines), text  # one line, whatever the terminal's width
    assert "clock-skew: 2 hosts, clocks read on none: nothing to compare" in text
    assert len(lines) <= 30, text
