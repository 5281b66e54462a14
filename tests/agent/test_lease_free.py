"""Reads of DRAM chunks without a lease: the agent's side. The lookup table says where a
single-extent chunk lies, and the agent retires a chunk's slot before its pages can be
freed (docs/protocol.md, "Reads without a lease")."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from kvpool.agent.arena import Arena, ExtentAllocator
from kvpool.agent.config import AgentConfig, TierPolicy
from kvpool.agent.lookupindex import IndexReader, SharedIndex
from kvpool.agent.metrics import AgentMetrics
from kvpool.agent.protocol import Extents, checksum
from kvpool.agent.store import ChunkStore
from kvpool.agent.tiers.dram import DramTier
from kvpool.agent.tiers.nvme import NvmeTier

# ------------------------------------------------- the agent retires a slot before freeing

STORE_CHUNK = 128 << 10


def test_a_published_slot_is_retired_before_its_pages_are_freed_on_every_path(
        tmp_path: Path) -> None:
    """A store on a small arena over an NVMe tier, published in a lookup table, driven
    through every way DRAM pages are freed: eviction to NVMe (demotion: detach, then the
    pages once the file landed), eviction where NVMe refuses, DELETE (now, or at the last
    RELEASE of a chunk read meanwhile), a transient promotion's RELEASE, aborted writes and
    duplicate commits, table rebuilds. Each time pages are freed, no LIVE slot of the table
    may still say they hold its chunk: a lease-free reader would copy another chunk's
    bytes and find its slot unchanged."""
    published = SharedIndex(16, lower_tiers=True)  # 16 slots: rebuilt often
    index = IndexReader(published.fd)
    keys = [bytes([i]) * 16 for i in range(12)]
    frees = [0]

    def checked_free(extents: Extents) -> None:
        for key in keys:
            got = index.locate(key)
            if got is None:
                continue
            offset, size = got[2][0], got[2][1]
            for start, n in extents:
                assert start + n <= offset or offset + size <= start, \
                    f"pages of {key.hex()} freed while its slot is LIVE"
        frees[0] += 1
        free_pages[0](extents)
    free_pages: list[Any] = []

    def data(key: bytes) -> bytes:
        return (key * (STORE_CHUNK // 16))[:STORE_CHUNK]

    async def drive() -> None:
        arena = Arena(tmp_path / "arena", 1 << 20, lock=False)
        policy = TierPolicy.model_validate({"prefetch": {"enabled": False},
                                            "tiers": {"dram": {"eviction": "lru"}}})
        store = ChunkStore(AgentConfig(socket_path=tmp_path / "agent.sock"),
                           DramTier(arena, published=published),
                           NvmeTier(tmp_path / "nvme", 2 << 20), AgentMetrics("test"), policy)
        store.dram.alloc.free = checked_free  # type: ignore[method-assign]
        free_pages.append(ExtentAllocator.free.__get__(store.dram.alloc))
        rng = random.Random(7)
        for _ in range(300):
            key = rng.choice(keys)
            op = rng.randrange(6)
            try:
                if op <= 1:
                    await store.put(key, data(key), checksum(data(key), b""), b"", "")
                elif op == 2:
                    store.delete(key)
                elif op == 3:
                    granted = await store.acquire(key, 1)
                    if rng.random() < 0.5:
                        store.delete(key)  # hidden, freed at the RELEASE
                    store.release(granted.lease, 1)
                elif op == 4:
                    lease = await store.alloc(key, STORE_CHUNK, b"", "", 2)
                    if lease is not None:
                        if rng.random() < 0.5:
                            store.abort(lease.lease, owner=2)
                        else:
                            store.commit(lease.lease, checksum(data(key), b""), 2)
                else:
                    await store.get(key)  # promotes from NVMe
            except Exception as e:  # NOT_FOUND, NO_SPACE: the store's answers, not failures
                if type(e).__name__ != "OpError":
                    raise
            await asyncio.sleep(0)
        while store.nvme is not None and (store.nvme.writes.running or len(store.nvme.writes)):
            await asyncio.sleep(0.01)
    try:
        asyncio.run(drive())
        assert frees[0] > 50, "pages were freed on the way"
    finally:
        index.close()
        published.close()


def test_a_chunk_in_several_extents_is_in_the_table_but_read_under_a_lease(
        tmp_path: Path) -> None:
    published = SharedIndex(16, lower_tiers=False)
    index = IndexReader(published.fd)
    try:
        tier = DramTier(Arena(tmp_path / "arena", 1 << 20, lock=False), published=published)
        spread, whole = b"\xee" * 16, b"\xef" * 16
        tier.insert(spread, [(0, 4096), (8192, 4096)], 8192, 1, b"m", "")
        tier.insert(whole, [(16384, 4096)], 4000, 2, b"m", "", checksum_kind=1)
        assert index.lookup([spread, whole]) == 2
        assert index.locate(spread) is None  # "ask the socket"
        located = index.locate(whole)
        assert located is not None
        assert located[2][:4] == (16384, 4000, 2, 1)
        tier.remove(whole)
        assert index.locate(whole) is None
    finally:
        index.close()
        published.close()
