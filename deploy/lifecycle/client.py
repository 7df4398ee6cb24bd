"""A minimal streaming OpenAI-completions client: one request, its answer, its TTFT.

Used by `kvpush request` and by readiness proofs; stdlib only, so it runs anywhere.
"""
from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvpush.common.errors import KvpushError

COMPLETIONS_PATH = "/v1/completions"


def completion_body(model: str, prompt: str, max_tokens: int, stream: bool = False, **extra) -> bytes:
    """A greedy OpenAI completions request: the same answer for the same prompt on any instance."""
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       **({"stream": True} if stream else {}), **extra}).encode()


@dataclass(frozen=True)
class CompletionResult:
    text: str
    ttft_s: float
    latency_s: float
    completion_tokens: int
    finish_reason: str | None


def stream_completion(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int = 32,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    extra: dict | None = None,
) -> CompletionResult:
    """POST /v1/completions with stream=true, greedy; raises KvpushError naming the URL on failure."""
    parts = urlsplit(base_url)
    if not parts.hostname:
        raise KvpushError(f"{base_url}: not a URL with a host; give one like http://127.0.0.1:8000")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    start = time.perf_counter()
    try:
        conn.request("POST", COMPLETIONS_PATH, completion_body(model, prompt, max_tokens, stream=True, **(extra or {})),
                     headers)
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read(2000).decode(errors="replace").strip().replace("\n", " ")
            raise KvpushError(f"{base_url}{COMPLETIONS_PATH} answered HTTP {resp.status}: {detail}")
        text, ttft, tokens, finish = [], None, 0, None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise KvpushError(
                    f"{base_url}: request failed mid-stream: {event['error'].get('message', event['error'])}"
                )
            for choice in event.get("choices", []):
                if choice.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(choice["text"])
                    tokens += 1
                finish = choice.get("finish_reason") or finish
        latency = time.perf_counter() - start
        return CompletionResult("".join(text), ttft if ttft is not None else latency, latency, tokens, finish)
    except (OSError, http.client.HTTPException) as exc:
        raise KvpushError(f"{base_url}: request failed: {exc}; is the deployment up (`kvpush status`)?") from None
    finally:
        conn.close()
