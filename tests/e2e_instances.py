"""What every real-vLLM instance of the e2e tests shares on this 2-core machine."""
from __future__ import annotations

# A quarter GiB of KV cache per instance (per rank): kvpush's connector collapses a CPU cache into
# huge pages at start-up, so a small cache starts sooner.
KV_CACHE_GIB = 0.25
