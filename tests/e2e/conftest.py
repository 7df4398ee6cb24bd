"""Fixtures of the e2e tests (real vLLM on CPU): the session's plain reference server and its pool
of deployments (tests/deployment_pool.py, tests/pool_topologies.py), and the order modules run in."""
from __future__ import annotations

import atexit
import os
from pathlib import Path

import pytest

# Modules that use one pooled deployment run one after the other, those that only read it before
# those that break it, so each deployment starts once and is revived by `up` only after a fault.
# Modules not named run after these, in file order.
MODULE_ORDER = [
    "connector/test_kvpush_vllm.py",  # pool-kvpush (its last test kills prefill)
    "test_signed_params_real_vllm.py",  # pool-kvpush: forged legs straight to the instances
    "test_faults_real_vllm.py",  # pool-kvpush: revived by `up` before each fault
    "test_live_change_real_vllm.py",  # pool-kvpush: a decode added and removed again
    "test_router_real_vllm.py",  # pool-kvpush, then pool-nixl-pull, pool-nixl-push, pool-colocated
    "test_tp_real_vllm.py",  # pool-tp
    "test_tp_rank_kill_real_vllm.py",  # pool-tp (kills a rank of p2)
]


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent

    def rank(item) -> int:
        try:
            name = Path(str(item.fspath)).relative_to(here).as_posix()
        except ValueError:
            return len(MODULE_ORDER)
        return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)

    items.sort(key=rank)  # stable: a module's tests keep their order


_pools: list = []  # the session's pool, once a test asked for it


def pytest_runtest_setup(item):
    """A test without the pool gets the machine's memory and cores for deployments of its own: every
    pooled deployment is taken down first (the pool starts one again if a later test asks)."""
    if _pools and "pool" not in item.fixturenames:
        _pools[0].release_all()


@pytest.fixture(scope="session")
def reference_server(tmp_path_factory):
    """The session's plain vLLM server (tests/reference_server.py); it starts only when a test
    first asks for its URL or start, so a session without such a test never starts it."""
    from reference_server import ReferenceServer

    server = ReferenceServer(tmp_path_factory.mktemp("reference"))
    atexit.register(server.stop)  # also when pytest itself dies before its teardown
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def e2e_hosts(tmp_path_factory):
    """Two real sshd hosts of the module's own (default 127.0.0.20-21, away from the integration
    lane's), stopped after the module."""
    from sshd_hosts import SshdCluster

    first = os.environ.get("KVPUSH_TEST_E2E_SSHD_FIRST", "127.0.0.20")
    with SshdCluster(2, first_address=first, port=2222, root=tmp_path_factory.mktemp("sshd-e2e")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def pool(model_dir, tmp_path_factory):
    """The session's pooled deployments, each started at its first `pool.ready(name)`; taken down at
    the end (and at exit or on SIGTERM), with nothing of any of them left behind."""
    from deployment_pool import DeploymentPool, register, unregister
    from pool_topologies import POOL

    deployments = DeploymentPool(tmp_path_factory.mktemp("pool"), POOL)
    deployments.set_model(lambda: model_dir)
    register(deployments)
    _pools.append(deployments)
    # The session's state directory is the pool's: `kvpush status` and the tests' status checks see
    # pooled deployments; a test with a deployment of its own may set its own (the state_dir fixture).
    before = os.environ.get("KVPUSH_STATE_DIR")
    os.environ["KVPUSH_STATE_DIR"] = str(deployments.state_dir)
    try:
        yield deployments
    finally:
        if before is None:
            os.environ.pop("KVPUSH_STATE_DIR", None)
        else:
            os.environ["KVPUSH_STATE_DIR"] = before
        unregister(deployments)
        _pools.clear()
        problems = deployments.close()
        starts = {name: d.ups for name, d in deployments._made.items()}
        print(f"\npooled deployments: `up` started or revived something {starts} time(s)")
        assert not problems, problems
