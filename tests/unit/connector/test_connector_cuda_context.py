"""Binding a device's primary CUDA context to a thread that has none, through a stand-in driver
(the real one is exercised on the GPU machine: benchmarks/gpu_nixl_context.py)."""
from __future__ import annotations

import threading

import pytest

from kvpush.connector import cuda_context


class FakeDriver:
    """libcuda's four calls the module makes, with one current context per thread."""

    def __init__(self, fail: str | None = None):
        self.fail = fail
        self.current: dict[int, int] = {}
        self.calls: list[tuple] = []

    def _result(self, name: str) -> int:
        return 201 if self.fail == name else 0

    def cuCtxGetCurrent(self, ref):  # noqa: N802 (driver's names)
        ref._obj.value = self.current.get(threading.get_ident())
        return self._result("cuCtxGetCurrent")

    def cuDeviceGet(self, ref, ordinal):  # noqa: N802
        self.calls.append(("cuDeviceGet", ordinal))
        ref._obj.value = 100 + ordinal
        return self._result("cuDeviceGet")

    def cuDevicePrimaryCtxRetain(self, ref, dev):  # noqa: N802
        self.calls.append(("retain", dev.value))
        ref._obj.value = 5000 + dev.value
        return self._result("cuDevicePrimaryCtxRetain")

    def cuCtxSetCurrent(self, ctx):  # noqa: N802
        self.calls.append(("set", ctx.value))
        if self.fail != "cuCtxSetCurrent":
            self.current[threading.get_ident()] = ctx.value
        return self._result("cuCtxSetCurrent")


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda_context, "_driver", fake)
    monkeypatch.setattr(cuda_context, "_local", threading.local())
    return fake


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_thread_without_context_gets_the_devices_primary_one_once(driver):
    def bind_twice():
        first = cuda_context.bind_device_context(1)
        second = cuda_context.bind_device_context(1)
        return first, second, cuda_context.current_context()

    assert in_thread(bind_twice) == (True, True, 5101)
    assert driver.calls == [("cuDeviceGet", 1), ("retain", 101), ("set", 5101)]


def test_a_thread_with_a_context_keeps_it(driver):
    def bind():
        driver.current[threading.get_ident()] = 42
        return cuda_context.bind_device_context(0), cuda_context.current_context()

    assert in_thread(bind) == (True, 42)
    assert driver.calls == []


def test_a_driver_failure_is_reported_not_raised(driver, caplog):
    driver.fail = "cuDevicePrimaryCtxRetain"
    assert in_thread(lambda: (cuda_context.bind_device_context(0), cuda_context.bind_device_context(0))) == (False, False)
    assert sum("cannot bind GPU 0's CUDA context" in r.getMessage() for r in caplog.records) == 1
