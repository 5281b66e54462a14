"""Reads of DRAM chunks without a lease: the client copies what the lookup index describes,
checks the copy against the chunk's checksum and the index's slot after it, and asks the
agent (ACQUIRE) only for what fails (docs/protocol.md, "Reads without a lease")."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.agent import leasefree
from kvpool.agent.arena import Arena, ExtentAllocator
from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import AgentConfig, TierPolicy
from kvpool.agent.lookupindex import IndexReader, SharedIndex
from kvpool.agent.metrics import AgentMetrics
from kvpool.agent.protocol import Extents, checksum
from kvpool.agent.store import ChunkStore
from kvpool.agent.tiers.dram import DramTier
from kvpool.agent.tiers.nvme import NvmeTier
from kvpool.agent.transport import ZeroCopyTransport
from kvpool.bench.local import LocalAgent

from .conftest import scrape

CHUNK = 64 << 10
META = b"layout-7"
ACQUIRES = 'kvpool_ops_total{op="acquire",pool="default",result="ok"}'
READS = 'kvpool_ops_total{op="read",pool="default",result="ok"}'
NOT_FOUND = 'kvpool_ops_total{op="acquire",pool="default",result="not_found"}'
READ_BYTES = 'kvpool_tier_read_bytes_total{pool="default",tier="dram"}'


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def _index(client: KVPoolClient) -> IndexReader:
    t = client._transport
    assert isinstance(t, ZeroCopyTransport) and t.index is not None
    return t.index


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    """One agent for the tests that need no arena of their own (each its own keys): an
    agent start is most of what a test here costs."""
    with LocalAgent("--no-lock", workdir=tmp_path_factory.mktemp("leasefree"),
                    dram="32Mi") as a:
        yield a


@pytest.fixture
def reader(shared: LocalAgent) -> Iterator[KVPoolClient]:
    with KVPoolClient(shared.socket_path, lease_free=True) as c:
        yield c


def test_a_dram_chunk_is_read_without_a_lease_and_the_agent_counts_the_read(
        shared: LocalAgent, reader: KVPoolClient) -> None:
    agent = shared
    keys = [_key(i) for i in range(5)]
    data = [os.urandom(CHUNK) for _ in keys]
    assert reader.put_many(keys, data, [META] * len(keys)) == [True] * len(keys)
    before = scrape(agent)
    outs = [bytearray(CHUNK) for _ in keys]
    seen: list[tuple[int, int, bytes]] = []

    def target(i: int, size: int, meta: bytes) -> bytearray:
        seen.append((i, size, meta))
        return outs[i]
    assert reader.get_many_into(keys[:4], target) == [CHUNK] * 4
    assert [bytes(o) for o in outs[:4]] == data[:4]
    assert sorted(seen) == [(i, CHUNK, META) for i in range(4)]  # the chunk's own metadata
    assert reader.get_into(keys[4], outs[4]) == CHUNK and bytes(outs[4]) == data[4]
    assert reader.reads_without_lease == 5
    reader.stats()  # takes the told READs along first
    after = scrape(agent)
    assert after[ACQUIRES] == before[ACQUIRES], "no ACQUIRE went to the agent"
    assert after[READS] == before.get(READS, 0) + 2  # one told READ per call
    assert after[READ_BYTES] == before[READ_BYTES] + 5 * CHUNK  # counted as reads


def test_metadata_first_seen_through_a_lease_makes_the_next_read_lease_free(
        shared: LocalAgent, reader: KVPoolClient) -> None:
    """A client that never put a chunk of this metadata learns it from the agent's first
    description (ACQUIRE); from then on the table's hash of it is enough."""
    agent = shared
    keys = [_key(10 + i) for i in range(3)]
    data = [os.urandom(CHUNK) for _ in keys]
    reader.put_many(keys, data, [META + b"-other"] * len(keys))
    with KVPoolClient(agent.socket_path, lease_free=True) as fresh:
        out = bytearray(CHUNK)
        before = scrape(agent)[ACQUIRES]
        assert fresh.get_into(keys[0], out) == CHUNK and bytes(out) == data[0]
        assert fresh.reads_without_lease == 0 and scrape(agent)[ACQUIRES] == before + 1
        outs = [bytearray(CHUNK) for _ in keys]
        assert fresh.get_many_into(keys, lambda i, n, m: outs[i]) == [CHUNK] * 3
        assert [bytes(o) for o in outs] == data
        assert fresh.reads_without_lease == 3 and scrape(agent)[ACQUIRES] == before + 1


