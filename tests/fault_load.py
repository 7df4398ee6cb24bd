"""The load the fault e2e tests keep on a deployment while they break it: CLIENTS threads, each
sending fresh random prompts of PROMPT_TOKENS tokens for MAX_TOKENS greedy tokens back to back,
through a `send(url, prompt)` of the test's own (a plain or a streamed completion), until stop().
A load of other shape (the chaos suite's) gives its number of clients and what each request is."""
from __future__ import annotations

import random
import threading
import time
import urllib.request
from typing import Any, Callable, Generic, TypeVar

import completions
from random_prompts import VOCAB

CLIENTS, PROMPT_TOKENS, MAX_TOKENS = 32, 1500, 48
LOAD_BEFORE_FAULT_S = 3.0  # the fault hits a steady load

Outcome = TypeVar("Outcome")


def full_length_prompt(rng: random.Random) -> list[int]:
    return [rng.randint(10, VOCAB - 1) for _ in range(PROMPT_TOKENS)]


def completion_request(url: str, prompt: list[int], stream: bool = False, max_tokens: int = MAX_TOKENS,
                       request_id: str | None = None) -> urllib.request.Request:
    """A greedy completion of max_tokens tokens (ignore_eos: always all of them) of the tiny model;
    with request_id, sent as X-Request-Id (the router and both instances then name it in their logs)."""
    headers = {"X-Request-Id": request_id} if request_id else None
    return completions.completion_request(url, completions.completion_body(prompt, max_tokens, stream), headers)


class Load(Generic[Outcome]):
    """`clients` threads, each sending what `job(rng)` makes (by default a fresh prompt of
    PROMPT_TOKENS tokens) back to back until stop(). A client whose answer `backs_off` waits
    `back_off_s` before its next request (it does not hammer a server that is down)."""

    def __init__(self, url: str, seed: int, send: Callable[[str, Any], Outcome],
                 backs_off: Callable[[Outcome], bool] = lambda outcome: False, clients: int = CLIENTS,
                 job: Callable[[random.Random], Any] = full_length_prompt, back_off_s: float = 0.2):
        self.outcomes: list[Outcome] = []
        self._send, self._backs_off, self._job, self._back_off_s = send, backs_off, job, back_off_s
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(url, random.Random(seed * 1000 + i)), daemon=True)
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self, url: str, rng: random.Random) -> None:
        while not self._stop.is_set():
            outcome = self._send(url, self._job(rng))
            with self._lock:
                self.outcomes.append(outcome)
            if self._backs_off(outcome):
                self._stop.wait(self._back_off_s)

    def stop(self, timeout_s: float) -> list[Outcome]:
        """Every outcome, by start; fails the test if a client is still waiting after timeout_s."""
        self._stop.set()
        end = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a client is still waiting for an answer"
        return sorted(self.outcomes, key=lambda o: o.start)
