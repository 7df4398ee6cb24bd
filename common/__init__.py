"""What the router, the connector and the deploy tooling share: error types, vLLM metric
parsing and the per-request `kv_transfer_params` contract. Imports nothing else of kvpush."""
