"""Rank processes as vLLM starts them (children of one process, titled with setproctitle): a rank
finds exactly its siblings in /proc, its side-channel thread hears a sibling's SIGKILL at once, and
then puts every other thread (one spinning, as a rank stuck in a collective) under SCHED_IDLE."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

RANK = """
import json, os, sys, threading, time
import setproctitle
from kvpush.connector.channel import Reactor
from kvpush.connector.siblings import exit_handles, sibling_ranks, yield_cores

rank = int(sys.argv[1])
setproctitle.setproctitle(f"VLLM::Worker_TP{rank}")
if rank:
    time.sleep(600)
deadline = time.monotonic() + 60
while len(siblings := sibling_ranks()) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)  # until the others have titled themselves
handles, gone = exit_handles(siblings)
ended = []
class Quiet:
    def on_message(self, *a): pass
    def on_closed(self, *a): pass
    def on_malformed(self, *a): pass
    def on_tick(self): pass
    def timeout(self): return None
reactor = Reactor("siblings-test", Quiet())
spinner = threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True)  # a rank stuck in a collective
spinner.start()
def on_exit(name):
    at = time.monotonic()
    moved = yield_cores(keep_threads={threading.get_native_id()})
    policies = {t: os.sched_getscheduler(t) for t in (threading.get_native_id(), spinner.native_id, threading.main_thread().native_id)}
    print(json.dumps({"ended": name, "at": at, "moved": moved,
                      "idle": [policies[spinner.native_id] == os.SCHED_IDLE, policies[threading.main_thread().native_id] == os.SCHED_IDLE],
                      "reactor_idle": policies[threading.get_native_id()] == os.SCHED_IDLE}), flush=True)
    ended.append(name)
for fd, name in handles.items():
    reactor.watch_exit(fd, lambda name=name: on_exit(name))
reactor.start()
print(json.dumps({"siblings": {str(k): v for k, v in siblings.items()}, "gone": gone}), flush=True)
deadline = time.monotonic() + 60
while not ended and time.monotonic() < deadline:
    time.sleep(0.01)
reactor.stop()
"""

ENGINE = """
import subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1], str(r)], stdout=subprocess.PIPE if r == 0 else None, text=True)
         for r in range(3)]
print(" ".join(str(p.pid) for p in ranks), flush=True)
for line in ranks[0].stdout:
    print(line, end="", flush=True)
for p in ranks[1:]:
    p.kill()
"""

pytestmark = pytest.mark.integration


def test_a_rank_finds_its_siblings_and_hears_one_killed():
    pytest.importorskip("setproctitle")
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, RANK], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        found = json.loads(engine.stdout.readline())
        assert found == {"siblings": {str(pids[1]): "VLLM::Worker_TP1", str(pids[2]): "VLLM::Worker_TP2"}, "gone": []}
        killed = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)
        heard = json.loads(engine.stdout.readline())
        assert heard["ended"] == f"VLLM::Worker_TP2 (pid {pids[2]})"
        assert heard["idle"] == [True, True] and not heard["reactor_idle"] and heard["moved"] >= 2
        print(f"rank 0 heard its sibling's SIGKILL after {heard['at'] - killed:.4f} s")
    finally:
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
