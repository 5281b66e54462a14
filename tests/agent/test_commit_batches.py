"""A put window's COMMITs, sent in one write, are handled by the agent as one batch: their
chunks journaled in one write, then made visible, then answered. Each COMMIT still
succeeds or fails alone, as one at a time would. (Durability once answered, and a journal
that cannot take the batch's write: `test_journal.py`, `in-windows`; such a window with a
key twice in it: here.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from kvpool.agent import checksums
from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import JOURNAL_LIMIT, RawConn, journal_capped, module_agent

SIZE = 64 * 1024
PAGE = 4096
ROOM = 2000
"""Bytes the journal is left short of its limit: room for a chunk of a few bytes of
metadata, not for one of 2 * ROOM."""


agent = module_agent()


def _leases(raw: RawConn, keys: list[bytes]) -> list[int]:
    """A write lease for each key, asked in one write."""
    raw.send(b"".join(p.encode(p.Alloc(i, k, SIZE)) for i, k in enumerate(keys)))
    replies = [raw.reply() for _ in keys]
    assert all(isinstance(r, p.AllocReply) and not r.exists for r in replies), replies
    return [r.lease for r in replies if isinstance(r, p.AllocReply)]


def _commit_together(raw: RawConn, commits: list[p.Commit]) -> list[p.Reply]:
    """COMMITs sent in one write (as a put window sends them), their replies in order."""
    raw.send(b"".join(p.encode(c) for c in commits))
    replies = [raw.reply() for _ in commits]
    assert [r.rid for r in replies] == [c.rid for c in commits]
    return replies


def _error(reply: p.Reply) -> int:
    assert isinstance(reply, p.ErrorReply), reply
    return reply.code


def test_a_bad_commit_in_a_window_fails_alone_and_its_lease_stays_open(
        agent: LocalAgent) -> None:
    keys = [os.urandom(16) for _ in range(5)]
    raw = RawConn(agent.socket_path)
    try:
        leases = _leases(raw, keys)
        replies = _commit_together(raw, [
            p.Commit(10, leases[0], 0),
            p.Commit(11, leases[1], 0, checksum_kind=99),  # an unknown kind
            p.Commit(12, 1 << 40, 0),  # a lease never granted
            p.Commit(13, leases[3], 0, next_size=-1),  # a spare of a bad size
            p.Commit(14, leases[4], 0),
        ])
        assert isinstance(replies[0], p.CommitReply) and replies[0].stored
        assert _error(replies[1]) == p.ErrorCode.BAD_ARGUMENT
        assert _error(replies[2]) == p.ErrorCode.UNKNOWN_LEASE
        assert _error(replies[3]) == p.ErrorCode.BAD_ARGUMENT
        assert isinstance(replies[4], p.CommitReply) and replies[4].stored
        with KVPoolClient(agent.socket_path) as c:
            assert [c.lookup([k]) for k in keys] == [1, 0, 0, 0, 1]
        # The refused commits' leases are still open: committed right, they store.
        replies = _commit_together(raw, [p.Commit(20, leases[1], 0), p.Commit(21, leases[3], 0),
                                         p.Commit(22, leases[0], 0)])
        assert [r.stored for r in replies if isinstance(r, p.CommitReply)] == [True, True]
        assert _error(replies[2]) == p.ErrorCode.UNKNOWN_LEASE  # committed already
        with KVPoolClient(agent.socket_path) as c:
            assert [c.lookup([k]) for k in keys] == [1, 1, 0, 1, 1]
    finally:
        raw.close()


def test_a_key_committed_twice_in_a_window_keeps_the_first_stored_copy(
        agent: LocalAgent) -> None:
    twice, refused_first = os.urandom(16), os.urandom(16)
    raw = RawConn(agent.socket_path)
    try:
        a, b, c, d = _leases(raw, [twice, twice, refused_first, refused_first])
        replies = _commit_together(raw, [
            p.Commit(30, a, 0), p.Commit(31, b, 0),
            # The first commit of this key is refused: the second one stores it.
            p.Commit(32, c, 0, checksum_kind=99), p.Commit(33, d, 0),
        ])
        assert isinstance(replies[0], p.CommitReply) and replies[0].stored
        assert isinstance(replies[1], p.CommitReply) and not replies[1].stored
        assert _error(replies[2]) == p.ErrorCode.BAD_ARGUMENT
        assert isinstance(replies[3], p.CommitReply) and replies[3].stored
        # ... and the refused one, committed again, finds the key stored (its pages freed).
        (again,) = _commit_together(raw, [p.Commit(34, c, 0)])
        assert isinstance(again, p.CommitReply) and not again.stored
        with KVPoolClient(agent.socket_path) as client:
            assert client.lookup([twice, refused_first]) == 2
    finally:
        raw.close()


def test_a_key_twice_in_a_window_the_journal_cannot_take_is_stored_by_its_second_copy(
        tmp_path: Path) -> None:
    """The window's one journal write does not fit, so each chunk is journaled alone: a
    key's first copy, too large for what the journal has left, is refused, and its second
    copy later in the window, which fits, stores the key, as one commit at a time would
    (and a restart finds it, with that copy's metadata)."""
    twice, other = os.urandom(16), os.urandom(16)
    with journal_capped(tmp_path) as agent:
        journal = agent.arena_path.with_suffix(".journal")
        with KVPoolClient(agent.socket_path) as c:
            # A chunk's record is its metadata and a fixed part; the journal is filled to
            # ROOM bytes short of its limit, a chunk of 16 KiB of metadata at a time.
            before = journal.stat().st_size
            assert c.put(os.urandom(16), b"x" * PAGE)
            fixed = journal.stat().st_size - before
            while (left := JOURNAL_LIMIT - journal.stat().st_size) > ROOM:
                meta = b"m" * min(16_000, left - ROOM - fixed)
                assert c.put(os.urandom(16), b"x" * PAGE, meta=meta)
        assert 0 < JOURNAL_LIMIT - journal.stat().st_size <= ROOM
        copies = [(twice, b"1" * (2 * ROOM), b"\x01" * PAGE), (other, b"", b"\x02" * PAGE),
                  (twice, b"2", b"\x03" * PAGE)]
        raw = RawConn(agent.socket_path)
        try:
            leases = _written(raw, agent, copies)
            replies = _commit_together(raw, [
                p.Commit(10 + i, lease, checksums.compute(checksums.XXH3, [data], meta))
                for i, (lease, (_, meta, data)) in enumerate(zip(leases, copies, strict=True))])
        finally:
            raw.close()
        assert _error(replies[0]) == p.ErrorCode.NO_SPACE
        assert all(isinstance(r, p.CommitReply) and r.stored for r in replies[1:]), replies
        for restart in (False, True):
            if restart:  # the journal holds what was acknowledged
                agent.kill(signal.SIGKILL)
                agent.start()
            with KVPoolClient(agent.socket_path) as c:
                assert c.get_with_meta(twice) == (b"\x03" * PAGE, b"2")
                assert c.get(other) == b"\x02" * PAGE


def _written(raw: RawConn, agent: LocalAgent,
             copies: list[tuple[bytes, bytes, bytes]]) -> list[int]:
    """A write lease for each (key, metadata, bytes), asked in one write, its bytes written
    into the arena (through its file, as a client does through the fd HELLO passes)."""
    raw.send(b"".join(p.encode(p.Alloc(i, key, len(data), meta))
                      for i, (key, meta, data) in enumerate(copies)))
    replies = [raw.reply() for _ in copies]
    leases = []
    with open(agent.arena_path, "r+b", buffering=0) as arena:
        for reply, (_, _, data) in zip(replies, copies, strict=True):
            assert isinstance(reply, p.AllocReply) and not reply.exists, reply
            pos = 0
            for offset, n in reply.extents:
                os.pwrite(arena.fileno(), data[pos : pos + n], offset)
                pos += n
            leases.append(reply.lease)
    return leases
