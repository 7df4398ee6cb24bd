"""Run per-host work in parallel; every host gets a result, a failure never hides the others."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, TypeVar, cast

from kvpush.common.errors import KvpushError

K = TypeVar("K")
T = TypeVar("T")


@dataclass(frozen=True)
class HostResult(Generic[T]):
    host: str
    ok: bool
    value: T | None = None
    error: str | None = None
    timed_out: bool = False

    @property
    def ok_value(self) -> T:
        """What fn returned, for an ok result (a failed one holds no value)."""
        assert self.ok, f"host {self.host} failed, so it has no value: {self.error}"
        return cast(T, self.value)  # ok: value is fn's return, a T (None included where T allows it)

    @property
    def failure(self) -> str:
        """The one-line error of a failed result."""
        return self.error or f"host {self.host}: failed"


class FanOutError(KvpushError):
    """Some hosts failed; carries every host's result. str() is one line per failed host."""

    def __init__(self, results: dict[str, HostResult]):
        self.results = results
        failed = [r for r in results.values() if not r.ok]
        super().__init__("; ".join(r.failure for r in failed))


def fan_out(items: Iterable[K], fn: Callable[[K], T], name: Callable[[K], str] = str,
            max_workers: int = 64, timeout_s: float | None = None,
            shown_timeout_s: float | None = None) -> dict[str, HostResult[T]]:
    """fn(item) for every item in parallel threads, keyed by name(item), in input order.

    With timeout_s, each item runs in a daemon thread and one still running at the deadline is
    reported as timed out and abandoned (a hung host can't hang the command, nor its exit)."""
    items = list(items)
    if not items:
        return {}

    def call(item: K) -> HostResult[T]:
        host = name(item)
        try:
            return HostResult(host, True, value=fn(item))
        except KvpushError as exc:
            message = str(exc)
            return HostResult(host, False, error=message if host in message else f"host {host}: {message}")
        except Exception as exc:  # one host's surprise must not hide the others' results
            return HostResult(host, False, error=f"host {host}: {type(exc).__name__}: {exc}")

    if timeout_s is None:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
            results = list(pool.map(call, items))
        return {r.host: r for r in results}

    finished: dict[int, HostResult[T]] = {}
    done = [threading.Event() for _ in items]

    def run(index: int, item: K) -> None:
        finished[index] = call(item)
        done[index].set()

    for index, item in enumerate(items):
        threading.Thread(target=run, args=(index, item), daemon=True, name=f"fan-out-{name(item)}").start()
    deadline = time.monotonic() + timeout_s
    shown = timeout_s if shown_timeout_s is None else shown_timeout_s
    out: dict[str, HostResult[T]] = {}
    for index, item in enumerate(items):
        host = name(item)
        if done[index].wait(max(0.0, deadline - time.monotonic())):
            out[host] = finished[index]
        else:
            out[host] = HostResult(
                host, False, error=f"host {host}: no answer within {shown:g} s (cut off)", timed_out=True
            )
    return out


def values_or_raise(results: dict[str, HostResult[T]]) -> dict[str, T]:
    if any(not r.ok for r in results.values()):
        raise FanOutError(results)
    return {h: r.ok_value for h, r in results.items()}
