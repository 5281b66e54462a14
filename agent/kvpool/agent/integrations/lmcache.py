"""kvpool as an LMCache remote storage plugin (what vLLM reaches through LMCache).

LMCache loads it from its configuration::

    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.agent.integrations.lmcache
      remote_storage_plugin.kvpool.class_name: KVPoolConnector

and builds one `KVPoolConnector` per worker. The connector talks to the node's
agent at `KVPOOL_SOCKET` (or `extra_config["kvpool.socket"]`) in zero-copy
mode: a get allocates LMCache's own memory object and copies the chunk from
the arena into it (a DRAM chunk without a lease where the agent's lookup index says where
it is: `kvpool.lease_free`, or `$KVPOOL_LEASE_FREE`, default true); a put copies the memory
object's bytes into the arena.
The memory object's shapes, dtypes and format travel with the chunk as its
metadata (`ChunkMeta`), so partial chunks and any KV layout come back as they
went in. A batch of N chunks costs one round trip to read and two to write.

Data path: LMCache hands remote connectors memory objects in its own CPU buffer; kvpool
copies them to and from the arena with XXH3 fused into the copy, the fastest path for
host memory. The GPU <-> CPU-buffer copy is LMCache's own (docs/integrations.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from typing import Any

import msgspec
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from .. import protocol as p
from ..client import KVPoolClient
from ..constants import ENV_SOCKET
from ..keys import domain_key
from . import engine_pod, fits_64_bits, lease_free_setting

log = logging.getLogger(__name__)

KEY_SCHEME = "kvpool-lmcache-xxh3-128-v1"
_KEY_DOMAIN = b"kvpool/lmcache/v1\x00"
_META_SCHEME = "lmcache/v1"


def pool_key(key: CacheEngineKey, tenant: str = "") -> bytes:
    """The kvpool key of an LMCache chunk key: deterministic across processes and nodes.

    `CacheEngineKey.to_string()` names model, world size, worker, chunk hash
    and dtype (and layer and tags when present); the tenant is mixed in so
    tenants never read each other's chunks, as with `kvpool.agent.keys`.
    """
    return domain_key(_KEY_DOMAIN, tenant, str(key.to_string()))


class ChunkMeta(msgspec.Struct, array_like=True, frozen=True):
    """What LMCache needs to rebuild a memory object, stored as the chunk's `meta`."""

    scheme: str
    fmt: str
    """`MemoryFormat` member name, e.g. "KV_2LTD"."""
    shapes: list[list[int]]
    dtypes: list[str]
    """torch dtype names without the "torch." prefix, e.g. "bfloat16"."""

    def torch_dtypes(self) -> list[torch.dtype]:
        out = []
        for name in self.dtypes:
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {name!r}")
            out.append(dtype)
        return out

    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize
                   for shape, dtype in zip(self.shapes, self.torch_dtypes(), strict=True))


_meta_decoder = msgspec.msgpack.Decoder(ChunkMeta)


def encode_meta(obj: MemoryObj) -> bytes:
    meta = ChunkMeta(
        scheme=_META_SCHEME,
        fmt=obj.get_memory_format().name,
        shapes=[list(s) for s in obj.get_shapes()],
        dtypes=[str(d).removeprefix("torch.") for d in obj.get_dtypes()],
    )
    return msgspec.msgpack.encode(meta)


def decode_meta(raw: bytes, size: int) -> ChunkMeta | None:
    """The chunk's metadata if it describes exactly `size` bytes, else None (a miss)."""
    try:
        meta = _meta_decoder.decode(raw)
        if meta.scheme != _META_SCHEME or meta.nbytes() != size:
            return None
        MemoryFormat[meta.fmt]
    except (msgspec.MsgspecError, ValueError, KeyError, TypeError):
        return None
    return meta


class PutRefused(RuntimeError):
    """The agent refused some chunks of a put (no space, too large); LMCache counts a failure."""


class KVPoolConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache `RemoteConnector` backed by the node's kvpool agent."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any = None, plugin_name: str | None = None) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        extra = (config.extra_config if config is not None else None) or {}
        socket_path = extra.get("kvpool.socket") or os.environ.get(ENV_SOCKET)
        chunk_tokens = int(getattr(local_cpu_backend.config, "chunk_size", 0) or 0)
        # reconnect_timeout 0: with the agent gone a call fails at once (one reconnect
        # attempt), and LMCache recomputes; the default 10 s of retries held each request's
        # lookup until LMCache's own lookup timeout, for every request until LMCache's
        # health check (every `ping_interval`, 30 s) put it in its degraded mode.
        self.client = KVPoolClient(socket_path, name="lmcache", pod=engine_pod(),
                                   model=getattr(local_cpu_backend.metadata, "model_name", "")
                                   or "", block_size=chunk_tokens, chunk_tokens=chunk_tokens,
                                   reconnect_timeout=0.0,
                                   lease_free=lease_free_setting(extra.get("kvpool.lease_free")))
        self.tenant = self.client.tenant
        # LMCache calls from its event-loop thread (get/put) and from the
        # engine's thread (exists_sync, batched_contains); one connection, one lock.
        self._lock = threading.Lock()
        assert self.client.hello is not None
        log.info("kvpool connector: pool %s at %s", self.client.hello.pool,
                 self.client.socket_path)

    def _keys(self, keys: list[CacheEngineKey]) -> list[bytes]:
        return [pool_key(k, self.tenant) for k in keys]

    # -- lookups

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    async def exists(self, key: CacheEngineKey) -> bool:
        return self.exists_sync(key)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many leading keys the pool holds: one LOOKUP."""
        with self._lock:
            return self.client.lookup(self._keys(keys))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        # LMCache's lookup pin holds a chunk until retrieve; kvpool's PIN is
        # an operator's durable pin, so it is not used for this.
        return self.batched_contains(keys)

    # -- reads

    def support_batched_get(self) -> bool:
        return True

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Each chunk in a memory object of LMCache's, or None. A chunk read but failing its
        checksum is a miss, and is deleted from the pool: LMCache's lookup would otherwise
        keep finding it, vLLM recompute its blocks on every request (or, under vLLM's
        default `kv_load_failure_policy`, fail them), and LMCache never store it again."""
        objs: list[MemoryObj | None] = [None] * len(keys)
        copied = [False] * len(keys)

        def target(i: int, size: int, raw_meta: bytes) -> Any:
            obj = objs[i]
            if obj is not None:
                # Asked again: a lease-free copy failed its checks, and the chunk is read
                # under a lease into the same object (it is the same chunk: its size and
                # metadata, which the checksum covers, are those the object was made for).
                return obj.byte_array if copied[i] and obj.get_size() == size else None
            meta = decode_meta(raw_meta, size)
            if meta is None:
                log.warning("kvpool chunk for %s has unusable metadata; a miss", keys[i])
                return None
            # busy_loop=False: under memory pressure this is a miss, not a wait
            # with the agent's read leases held.
            obj = self.local_cpu_backend.allocate(
                [torch.Size(s) for s in meta.shapes], meta.torch_dtypes(),
                MemoryFormat[meta.fmt], busy_loop=False)
            if obj is None:
                return None
            objs[i] = obj
            if obj.get_size() != size:
                return None
            copied[i] = True
            return obj.byte_array

        try:
            with self._lock:
                sizes = self.client.get_many_into(self._keys(keys), target)
        except BaseException:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
            raise
        corrupt = [keys[i] for i, size in enumerate(sizes) if copied[i] and not size]
        for i, size in enumerate(sizes):
            obj = objs[i]
            if size == 0 and obj is not None:
                obj.ref_count_down()
                objs[i] = None
        if corrupt:
            with self._lock:
                deleted = sum(self.client.delete(k) for k in self._keys(corrupt))
            log.warning("kvpool: %d chunk(s) failed their checksum (a miss; LMCache "
                        "recomputes them) and %d were deleted from the pool, first %s",
                        len(corrupt), deleted, corrupt[0])
        return objs

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading run of hits (LMCache loads prefixes only)."""
        objs = await self.batched_get(keys)
        prefix: list[MemoryObj] = []
        for obj in objs:
            if obj is None:
                break
            prefix.append(obj)
        for obj in objs[len(prefix):]:
            if obj is not None:
                obj.ref_count_down()
        return prefix

    # -- writes

    def support_batched_put(self) -> bool:
        return True

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Store the memory objects' bytes; LMCache drops its references afterwards."""
        data = [obj.byte_array for obj in memory_objs]
        metas = [encode_meta(obj) for obj in memory_objs]
        # LMCache names a chunk by its chunk hash (one hash per chunk of chunk_size tokens):
        # KV events carry it as the chunk's block hash where it fits one.
        blocks = [p.EngineBlocks([k.chunk_hash]) if fits_64_bits(k.chunk_hash) else None
                  for k in keys]
        with self._lock:
            results = self.client.put_many(self._keys(keys), data, metas, blocks=blocks)
        refused = [(k, r) for k, r in zip(keys, results, strict=True)
                   if isinstance(r, p.ProtocolError)]
        if refused:
            raise PutRefused(f"kvpool refused {len(refused)} of {len(keys)} chunks, "
                             f"first {refused[0][0]}: {refused[0][1]}")

    def remove_sync(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return self.client.delete(pool_key(key, self.tenant))

    # -- the rest of the contract

    async def list(self) -> list[str]:
        raise NotImplementedError(
            "kvpool stores one-way hashes of LMCache keys and cannot list them")

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the agent answers (LMCache's health check)."""
        with self._lock:
            self.client.stats()
        return 0

    async def close(self) -> None:
        with self._lock:
            self.client.close()

    def __repr__(self) -> str:
        return f"<KVPoolConnector {self.client.socket_path}>"
