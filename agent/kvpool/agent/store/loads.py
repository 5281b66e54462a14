"""Reads of chunks below DRAM that a client waits for (ACQUIRE/GET, prefetch).

One read per key however many ask (`loading`); NVMe first, then G4. An NVMe read
also takes the chunks that follow the key in the LOOKUP that found it, when NVMe
holds them too (`ReadAhead`). The reads run in a pool of their own, never queued
behind a burst of background writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from ..config import TierName
from ..metrics import AgentMetrics
from ..tiers.base import ChunkRecord
from .demotion import Demotion
from .readahead import ReadAhead
from .sharedlink import SharedLink
from .tierreads import read_nvme, read_shared

READ_THREADS = 4
"""Threads that read chunks a client waits for."""

Loaded = tuple[ChunkRecord, TierName, int]
"""A chunk read from below DRAM, the tier it came from, and its hits there."""


class Loads:
    def __init__(self, nvme: Demotion | None, shared: SharedLink | None, metrics: AgentMetrics,
                 *, position: Callable[[bytes], tuple[int, int]],
                 in_dram: Callable[[bytes], bool]) -> None:
        self._nvme = nvme
        self._shared = shared
        self.m = metrics
        self._position = position
        """(LOOKUP seq, depth) a key was last looked up at; (0, 0) when none remembers it."""
        self._in_dram = in_dram
        self.ahead = ReadAhead()
        self.loading: dict[bytes, asyncio.Future[Loaded | None]] = {}
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvpool-read")

    async def load(self, key: bytes) -> Loaded | None:
        """A verified chunk from below DRAM, the tier it came from and its hits there.
        A read-ahead copy is used only while the NVMe index still holds the entry it was
        read under (so never after a delete, a rewrite or an eviction)."""
        nvme = self._nvme
        if nvme is not None:
            rec = nvme.copy_of(key)
            if rec is not None:
                return rec, "nvme", 1
        pending = self.loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        if nvme is not None:
            ahead = self.ahead.take(key, nvme.nvme.entry)
            if ahead is not None:
                return ahead[0], "nvme", ahead[1].hits
            if nvme.entry(key) is not None:
                return await self._load_nvme(nvme, [key, *self._following(nvme, key)])
        shared = self._shared
        if shared is None or not shared.healthy() or shared.deleted(key):
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Loaded | None] = loop.create_future()
        self.loading[key] = fut
        try:
            got, gone = await loop.run_in_executor(self.pool, read_shared, shared.tier, key,
                                                   self.m)
            result: Loaded | None = None
            if got is not None:
                result = (got, "shared", 1)
                shared.found(key)
            elif gone:
                shared.lost(key)
            fut.set_result(result)
            return result
        except BaseException as e:
            _fail([fut], e)
            raise
        finally:
            if self.loading.get(key) is fut:
                del self.loading[key]

    async def _load_nvme(self, nvme: Demotion, keys: list[bytes]) -> Loaded | None:
        """Read `keys` from NVMe in one worker-thread call; the first one's result, the
        others kept for read-ahead (and given to whoever waits for them meanwhile)."""
        loop = asyncio.get_running_loop()
        entries = [nvme.entry(k) for k in keys]
        futs: list[asyncio.Future[Loaded | None]] = []
        for k in keys:
            fut: asyncio.Future[Loaded | None] = loop.create_future()
            self.loading[k] = fut
            futs.append(fut)
        try:
            got = await loop.run_in_executor(self.pool, self.read_nvme_many, keys)
            first: Loaded | None = None
            for i, (k, rec, read_under, fut) in enumerate(
                    zip(keys, got, entries, futs, strict=True)):
                result: Loaded | None = None
                if rec is not None:
                    entry = nvme.entry(k)
                    result = (rec, "nvme", entry.hits if entry is not None else 1)
                    if i and read_under is not None and entry == read_under:
                        self.ahead.keep(k, rec, read_under)
                elif nvme.entry(k) is None:
                    # Quarantined or gone: out of the order too, and its slot handed back.
                    # Not so when the key was written to NVMe again meanwhile: the new
                    # entry has the old one's slot and place in the order (`NvmeIndex.put`).
                    nvme.queue.discard(k)
                    nvme.nvme.reap(k)
                    nvme.observer.removed("nvme", k)
                fut.set_result(result)
                if i == 0:
                    first = result
            return first
        except BaseException as e:
            _fail(futs, e)
            raise
        finally:
            for k, fut in zip(keys, futs, strict=True):
                if self.loading.get(k) is fut:
                    del self.loading[k]

    def _following(self, nvme: Demotion, key: bytes) -> list[bytes]:
        """The keys after `key` in its LOOKUP that NVMe holds and nobody is reading yet."""
        seq, depth = self._position(key)
        return self.ahead.following(
            key, seq, depth, nvme.nvme.entry,
            busy=lambda k: k in self.loading or k in nvme.inflight or self._in_dram(k))

    def forget(self, key: bytes) -> None:
        """A deleted key: a read of it already under way serves only those who asked
        before (and they are told it was deleted: `ChunkStore` checks); later readers
        start afresh. Its read-ahead copy goes."""
        self.loading.pop(key, None)
        self.ahead.drop(key)

    def read_nvme_many(self, keys: list[bytes]) -> list[ChunkRecord | None]:
        """Read chunks from NVMe (a worker thread), each verified; a failure is a miss."""
        assert self._nvme is not None
        return [read_nvme(self._nvme.nvme, k, self.m) for k in keys]

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _fail(futs: Iterable[asyncio.Future[Loaded | None]], e: BaseException) -> None:
    """A read failed: whoever waits for one of its chunks gets `e`."""
    for fut in futs:
        if not fut.done():
            fut.set_exception(e)
            fut.exception()  # retrieved: waiting readers get it, nobody else must
