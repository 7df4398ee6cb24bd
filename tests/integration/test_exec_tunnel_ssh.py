"""`kvpush exec` and `kvpush tunnel` against real sshd hosts on loopback, as a user runs them
(the console script in its own process: real stdout, real Ctrl-C)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
import yaml

from cli_in_process import run_cli

KVPUSH = Path(sys.executable).parent / "kvpush"


def _topology(cluster, tmp_path: Path, router_port: int, port_base: int) -> Path:
    hosts = {f"h{i}": {**cluster.host_yaml(cluster.hosts[i]), "workdir": str(tmp_path / f"h{i}")} for i in (0, 1)}
    doc = {
        "name": "remote", "platform": "cpu", "model": {"path": "/nonexistent-model", "served_name": "tiny"},
        "connector": {"type": "kvpush"}, "hosts": hosts,
        "prefill": [{"host": "h0", "http_port": port_base, "side_channel_port": port_base + 1}],
        "decode": [{"host": "h1", "http_port": port_base + 2, "side_channel_port": port_base + 3, "env": {"MARK": "d 0"}}],
        "router": {"host": "h1", "bind": cluster.hosts[1].address, "port": router_port},
    }
    path = tmp_path / "remote.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _env(cluster, state_dir) -> dict[str, str]:
    return {**os.environ, "KVPUSH_KNOWN_HOSTS": str(cluster.known_hosts), "KVPUSH_STATE_DIR": str(state_dir)}


@pytest.fixture
def topology(sshd_cluster, tmp_path):
    return _topology(sshd_cluster, tmp_path, router_port=27390, port_base=27380)


def test_exec_streams_output_and_passes_the_exit_status_on(sshd_cluster, topology, state_dir):
    env = _env(sshd_cluster, state_dir)
    done = subprocess.run([str(KVPUSH), "exec", "--file", str(topology), "h1", "--",
                           "echo out; echo err >&2; echo $SSH_CONNECTION; exit 7"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 7, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "out" and lines[1].split()[2] == sshd_cluster.hosts[1].address and done.stderr == "err\n"
    # Output comes as the command writes it, not when it ends.
    pid_file = topology.parent / "remote.pid"
    proc = subprocess.Popen([str(KVPUSH), "exec", "--file", str(topology), "h0", "--",
                             f"echo $$ > {pid_file}; echo first; exec sleep 30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline() == "first\n"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        if pid_file.exists():  # the remote command has no terminal whose end would end it (as with ssh)
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_exec_on_a_process_runs_on_its_host_in_its_directory_with_its_env(sshd_cluster, topology, state_dir, tmp_path):
    (tmp_path / "h1" / "remote").mkdir(parents=True)  # the process's cwd: the host's workdir/<deployment>
    code, out, err = (lambda r: (r.returncode, r.stdout, r.stderr))(run_cli(
        "exec", "--file", str(topology), "decode-0", "--", "printf '%s|' \"$PWD\" \"$KVPUSH_PROCESS\" \"$MARK\"; "
        "echo $SSH_CONNECTION", env=_env(sshd_cluster, state_dir)))
    assert code == 0, err
    cwd, process, mark, connection = out.split("|")
    assert (cwd, process, mark) == (str(tmp_path / "h1" / "remote"), "decode-0", "d 0")
    assert connection.split()[2] == sshd_cluster.hosts[1].address
    words = run_cli("exec", "--file", str(topology), "h0", "--", "printf", "<%s>", "a b", "$HOME",
                    env=_env(sshd_cluster, state_dir))
    assert (words.returncode, words.stdout) == (0, "<a b><$HOME>")


class _Upstream(BaseHTTPRequestHandler):
    """A stand-in router: streams a completion as SSE, serves /metrics; records which process connected."""

    peers: list[str] = []

    def log_message(self, *args):
        pass

    def _reply(self, body: bytes, ctype: str) -> None:
        self.peers.append(_process_of(self.client_address))  # while the connection is open
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply(b"kvpush_router_requests_total 1.0\n", "text/plain")

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        events = [{"choices": [{"text": f" tunnelled:{prompt}", "finish_reason": None}]},
                  {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}]
        self._reply(b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n",
                    "text/event-stream")


def _process_of(local: tuple[str, int]) -> str:
    """The name of the process whose TCP socket has this local address."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and (conn.laddr.ip, conn.laddr.port) == local and conn.pid:
            return psutil.Process(conn.pid).name()
    return "?"


