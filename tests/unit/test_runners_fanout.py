"""fan_out: every host gets a result; a failure or a hang on one never hides the others."""
from __future__ import annotations

import threading

from kvpush.common.errors import KvpushError
from kvpush.deploy.runners import fan_out, values_or_raise, FanOutError

import pytest


def work(host: str) -> str:
    if host == "bad":
        raise KvpushError("refused")
    if host == "odd":
        raise ValueError("boom")
    return host.upper()


def test_each_host_gets_a_result_and_failures_name_their_host():
    results = fan_out(["a", "bad", "odd"], work)
    assert results["a"].ok and results["a"].value == "A"
    assert results["bad"].error == "host bad: refused"
    assert results["odd"].error == "host odd: ValueError: boom"
    with pytest.raises(FanOutError, match="host bad: refused"):
        values_or_raise(results)


def test_a_hanging_host_is_cut_off_at_the_deadline():
    release = threading.Event()

    def maybe_hang(host: str) -> str:
        if host == "hung":
            release.wait(10)
        return host

    # the deadline leaves "a"'s thread ample time to be scheduled on a loaded machine
    results = fan_out(["a", "hung"], maybe_hang, timeout_s=2.0, shown_timeout_s=5)  # "hung" answers only on release
    assert results["a"].ok and results["a"].value == "a"
    assert not results["hung"].ok and results["hung"].timed_out
    assert results["hung"].error == "host hung: no answer within 5 s (cut off)"
    release.set()
