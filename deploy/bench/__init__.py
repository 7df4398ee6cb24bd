"""`kvpush bench`: push vs pull under load, measured with vLLM's own benchmark client.

modes.py derives one topology per connector mode (pure); client.py builds and runs
`vllm bench serve`; scrape.py reads the router's and instances' /metrics; results.py parses and
aggregates (pure); environment.py records versions and the machine; plots.py draws PNGs;
runner.py ties it together around the lifecycle's up/down.
"""
