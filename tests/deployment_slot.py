"""One deployment that e2e tests share while they leave it as they found it, and hand over to a
test that breaks it (kills or stops a process, cancels its job).

`shared()` starts the deployment at its first use and returns the running one after that; `take()`
gives it to one test and empties the slot, so the next test gets a fresh one; the taker stops it
(`stop`). A test that breaks the deployment and repairs it (a fault, then `up`) may share it too:
if it fails before the repair is proven it calls `discard()`, and the next test gets a fresh one.
Tests run in file order, so when the destructive tests come last they take the
deployment the others used and nothing is started twice, yet every test passes when run alone.
A start that failed fails the tests after it at once instead of starting again.
"""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

import pytest

T = TypeVar("T")


class DeploymentSlot(Generic[T]):
    def __init__(self, name: str, start: Callable[[], T], stop: Callable[[T], None], current: T | None = None):
        self.name = name
        self._start, self._stop = start, stop
        self._current = current
        self._results: dict[str, object] = {}
        self._failed = ""

    def shared(self) -> T:
        if self._failed:
            pytest.fail(f"{self.name} did not start: {self._failed}")
        if self._current is None:
            try:
                self._current = self._start()
            except BaseException as exc:
                self._failed = f"{type(exc).__name__}: {exc}"
                raise
        return self._current

    def take(self) -> T:
        current, self._current, self._results = self.shared(), None, {}
        return current

    def once(self, key: str, compute: Callable[[], object]) -> object:
        """`compute()`'s result, computed once per deployment (a take starts a new one)."""
        if key not in self._results:
            self._results[key] = compute()
        return self._results[key]

    def stop(self, deployment: T) -> None:
        self._stop(deployment)

    def discard(self) -> None:
        """Stop the shared deployment now (a test left it in an unknown state); the next `shared()`
        starts a fresh one."""
        if self._current is not None:
            current, self._current, self._results = self._current, None, {}
            self._stop(current)

    def close(self) -> None:
        """Stop the shared deployment, if one is up (at the end of the module)."""
        if self._current is not None:
            current, self._current = self._current, None
            self._stop(current)
