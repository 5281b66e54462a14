"""The connector's settings, read once from vLLM's config and the pod's environment.

`kv_connector_extra_config` may override what the environment gives (the webhook sets
KVPOOL_SOCKET, KVPOOL_TENANT and KVPOOL_CHUNK_TOKENS in an annotated pod):

| key | default | what |
|---|---|---|
| `socket` | `$KVPOOL_SOCKET` | the agent's socket |
| `chunk_tokens` | `$KVPOOL_CHUNK_TOKENS`, else 256 | tokens per chunk (whole vLLM blocks) |
| `model` | vLLM's `model` | the model name keys are made of (same on every engine sharing chunks) |
| `timeout` | 5 | seconds a socket call may wait before the agent counts as stalled |
| `lookup_wait` | 0.05 (`kv_consumer`: 0.5) | seconds to wait for a lookup the index cannot answer |
| `lease_free` | `$KVPOOL_LEASE_FREE`, else true | loads read DRAM chunks with no ACQUIRE |

(`lease_free`: where the agent's lookup index allows; docs/protocol.md, "Reads without a
lease".)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ...constants import ENV_SOCKET, ENV_TENANT
from .. import lease_free_setting
from .layout import Layout, check_chunk_tokens

ENV_CHUNK_TOKENS = "KVPOOL_CHUNK_TOKENS"
DEFAULT_CHUNK_TOKENS = 256
LOOKUP_WAIT = 0.05
CONSUMER_LOOKUP_WAIT = 0.5
"""A decode engine (`kv_consumer`) is there to load what a prefill engine stored, and its
lookups go to the socket (chunks on a peer node are not in the shared-memory index): a
late answer costs it the whole prompt's prefill, so it waits longer for one."""


class UnsupportedModel(ValueError):
    """A KV cache this connector does not store (not one group of full attention)."""


@dataclass(frozen=True, slots=True)
class Settings:
    socket: str | None
    layout: Layout
    loads: bool
    """kv_consumer or kv_both: look requests up in the pool and load what it holds."""
    saves: bool
    """kv_producer or kv_both: store each request's computed whole chunks."""
    timeout: float
    lookup_wait: float
    lease_free: bool = True
    """Loads read DRAM chunks straight from the arena where the lookup index allows."""


def _extra(vllm_config: Any, key: str, default: Any) -> Any:
    return vllm_config.kv_transfer_config.get_from_extra_config(key, default)


def settings(vllm_config: Any, kv_cache_config: Any) -> Settings:
    """The settings of one engine; one clear error for a setup the pool cannot serve."""
    cache = vllm_config.cache_config
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if spec is None or type(spec).__name__ != "FullAttentionSpec" \
            or getattr(spec, "sliding_window", None) is not None:
        raise UnsupportedModel(
            "kvpool's vLLM connector stores models whose KV cache is one group of full "
            f"attention; this one has {[type(g.kv_cache_spec).__name__ for g in groups]}")
    block_size = int(spec.block_size)
    chunk_tokens = check_chunk_tokens(
        int(_extra(vllm_config, "chunk_tokens", 0)
            or os.environ.get(ENV_CHUNK_TOKENS) or DEFAULT_CHUNK_TOKENS), block_size)
    dtype = str(spec.dtype).removeprefix("torch.")
    if cache.cache_dtype not in ("auto", dtype):
        dtype = f"{dtype}/{cache.cache_dtype}"
    parallel = vllm_config.parallel_config
    layout = Layout(
        model=str(_extra(vllm_config, "model", "") or vllm_config.model_config.model),
        dtype=dtype, layers=vllm_config.model_config.get_total_num_hidden_layers(),
        kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size),
        head_size_v=int(getattr(spec, "head_size_v", None) or spec.head_size),
        block_size=block_size, chunk_tokens=chunk_tokens,
        tp_size=int(parallel.tensor_parallel_size), pp_size=int(parallel.pipeline_parallel_size),
        tenant=str(_extra(vllm_config, "tenant", "") or os.environ.get(ENV_TENANT, "")))
    transfer = vllm_config.kv_transfer_config
    loads, saves = bool(transfer.is_kv_consumer), bool(transfer.is_kv_producer)
    return Settings(
        socket=_extra(vllm_config, "socket", None) or os.environ.get(ENV_SOCKET),
        layout=layout, loads=loads, saves=saves,
        timeout=float(_extra(vllm_config, "timeout", 5.0)),
        lookup_wait=float(_extra(vllm_config, "lookup_wait",
                                 CONSUMER_LOOKUP_WAIT if loads and not saves else LOOKUP_WAIT)),
        lease_free=lease_free_setting(_extra(vllm_config, "lease_free", None)))
