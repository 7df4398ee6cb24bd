"""kvpush's push KV connector for vLLM: `"kv_connector": "KVPushConnector"`,
`"kv_connector_module_path": "kvpush.connector"`.

A thin facade over PushScheduler (scheduler role) and PushWorker (worker role); vLLM is imported
only here and in the modules the facade needs, so wire/state/layout/transfer stay vLLM-free.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["KVPushConnector"]

if TYPE_CHECKING:
    from .connector import KVPushConnector


def __getattr__(name: str) -> Any:
    # vLLM is heavy to import: load it only when vLLM itself asks for the connector class
    if name == "KVPushConnector":
        from .connector import KVPushConnector

        return KVPushConnector
    raise AttributeError(name)
