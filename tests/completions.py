"""The e2e tests' completion client: greedy completions of the tiny model (served name `tiny`) over
plain urllib, with the headers a test gives (an instance key, a router key)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


def completion_body(prompt: list[int] | str, max_tokens: int, stream: bool = False, **extra) -> dict:
    """Greedy, every one of max_tokens tokens (ignore_eos), with any extra fields (kv_transfer_params)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra}
    if stream:
        body["stream"] = True
    return body


def completion_request(url: str, body: dict, headers: dict[str, str] | None = None) -> urllib.request.Request:
    return urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                  {"Content-Type": "application/json", **(headers or {})})


def get(url: str, timeout_s: float = 10, headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def complete(url: str, prompt: list[int] | str, stream: bool = False, max_tokens: int = 8, timeout_s: float = 180,
             headers: dict[str, str] | None = None, **extra) -> tuple[int, str]:
    """(status, body) of one completion; for a stream, the body is the raw SSE text. A connection
    that fails (refused, reset, timed out) is status 0 with the error as the body."""
    try:
        with urllib.request.urlopen(completion_request(url, completion_body(prompt, max_tokens, stream, **extra), headers),
                                    timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def answer_text(status: int, raw: str, stream: bool = False) -> str:
    """The answer's text; fails the test on an error status, a cut stream or an error event."""
    assert status == 200, raw[:500]
    if not stream:
        return json.loads(raw)["choices"][0]["text"]
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", raw[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], raw[-500:]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
