"""A full arena evicts least recently used chunks, never leased or pinned ones."""

from __future__ import annotations

import os

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import RawConn, scrape

MiB = 1 << 20


def capacity_only(tmp_path) -> tuple[str, ...]:
    """Agent flags for plain LRU with watermarks at the top: only a write that does not
    fit evicts, so the tests can count exactly what goes."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("tiers:\n  dram: {eviction: lru, highWatermark: 1.0, lowWatermark: 0.99}\n")
    return ("--no-lock", "--policy", str(policy))


def fill(c: KVPoolClient, n: int) -> list[bytes]:
    keys = [os.urandom(16) for _ in range(n)]
    for k in keys:
        assert c.put(k, k * (MiB // 16))
    return keys


def test_least_recently_used_chunk_goes_first(tmp_path) -> None:
    with LocalAgent(*capacity_only(tmp_path), workdir=tmp_path, dram="8Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        keys = fill(c, 8)
        assert c.get(keys[0]) is not None  # keys[1] is now the least recently used
        extra = fill(c, 1)
        assert c.get(keys[1]) is None
        assert c.lookup([keys[0]]) == 1 and c.lookup(extra) == 1
        assert scrape(agent)['kvpool_tier_evictions_total{pool="default",reason="capacity",'
                             'tier="dram"}'] == 1


def test_leased_and_pinned_chunks_are_never_evicted(tmp_path) -> None:
    with LocalAgent(*capacity_only(tmp_path), workdir=tmp_path, dram="8Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        keys = fill(c, 8)
        c.pin(keys[0])
        raw = RawConn(agent.socket_path)
        lease = raw.call(p.Acquire(1, keys[1]))
        assert isinstance(lease, p.AcquireReply)
        fill(c, 6)
        assert c.get(keys[0]) == keys[0] * (MiB // 16)
        assert c.get(keys[1]) == keys[1] * (MiB // 16)
        assert all(c.get(k) is None for k in keys[2:])


def test_write_is_refused_when_nothing_can_be_evicted(tmp_path) -> None:
    with LocalAgent(*capacity_only(tmp_path), workdir=tmp_path, dram="4Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        keys = fill(c, 4)
        for k in keys:
            c.pin(k)
        try:
            c.put(os.urandom(16), b"x" * MiB)
        except p.ProtocolError as e:
            assert e.code == p.ErrorCode.NO_SPACE
            assert "leased or pinned" in e.message
        else:
            raise AssertionError("a write into a fully pinned arena succeeded")
        assert all(c.contains(k) for k in keys)


def test_deleted_chunk_under_a_read_lease_stays_readable_until_release(tmp_path) -> None:
    with LocalAgent(*capacity_only(tmp_path), workdir=tmp_path, dram="8Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        k = fill(c, 1)[0]
        raw = RawConn(agent.socket_path)
        lease = raw.call(p.Acquire(1, k))
        assert isinstance(lease, p.AcquireReply)
        used = c.stats()["tiers"]["dram"]["used_bytes"]
        assert c.delete(k) and not c.contains(k)
        assert c.stats()["tiers"]["dram"]["used_bytes"] == used  # bytes still being read
        raw.call(p.Release(2, lease.lease))
        assert c.stats()["tiers"]["dram"]["used_bytes"] == used - MiB


def test_a_chunk_that_can_never_fit_is_refused_before_anything_is_evicted(tmp_path) -> None:
    """A 40 MiB ALLOC on a 32 MiB arena (the default max chunk is 64 MiB) evicts nothing."""
    with LocalAgent(*capacity_only(tmp_path), workdir=tmp_path, dram="32Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        keys = fill(c, 20)
        raw = RawConn(agent.socket_path)
        try:
            reply = raw.call(p.Alloc(1, os.urandom(16), 40 * MiB))
        finally:
            raw.close()
        assert isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.NO_SPACE, reply
        assert "never fit" in reply.message
        assert c.lookup(keys) == 20
        assert scrape(agent)['kvpool_tier_evictions_total{pool="default",reason="capacity",'
                             'tier="dram"}'] == 0


def test_one_connections_uncommitted_allocs_cannot_flush_the_arena(tmp_path) -> None:
    """4,096 one-byte ALLOCs never committed take at most half of a 16 MiB arena: the
    chunks stored in the other half stay."""
    with LocalAgent(*capacity_only(tmp_path), workdir=tmp_path, dram="16Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        keys = fill(c, 8)
        raw = RawConn(agent.socket_path)
        try:
            replies: list[p.Reply] = []
            for first in range(0, 4096, 256):  # pipelined, a window at a time
                raw.send(b"".join(p.encode(p.Alloc(first + i + 2, os.urandom(16), 1))
                                  for i in range(256)))
                replies += [raw.reply() for _ in range(256)]
            granted = [r for r in replies if isinstance(r, p.AllocReply)]
            refused = [r for r in replies if isinstance(r, p.ErrorReply)]
            assert len(granted) == 2048, len(granted)  # 8 MiB of 4 KiB pages
            assert {r.code for r in refused} == {p.ErrorCode.NO_SPACE}
            assert "uncommitted" in refused[0].message
            assert c.lookup(keys) == 8
        finally:
            raw.close()


def test_a_put_into_a_fragmented_arena_evicts_until_its_runs_join(tmp_path) -> None:
    """Free pages split into more runs than one chunk may take (1,024 extents): the put
    evicts on in LRU order until the freed pages join, instead of refusing."""
    with LocalAgent(*capacity_only(tmp_path), workdir=tmp_path, dram="16Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        page = 4096
        keys = [os.urandom(16) for _ in range(4096)]
        for i in range(0, len(keys), 256):
            window = keys[i : i + 256]
            assert all(r is True for r in c.put_many(window, [k * (page // 16) for k in window]))
        for k in keys[::2]:  # 2,048 one-page holes: 8 MiB free, in 2,048 runs
            assert c.delete(k)
        big = os.urandom(16)
        data = big * (6 * MiB // 16)
        assert c.put(big, data)
        assert c.get(big) == data
        assert scrape(agent)['kvpool_tier_evictions_total{pool="default",reason="capacity",'
                             'tier="dram"}'] > 0
