"""Put-ahead: a COMMIT asks for the next put's write lease (a spare), so a put of a size
seen before costs one round trip. The spare is keyless until its COMMIT names the chunk:
it is never visible, never handed to another client, and gone with its connection."""

from __future__ import annotations

import os

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.transport import ZeroCopyTransport
from kvpool.bench.local import LocalAgent

from .conftest import RawConn, module_agent, scrape, used_bytes, wait_until

CHUNK = 1 << 20
PAGE_CHUNK = 64 * 1024


agent = module_agent()


def _key(name: str) -> bytes:
    return name.encode().ljust(16, b".")[:16]


def _transport(client: KVPoolClient) -> ZeroCopyTransport:
    t = client._live()
    assert isinstance(t, ZeroCopyTransport)
    return t


def _allocs(agent: LocalAgent) -> float:
    return sum(v for k, v in scrape(agent).items()
               if k.startswith("kvpool_ops_total") and 'op="alloc"' in k)


def test_a_put_of_a_size_seen_before_sends_no_alloc(agent: LocalAgent) -> None:
    chunks = {_key(f"ahead-{i}"): os.urandom(PAGE_CHUNK) for i in range(4)}
    with KVPoolClient(agent.socket_path, put_ahead=True) as c:
        before = _allocs(agent)
        for key, data in chunks.items():
            assert c.put(key, data, b"meta")
        assert _allocs(agent) - before == 1  # the first put's; the others used spares
        assert set(_transport(c).spares) == {PAGE_CHUNK}
        for key, data in chunks.items():
            assert c.get_with_meta(key) == (data, b"meta")
        for key in chunks:
            c.delete(key)


def test_without_put_ahead_a_client_holds_no_spare(agent: LocalAgent) -> None:
    with KVPoolClient(agent.socket_path) as c:
        before = _allocs(agent)
        for i in range(2):
            assert c.put(_key(f"plain-{i}"), os.urandom(PAGE_CHUNK))
        assert _allocs(agent) - before == 2
        assert _transport(c).spares == {}
        for i in range(2):
            c.delete(_key(f"plain-{i}"))


def test_a_spare_lease_is_never_visible(agent: LocalAgent) -> None:
    key, data = _key("spare-visible"), os.urandom(CHUNK)
    with KVPoolClient(agent.socket_path, put_ahead=True) as a, \
            KVPoolClient(agent.socket_path) as b:
        assert a.put(_key("spare-first"), os.urandom(CHUNK))
        chunks = b.stats()["tiers"]["dram"]["chunks"]
        (_, extents), = _transport(a).spares.values()
        # Bytes in the spare's pages, not committed: nobody sees them under any key.
        arena = _transport(a).arena
        offset, n = extents[0]
        arena[offset : offset + n] = data[:n]
        assert b.lookup([key]) == 0 and b.get(key) is None
        assert b.stats()["tiers"]["dram"]["chunks"] == chunks
        assert a.put(key, data)  # copied into the spare, named by its COMMIT
        assert b.lookup([key]) == 1 and b.get(key) == data
        assert b.stats()["tiers"]["dram"]["chunks"] == chunks + 1
        for k in (key, _key("spare-first")):
            a.delete(k)


def test_a_client_that_disconnects_with_a_spare_leaks_nothing(agent: LocalAgent) -> None:
    with KVPoolClient(agent.socket_path) as watcher:
        before = used_bytes(watcher)
        with KVPoolClient(agent.socket_path, put_ahead=True) as c:
            assert c.put(_key("leak-chunk"), os.urandom(CHUNK))
            assert _transport(c).spares
            assert used_bytes(watcher) == before + 2 * CHUNK  # the chunk and its spare
        wait_until(lambda: used_bytes(watcher) == before + CHUNK, "the spare's pages freed")
        assert watcher.stats()["leases"]["write"] == 0
        watcher.delete(_key("leak-chunk"))
        assert used_bytes(watcher) == before


