"""Inference-engine integrations: kvpool as a storage backend of LMCache and SGLang.

- `kvpool.agent.integrations.lmcache.KVPoolConnector`: an LMCache remote
  storage plugin (the path vLLM takes through LMCache).
- `kvpool.agent.integrations.sglang.KVPoolHiCacheStorage`: an SGLang HiCache
  storage backend.

Each module imports its engine, so import only the one the engine loads; the
rest of kvpool never imports them. Both move whole batches of chunks in one or
two round trips, zero-copy, through `KVPoolClient.get_many_into` and
`put_many`. Wiring them up is in docs/integrations.md.

Both tell the agent who the engine is, for KV events (docs/events.md): its pod (`engine_pod`),
its model, its tokens per chunk, and per chunk the hash its engine gives that chunk.
"""

import os
import socket

POD_NAME_ENV = "POD_NAME"
"""Where an engine pod may give its name (the downward API's metadata.name)."""


def engine_pod() -> str:
    """The engine's pod name, for the topic routers credit (`kv@<pod>@<model>`): POD_NAME
    where the pod sets it, else the host name, which is the pod's name unless its spec sets
    `hostname`."""
    return os.environ.get(POD_NAME_ENV) or socket.gethostname()


def fits_64_bits(value: int) -> bool:
    """Whether an engine's hash fits an event's 64-bit block hash (signed or unsigned)."""
    return -(1 << 63) <= value < 1 << 64
