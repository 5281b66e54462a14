"""The client's batch calls against a real agent: whole batches per round trip, zero-copy
both ways, and the same results in inline mode."""

from __future__ import annotations

import itertools
import os

import numpy as np

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.transport import read_groups
from kvpool.bench.local import LocalAgent


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def test_batches_larger_than_the_window_round_trip_with_their_metadata(agent: LocalAgent) -> None:
    ks = keys(10)
    chunks = [np.full(1000 + i, i, dtype=np.uint8) for i in range(10)]
    metas = [f"meta-{i}".encode() for i in range(10)]
    with KVPoolClient(agent.socket_path, batch_window=4) as c:
        assert c.put_many(ks, chunks, metas) == [True] * 10
        outs = [np.zeros(2000, dtype=np.uint8) for _ in ks]
        seen: dict[int, tuple[int, bytes]] = {}

        def target(i: int, size: int, meta: bytes) -> np.ndarray:
            seen[i] = (size, meta)
            return outs[i]

        sizes = c.get_many_into(ks, target, verify=True)
        assert sizes == [len(x) for x in chunks]
        assert seen == {i: (len(chunks[i]), metas[i]) for i in range(10)}
        for out, chunk in zip(outs, chunks, strict=True):
            assert np.array_equal(out[: len(chunk)], chunk)
        assert c.stats()["leases"]["read"] == 0


def test_misses_and_declined_chunks_read_nothing_and_hold_no_lease(agent: LocalAgent) -> None:
    stored, missing = keys(2), keys(1)
    with KVPoolClient(agent.socket_path) as c:
        c.put_many(stored, [b"a" * 64, b"b" * 64], [b"", b""])
        out = bytearray(64)
        sizes = c.get_many_into([stored[0], missing[0], stored[1]],
                                lambda i, size, meta: None if i == 0 else out)
        assert sizes == [0, 0, 64] and out == b"b" * 64
        assert c.lookup([stored[0], missing[0], stored[1]]) == 1
        assert c.stats()["leases"]["read"] == 0


def test_refused_chunk_fails_alone_and_stored_keys_are_deduplicated(agent: LocalAgent) -> None:
    ks = keys(3)
    with KVPoolClient(agent.socket_path) as c:
        assert c.hello is not None
        too_big = bytes(c.hello.max_chunk_bytes + 1)
        results = c.put_many(ks, [b"x" * 100, too_big, b"z" * 100], [b"", b"", b""])
        assert results[0] is True and results[2] is True
        assert isinstance(results[1], p.ProtocolError)
        assert results[1].code == p.ErrorCode.BAD_ARGUMENT
        assert c.put_many([ks[0]], [b"y" * 100], [b""]) == [False]
        assert c.get(ks[0]) == b"x" * 100


def test_inline_mode_batches_give_the_same_results(agent: LocalAgent) -> None:
    ks = keys(3)
    with KVPoolClient(agent.socket_path, mode="inline") as c:
        assert c.put_many(ks[:2], [b"a" * 10, b"b" * 20], [b"m0", b"m1"]) == [True, True]
        outs = [bytearray(32) for _ in ks]
        metas: dict[int, bytes] = {}

        def target(i: int, size: int, meta: bytes) -> bytearray:
            metas[i] = meta
            return outs[i]

        assert c.get_many_into(ks, target, verify=True) == [10, 20, 0]
        assert outs[0][:10] == b"a" * 10 and outs[1][:20] == b"b" * 20
        assert metas == {0: b"m0", 1: b"m1"}