def test_another_client_never_gets_the_pages_of_a_spare(agent: LocalAgent) -> None:
    mine = os.urandom(CHUNK)
    with KVPoolClient(agent.socket_path, put_ahead=True) as a, \
            KVPoolClient(agent.socket_path) as b:
        assert a.put(_key("owner-first"), os.urandom(CHUNK))
        (_, spare), = _transport(a).spares.values()
        spare_pages = set(range(spare[0][0], spare[0][0] + spare[0][1], 4096))
        conn, theirs = _transport(b).conn, os.urandom(CHUNK)
        # Twice the arena's worth of 1 MiB chunks: every page not leased is reused.
        for i in range(64):
            alloc = conn.call(p.Alloc(conn.rid(), _key(f"other-{i}"), CHUNK))
            assert isinstance(alloc, p.AllocReply) and not alloc.exists
            for offset, n in alloc.extents:
                assert spare_pages.isdisjoint(range(offset, offset + n, 4096))
                _transport(b).arena[offset : offset + n] = theirs[:n]
            conn.call(p.Commit(conn.rid(), alloc.lease, p.checksum(theirs)))
        assert a.put(_key("owner-second"), mine)  # into the spare, intact
        assert b.get(_key("owner-second")) == mine
        assert b.get(_key("other-63")) == theirs
        for k in (_key("owner-first"), _key("owner-second"), *(_key(f"other-{i}")
                                                                  for i in range(64))):
            b.delete(k)


def test_a_duplicate_put_through_a_spare_stores_nothing(agent: LocalAgent) -> None:
    key, first = _key("spare-dup"), os.urandom(PAGE_CHUNK)
    with KVPoolClient(agent.socket_path, put_ahead=True) as c:
        assert c.put(key, first)
        assert _transport(c).spares  # the next put goes through a spare
        chunks = c.stats()["tiers"]["dram"]["chunks"]
        assert not c.put(key, os.urandom(PAGE_CHUNK))
        assert c.get(key) == first
        assert c.stats()["tiers"]["dram"]["chunks"] == chunks
        c.delete(key)


def test_commit_of_a_spare_must_name_its_chunk(agent: LocalAgent) -> None:
    raw = RawConn(agent.socket_path)
    try:
        alloc = raw.call(p.Alloc(1, _key("raw-first"), 4096))
        assert isinstance(alloc, p.AllocReply)
        plain = raw.call(p.Commit(2, alloc.lease, 0))  # as an older client: no spare
        assert isinstance(plain, p.CommitReply) and plain.stored and plain.spare == 0
        alloc = raw.call(p.Alloc(3, _key("raw-second"), 4096))
        assert isinstance(alloc, p.AllocReply)
        too_big = raw.call(p.Commit(4, alloc.lease, 0, next_size=1 << 40))
        assert isinstance(too_big, p.ErrorReply) and too_big.code == p.ErrorCode.BAD_ARGUMENT
        got = raw.call(p.Commit(5, alloc.lease, 0, next_size=4096))  # the lease stayed open
        assert isinstance(got, p.CommitReply) and got.spare and got.spare_extents
        nameless = raw.call(p.Commit(6, got.spare, 0))
        assert isinstance(nameless, p.ErrorReply) and nameless.code == p.ErrorCode.BAD_KEY
        too_much = raw.call(p.Commit(7, got.spare, 0, key=_key("raw-spare"), meta=b"m" * 70000))
        assert isinstance(too_much, p.ErrorReply)
        assert too_much.code == p.ErrorCode.BAD_ARGUMENT
        named = raw.call(p.Commit(8, got.spare, 0, key=_key("raw-spare"), meta=b"m"))
        assert isinstance(named, p.CommitReply) and named.stored and named.spare == 0
        found = raw.call(p.Lookup(9, [_key("raw-spare")]))
        assert isinstance(found, p.LookupReply) and found.count == 1
        for i, name in enumerate(("raw-first", "raw-second", "raw-spare")):
            raw.call(p.Delete(10 + i, _key(name)))
    finally:
        raw.sock.close()


def test_commit_says_when_another_write_stored_the_key_first(agent: LocalAgent) -> None:
    first, second = RawConn(agent.socket_path), RawConn(agent.socket_path)
    key = _key("raced")
    try:
        late = first.call(p.Alloc(1, key, 4096))
        early = second.call(p.Alloc(1, key, 4096))
        assert isinstance(late, p.AllocReply) and isinstance(early, p.AllocReply)
        won = second.call(p.Commit(2, early.lease, 1))
        lost = first.call(p.Commit(2, late.lease, 2))
        assert isinstance(won, p.CommitReply) and won.stored
        assert isinstance(lost, p.CommitReply) and not lost.stored
        acquired = second.call(p.Acquire(3, key))
        assert isinstance(acquired, p.AcquireReply) and acquired.checksum == 1
        second.call(p.Release(4, acquired.lease))
        second.call(p.Delete(5, key))
    finally:
        first.sock.close()
        second.sock.close()
