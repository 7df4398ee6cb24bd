"""One request of the chaos suite and what became of it.

A client sends a prompt of the set (tests/chaos_prompts.py), streamed or not, through the router,
with an X-Request-Id of its own (so the router's and instances' logs can be searched for it), and
records its status, latency, what text came and whether it equals the plain server's answer. A
request is answered when it got HTTP 200 and every token it asked for (finish_reason `length`,
ignore_eos), and for a stream `[DONE]` with no error event. Its text is wrong when it was answered
with another text than the reference's, or when what came before an error is not the start of the
reference's text.
"""
from __future__ import annotations

import http.client
import itertools
import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from chaos_prompts import PromptSet
from fault_load import completion_request

READ_TIMEOUT_S = 90.0  # a request waiting longer than this for a byte counts as hung
SLOW_S = 30.0  # a request that takes longer than this is a finding, answered or not


@dataclass(frozen=True)
class Job:
    prompt_index: int
    stream: bool


def random_job(prompts: PromptSet, streamed_share: float = 0.5):
    """What a client sends next: a prompt of the set at random, streamed with streamed_share."""
    return lambda rng: Job(rng.randrange(len(prompts)), rng.random() < streamed_share)


@dataclass
class RequestRecord:
    topology: str
    request_id: str
    prompt_index: int
    prompt_tokens: int
    max_tokens: int
    streamed: bool
    start: float  # time.monotonic(); made relative to the run's start when written
    end: float
    status: int | None  # HTTP status; None: no HTTP answer (refused, reset, timed out)
    answered: bool
    first_token_s: float | None  # streamed: from the start to its first token
    text: str  # what came (a cut stream: up to the cut)
    error: str  # why it was not answered
    decode_computed: str | None  # the router's X-Kvpush-Decode-Computed-Prompt: why decode computed the prompt itself
    matches_reference: bool | None = None  # None: nothing came to compare
    faults: list[str] = field(default_factory=list)  # the faults under way at some time during it
    healthy_peer: bool = True  # every role kept an instance no fault touched, throughout

    @property
    def latency_s(self) -> float:
        return self.end - self.start

    @property
    def wrong(self) -> bool:
        return self.matches_reference is False

    @property
    def slow(self) -> bool:
        return self.latency_s > SLOW_S

    def compare(self, reference: str) -> None:
        if self.answered:
            self.matches_reference = self.text == reference
        elif self.text:
            self.matches_reference = reference.startswith(self.text)

    def to_json(self, epoch: float) -> dict:
        """A row of the run's file; the text only where it is not the reference's whole answer."""
        row = asdict(self)
        if self.answered and self.matches_reference:
            del row["text"]
        row.update(start=round(self.start - epoch, 3), end=round(self.end - epoch, 3), latency_s=round(self.latency_s, 3))
        if row["first_token_s"] is not None:
            row["first_token_s"] = round(row["first_token_s"], 3)
        return row


class Sender:
    """send(url, job) for fault_load.Load: one request, recorded and compared with the reference."""

    def __init__(self, topology: str, prompts: PromptSet, id_prefix: str):
        self._topology, self._prompts, self._prefix = topology, prompts, id_prefix
        self._counter = itertools.count()

    def __call__(self, url: str, job: Job) -> RequestRecord:
        prompt, max_tokens = self._prompts.prompts[job.prompt_index], self._prompts.max_tokens[job.prompt_index]
        request_id = f"{self._prefix}-{next(self._counter):06d}"
        request = completion_request(url, prompt, stream=job.stream, max_tokens=max_tokens, request_id=request_id)
        record = RequestRecord(self._topology, request_id, job.prompt_index, len(prompt), max_tokens, job.stream,
                               time.monotonic(), 0.0, None, False, None, "", "", None)
        try:
            with urllib.request.urlopen(request, timeout=READ_TIMEOUT_S) as response:
                record.status = response.status
                record.decode_computed = response.headers.get("X-Kvpush-Decode-Computed-Prompt")
                _read_stream(response, record) if job.stream else _read_body(response, record)
        except urllib.error.HTTPError as exc:
            record.status = exc.code
            record.error = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}"
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut off
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.end = time.monotonic()
        record.compare(self._prompts.answers[job.prompt_index])
        return record


def _read_body(response, record: RequestRecord) -> None:
    choice = json.loads(response.read())["choices"][0]
    record.text = choice.get("text") or ""
    record.answered = choice.get("finish_reason") == "length"
    if not record.answered:
        record.error = f"finish_reason {choice.get('finish_reason')!r}"


def _read_stream(response, record: RequestRecord) -> None:
    done, finish = False, None
    for line in response:
        if not line.startswith(b"data: "):
            continue
        if line.startswith(b"data: [DONE]"):
            done = True
            continue
        event = json.loads(line[6:])
        if "error" in event:
            record.error = f"error event: {line[:300].decode(errors='replace').strip()}"
            return
        for choice in event.get("choices", []):
            if record.first_token_s is None and choice.get("text"):
                record.first_token_s = time.monotonic() - record.start
            record.text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
    record.answered = done and finish == "length"
    if not record.answered:
        record.error = f"stream ended: finish_reason {finish!r}, [DONE] {'seen' if done else 'missing'}"


def backs_off(record: RequestRecord) -> bool:
    return not record.answered

