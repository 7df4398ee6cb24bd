"""How vLLM's step queues wait, tuned by the connector; and where NIXL's threads may run."""
from __future__ import annotations

import os
import threading

import pytest

from kvpush.connector import engine_wakeups
from kvpush.connector.transfer import threads_started_on


class Reader:
    is_reader = True
    busy_loop_s = 1.0


def test_a_reader_on_a_cpu_host_sleeps_without_spinning_first():
    seen = []
    wait = engine_wakeups._sleeping_at_once(lambda self, timeout_ms=None: seen.append((self.busy_loop_s, timeout_ms)))
    reader, writer = Reader(), Reader()
    writer.is_reader = False
    wait(reader, 50)
    wait(writer, 50)
    assert seen == [(0, 50), (1.0, 50)]  # a writer's setting is not a reader's to change


def test_vllms_queues_recheck_often_and_spin_only_off_cpu():
    from vllm.distributed.device_communicators import shm_broadcast

    original_wait, original_recheck = shm_broadcast.SpinCondition.wait, shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS
    try:
        assert engine_wakeups.tune_step_queues(on_cpu=False)
        assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == engine_wakeups.RECHECK_MS
        assert shm_broadcast.SpinCondition.wait is original_wait
        assert engine_wakeups.tune_step_queues(on_cpu=True) and engine_wakeups.tune_step_queues(on_cpu=True)
        assert shm_broadcast.SpinCondition.wait is not original_wait
        wrapped = shm_broadcast.SpinCondition.wait
        engine_wakeups.tune_step_queues(on_cpu=True)
        assert shm_broadcast.SpinCondition.wait is wrapped  # applied once, never wrapped twice
    finally:
        shm_broadcast.SpinCondition.wait = original_wait
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = original_recheck


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell affinities apart")
def test_threads_started_inside_get_the_cores_given_and_the_caller_keeps_its_own():
    everything = os.sched_getaffinity(0)
    one = {min(everything)}
    seen = {}

    def pinned_caller():
        os.sched_setaffinity(0, one)
        with threads_started_on(everything):
            child = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
            child.start()
            child.join()
        seen["caller"] = os.sched_getaffinity(0)

    caller = threading.Thread(target=pinned_caller)
    caller.start()
    caller.join()
    assert seen == {"child": everything, "caller": one}
