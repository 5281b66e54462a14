"""Inference-engine integrations: kvpool as a storage backend of LMCache and SGLang.

- `kvpool.agent.integrations.lmcache.KVPoolConnector`: an LMCache remote
  storage plugin (the path vLLM takes through LMCache).
- `kvpool.agent.integrations.sglang.KVPoolHiCacheStorage`: an SGLang HiCache
  storage backend.

Each module imports its engine, so import only the one the engine loads; the
rest of kvpool never imports them. Both move whole batches of chunks in one or
two round trips, zero-copy, through `KVPoolClient.get_many_into` and
`put_many`. Wiring them up is in docs/integrations.md.
"""
