"""A put window's COMMITs, sent in one write, are handled by the agent as one batch: their
chunks journaled in one write, then made visible, then answered. Each COMMIT still
succeeds or fails alone, as one at a time would. (Durability once answered, and a journal
that cannot take the batch's write: `test_journal.py`, `in-windows`.)"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import RawConn

SIZE = 64 * 1024


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    with LocalAgent("--no-lock", workdir=tmp_path_factory.mktemp("commit-batches"),
                    dram="32Mi") as a:
        yield a


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
