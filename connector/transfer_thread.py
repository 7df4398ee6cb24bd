"""P's transfer thread: the side channel's work that calls NIXL or takes the producer's lock.

The reactor thread (channel.py) reads and checks D's frames and answers what needs no more (PING,
the handshake's proofs); whatever needs NIXL (making D a peer, posting a WRITE for a registration
that arrives after its offer, polling WRITEs in flight, releasing them) or the producer's lock
(registrations, cancels, a lost connection) it hands over here, in the order the frames came. This
thread runs them one at a time, and between them the owner's `tick` at the owner's next deadline.
So a WRITE post that waits on NIXL's lock, or a compute thread that holds the producer's lock
through a step, delays this thread, never the reactor's answers to D's pings.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)


class TransferThread:
    def __init__(self, name: str, next_wait: Callable[[], float | None], tick: Callable[[], None]):
        """`next_wait()`: seconds until `tick` is due (None: only when woken); both run on this thread."""
        self._next_wait = next_wait
        self._tick = tick
        self._jobs: deque[Callable[[], None]] = deque()
        self._ready = threading.Condition(threading.Lock())  # guards _jobs, _woken, _stop only; held briefly
        self._woken = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on this thread after every job submitted before it (any thread)."""
        with self._ready:
            self._jobs.append(job)
            self._ready.notify()

    def wake(self) -> None:
        """Something changed the next deadline (a WRITE went in flight): tick now (any thread)."""
        with self._ready:
            self._woken = True
            self._ready.notify()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every job submitted before this call has run; False if that took longer."""
        if self.on_thread() or not self._thread.is_alive():
            return True
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout_s)

    def stop(self) -> None:
        with self._ready:
            self._stop = True
            self._ready.notify()
        if self._thread.is_alive() and not self.on_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            try:
                # Asked outside the condition's lock: the owner takes its own lock for it, and the
                # threads that wake this one may hold that lock while they do.
                timeout = self._next_wait()
            except Exception:
                log.exception("kvpush transfer thread: deadline failed")
                timeout = 1.0
            with self._ready:
                if not self._jobs and not self._woken and not self._stop:
                    self._ready.wait(timeout)
                if self._stop:
                    return
                jobs, self._jobs = self._jobs, deque()
                self._woken = False
            for job in jobs:
                try:
                    job()
                except Exception:  # one job's bug must not stop the ones behind it
                    log.exception("kvpush transfer thread: a job failed")
            try:
                self._tick()
            except Exception:
                log.exception("kvpush transfer thread: tick failed")
