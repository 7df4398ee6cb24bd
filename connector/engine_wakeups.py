"""How vLLM's processes wait for each other's messages, where that decides a TP deployment's fate.

vLLM's engine hands each step to its worker processes (TP ranks) through a shared-memory queue,
and reads their answers from another. Two of its waiting habits hurt a disaggregated deployment:

- A reader that has been idle sleeps on a ZeroMQ notification, which vLLM documents can be lost;
  a periodic recheck (5 s in vLLM 0.32) bounds the cost. With TP, a rank that sleeps through its
  step stalls the others inside their first collective, which waits with the GIL held, so their
  side-channel threads cannot answer the decode side, which then declares the prefill dead. On
  this project's CPU hosts a TP 2 -> TP 2 deployment lost such wake-ups in most requests (12-31 s
  stalls). A 50 ms recheck wakes an idle reader 20 times a second, one flag read each.
- After each message a reader spins (yielding the core) for a second before it sleeps. A decode
  engine that waits for pushed KV steps every few milliseconds, so its engine process spun
  without end: 29 of the 34 CPU-seconds it had over 34 s of a TP 2 -> TP 2 test on 2 cores,
  while prefill's ranks starved. On a CPU host readers sleep at once instead; a GPU host keeps
  vLLM's spin, which saves it a wake-up's latency per step and has the cores to spare.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

RECHECK_MS = 50


def tune_step_queues(on_cpu: bool, recheck_ms: int = RECHECK_MS) -> bool:
    """Apply the above in this process (idempotent). False where this vLLM has no such queue."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    current = getattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", None)
    spin = getattr(shm_broadcast, "SpinCondition", None)
    if not isinstance(current, int) or spin is None or not hasattr(spin, "wait"):
        return False
    if current > recheck_ms:
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms
    if on_cpu and not getattr(spin.wait, "_kvpush_sleeps_at_once", False):
        spin.wait = _sleeping_at_once(spin.wait)
    log.debug("kvpush: vLLM's step queues: idle readers recheck every %d ms%s", recheck_ms,
              ", and sleep without spinning first" if on_cpu else "")
    return True


def _sleeping_at_once(wait: Any) -> Any:
    def wait_without_spin(self: Any, timeout_ms: int | None = None) -> None:
        if getattr(self, "is_reader", False) and getattr(self, "busy_loop_s", 0) > 0:
            self.busy_loop_s = 0  # a reader's own setting, read by `wait` each time
        return wait(self, timeout_ms)

    wait_without_spin._kvpush_sleeps_at_once = True  # type: ignore[attr-defined]
    return wait_without_spin
