"""The router URL `kvpush up` prints answers from where kvpush runs, with the router on another
(real sshd) host; a router bound to loopback there is warned about before launch, and the warning
is true: the printed URL refuses connections."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest
import yaml
from cli_in_process import run_cli
from lifecycle_helpers import standin_deployments


@pytest.fixture
def deploy(sshd_cluster, tmp_path, state_dir):
    with standin_deployments(sshd_cluster, tmp_path) as make:
        yield make


def _up(topo, tmp_path, cluster):
    path = tmp_path / f"{topo.name}.yaml"
    path.write_text(yaml.safe_dump(topo.model_dump(mode="json", exclude_none=True), sort_keys=False))
    return run_cli("up", str(path), "--no-provision", "--skip-doctor", "--timeout", "120",
                   "--known-hosts", str(cluster.known_hosts))


def _printed_router_url(stdout: str) -> str:
    found = re.findall(r"^router: (http://\S+)$", stdout, re.MULTILINE)
    assert len(found) == 1, stdout
    return found[0]


def test_the_url_up_prints_for_a_remote_router_on_every_address_answers(deploy, sshd_cluster, tmp_path, free_port):
    topo = deploy(name="wide", extra={"router": {"bind": "0.0.0.0", "port": free_port}})
    result = _up(topo, tmp_path, sshd_cluster)
    assert result.returncode == 0, result.stderr
    assert "warning:" not in result.stderr
    url = _printed_router_url(result.stdout)
    assert url == f"http://{sshd_cluster.hosts[2].address}:{free_port}"  # the router host's address, not 127.0.0.1
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200 and json.loads(answer.read())["choices"][0]["text"]

    # `kvpush ls` finds the deployment on its real hosts: every process up, the same URL
    listed = run_cli("ls", "--json", "--known-hosts", str(sshd_cluster.known_hosts))
    assert listed.returncode == 0, listed.stderr
    [wide] = [d for d in json.loads(listed.stdout)["deployments"] if d["deployment"] == "wide"]
    assert wide["router"] == url and (wide["checked"], wide["up"], wide["down"]) == (True, 3, 0), wide
    assert sorted(p["name"] for p in wide["processes"]) == ["decode-0", "prefill-0", "router"]
    assert set(wide["hosts"]) == {"h0", "h1", "h2"}, wide["hosts"]


def test_a_remote_router_on_loopback_is_warned_about_and_its_url_indeed_refuses(deploy, sshd_cluster, tmp_path, free_port):
    topo = deploy(name="narrow", extra={"router": {"bind": "127.0.0.1", "port": free_port}})
    result = _up(topo, tmp_path, sshd_cluster)
    assert result.returncode == 0, result.stderr  # it serves its own host: `up`'s proof runs there
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "router.bind: 127.0.0.1 on host 'h2'" in warnings[0], result.stderr
    url = _printed_router_url(result.stdout)
    assert url == f"http://{sshd_cluster.hosts[2].address}:{free_port}"
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/health", timeout=5)
