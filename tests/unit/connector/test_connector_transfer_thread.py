"""The producer's transfer thread (transfer_thread.py): jobs run one at a time in the order they
were handed over, a failing job costs only itself, and the owner's tick runs when its deadline
says or when woken."""
from __future__ import annotations

import threading

import pytest

from kvpush.connector.transfer_thread import TransferThread

pytestmark = pytest.mark.unit
HANG_S = 30.0  # only to name a hang


@pytest.fixture
def thread():
    made = []

    def make(next_wait=lambda: None, tick=lambda: None):
        t = TransferThread("test-transfer", next_wait, tick)
        t.start()
        made.append(t)
        return t

    yield make
    for t in made:
        t.stop()


def test_jobs_run_in_order_on_the_thread_and_drain_waits_for_them(thread):
    t = thread()
    ran, names = [], set()
    for i in range(100):
        t.submit(lambda i=i: (ran.append(i), names.add(threading.current_thread().name)))
    assert t.drain(HANG_S)
    assert ran == list(range(100)) and names == {"test-transfer"}


def test_a_failing_job_does_not_stop_the_ones_behind_it(thread):
    t = thread()
    ran = []
    t.submit(lambda: 1 / 0)
    t.submit(lambda: ran.append("after"))
    assert t.drain(HANG_S) and ran == ["after"]


def test_the_tick_runs_when_woken(thread):
    ticked = threading.Event()
    t = thread(next_wait=lambda: None, tick=ticked.set)  # None: sleeps until woken
    assert t.drain(HANG_S)
    ticked.clear()
    t.wake()
    assert ticked.wait(HANG_S)


def test_a_thread_holding_the_owners_lock_may_wake_it_while_it_asks_for_its_deadline(thread):
    """The producer's compute thread wakes the transfer thread with the producer's lock held, and
    the transfer thread takes that lock to compute its deadline: neither may wait on the other."""
    owner = threading.Lock()
    asked = threading.Event()

    def next_wait():
        asked.set()
        with owner:
            return None

    with owner:
        t = thread(next_wait=next_wait)
        assert asked.wait(HANG_S)  # it now waits for `owner`
        t.wake()  # must return although that thread is inside next_wait
    assert t.drain(HANG_S)


def test_a_due_deadline_ticks_without_a_wake(thread):
    ticks = threading.Semaphore(0)
    thread(next_wait=lambda: 0.0, tick=ticks.release)
    for _ in range(3):
        assert ticks.acquire(timeout=HANG_S)
