"""The load the fault e2e tests keep on a deployment while they break it: CLIENTS threads, each
sending fresh random prompts of PROMPT_TOKENS tokens for MAX_TOKENS greedy tokens back to back,
through a `send(url, prompt)` of the test's own (a plain or a streamed completion), until stop()."""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from typing import Callable, Generic, TypeVar

from random_prompts import VOCAB

CLIENTS, PROMPT_TOKENS, MAX_TOKENS = 32, 1500, 48
LOAD_BEFORE_FAULT_S = 3.0  # the fault hits a steady load

Outcome = TypeVar("Outcome")


def completion_request(url: str, prompt: list[int], stream: bool = False) -> urllib.request.Request:
    """A greedy completion of MAX_TOKENS tokens (ignore_eos: always all of them) of the tiny model."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    if stream:
        body["stream"] = True
    return urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})


class Load(Generic[Outcome]):
    """CLIENTS threads, each sending fresh prompts back to back until stop(). A client whose answer
    `backs_off` waits 0.2 s before its next request (it does not hammer a server that is down)."""

    def __init__(self, url: str, seed: int, send: Callable[[str, list[int]], Outcome],
                 backs_off: Callable[[Outcome], bool] = lambda outcome: False):
        self.outcomes: list[Outcome] = []
        self._send, self._backs_off = send, backs_off
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(url, random.Random(seed * 1000 + i)), daemon=True)
                         for i in range(CLIENTS)]
        for t in self._threads:
            t.start()

    def _client(self, url: str, rng: random.Random) -> None:
        while not self._stop.is_set():
            outcome = self._send(url, [rng.randint(10, VOCAB - 1) for _ in range(PROMPT_TOKENS)])
            with self._lock:
                self.outcomes.append(outcome)
            if self._backs_off(outcome):
                self._stop.wait(0.2)

    def stop(self, timeout_s: float) -> list[Outcome]:
        """Every outcome, by start; fails the test if a client is still waiting after timeout_s."""
        self._stop.set()
        end = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a client is still waiting for an answer"
        return sorted(self.outcomes, key=lambda o: o.start)
