"""The router is ready when its /metrics has every instance in rotation; waiting for it is bounded."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.router_ready import out_of_rotation, wait_router_ready
from kvpush.deploy.runners.base import HttpResponse
from kvpush.deploy.lifecycle.secrets import AccessKeys

RECORDED = (Path(__file__).parents[1] / "fixtures" / "bench" / "router_metrics_after.txt").read_text()
EJECTED = RECORDED.replace('kvpush_router_instance_in_rotation{instance="decode-0",role="decode"} 1.0',
                           'kvpush_router_instance_in_rotation{instance="decode-0",role="decode"} 0.0')


def test_out_of_rotation_names_ejected_instances():
    assert out_of_rotation(RECORDED) == []  # both instances in rotation while the bench ran
    assert out_of_rotation(EJECTED) == ["decode-0"]


def test_an_instance_no_longer_planned_is_not_waited_for():
    removed = RECORDED + 'kvpush_router_instance_in_rotation{instance="decode-1",role="decode"} 0.0\n'
    assert out_of_rotation(removed) == ["decode-1"]
    assert out_of_rotation(removed, {"prefill-0", "decode-0"}) == []
    assert out_of_rotation(EJECTED, {"prefill-0", "decode-0"}) == ["decode-0"]


class _Router:
    """A router whose /metrics shows decode-0 ejected for the first `ejected_for` scrapes."""

    def __init__(self, ejected_for: int, status: int = 200):
        self.ejected_for, self.status, self.scrapes, self.headers = ejected_for, status, 0, []

    def http(self, method, url, body=None, timeout=5.0, headers=None):
        assert (method, url) == ("GET", "http://r:8000/metrics")
        self.scrapes += 1
        self.headers.append(headers)
        page = EJECTED if self.scrapes <= self.ejected_for else RECORDED
        return HttpResponse(self.status, page.encode())


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_waits_until_every_instance_is_back_and_sends_the_routers_key():
    router, clock = _Router(ejected_for=3), _Clock()
    wait_router_ready(router, "http://r:8000", 30, AccessKeys(client="ck"), clock=clock, sleep=clock.sleep)
    assert router.scrapes == 4
    assert router.headers[0] == {"Authorization": "Bearer ck"}


def test_gives_up_after_the_timeout_naming_what_is_out():
    router, clock = _Router(ejected_for=10**6), _Clock()
    with pytest.raises(KvpushError, match=r"still has decode-0 out of rotation 5 s after"):
        wait_router_ready(router, "http://r:8000", 5, clock=clock, sleep=clock.sleep)
    assert 5 <= clock.now <= 5.5


def test_a_router_whose_metrics_fail_is_not_ready():
    router, clock = _Router(ejected_for=0, status=401), _Clock()
    with pytest.raises(KvpushError, match=r"\(its /metrics answers HTTP 401\)"):
        wait_router_ready(router, "http://r:8000", 1, clock=clock, sleep=clock.sleep)
