"""Reads of DRAM chunks without a lease: the client copies what the lookup index describes,
checks the copy against the chunk's checksum and the index's slot after it, and asks the
agent (ACQUIRE) only for what fails (docs/protocol.md, "Reads without a lease")."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvpool.agent import leasefree, leasekernel
from kvpool.agent.arena import Arena, ExtentAllocator
from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import AgentConfig, TierPolicy
from kvpool.agent.hostcopy import BlockTargets, HostBlocks, HostTargets
from kvpool.agent.lookupindex import IndexReader, SharedIndex
from kvpool.agent.metrics import AgentMetrics
from kvpool.agent.protocol import Extents, checksum
from kvpool.agent.store import ChunkStore
from kvpool.agent.tiers.dram import DramTier
from kvpool.agent.tiers.nvme import NvmeTier
from kvpool.agent.transport import ZeroCopyTransport
from kvpool.bench.local import LocalAgent

from .conftest import module_agent, scrape, wait_until

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


shared = module_agent("shared")
"""For the tests that need no arena of their own."""


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


def test_reads_without_a_lease_just_before_a_close_are_told_to_the_agent(
        shared: LocalAgent) -> None:
    """A client that reads without a lease and closes, with no call after (the READ goes
    with the next write, and there is none): the close writes it first, so the agent
    counts the reads (the eviction order, the read bytes, a hand-off's pin, all as an
    ACQUIRE's)."""
    keys = [_key(i) for i in range(300, 303)]
    data = [os.urandom(CHUNK) for _ in keys]
    with KVPoolClient(shared.socket_path, lease_free=True) as c:
        assert c.put_many(keys, data, [META] * len(keys)) == [True] * len(keys)
        c.stats()
        before = scrape(shared)
        outs = [bytearray(CHUNK) for _ in keys]
        assert c.get_many_into(keys, lambda i, n, meta: outs[i]) == [CHUNK] * len(keys)
        assert c.reads_without_lease == len(keys)
    wait_until(lambda: scrape(shared)[READ_BYTES] == before[READ_BYTES] + len(keys) * CHUNK,
               "the reads told as the client closed")
    assert scrape(shared)[READS] == before.get(READS, 0) + 1
    assert scrape(shared)[ACQUIRES] == before[ACQUIRES]


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


# ------------------------------------ destinations known before the read: compiled calls


_fresh = itertools.count(1000)
"""Key numbers for the tests below, each its own (the `shared` agent keeps what they store)."""


def _wsum_put(client: KVPoolClient, keys: list[bytes], data: list[bytes],
              meta: bytes = META) -> None:
    """Store WSUM chunks, as an engine's connector does (from tensors)."""
    torch = pytest.importorskip("torch")
    chunks = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    assert client.put_many(keys, chunks, [meta] * len(keys)) == [True] * len(keys)


def _targets(outs: list[bytearray], size: int = CHUNK, meta: bytes = META,
             cut: int = 0) -> HostTargets:
    """Each chunk into its buffer, as two ranges (the second `cut` bytes longer)."""
    flat: list[int] = []
    starts = [0]
    for out in outs:
        at = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
        half = len(out) // 2 + cut
        flat += [at, half, at + half, len(out) - half]
        starts.append(len(flat) // 2)
    return HostTargets(size, meta, flat, starts, owner=outs)


@pytest.fixture(params=["compiled", "python"])
def planned(request: pytest.FixtureRequest,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A `HostTargets` read through the compiled calls, or, where they are missing (no
    llvmlite), through the Python path: the same results. Yields the compiled path's
    table reads (`leasefree.located`'s calls: none for the Python path)."""
    calls: list[int] = []
    if request.param == "compiled":
        assert leasekernel.kernels() is not None, "the agent's install has llvmlite"
        real = leasefree.located

        def counted(index: IndexReader, keys: Any) -> None:
            calls.append(len(keys))
            real(index, keys)
        monkeypatch.setattr(leasefree, "located", counted)
    else:
        monkeypatch.setattr(leasekernel, "ready", lambda: None)
        monkeypatch.setattr(leasekernel, "compile_soon", lambda: None)
    yield calls
    if request.param == "python":
        assert not calls


@pytest.mark.parametrize("meta", [META, b"m" * 300], ids=["short-meta", "long-meta"])
def test_a_planned_window_is_read_without_a_lease_in_compiled_calls_or_python(
        shared: LocalAgent, reader: KVPoolClient, planned: list[int], meta: bytes) -> None:
    """Metadata of 300 bytes: its checksum's input is over the compiled hash's 240 bytes,
    so the checksums are made from the sums in Python (`wsum_finish_many`)."""
    keys = [_key(next(_fresh)) for _ in range(6)]
    data = [os.urandom(CHUNK) for _ in keys]
    _wsum_put(reader, keys, data, meta)
    before = scrape(shared)
    outs = [bytearray(CHUNK) for _ in keys]
    assert reader.get_many_into(keys, _targets(outs, meta=meta)) == [CHUNK] * len(keys)
    assert [bytes(o) for o in outs] == data
    assert reader.reads_without_lease == len(keys)
    reader.stats()  # takes the told READ along first
    after = scrape(shared)
    assert after[ACQUIRES] == before[ACQUIRES], "no ACQUIRE went to the agent"
    assert after[READS] == before.get(READS, 0) + 1
    assert planned in ([], [len(keys)])


def test_chunks_a_planned_read_cannot_take_go_through_a_lease(
        shared: LocalAgent, reader: KVPoolClient, planned: list[int]) -> None:
    """In one window: a WSUM chunk (read by the compiled calls), a chunk of another
    metadata, one of another size (both declined by the target: misses), an XXH3 chunk
    (written from a buffer: the compiled calls have no sums to check it with), a key not
    stored, and, in a second read, ranges that cut a 32-bit word (the copy loop's sums need
    whole words). What the compiled calls leave goes on to the Python path, which leases
    what it cannot read: the same results, the same requests to the agent."""
    good, other_meta, small, xxh3, absent = (_key(next(_fresh)) for _ in range(5))
    data = {k: os.urandom(CHUNK) for k in (good, other_meta, xxh3)}
    data[small] = os.urandom(CHUNK // 2)
    _wsum_put(reader, [good], [data[good]])
    _wsum_put(reader, [other_meta], [data[other_meta]], META + b"-other")
    _wsum_put(reader, [small], [data[small]])
    assert reader.put(xxh3, data[xxh3], META)
    keys = [good, other_meta, small, xxh3, absent]
    outs = [bytearray(CHUNK) for _ in keys]
    before = scrape(shared)
    sizes = reader.get_many_into(keys, _targets(outs))
    assert sizes == [CHUNK, 0, 0, CHUNK, 0]
    assert bytes(outs[0]) == data[good] and bytes(outs[3]) == data[xxh3]
    assert outs[1] == outs[2] == bytearray(CHUNK)  # declined: nothing copied there
    after = scrape(shared)
    assert after[NOT_FOUND] == before.get(NOT_FOUND, 0) + 1  # the key not stored
    assert after[ACQUIRES] == before[ACQUIRES]  # the declined ones were not asked for
    assert reader.reads_without_lease == 2
    cut = [bytearray(CHUNK)]
    assert reader.get_many_into([good], _targets(cut, cut=2)) == [CHUNK]
    assert bytes(cut[0]) == data[good]
    assert scrape(shared)[ACQUIRES] == after[ACQUIRES]
    assert reader.reads_without_lease == 3
    assert planned in ([], [5, 1])  # the compiled calls' table reads: both reads


@pytest.mark.parametrize(("reuse", "blocks"), [(False, False), (True, False), (True, True)],
                         ids=["deleted", "deleted-and-reused", "deleted-and-reused-block-ids"])
def test_a_chunk_that_leaves_between_the_compiled_table_read_and_the_copy_is_never_returned(
        agent: LocalAgent, client: KVPoolClient, reuse: bool, blocks: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The race of the Python path's test above, through the compiled calls: another
    client deletes the chunk (and stores another WSUM chunk of the same size and metadata
    in its pages) after `locate` found its slot and before `copy` copies it. The copy's
    sums may even pass (deleted only: its pages still hold its bytes; reused: the other
    chunk's bytes, checked against the first chunk's checksum), so the slot read again
    after the copy must fail it: it goes to the agent, which has no such chunk."""
    assert leasekernel.kernels() is not None
    before_key, key, after_key, other = _key(140), _key(141), _key(142), _key(143)
    data = {k: os.urandom(CHUNK) for k in (before_key, key, after_key, other)}
    reader = KVPoolClient(agent.socket_path, lease_free=True)
    _wsum_put(reader, [before_key, key, after_key], [data[before_key], data[key],
                                                      data[after_key]])
    where = _index(reader).locate(key)
    assert where is not None
    raced: list[bool] = []

    def racing(index: IndexReader, keys: Any) -> None:
        assert list(keys) == [key]
        assert client.delete(key)
        if reuse:
            _wsum_put(client, [other], [data[other]])
            moved = index.locate(other)
            assert moved is not None and moved[2][0] == where[2][0], \
                "the other chunk took the deleted chunk's pages"
        raced.append(True)
    monkeypatch.setattr(leasefree, "located", racing)
    before = scrape(agent)
    out = [bytearray(CHUNK)]
    kv = _Layers(blocks=4, per=1)  # (blocks: the chunk in block 2 of each layer)
    target = kv.host.targets([[2]]) if blocks else _targets(out)
    assert reader.get_many_into([key], target) == [0]
    assert raced, "the race ran"
    assert reader.reads_without_lease == 0
    if blocks:
        out = [bytearray(kv.block(0, 2) + kv.block(1, 2))]
    if reuse:
        assert bytes(out[0]) == data[other]  # the copy read the other chunk's bytes...
    after = scrape(agent)  # ...and the read went on to the agent: not found
    assert after[NOT_FOUND] == before[NOT_FOUND] + 1
    reader.close()


class _Layers:
    """Two KV-cache layers of `blocks` blocks in host memory (bytearrays), as
    `HostBlocks` a chunk of `per` blocks of each: the destinations of `BlockTargets`."""

    def __init__(self, blocks: int = 12, per: int = 4, meta: bytes = META) -> None:
        self.nbytes = CHUNK // (2 * per)
        self.layers = [bytearray(blocks * self.nbytes) for _ in range(2)]
        self.scratch = bytearray(self.nbytes)
        self.host = HostBlocks([self._at(b) for b in self.layers], self.nbytes, self.nbytes,
                               blocks, per, meta, scratch_address=self._at(self.scratch),
                               owner=self)

    @staticmethod
    def _at(b: bytearray) -> int:
        return ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))

    def block(self, layer: int, block_id: int) -> bytes:
        return bytes(self.layers[layer][block_id * self.nbytes : (block_id + 1) * self.nbytes])


def test_block_targets_are_read_into_their_blocks(
        shared: LocalAgent, reader: KVPoolClient, planned: list[int]) -> None:
    """A read whose destinations are block ids (`BlockTargets`, a vLLM load's): each chunk's
    bytes land, layer by layer, in its blocks in order, adjacent or not, the first chunk's
    skipped blocks in scratch and not in the KV cache; without a lease, no ACQUIRE. The
    compiled call plans the copies from the ids itself; the Python path from `ranges`."""
    kv = _Layers()
    keys = [_key(next(_fresh)) for _ in range(3)]
    data = [os.urandom(CHUNK) for _ in keys]
    _wsum_put(reader, keys, data)
    chunks = [[3, 4, 5, 6], [9, 1, 11, 10], [0, 2, 7, 8]]
    before = scrape(shared)
    target = kv.host.targets(chunks, skip=1)
    assert reader.get_many_into(keys, target) == [CHUNK] * 3
    n = kv.nbytes
    for c, (bids, chunk) in enumerate(zip(chunks, data, strict=True)):
        for layer in range(2):
            for j, b in enumerate(bids):
                got = chunk[(layer * 4 + j) * n : (layer * 4 + j + 1) * n]
                if c == 0 and j == 0:  # skipped: vLLM holds it already
                    assert kv.block(layer, b) == bytes(n)
                else:
                    assert kv.block(layer, b) == got, (c, layer, j)
    assert bytes(kv.scratch) == data[0][4 * n : 5 * n]  # layer 1's skipped block, last
    assert reader.reads_without_lease == 3
    assert scrape(shared)[ACQUIRES] == before[ACQUIRES]
    assert planned in ([], [3])


def test_reads_in_a_held_block_are_told_to_the_agent_when_it_ends(
        shared: LocalAgent, reader: KVPoolClient) -> None:
    """A vLLM load reads inside `releases_held` and reports to vLLM before the block ends:
    the READ of its lease-free reads is made and told when the block ends (with its
    RELEASEs), one for the block's reads, and the agent counts it."""
    kv = _Layers()
    keys = [_key(next(_fresh)) for _ in range(4)]
    _wsum_put(reader, keys, [os.urandom(CHUNK) for _ in keys])
    before = scrape(shared)
    with reader.releases_held():
        assert reader.get_many_into(keys[:2], kv.host.targets([[0, 1, 2, 3], [4, 5, 6, 7]])) \
            == [CHUNK] * 2
        assert reader.get_many_into(keys[2:], kv.host.targets([[8, 9, 10, 11], [0, 1, 2, 3]])) \
            == [CHUNK] * 2
        assert reader.reads_without_lease == 4
    reader.stats()  # takes the told READ along first
    after = scrape(shared)
    assert after[READS] == before.get(READS, 0) + 1
    assert after[ACQUIRES] == before[ACQUIRES]


def test_read_blocks_reads_a_whole_call_then_tells(
        shared: LocalAgent, reader: KVPoolClient) -> None:
    """`read_blocks`: every chunk in DRAM, read in the compiled call, `then` called once and
    then one READ told; a client without `lease_free`: None, nothing read or told."""
    assert leasekernel.kernels() is not None
    kv = _Layers()
    keys = [_key(next(_fresh)) for _ in range(3)]
    data = [os.urandom(CHUNK) for _ in keys]
    _wsum_put(reader, keys, data)
    calls: list[int] = []
    before = scrape(shared)
    target = kv.host.targets([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    assert reader.read_blocks(keys, target, lambda: calls.append(reader.reads_without_lease)) \
        == [CHUNK] * 3
    assert calls == [3]  # after the reads were counted, before the READ
    assert kv.block(1, 9) == data[2][5 * kv.nbytes : 6 * kv.nbytes]
    reader.stats()
    after = scrape(shared)
    assert after[READS] == before.get(READS, 0) + 1
    assert after[ACQUIRES] == before[ACQUIRES]

    with KVPoolClient(shared.socket_path) as leased:  # lease_free off
        assert leased.read_blocks(keys[:2], kv.host.targets([[0, 1, 2, 3], [4, 5, 6, 7]]),
                                  lambda: calls.append(-1)) is None
    reader.stats()
    assert scrape(shared)[READS] == after[READS] and calls == [3]


def test_get_many_into_reads_only_what_read_blocks_left(
        shared: LocalAgent, reader: KVPoolClient) -> None:
    """A call `read_blocks` reads in part: the chunks it read are told (one READ), `then` is
    not called, and `get_many_into(..., read=sizes)` reads the chunks it left and not the
    others again (their blocks, overwritten meanwhile, stay as they are)."""
    assert leasekernel.kernels() is not None
    kv = _Layers()
    keys = [_key(next(_fresh)) for _ in range(3)]
    data = [os.urandom(CHUNK) for _ in keys]
    _wsum_put(reader, [keys[0], keys[2]], [data[0], data[2]])
    calls: list[int] = []
    before = scrape(shared)
    target = kv.host.targets([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    read = reader.read_blocks(keys, target, lambda: calls.append(-1))
    assert read == [CHUNK, 0, CHUNK] and calls == []
    assert reader.reads_without_lease == 2
    assert kv.block(0, 8) == data[2][: kv.nbytes]
    reader.stats()
    assert scrape(shared)[READS] == before.get(READS, 0) + 1

    _wsum_put(reader, [keys[1]], [data[1]])  # the chunk left is there now
    for layer in kv.layers:  # chunk 0's blocks: were it read again, they would change
        layer[: 4 * kv.nbytes] = bytes(4 * kv.nbytes)
    assert reader.get_many_into(keys, target, read=read) == [CHUNK] * 3
    assert kv.block(0, 0) == bytes(kv.nbytes) and kv.block(1, 3) == bytes(kv.nbytes)
    assert kv.block(0, 4) == data[1][: kv.nbytes]
    assert kv.block(1, 7) == data[1][7 * kv.nbytes :]
    assert kv.block(1, 11) == data[2][7 * kv.nbytes :]
    with pytest.raises(ValueError, match="one size per key"):
        reader.get_many_into(keys, target, read=read[:2])


def test_block_ids_outside_the_blocks_are_refused_and_nothing_is_read(
        shared: LocalAgent, reader: KVPoolClient, planned: list[int]) -> None:
    """A `BlockTargets` made with an id outside its blocks (`HostBlocks.targets` refuses it
    before any read): one clear error from the read, and no block written."""
    kv = _Layers()
    keys = [_key(next(_fresh)) for _ in range(2)]
    _wsum_put(reader, keys, [os.urandom(CHUNK) for _ in keys])
    with pytest.raises(ValueError, match="out of the KV cache"):
        kv.host.targets([[0, 1, 2, 12], [4, 5, 6, 7]])
    import array
    bad = BlockTargets(kv.host, array.array("q", [0, 1, 2, 12, 4, 5, 6, 7]))
    with pytest.raises(ValueError, match="out of the KV cache"):
        reader.get_many_into(keys, bad)
    assert kv.layers == [bytearray(len(kv.layers[0]))] * 2
    assert reader.reads_without_lease == 0


def test_corrupted_arena_bytes_fail_a_planned_read_and_are_a_miss(
        shared: LocalAgent, reader: KVPoolClient, planned: list[int]) -> None:
    key = _key(next(_fresh))
    data = os.urandom(CHUNK)
    _wsum_put(reader, [key], [data])
    located = _index(reader).locate(key)
    assert located is not None
    arena = reader._arena
    assert arena is not None
    arena[located[2][0] + 4096] ^= 0x01
    acquires = scrape(shared)[ACQUIRES]
    out = [bytearray(CHUNK)]
    assert reader.get_many_into([key], _targets(out)) == [0]
    assert reader.reads_without_lease == 0
    assert scrape(shared)[ACQUIRES] == acquires + 1  # the leased read's check failed too
    arena[located[2][0] + 4096] ^= 0x01
    assert reader.get_many_into([key], _targets(out)) == [CHUNK] and bytes(out[0]) == data
    assert reader.reads_without_lease == 1


def test_the_compiled_checksum_hash_is_xxh3_at_every_length_it_takes() -> None:
    """The copy call's own XXH3-64 (the last step of a WSUM checksum, 17 to 240 bytes: a
    WSUM head of 39 and metadata of up to 201) is xxhash's, at every length."""
    kernels = leasekernel.kernels()
    assert kernels is not None
    rng = random.Random(5)
    for n in range(leasekernel.MIN_MESSAGE, leasekernel.MAX_MESSAGE + 1):
        for _ in range(3):
            data = rng.randbytes(n)
            assert kernels.xxh3(data) == xxhash.xxh3_64_intdigest(data), n
