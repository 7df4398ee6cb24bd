"""Whether this prefill rank's instance can still prefill. Once another of its ranks ends
(siblings.py), this rank's forward passes stop in their next collective and nothing more will be
offered here: every registration decode holds here fails at once and every later one on arrival
(the push service, producer.py, asks `reason`), and a hook runs once the pushes this rank had
already matched have ended.
"""
from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Callable

log = logging.getLogger(__name__)
Job = Callable[[], None]


class InstanceLoss:
    def __init__(self, engine_id: str, lock: threading.RLock, fail_waiting: Callable[[str], int],
                 busy: Callable[[], bool]):
        """`fail_waiting(reason)` (lock held) fails the registrations decode holds here and says how
        many; `busy()` (lock held): a push this rank matched is still being written."""
        self._engine_id = engine_id
        self._lock = lock
        self._fail_waiting = fail_waiting
        self._busy = busy
        self.reason = ""  # why this instance can prefill nothing more, "" while whole (under the lock)
        self._after: Job | None = None  # to run once the pushes under way have ended

    def watch(self, handles: dict[int, str], gone: list[str], on_lost: Job, watch_exit: Callable[[int, Job], None],
              submit: Callable[[Job], None]) -> None:
        """Lose the instance once a sibling (pidfd -> name) ends, or now if one in `gone` did;
        `watch_exit` hears of an end (on the reactor thread), `submit` moves the rest to the transfer
        thread, where `on_lost` runs."""
        def lost(name: str) -> None:
            if self.lose(f"its rank process {name} ended"):
                with self._lock:
                    self._after = on_lost
                self.run_if_idle()

        for fd, name in handles.items():
            watch_exit(fd, partial(submit, partial(lost, name)))
        if gone:
            submit(lambda: lost(gone[0]))

    def lose(self, why: str) -> bool:
        """Fail every registration decode holds here now, and every later one on arrival. False if
        that was done before."""
        with self._lock:
            if self.reason:
                return False
            self.reason = f"prefill {self._engine_id} can no longer prefill: {why}"
            failed = self._fail_waiting(self.reason)
        (log.warning if failed else log.info)("kvpush: %s; failed the %d transfer(s) decode was waiting for here",
                                              self.reason, failed)
        return True

    def run_if_idle(self) -> None:
        """Transfer thread: run the hook once no push this rank had matched is still being written."""
        with self._lock:
            if self._after is None or self._busy():
                return
            run, self._after = self._after, None
        run()
