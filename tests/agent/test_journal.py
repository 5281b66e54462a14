"""The DRAM commit journal through a real agent: bounded while it runs, never out of step.

The journal lives beside the arena on a tmpfs. It used to grow by every chunk's lifecycle
for as long as the agent ran (a 1 MiB tenant name made each record 1 MiB), and once it could
not grow, a PUT answered with an error had stored its chunk anyway.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.journal import (
    Handoff,
    Journal,
    JournalEntry,
    pending_handoffs,
    pending_shared_deletes,
    replay,
)
from kvpool.bench.local import LocalAgent

from .conftest import RawConn, journal_capped

PAGE = 4096


def key_of(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def data_of(i: int) -> bytes:
    return bytes([i % 251 + 1]) * PAGE


@pytest.fixture
def small_agent(tmp_path: Path) -> Iterator[LocalAgent]:
    with LocalAgent("--no-lock", workdir=tmp_path, dram="4Mi") as a:
        yield a


def test_the_journal_stays_bounded_while_chunks_come_and_go_and_a_restart_keeps_the_live_ones(
        small_agent: LocalAgent) -> None:
    journal = small_agent.arena_path.with_suffix(".journal")
    cycles, kept = 3000, range(0, 3000, 10)
    largest = 0
    with KVPoolClient(small_agent.socket_path) as c:
        for i in range(cycles):
            assert c.put(key_of(i), data_of(i))
            if i % 10:
                assert c.delete(key_of(i))
            largest = max(largest, journal.stat().st_size)
    # 3,000 commits and 2,700 drops appended and never compacted: about 250 KB. Compacted
    # past twice the live chunks plus 1,024 records, it stays near 100 KB.
    assert largest < 150_000, largest

    small_agent.kill(signal.SIGKILL)
    small_agent.start()
    with KVPoolClient(small_agent.socket_path) as c:
        assert all(c.get(key_of(i), verify=True) == data_of(i) for i in kept)
        assert c.lookup([key_of(1)]) == 0 and c.lookup([key_of(cycles - 1)]) == 0
        assert c.stats()["tiers"]["dram"]["chunks"] == len(kept)


def test_a_tenant_name_longer_than_the_protocol_allows_is_refused_at_hello(
        small_agent: LocalAgent) -> None:
    raw = RawConn(small_agent.socket_path, hello=False)
    try:
        reply = raw.call(p.Hello(1, p.PROTOCOL_VERSION, "test", "t" * (1 << 20)))
        assert isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.BAD_ARGUMENT
        assert str(p.MAX_TENANT_BYTES) in reply.message
    finally:
        raw.close()
    with KVPoolClient(small_agent.socket_path, tenant="t" * p.MAX_TENANT_BYTES) as c:
        assert c.put(key_of(1), data_of(1))
        assert c.get(key_of(1)) == data_of(1)


def _put(c: KVPoolClient, i: int, meta: bytes) -> bool | p.ProtocolError:
    try:
        return c.put(key_of(i), data_of(i), meta=meta)
    except p.ProtocolError as e:
        return e


@pytest.mark.parametrize("windows", [False, True], ids=["one-by-one", "in-windows"])
def test_a_chunk_the_journal_cannot_record_is_refused_and_never_stored(
        tmp_path: Path, windows: bool) -> None:
    """`in-windows`: `put_many`, whose window's COMMITs the agent journals in one write;
    where that write does not fit, each chunk is journaled alone, stored where it fits and
    refused where not. Every chunk acknowledged survives a SIGKILL right after the
    replies. (`journal_capped`: the journal fills up long before the arena.)"""
    meta = b"m" * 16_000
    with journal_capped(tmp_path) as agent:
        stored, refused = [], []
        with KVPoolClient(agent.socket_path) as c:
            results = c.put_many([key_of(i) for i in range(300)],  # windows of 128
                                 [data_of(i) for i in range(300)], [meta] * 300) \
                if windows else [_put(c, i, meta) for i in range(300)]
            for i, r in enumerate(results):
                if r is True:
                    stored.append(i)
                else:
                    assert isinstance(r, p.ProtocolError) and r.code == p.ErrorCode.NO_SPACE, r
                    assert "journal" in str(r)
                    refused.append(i)
            assert stored and refused
            if windows:  # the window whose one write did not fit stored what fitted alone
                assert len(stored) % 128, "a window was stored or refused whole, never in part"
            assert c.stats()["tiers"]["dram"]["chunks"] == len(stored)
            assert all(c.lookup([key_of(i)]) == 0 for i in refused)
            assert all(c.get_with_meta(key_of(i)) == (data_of(i), meta) for i in stored)

        # What the journal holds is exactly what was acknowledged: a restart (without the
        # limit) finds every stored chunk and nothing else.
        agent.kill(signal.SIGKILL)
        agent.start()
        with KVPoolClient(agent.socket_path) as c:
            assert c.stats()["tiers"]["dram"]["chunks"] == len(stored)
            assert all(c.get(key_of(i), verify=True) == data_of(i) for i in stored)


def test_pending_shared_deletes_are_replayed_and_kept_by_every_rewrite(tmp_path: Path) -> None:
    """A shared-tier delete recorded and not yet confirmed is read back at start-up, and a
    rewrite (compaction, or the one a warm restart does) keeps it beside the live chunks;
    a confirmed one is gone."""
    path = tmp_path / "arena.journal"
    journal = Journal(path)
    try:
        entry = JournalEntry(key_of(9), [(0, 1)], PAGE, 1, b"", "")
        journal.commit(entry)
        for i in (1, 2, 3):
            journal.shared_delete(key_of(i))
        journal.shared_deleted(key_of(2))
        assert pending_shared_deletes(path) == [key_of(1), key_of(3)]
        journal.rewrite([entry], pending_shared_deletes(path))
        assert pending_shared_deletes(path) == [key_of(1), key_of(3)]
        assert [e.key for e in replay(path)] == [key_of(9)]
        journal.shared_deleted(key_of(1))
        assert pending_shared_deletes(path) == [key_of(3)]
    finally:
        journal.close()


def test_hand_off_pins_are_replayed_until_read_dropped_or_committed_again(
        tmp_path: Path) -> None:
    """A pushed chunk's pin (with its wall-clock end) is read back at start-up until it ends
    (its first read, a client's pin), or its key is dropped or committed anew (a new chunk
    owes nothing to an old pin); a rewrite keeps the pins it is given after the commits."""
    path = tmp_path / "arena.journal"
    journal = Journal(path)
    try:
        entries = [JournalEntry(key_of(i), [(i * PAGE, PAGE)], PAGE, i, b"", "")
                   for i in range(5)]
        for e in entries:
            journal.commit(e)
        for i in range(5):
            journal.handoff(key_of(i), 1000.0 + i)
        journal.handoff_ended(key_of(1))
        journal.drop(key_of(2))
        journal.commit(entries[3])
        assert pending_handoffs(path) == [Handoff(key_of(0), 1000.0),
                                          Handoff(key_of(4), 1004.0)]
        journal.rewrite([entries[0], entries[4]], [], pending_handoffs(path))
        assert pending_handoffs(path) == [Handoff(key_of(0), 1000.0),
                                          Handoff(key_of(4), 1004.0)]
        assert [e.key for e in replay(path)] == [key_of(0), key_of(4)]
    finally:
        journal.close()


def test_a_rewrite_keeps_the_journal_private_as_it_was_created(tmp_path: Path) -> None:
    """Compaction replaces the journal by a new file: it keeps the journal's owner-only
    mode (it names every chunk's key and tenant) rather than the umask's."""
    path = tmp_path / "arena.journal"
    journal = Journal(path)
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        journal.rewrite([JournalEntry(key_of(1), [(0, 1)], PAGE, 1, b"", "")])
        assert path.stat().st_mode & 0o777 == 0o600
        assert [e.key for e in replay(path)] == [key_of(1)]
    finally:
        journal.close()


def test_chunks_committed_together_are_one_write_replayed_in_order_or_none_of_them(
        tmp_path: Path) -> None:
    """`commit_many` (a drain's peer reads, landed together): one write, replayed as the
    commits one by one would be; a write that fails leaves the file as it was."""
    path = tmp_path / "arena.journal"
    journal = Journal(path)
    try:
        entries = [JournalEntry(key_of(i), [(i * PAGE, PAGE)], PAGE, i, b"m", "t")
                   for i in range(4)]
        journal.commit(entries[0])
        journal.commit_many(entries[1:])
        journal.drop(key_of(2))
        assert list(replay(path)) == [entries[0], entries[1], entries[3]]
        size = path.stat().st_size
        journal.fd, good = os.open(path, os.O_RDONLY), journal.fd  # a write that fails
        with pytest.raises(OSError):
            journal.commit_many([JournalEntry(key_of(9), [(0, PAGE)], PAGE, 9, b"", "")])
        os.close(journal.fd)
        journal.fd = good
        assert path.stat().st_size == size
        assert list(replay(path)) == [entries[0], entries[1], entries[3]]
    finally:
        journal.close()
