"""kvpush router: one OpenAI-compatible endpoint in front of prefill and decode vLLM instances.

Modules: config (RouterConfig, written by the plan), keys (the API keys, from env or owner-only
files), validation (what the router checks and strips before any leg), fanout (a request's parts
and how each part's prompt reaches decode), protocols (leg bodies per transfer protocol; the
kvpush connector contract), pool (selection and health bookkeeping), legs (one leg and reading its
answer), vllm_errors (how vLLM says a request failed: a failed KV load, the request's own fault),
attempts (the legs of one attempt on one pair), pairs (which pair each retry goes to), dispatch
(parts, retries, phases), fallbacks (counting and logging prompts decode computed itself), respond
and relay (answering the client; a stream after its first token goes socket to socket), merge (a
split batch's answers and streams as one), upstream_http (the lean HTTP/1.1 client every call to an
instance goes through), errors (vLLM-shaped error bodies), metrics, app (HTTP front, API key,
background probing/scraping). The in-process fake vLLM the router's tests and benchmarks answer
with is tests/fake_upstream.py.

Failure policy: until the client has seen a byte (a stream's first token; a non-streamed answer
whole) a failed leg (connection error, 5xx/408/429, timeout, a request vLLM finished with an error
such as a failed KV load) ends the attempt, cancels the other legs, and the part is tried again
with a new transfer id on a pair no attempt of it used: another prefill (and another decode where
the failure named decode) while one is in rotation, then decode computing the prompt itself (a
fallback), on each decode in turn; no attempt starts later than retry_deadline_s after the request
arrived. A 4xx answer is the client's problem and is returned verbatim. From the first byte on
nothing is retried: a stream ends with a vLLM-style error event and `data: [DONE]`; a stream is cut
after stream_idle_s without a byte, however long it runs. Only instances that cannot be reached
(connection failures) or fail their health check leave rotation (eject_after_failures in a row)
until /health answers 200 again; a slow or failed generation never ejects.
"""
