"""PipelinedClient against a real agent: whole batches per round trip, zero-copy both ways."""

from __future__ import annotations

import os

import numpy as np

from kvpool.agent import protocol as p
from kvpool.agent.integrations.pipeline import PipelinedClient
from kvpool.agent.local import LocalAgent


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def test_batches_larger_than_the_window_round_trip_with_their_metadata(agent: LocalAgent) -> None:
    ks = keys(10)
    chunks = [np.full(1000 + i, i, dtype=np.uint8) for i in range(10)]
    metas = [f"meta-{i}".encode() for i in range(10)]
    with PipelinedClient(agent.socket_path, window=4) as c:
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
    with PipelinedClient(agent.socket_path) as c:
        c.put_many(stored, [b"a" * 64, b"b" * 64], [b"", b""])
        out = bytearray(64)
        sizes = c.get_many_into([stored[0], missing[0], stored[1]],
                                lambda i, size, meta: None if i == 0 else out)
        assert sizes == [0, 0, 64] and out == b"b" * 64
        assert c.lookup_prefix([stored[0], missing[0], stored[1]]) == 1
        assert c.stats()["leases"]["read"] == 0


def test_refused_chunk_fails_alone_and_stored_keys_are_deduplicated(agent: LocalAgent) -> None:
    ks = keys(3)
    with PipelinedClient(agent.socket_path) as c:
        assert c.hello is not None
        too_big = bytes(c.hello.max_chunk_bytes + 1)
        results = c.put_many(ks, [b"x" * 100, too_big, b"z" * 100], [b"", b"", b""])
        assert results[0] is True and results[2] is True
        assert isinstance(results[1], p.ProtocolError)
        assert results[1].code == p.ErrorCode.BAD_ARGUMENT
        assert c.put_many([ks[0]], [b"y" * 100], [b""]) == [False]
        assert c.get(ks[0]) == b"x" * 100
