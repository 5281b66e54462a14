"""kvpool as a native vLLM v1 KV connector.

vLLM loads it from its `kv_transfer_config`::

    {"kv_connector": "KVPoolConnector",
     "kv_connector_module_path": "kvpool.agent.integrations.vllm",
     "kv_role": "kv_both"}

`KVPoolConnector` (connector.py) is the class vLLM builds; its scheduler side
(scheduler.py) and worker side (worker.py) live apart, on the client library, never the
agent's server. layout.py holds what a chunk is (keys, bytes) without importing vLLM.
Importing this package imports vLLM only when `KVPoolConnector` is asked for.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVPoolConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPoolConnector":
        from .connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