def test_tunnel_reaches_a_router_bound_to_its_hosts_address_and_ctrl_c_ends_it(sshd_cluster, tmp_path, state_dir):
    router_host = sshd_cluster.hosts[1].address
    server = ThreadingHTTPServer((router_host, 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Upstream.peers = []
    topology = _topology(sshd_cluster, tmp_path, router_port=server.server_address[1], port_base=27380)
    tunnel = subprocess.Popen([str(KVPUSH), "tunnel", str(topology), "--local-port", "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(sshd_cluster, state_dir))
    try:
        first = tunnel.stdout.readline()
        assert first.startswith("router: http://127.0.0.1:"), (first, tunnel.stderr.read() if tunnel.poll() else "")
        url = first.split()[1]
        assert url != f"http://{router_host}:{server.server_address[1]}" and f"host h1, http://{router_host}:" in first
        assert tunnel.stdout.readline() == f"metrics: {url}/metrics\n"
        assert f"--router-url {url}" in tunnel.stdout.readline()

        answered = run_cli("request", "--file", str(topology), "--router-url", url, "--json", "hello",
                           env=_env(sshd_cluster, state_dir))
        assert answered.returncode == 0, answered.stderr
        assert json.loads(answered.stdout)["text"] == " tunnelled:hello"
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            assert b"kvpush_router_requests_total" in resp.read()
        # Both reached the router from sshd on its host, not from this machine's own client.
        assert _Upstream.peers == ["sshd", "sshd"]

        tunnel.send_signal(signal.SIGINT)
        assert tunnel.wait(timeout=20) == 0
        assert "tunnel closed (2 connection(s) carried)" in tunnel.stderr.read()
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if tunnel.poll() is None:
            tunnel.kill()
            tunnel.wait()
        server.shutdown()
        server.server_close()


def test_tunnel_to_an_unreachable_host_fails_at_once_in_one_line(sshd_cluster, tmp_path, state_dir):
    topology = _topology(sshd_cluster, tmp_path, router_port=27391, port_base=27380)
    doc = yaml.safe_load(topology.read_text())
    doc["hosts"]["h1"]["ssh_port"] = 1  # nothing listens there
    topology.write_text(yaml.safe_dump(doc, sort_keys=False))
    started = time.monotonic()
    done = run_cli("tunnel", str(topology), env=_env(sshd_cluster, state_dir))
    assert done.returncode == 1 and "host h1" in done.stderr and "connection refused" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and time.monotonic() - started < 30


def test_exec_on_this_machine_goes_through_the_local_runner(tmp_path, state_dir):
    """The built-in local-cpu topology's host `local` is this machine: no SSH."""
    done = subprocess.run([str(KVPUSH), "exec", "local", "--", "echo $$ $PPID; echo err >&2; exit 9"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env={**os.environ, "KVPUSH_STATE_DIR": str(state_dir)})
    assert done.returncode == 9 and done.stderr == "err\n"
    assert len(done.stdout.split()) == 2  # bash ran it (no sshd between: no SSH_CONNECTION either)
    quiet = subprocess.run([str(KVPUSH), "exec", "local", "--", "printenv", "SSH_CONNECTION"], capture_output=True,
                           text=True, cwd=tmp_path, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "SSH_CONNECTION"})
    assert quiet.returncode == 1 and quiet.stdout == ""
