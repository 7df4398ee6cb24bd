"""The instance list read again on request (SIGHUP), off the event loop.

The file is opened, checked (a regular file, at most instances.MAX_FILE_BYTES) and parsed on a
thread of its own, so a path that hangs (a FIFO, a stalled network mount) or a long list never
stops the router from serving; a read that has not returned within READ_TIMEOUT_S is given up
(the list in use stays). One read at a time: a request that comes during one is taken after it,
once, with the file as it is then.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

from kvpush.common.errors import UsageError

from .instances import InstanceList, load_instance_list

log = logging.getLogger("kvpush.router")

READ_TIMEOUT_S = 10.0


class InstanceListReloader:
    def __init__(self, path: str | None, take: Callable[[InstanceList, str, str], None],
                 read_timeout_s: float = READ_TIMEOUT_S):
        self.path = path
        self._take = take
        self._read_timeout_s = read_timeout_s
        self._task: asyncio.Task | None = None
        self._again = False
        self.reading = False  # a read's thread has not handed its result back (it may hang)
        self._reader_since = 0.0

    def request(self) -> asyncio.Task | None:
        """Read the list again soon (on the event loop's thread); the task doing it, to await in tests."""
        if self.path is None:
            log.warning("reload asked for, but the router config names no instances_file: nothing to reload")
            return None
        if self._task is not None and not self._task.done():
            self._again = True
            return self._task
        self._task = asyncio.create_task(self._run(self.path))
        return self._task

    async def _run(self, path: str) -> None:
        while True:
            self._again = False
            read = await self._read(path)
            if read is not None:
                self._take(read[0], path, read[1])
            if not self._again:
                return

    async def _read(self, path: str) -> tuple[InstanceList, str] | None:
        """The list and its digest, both worked out on a thread of their own; None if it failed (logged)."""
        if self.reading:
            log.error(
                "router instances file %s: the read started %.0f s ago has not returned; not reading it again "
                "until it does; still serving the instance list it had",
                path,
                time.monotonic() - self._reader_since,
            )
            return None
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[InstanceList, str]] = loop.create_future()

        def settle(result: tuple[InstanceList, str] | None, error: BaseException | None) -> None:
            self.reading = False
            if done.done():  # given up on already
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def read() -> None:
            try:
                listed = load_instance_list(path)
                result, error = (listed, listed.digest()), None
            except BaseException as exc:  # handed to the loop, which decides
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop closed while this hung
                pass

        # a daemon thread, not an executor's: a read that never returns must not hold up the exit
        self.reading = True
        self._reader_since = time.monotonic()
        threading.Thread(target=read, name="kvpush-router-reload", daemon=True).start()
        try:
            return await asyncio.wait_for(done, self._read_timeout_s)
        except asyncio.TimeoutError:
            log.error("router instances file %s: not read within %g s; still serving the instance list it had",
                      path, self._read_timeout_s)
        except UsageError as exc:
            log.error("%s; still serving the instance list it had", exc)
        except Exception:
            log.exception("router instances file %s: reading it failed; still serving the instance list it had", path)
        return None
