"""kvpool as an SGLang HiCache storage backend (the L3 tier under SGLang's host cache).

SGLang loads it through its dynamic backend option::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.agent.integrations.sglang",
        "class_name": "KVPoolHiCacheStorage"}'

SGLang's cache controller hands the backend flat host-memory pages: `batch_set`
with the pages to store, `batch_get` with the tensors to fill, `batch_exists`
to learn how many leading pages are stored. Pages are copied between those
tensors and the agent's arena directly; a batch costs one round trip to read
(none for DRAM pages the agent's lookup index describes: they are read without a lease,
extra config `lease_free` or `$KVPOOL_LEASE_FREE`, default true) and two to write. The
page's dtype and shape travel as the chunk's metadata and a page that does not fit the
tensor it is read into is a miss.

Data path: SGLang hands the backend host-memory pages (its host pool); kvpool copies them
to and from the arena with XXH3 fused into the copy, the fastest path for host memory.
The GPU <-> host copy is SGLang's own; a GPU tensor path is not reachable through
`HiCacheStorage` (docs/integrations.md).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import msgspec
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.utils import hash_str_to_int64

from .. import protocol as p
from ..client import KVPoolClient
from ..constants import ENV_SOCKET
from ..keys import domain_key
from . import engine_pod, lease_free_setting

log = logging.getLogger(__name__)

KEY_SCHEME = "kvpool-sglang-xxh3-128-v1"
_KEY_DOMAIN = b"kvpool/sglang/v1\x00"
_META_SCHEME = "sglang/v1"


def namespace(config: HiCacheStorageConfig) -> str:
    """Which shard of a model's KV a rank holds: the part of a key SGLang's page hash lacks.

    MLA KV is the same on every tensor-parallel rank, so those ranks share
    pages; other models' ranks each hold their own heads.
    """
    parts = [config.model_name or ""]
    if not config.is_mla_model:
        parts.append(f"tp{config.tp_rank}of{config.tp_size}")
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}of{config.pp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    if getattr(config, "dcp_size", 1) > 1:
        parts.append(f"dcp{config.dcp_rank}of{config.dcp_size}")
    return "/".join(parts)


def pool_key(page_hash: str, space: str, tenant: str = "") -> bytes:
    """The kvpool key of an SGLang page hash in a model shard, for a tenant."""
    return domain_key(_KEY_DOMAIN, tenant, space, page_hash)


class PageMeta(msgspec.Struct, array_like=True, frozen=True):
    """The stored page's element type and shape, kept as the chunk's `meta`."""

    scheme: str
    dtype: str
    shape: list[int]


_meta_decoder = msgspec.msgpack.Decoder(PageMeta)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (no copy): CPU and contiguous only."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("HiCache pages must be contiguous CPU tensors")
    flat: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(flat)


class KVPoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang `HiCacheStorage` backed by the node's kvpool agent."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        extra = storage_config.extra_config or {}
        socket_path = extra.get("socket_path") or os.environ.get(ENV_SOCKET)
        page_tokens = storage_config.logical_page_size or 0
        self.client = KVPoolClient(socket_path, name="sglang", pod=engine_pod(),
                                   model=storage_config.model_name or "",
                                   block_size=page_tokens, chunk_tokens=page_tokens,
                                   lease_free=lease_free_setting(extra.get("lease_free")))
        self.space = namespace(storage_config)
        self.tenant = self.client.tenant
        # SGLang's prefetch and backup threads share the backend.
        self._lock = threading.Lock()

    def _keys(self, keys: list[str]) -> list[bytes]:
        return [pool_key(k, self.space, self.tenant) for k in keys]

    # -- reads

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Fill each target page from the pool; None where the page is missing."""
        if target_locations is None:
            raise ValueError("kvpool reads into SGLang's page tensors: pass target_locations")
        targets: list[torch.Tensor] = list(target_locations)

        def target(i: int, size: int, raw_meta: bytes) -> memoryview | None:
            page = targets[i]
            try:
                meta = _meta_decoder.decode(raw_meta)
            except msgspec.MsgspecError:
                return None
            fits = (meta.scheme == _META_SCHEME and meta.dtype == _dtype_name(page)
                    and size == page.numel() * page.element_size())
            return _bytes_of(page) if fits else None

        with self._lock:
            sizes = self.client.get_many_into(self._keys(keys), target)
        return [page if size else None for page, size in zip(targets, sizes, strict=True)]

    # -- writes

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store the pages; True when the pool holds every one of them afterwards."""
        if values is None:
            raise ValueError("kvpool stores SGLang's page tensors: pass values")
        pages = [v.contiguous() for v in values]
        metas = [msgspec.msgpack.encode(PageMeta(_META_SCHEME, _dtype_name(v), list(v.shape)))
                 for v in pages]
        # SGLang's own KV events publish a page as hash_str_to_int64 of its page hash, the
        # key it gives storage: the same block hash, so routers see one page, not two.
        blocks = [p.EngineBlocks([hash_str_to_int64(k)]) for k in keys]
        with self._lock:
            results = self.client.put_many(self._keys(keys), [_bytes_of(v) for v in pages], metas,
                                           blocks=blocks)
        refused = [r for r in results if isinstance(r, p.ProtocolError)]
        if refused:
            log.warning("kvpool refused %d of %d pages: %s", len(refused), len(keys), refused[0])
        return not refused

    # -- lookups

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages the pool holds: one LOOKUP."""
        with self._lock:
            return self.client.lookup(self._keys(keys))

    def close(self) -> None:
        """Called by SGLang when the storage backend is detached."""
        with self._lock:
            self.client.close()