def test_lookup_of_a_prefix_longer_than_one_lookup_takes(tmp_path) -> None:
    ks = keys(p.MAX_LOOKUP_KEYS + 10)  # a page of arena each: 32 MiB and a bit
    with LocalAgent("--no-lock", workdir=tmp_path, dram="48Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        assert all(r is True for r in c.put_many(ks, [b"x"] * len(ks)))
        assert c.lookup(ks) == len(ks)
        assert c.lookup([*ks[: p.MAX_LOOKUP_KEYS + 2], os.urandom(16), ks[0]]) \
            == p.MAX_LOOKUP_KEYS + 2


def test_read_windows_go_in_growing_groups() -> None:
    assert read_groups(4) == [(0, 4)]
    assert read_groups(17) == [(0, 17)]  # 13 keys after the first 4: no group of their own
    assert read_groups(18) == [(0, 4), (4, 18)]
    assert read_groups(63) == [(0, 4), (4, 63)]
    assert read_groups(128) == [(0, 4), (4, 20), (20, 128)]
    for n in range(1, 300):
        groups = read_groups(n)
        assert groups[0][0] == 0 and groups[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))


def test_a_read_window_that_fails_in_a_later_group_ends_every_lease_and_the_connection_works(
        agent: LocalAgent) -> None:
    """The target refuses a chunk of the window's second group, whose ACQUIREs went out with
    the third's still unanswered: the error reaches the caller, every lease granted so far
    is released (those of the unanswered group too), and the next call works."""
    ks = keys(90)
    assert read_groups(90) == [(0, 4), (4, 20), (20, 90)]
    with KVPoolClient(agent.socket_path) as c:
        assert c.put_many(ks, [bytes([i]) * 100 for i in range(90)]) == [True] * 90
        outs = [bytearray(100) for _ in ks]

        def target(i: int, size: int, meta: bytes) -> bytearray:
            return bytearray(10) if i == 7 else outs[i]  # too small: refused
        try:
            c.get_many_into(ks, target)
        except ValueError as e:
            assert "does not fit" in str(e)
        else:
            raise AssertionError("a destination too small was accepted")
        assert c.stats()["leases"]["read"] == 0
        assert all(outs[i] == bytes([i]) * 100 for i in range(4))  # the group before it
        assert c.get_many_into(ks, lambda i, size, meta: outs[i]) == [100] * 90
        assert all(out == bytes([i]) * 100 for i, out in enumerate(outs))


def test_reads_in_a_releases_held_block_end_their_leases_when_it_ends(agent: LocalAgent) -> None:
    """Inside `releases_held` a read's chunks are copied when it returns, its leases still
    held (another connection sees them) until the block ends; a call made meanwhile takes
    the RELEASEs along first."""
    ks = keys(3)
    with KVPoolClient(agent.socket_path) as c, KVPoolClient(agent.socket_path) as other:
        assert c.put_many(ks, [bytes([i]) * 100 for i in range(3)]) == [True] * 3
        outs = [bytearray(100) for _ in ks]
        with c.releases_held():
            assert c.get_many_into(ks, lambda i, size, meta: outs[i]) == [100] * 3
            assert all(out == bytes([i]) * 100 for i, out in enumerate(outs))
            assert other.stats()["leases"]["read"] == 3
        assert c.stats()["leases"]["read"] == 0
        with c.releases_held():
            assert c.get_many_into(ks, lambda i, size, meta: outs[i]) == [100] * 3
            assert c.stats()["leases"]["read"] == 0  # sent before the STATS


def test_meanwhile_runs_once_after_the_first_acquires_and_before_any_target(
        agent: LocalAgent) -> None:
    """`meanwhile` (the caller's work while the agent answers) runs once per call, however
    many windows the call takes, before `target` is asked for any chunk; inline mode too."""
    ks = keys(10)
    seen: list[str] = []
    outs = [bytearray(100) for _ in ks]

    def target(i: int, size: int, meta: bytes) -> bytearray:
        seen.append("target")
        return outs[i]
    for mode in ("zero_copy", "inline"):
        with KVPoolClient(agent.socket_path, batch_window=4, mode=mode) as c:
            c.put_many(ks, [bytes([i]) * 100 for i in range(10)])
            seen.clear()
            sizes = c.get_many_into(ks, target, meanwhile=lambda: seen.append("meanwhile"))
            assert sizes == [100] * 10
            assert seen == ["meanwhile"] + ["target"] * 10, mode
            assert c.get_many_into([], target, meanwhile=lambda: seen.append("again")) == []
            assert "again" not in seen
