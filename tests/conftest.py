"""Shared pytest set-up: tests are marked by the layer they live in (unit / integration / e2e)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))  # test helper modules (sshd_hosts, standin_server) import by name


# Per-test timeout of each lane, for tests that set none themselves (pytest.mark.timeout). A unit test
# is pure logic, so a minute means it hangs; an integration test starts sshd hosts, Slurm daemons or
# NIXL processes; an e2e test waits for real vLLM servers to load on a 2-core CPU machine.
LANE_TIMEOUT_S = {"unit": 60, "integration": 300, "e2e": 900}


def _unwind(signum, frame):
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config):
    """SIGTERM (a CI timeout, `kill`) and SIGHUP (a closed terminal) unwind the session as Ctrl-C
    does: pytest then runs every fixture's teardown and every test's `finally`, which stop the
    servers, daemons and deployments they started, instead of dying and leaving them running."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _unwind)
        # A shell starts a background job (scripts/test.sh runs pytest as one) with SIGINT ignored, and
        # every process it starts inherits that: a CLI the tests stop with Ctrl-C would never see it.
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_ignore_collect(collection_path, config):
    """With `-m LANE` only that lane's directory can match (the marker comes from the directory), so
    the others are not imported at all: their modules import torch, vLLM and the OpenAI client."""
    lane = (config.option.markexpr or "").strip()
    another_lane = collection_path.parent == TESTS_DIR and collection_path.name in LANE_TIMEOUT_S.keys() - {lane}
    return True if lane in LANE_TIMEOUT_S and another_lane else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        layer = Path(str(item.fspath)).relative_to(TESTS_DIR).parts[0]
        if layer in LANE_TIMEOUT_S:
            item.add_marker(getattr(pytest.mark, layer))
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(LANE_TIMEOUT_S[layer]))


# -- real sshd hosts (tests/sshd_hosts.py) ---------------------------------------------------------
# The first loopback address is a parameter so engineers running suites side by side don't collide;
# each pytest-xdist worker (gw0, gw1, ...) takes its own ten addresses, so modules on different workers
# run their clusters side by side (127.0.0.2-4, 127.0.0.12-14, ...).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
SSHD_FIRST_ADDRESS = os.environ.get("KVPUSH_TEST_SSHD_FIRST", f"127.0.0.{2 + 10 * _WORKER}")
SSHD_PORT = int(os.environ.get("KVPUSH_TEST_SSHD_PORT", "2222"))


@pytest.fixture(scope="module")
def sshd_cluster(tmp_path_factory):
    """Three real sshd hosts on loopback (127.0.0.2-4 by default), stopped after the module."""
    from sshd_hosts import SshdCluster

    with SshdCluster(3, first_address=SSHD_FIRST_ADDRESS, port=SSHD_PORT, root=tmp_path_factory.mktemp("sshd")) as cluster:
        yield cluster


@pytest.fixture(scope="module", autouse=True)
def private_known_hosts(tmp_path_factory):
    """Every `kvpush` a module runs checks SSH host keys against a known_hosts of the module's own
    (KVPUSH_KNOWN_HOSTS), never the user's: OpenSSH finds ~/.ssh by the account, not by $HOME, and
    each module's sshd hosts get fresh keys on addresses other modules and runs reuse."""
    path = tmp_path_factory.mktemp("known_hosts") / "known_hosts"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPUSH_KNOWN_HOSTS", str(path))
        yield path


@pytest.fixture(autouse=True)
def signal_mask_kept():
    """A test that runs a process's main in-process (the router's blocks its stop and reload signals
    for the one thread that waits on them) must not leave this process with signals blocked: every
    process a later test starts would inherit the mask and never see SIGTERM or SIGHUP."""
    import signal

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, before)


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """A private kvpush state directory (KVPUSH_STATE_DIR) for one test."""
    path = tmp_path / "state"
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(path))
    return path


@pytest.fixture
def free_port() -> int:
    """A loopback port nothing listened on a moment ago (the kernel's pick)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the tiny local model (kvpush make-model) ------------------------------------------------------
@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model (seed 0) real vLLM loads on the CPU, made once per session (per xdist worker):
    the one tiny-model builder of the suite; no test writes into it."""
    from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
    from kvpush.deploy.topology.topology import TinyModelSpec

    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path, TinyModelSpec(seed=0))
    return path


# -- a real Slurm cluster (tests/slurm_cluster.py) ------------------------------------------------


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """munged + slurmctld + slurmd n1 (127.0.0.51) and n2 (127.0.0.52) under a temporary directory,
    SLURM_CONF pointing at it for this module (kvpush's own Slurm commands included); stopped after."""
    from slurm_cluster import SlurmCluster

    with pytest.MonkeyPatch.context() as patch, SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        for key, value in cluster.env.items():
            patch.setenv(key, value)
        patch.delenv("SLURM_JOB_ID", raising=False)
        yield cluster
