"""kvpush router: one OpenAI-compatible endpoint in front of prefill and decode vLLM instances.

Modules: config (RouterConfig, written by the plan), protocols (leg bodies per transfer protocol;
the kvpush connector contract), pool (selection and health bookkeeping), dispatch (legs, retry,
cancellation, streaming), upstream_http (the lean HTTP/1.1 client every call to an instance goes
through), relay (the decode stream after its first token, socket to socket), validation, errors
(vLLM-shaped error bodies), metrics, app (HTTP front and background probing/scraping),
fake_upstream (an in-process fake vLLM for tests and benchmarks).

Failure policy: until the decode leg's first token reaches the client, a failed leg (connection
error, 5xx/408/429, timeout, an error reported by vLLM such as a failed KV load) ends the attempt,
cancels the other leg, and the request is tried again (max_retries, default once) with a new transfer
id on a pair that avoids the failed instance; with no other instance the same one is tried again.
A 4xx answer is the client's problem and is returned verbatim. After the first token a failure ends
the stream with a vLLM-style error event and `data: [DONE]`. An instance failing
eject_after_failures legs in a row leaves rotation until its /health answers 200; with every prefill
instance out, decode instances serve alone (counted as fallbacks).
"""