@pytest.mark.parametrize("reuse", [False, True], ids=["deleted", "deleted-and-reused"])
def test_a_chunk_that_leaves_between_the_table_read_and_the_copy_is_never_returned(
        agent: LocalAgent, client: KVPoolClient, reuse: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another client deletes the chunk (and stores another chunk in its pages) after the
    reader found its slot and before it copies. Deleted only, the pages still hold its
    bytes, which pass the checksum: the slot's changed seq alone fails the read. Reused,
    the copy holds the other chunk's bytes. Either way the read goes to the agent, which
    has no such chunk: a miss, never the other chunk's bytes."""
    before_key, key, after_key, other = _key(20), _key(21), _key(22), _key(23)
    data = {k: os.urandom(CHUNK) for k in (before_key, key, after_key, other)}
    # Neighbours on both sides: the chunk's pages stay one free run of its size when it
    # goes, which the best-fit allocator gives the next chunk of that size.
    # An agent of its own (`agent`, not `shared`): its arena's free runs are known.
    reader = KVPoolClient(agent.socket_path, lease_free=True)
    for k in (before_key, key, after_key):
        assert reader.put(k, data[k], META)
    real = leasefree.locate
    raced: list[tuple[int, int]] = []

    def racing(index: IndexReader, k: bytes) -> Any:
        got = real(index, k)
        if k == key and not raced:
            assert got is not None, "the chunk is in the table, in one extent"
            assert client.delete(key)
            if reuse:
                assert client.put(other, data[other], META)
                moved = index.locate(other)
                assert moved is not None and moved[2][0] == got[2][0], \
                    "the other chunk took the deleted chunk's pages"
            raced.append((got[2][0], got[2][1]))
        return got
    monkeypatch.setattr(leasefree, "locate", racing)
    before = scrape(agent)
    out = bytearray(CHUNK)
    assert reader.get_many_into([key], lambda i, n, m: out) == [0]
    assert raced, "the race ran"
    assert reader.reads_without_lease == 0
    if reuse:
        assert bytes(out) == data[other]  # the copy read the other chunk's bytes...
    # ...and the read went on to the agent, whose ACQUIRE found no such chunk.
    after = scrape(agent)
    assert after[NOT_FOUND] == before[NOT_FOUND] + 1
    assert after[ACQUIRES] == before[ACQUIRES]
    reader.close()


def test_corrupted_arena_bytes_fail_the_lease_free_read_and_are_a_miss(
        shared: LocalAgent, reader: KVPoolClient) -> None:
    agent = shared
    key = _key(30)
    data = os.urandom(CHUNK)
    assert reader.put(key, data, META)
    located = _index(reader).locate(key)
    assert located is not None
    offset = located[2][0]
    arena = reader._arena
    assert arena is not None
    arena[offset + 100] ^= 0xFF  # what a client of the tenant may do to the shared arena
    acquires = scrape(agent)[ACQUIRES]
    out = bytearray(CHUNK)
    assert reader.get_many_into([key], lambda i, n, m: out) == [0]
    assert reader.get_into(key, out) == 0
    assert reader.reads_without_lease == 0
    # Both went on to a leased read, whose own check failed too: a miss, as ever.
    assert scrape(agent)[ACQUIRES] == acquires + 2
    arena[offset + 100] ^= 0xFF
    assert reader.get_into(key, out) == CHUNK and bytes(out) == data
    assert reader.reads_without_lease == 1


def test_a_tensor_destination_is_read_under_a_lease_and_asked_for_once(
        shared: LocalAgent, reader: KVPoolClient) -> None:
    """A destination that is not host memory the client copies into (a tensor: on a GPU,
    its copy completes after the call) keeps its lease; `target` is not asked again."""
    torch = pytest.importorskip("torch")
    keys = [_key(50 + i) for i in range(3)]
    data = [os.urandom(CHUNK) for _ in keys]
    reader.put_many(keys, data, [META] * len(keys))
    outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in keys]
    asked: list[int] = []

    def target(i: int, size: int, meta: bytes) -> Any:
        asked.append(i)
        return outs[i] if i else bytearray(CHUNK)  # the first into a buffer, lease-free
    acquires = scrape(shared)[ACQUIRES]
    assert reader.get_many_into(keys, target) == [CHUNK] * 3
    assert sorted(asked) == [0, 1, 2]
    assert [bytes(o.numpy()) for o in outs[1:]] == data[1:]
    assert reader.reads_without_lease == 1
    assert scrape(shared)[ACQUIRES] == acquires + 2


def test_lease_free_reads_are_off_with_the_flag(shared: LocalAgent) -> None:
    agent = shared
    key = _key(40)
    with KVPoolClient(agent.socket_path, lease_free=False) as c:
        c.put(key, b"x" * CHUNK, META)
        acquires = scrape(agent)[ACQUIRES]
        assert c.get_into(key, bytearray(CHUNK)) == CHUNK
        assert c.reads_without_lease == 0 and scrape(agent)[ACQUIRES] == acquires + 1


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
