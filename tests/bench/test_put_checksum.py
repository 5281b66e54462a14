"""The zero-copy put hashes while it copies: its checksum must be `protocol.checksum` exactly.

The agent and every reader verify chunks against `checksum(data, meta)` (meta
first, then data); the client now streams that hash block by block across the
arena extents, so these tests pin the two to each other.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from kvpool.agent import checksums
from kvpool.agent import protocol as p
from kvpool.agent.chunkblocks import COPY_BLOCK
from kvpool.agent.client import KVPoolClient
from kvpool.agent.transport import copy_and_checksum, copy_out
from kvpool.bench.local import LocalAgent


@pytest.mark.parametrize("size", [0, 1, COPY_BLOCK - 1, COPY_BLOCK, 3 * COPY_BLOCK + 4097])
@pytest.mark.parametrize("meta", [b"", b'{"shape":[2,8,128]}'])
@pytest.mark.parametrize("pieces", [1, 3])
def test_streamed_checksum_equals_protocol_checksum(size: int, meta: bytes,
                                                    pieces: int) -> None:
    data = os.urandom(size)
    # Extents out of order and apart in the arena, like a fragmented allocator's.
    cut = [size * i // pieces for i in range(pieces + 1)]
    lengths = [b - a for a, b in itertools.pairwise(cut)]
    arena = bytearray(2 * size + 3 * 4096 * pieces + 4096)
    extents, offset = [], len(arena)
    for n in lengths:
        offset -= n + 4096
        extents.append((offset, n))
    digest = copy_and_checksum(memoryview(arena), extents, memoryview(data), meta)
    assert digest == p.checksum(data, meta)
    copied = b"".join(bytes(arena[o : o + n]) for o, n in extents)
    assert copied == data


@pytest.mark.parametrize("size", [1, COPY_BLOCK, 3 * COPY_BLOCK + 4097])
@pytest.mark.parametrize("meta", [b"", b'{"shape":[2,8,128]}'])
@pytest.mark.parametrize("kind", [checksums.XXH3, checksums.WSUM])
def test_a_verified_read_copies_the_chunk_and_misses_on_one_flipped_byte(
        size: int, meta: bytes, kind: int) -> None:
    """`copy_out` with the ACQUIRE reply copies across extents and checks the chunk's
    checksum in the same pass (XXH3) or after the copy (WSUM): equal bytes pass, and a
    byte flipped in the arena, first or last, is caught."""
    data = os.urandom(size - size % 4 or 4)  # WSUM sums 4-byte words
    half = len(data) // 2
    extents = [(8192 + half + 4096, len(data) - half), (0, half)]  # apart, out of order
    arena = bytearray(2 * len(data) + 3 * 4096 + 8192)
    for (offset, n), piece in zip(extents, (data[half:], data[:half]), strict=True):
        arena[offset : offset + n] = piece
    arena_order = [extents[1], extents[0]]  # the chunk's bytes: first half, then second
    reply = p.AcquireReply(1, lease=1, size=len(data),
                           checksum=checksums.compute(kind, [data], meta),
                           extents=arena_order, meta=meta, tier=0, checksum_kind=kind)
    out = bytearray(len(data))
    assert copy_out(memoryview(arena), arena_order, memoryview(out), reply)
    assert out == data
    for offset in (arena_order[0][0], arena_order[1][0] + arena_order[1][1] - 1):
        damaged = bytearray(arena)
        damaged[offset] ^= 0x40
        assert not copy_out(memoryview(damaged), arena_order, memoryview(out), reply)


def test_chunk_put_through_the_agent_verifies_on_read(tmp_path: Path) -> None:
    data = os.urandom(5 * COPY_BLOCK + 123)
    meta = b'{"layer":7}'
    with LocalAgent("--no-lock", workdir=tmp_path, dram="32Mi") as agent, \
            KVPoolClient(agent.socket_path) as client:
        assert client.put(b"k" * 16, data, meta=meta)
        # verify=True recomputes protocol.checksum over what it read and compares it
        # with the digest the put committed.
        assert client.get_with_meta(b"k" * 16, verify=True) == (data, meta)
