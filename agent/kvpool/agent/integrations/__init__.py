"""Inference-engine integrations: kvpool as a storage backend of LMCache and SGLang.

- `kvpool.agent.integrations.lmcache.KVPoolConnector`: an LMCache remote
  storage plugin (the path vLLM takes through LMCache).
- `kvpool.agent.integrations.sglang.KVPoolHiCacheStorage`: an SGLang HiCache
  storage backend.

Each module imports its engine, so import only the one the engine loads; the
rest of kvpool never imports them. Both move whole batches of chunks in one or
two round trips, zero-copy, through `KVPoolClient.get_many_into` and
`put_many`. Wiring them up is in docs/integrations.md.

Both read DRAM chunks without a lease by default, as the vLLM connector does
(`lease_free`: `lease_free_setting`).

Both tell the agent who the engine is, for KV events (docs/events.md): its pod (`engine_pod`),
its model, its tokens per chunk, and per chunk the hash its engine gives that chunk.
"""

import os
import socket
from typing import Any

from ..client import env_flag
from ..constants import ENV_LEASE_FREE

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


def flag_setting(value: Any, env: str, default: bool) -> bool:
    """A yes/no setting of an engine's extra config: a bool, or a string as the
    environment's (`1`/`true`/`yes`); unset (None), the environment variable `env`'s, else
    `default`."""
    if value is None:
        return env_flag(env, default)
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)


def lease_free_setting(value: Any) -> bool:
    """Whether an engine's reads take DRAM chunks without a lease (`KVPoolClient`'s
    `lease_free`): its extra config's `value`, else `$KVPOOL_LEASE_FREE`, else yes."""
    return flag_setting(value, ENV_LEASE_FREE, True)
