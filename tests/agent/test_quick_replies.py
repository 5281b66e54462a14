"""Frames a connection answers as they arrive (a RELEASE, an ACQUIRE of a chunk in DRAM, an
ALLOC that needs no wait for room), without waking its task (`Connection._quick`), against a
real agent process: their replies keep the order of the requests with those the task
answers, and replies the socket does not take at once still reach a client that reads
them late."""

from __future__ import annotations

import os
import time

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import RawConn

KEY, MISSING = b"q" * 16, b"m" * 16


def _sequence(fresh: bytes) -> list[p.Request]:
    """Requests of both kinds, interleaved: quick ones (RELEASE, ACQUIRE of a DRAM chunk,
    ALLOC) and ones the task answers (LOOKUP, ACQUIRE of a key nobody holds)."""
    return [p.Release(1, 999_999), p.Acquire(2, KEY), p.Lookup(3, [KEY, MISSING]),
            p.Acquire(4, MISSING), p.Acquire(5, KEY), p.Release(6, 999_998),
            p.Alloc(7, KEY, 4096), p.Alloc(8, fresh, 4096)]


def _check(replies: list[p.Reply], conn: RawConn, fresh: bytes) -> None:
    assert [r.rid for r in replies] == [1, 2, 3, 4, 5, 6, 7, 8]
    unknown, first, lookup, missing, second, unknown2, exists, granted = replies
    assert isinstance(exists, p.AllocReply) and exists.exists
    assert isinstance(granted, p.AllocReply) and not granted.exists and granted.extents
    committed = conn.call(p.Commit(9, granted.lease, 0))  # the write lease is real
    assert isinstance(committed, p.CommitReply) and committed.stored
    assert isinstance(conn.call(p.Lookup(10, [fresh])), p.LookupReply)
    assert isinstance(unknown, p.ErrorReply) and unknown.code == p.ErrorCode.UNKNOWN_LEASE
    assert isinstance(first, p.AcquireReply) and first.size == 4096
    assert isinstance(lookup, p.LookupReply) and lookup.count == 1
    assert isinstance(missing, p.ErrorReply) and missing.code == p.ErrorCode.NOT_FOUND
    assert isinstance(second, p.AcquireReply) and second.lease != first.lease
    assert isinstance(unknown2, p.ErrorReply)
    for lease in (first.lease, second.lease):  # the leases are real: released once
        assert isinstance(conn.call(p.Release(7, lease)), p.ReleaseReply)
        reply = conn.call(p.Release(8, lease))
        assert isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.UNKNOWN_LEASE


def test_quick_replies_keep_their_order_among_the_tasks(agent: LocalAgent,
                                                        client: KVPoolClient) -> None:
    assert client.put(KEY, b"x" * 4096)
    conn = RawConn(agent.socket_path)
    try:
        # All in one write (the task finds them buffered), then one at a time with the
        # task waiting for each (answered as they arrive where they can be).
        fresh = os.urandom(16)
        reqs = _sequence(fresh)
        conn.send(b"".join(p.encode(r) for r in reqs))
        _check([conn.reply() for _ in reqs], conn, fresh)
        replies = []
        fresh = os.urandom(16)
        for r in _sequence(fresh):
            conn.send(p.encode(r))
            time.sleep(0.02)
            replies.append(conn.reply())
        _check(replies, conn, fresh)
        assert client.lookup([fresh]) == 1
    finally:
        conn.close()


def test_quick_replies_the_socket_does_not_take_reach_a_client_that_reads_late(
        agent: LocalAgent) -> None:
    """One write of RELEASEs of unknown leases whose error replies (~240 KB, less than a
    connection holds back for one send) are more than the agent's socket takes at once,
    the client reading nothing for a while: what the socket did not take goes out once the
    client reads, in order, with no further request to carry it."""
    conn = RawConn(agent.socket_path)
    n = 3_500
    try:
        conn.send(b"".join(p.encode(p.Release(rid, 1 << 40)) for rid in range(n)))
        time.sleep(0.5)  # the agent's replies fill its socket meanwhile
        for rid in range(n):
            reply = conn.reply()
            assert isinstance(reply, p.ErrorReply) and reply.rid == rid
            assert reply.code == p.ErrorCode.UNKNOWN_LEASE
        assert isinstance(conn.call(p.Lookup(n, [KEY])), p.LookupReply)
    finally:
        conn.close()
