"""tests/deployment_slot.py, which the e2e modules share deployments with."""
from __future__ import annotations

import pytest

from deployment_slot import DeploymentSlot


def counting_slot():
    started, stopped = [], []

    def start():
        started.append(f"d{len(started)}")
        return started[-1]

    return DeploymentSlot("d", start, stopped.append), started, stopped


def test_tests_share_one_deployment_and_a_taker_leaves_the_next_test_a_fresh_one():
    slot, started, stopped = counting_slot()
    assert slot.shared() == slot.shared() == "d0"
    assert slot.take() == "d0" and started == ["d0"]  # the taker gets the one the others used
    slot.stop("d0")
    assert slot.shared() == "d1" and stopped == ["d0"]
    slot.close()
    assert stopped == ["d0", "d1"]
    slot.close()
    assert stopped == ["d0", "d1"]  # nothing is stopped twice


def test_results_go_with_the_deployment():
    slot, _, _ = counting_slot()
    slot.shared()
    assert slot.once("run", lambda: 1) == 1 and slot.once("run", lambda: 2) == 1
    slot.take()
    assert slot.once("run", lambda: 3) == 3


def test_a_failed_start_fails_the_tests_after_it_at_once():
    calls = []

    def start():
        calls.append(1)
        raise RuntimeError("port taken")

    slot = DeploymentSlot("d", start, lambda d: None)
    with pytest.raises(RuntimeError):
        slot.shared()
    with pytest.raises(pytest.fail.Exception, match="d did not start: RuntimeError: port taken"):
        slot.shared()
    assert calls == [1]
