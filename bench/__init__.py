"""`kvpush bench`: push vs pull under load, measured with vLLM's own benchmark client.

options.py says what a bench does and how it reports; modes.py derives one topology per
connector mode (pure); deployment.py brings a mode up, ready and warm; client.py builds and runs
`vllm bench serve`; measure.py drives one rate and scrapes /metrics around it, which scrape.py
reads; results.py parses and aggregates (pure); report.py writes bench.json and, through plots.py,
the PNGs, with environment.py's versions and machine; runner.py orchestrates the modes and rounds.
"""
