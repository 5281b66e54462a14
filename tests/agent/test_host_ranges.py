"""Reads into raw host memory (`HostRanges`, kvpool.agent.hostcopy), through a real agent.

What an engine's KV cache on the CPU uses: the destination is (address, bytes) ranges of
memory it owns, filled in order; a window's copies are made in one native call that sums
the words as it copies, so a WSUM chunk is verified in the copy's own pass.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
from collections.abc import Iterator

import pytest
import torch

from kvpool.agent import checksums, hostcopy, wsumkernel
from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.hostcopy import HostRanges
from kvpool.bench.local import LocalAgent

from .conftest import module_agent
from .test_tensors import chunk_segments, keys_for, kv_cache, packed


def scattered(t: torch.Tensor, cuts: list[int]) -> HostRanges:
    """`t`'s bytes as ranges cut at `cuts`."""
    base, n = t.data_ptr(), t.numel() * t.element_size()
    edges = [0, *cuts, n]
    pieces = [(base + a, b - a) for a, b in itertools.pairwise(edges)]
    return HostRanges(pieces, owner=t)


def gathered(ranges: HostRanges) -> bytes:
    return b"".join(ctypes.string_at(a, n) for a, n in ranges.ranges)


BLOCK = wsumkernel.BLOCK_BYTES


@pytest.mark.parametrize(("size", "cut"), [
    (12_288 + 36, []), (12_288 + 36, [4096]), (12_288 + 36, [1000, 5004, 9000]),
    (12_288 + 36, [128 * 7, 128 * 7 + 4]),
    # pieces of whole blocks of pages (copied in four streams) and the rows and words after
    (3 * BLOCK + 12_288 + 36, []), (3 * BLOCK + 12_288 + 36, [4096]),
    (3 * BLOCK + 12_288 + 36, [2 * BLOCK + 128, 2 * BLOCK + 132]),
    # 1 MiB: S1 wraps modulo 2^64 many times
    (64 * BLOCK + 36, [BLOCK - 64]),
])
def test_copy_sums_copies_every_piece_and_its_sums_give_the_wsum_of_the_whole(
        size: int, cut: list[int]) -> None:
    data = os.urandom(size)
    src = (ctypes.c_char * len(data)).from_buffer_copy(data)
    dst = (ctypes.c_char * (len(data) + 64))()
    shift = -ctypes.addressof(dst) % 64  # pieces landing 64-byte aligned and not
    edges = [0, *cut, len(data)]
    pieces: list[int] = []
    for a, b in itertools.pairwise(edges):
        pieces += [ctypes.addressof(src) + a, ctypes.addressof(dst) + shift + a, b - a]
    sums = wsumkernel.copy_sums(pieces)
    assert sums is not None
    assert ctypes.string_at(ctypes.addressof(dst) + shift, len(data)) == data
    s0 = s1 = words = 0
    for k, (a, b) in enumerate(itertools.pairwise(edges)):
        s0 += sums[2 * k]
        s1 += sums[2 * k + 1] + words * sums[2 * k]
        words += (b - a) // 4
    assert (len(data), s0 & checksums.U64, s1 & checksums.U64) == checksums.wsum_sums([data])


def test_the_copys_read_ahead_past_a_pieces_end_never_faults() -> None:
    """The block loop asks for each row's source a block ahead (BLOCK_PREFETCH_BYTES): a
    piece ending where readable memory ends (the next pages cannot be read) is still copied
    and summed, and the process lives (a read there would be a SIGSEGV)."""
    ahead = wsumkernel.BLOCK_PREFETCH_BYTES
    size = 2 * BLOCK
    area = mmap.mmap(-1, size + ahead)
    view = ctypes.c_char.from_buffer(area)
    base = ctypes.addressof(view)
    data = os.urandom(size)
    area[:size] = data
    libc = ctypes.CDLL(None, use_errno=True)  # mmap has no mprotect; 0 is PROT_NONE
    protect = libc.mprotect
    protect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert protect(base + size, ahead, 0) == 0, os.strerror(ctypes.get_errno())
    try:
        dst = (ctypes.c_char * (size + 64))()
        at = ctypes.addressof(dst) + (-ctypes.addressof(dst) % 64)  # the block loop's path
        sums = wsumkernel.copy_sums([base, at, size])
        assert sums is not None
        assert ctypes.string_at(at, size) == data
        assert (size, sums[0], sums[1]) == checksums.wsum_sums([data])
    finally:
        protect(base + size, ahead, mmap.PROT_READ | mmap.PROT_WRITE)
        del view
        area.close()


def test_copy_sums_refuses_pieces_that_are_not_whole_words() -> None:
    src, dst = (ctypes.c_char * 8)(), (ctypes.c_char * 8)()
    with pytest.raises(ValueError, match="multiple of 4"):
        wsumkernel.copy_sums([ctypes.addressof(src), ctypes.addressof(dst), 6])


def test_plan_cuts_copies_at_every_extent_and_range_edge() -> None:
    out: list[int] = []
    assert hostcopy.plan(1000, [(0, 10), (50, 6)], [(7000, 4), (9000, 20)], 16, out) == 3
    assert out == [1000, 7000, 4, 1004, 9000, 6, 1050, 9006, 6]
    with pytest.raises(ValueError, match="does not fit"):
        hostcopy.plan(0, [(0, 16)], [(0, 8)], 16, [])


def test_plan_of_one_extent_is_a_piece_per_range_up_to_the_chunks_end() -> None:
    out = [1, 2, 3]  # (appended to)
    ranges = [(7000, 0), (7100, 4), (7200, 0), (7300, 8), (7400, 8), (7500, 8)]
    assert hostcopy.plan(1000, [(40, 32)], ranges, 16, out) == 3
    assert out == [1, 2, 3, 1040, 7100, 4, 1044, 7300, 8, 1052, 7400, 4]
    assert hostcopy.plan(1000, [(40, 32)], [], 0, out) == 0 and len(out) == 12
    with pytest.raises(ValueError, match="does not fit in 12 bytes"):
        hostcopy.plan(0, [(0, 16)], [(0, 4), (100, 8)], 16, out)
    assert len(out) == 12  # nothing appended by a refused plan
    with pytest.raises(ValueError, match="hold 8 of the chunk's 16"):
        hostcopy.plan(0, [(0, 8)], [(0, 16)], 16, out)


shared_agent = module_agent("shared_agent")


@pytest.fixture
def tclient(shared_agent: LocalAgent) -> Iterator[KVPoolClient]:
    with KVPoolClient(shared_agent.socket_path) as c:
        yield c


def test_wsum_chunks_from_tensors_are_read_into_host_ranges_verified(
        tclient: KVPoolClient) -> None:
    cache = kv_cache(3)
    keys = keys_for(3)
    chunks = [chunk_segments(cache, b) for b in range(3)]
    assert tclient.put_many(keys, chunks) == [True] * 3
    size = len(packed(chunks[0]))
    outs = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
    dests = [scattered(o, [size // 3 - size // 3 % 4, size // 2 - size // 2 % 4]) for o in outs]
    assert tclient.get_many_into(keys, lambda i, n, m: dests[i], verify=True) == [size] * 3
    for chunk, dest in zip(chunks, dests, strict=True):
        assert gathered(dest) == packed(chunk)


def test_xxh3_chunks_from_buffers_are_read_into_host_ranges_verified(
        tclient: KVPoolClient) -> None:
    data = os.urandom(70_001)  # not whole words: copied piece by piece, hashed after
    key = keys_for(1, salt=9)[0]
    assert tclient.put(key, data)
    out = torch.zeros(len(data) + 3, dtype=torch.uint8)
    dest = scattered(out, [5, 40_000])
    assert tclient.get_many_into([key], lambda i, n, m: dest, verify=True) == [len(data)]
    assert gathered(dest)[: len(data)] == data


@pytest.mark.parametrize("kind", ["wsum", "xxh3"])
def test_a_flipped_byte_read_into_host_ranges_is_a_miss(tclient: KVPoolClient,
                                                         kind: str) -> None:
    key = keys_for(1, salt=5 if kind == "wsum" else 15)[0]
    if kind == "wsum":
        segments = chunk_segments(kv_cache(8), 0)
        assert tclient.put_many([key], [segments]) == [True]
        size = len(packed(segments))
    else:
        size = 65_536
        assert tclient.put(key, os.urandom(size))
    conn = tclient._live().conn
    lease = conn.call(p.Acquire(conn.rid(), key))
    assert isinstance(lease, p.AcquireReply)
    assert lease.checksum_kind == (checksums.WSUM if kind == "wsum" else checksums.XXH3)
    arena = tclient._arena
    assert arena is not None
    arena[lease.extents[0][0] + 77] ^= 0x80
    conn.cast(p.Release(conn.rid(), lease.lease))
    out = torch.zeros(size, dtype=torch.uint8)
    dest = scattered(out, [size // 2])
    assert tclient.get_many_into([key], lambda i, n, m: dest, verify=True) == [0]
    # without verifying, the bytes are copied as they are
    assert tclient.get_many_into([key], lambda i, n, m: dest, verify=False) == [size]


def test_host_ranges_too_small_for_the_chunk_are_refused_and_it_stays_stored(
        tclient: KVPoolClient) -> None:
    key = keys_for(1, salt=6)[0]
    assert tclient.put(key, b"x" * 8192)
    out = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        tclient.get_many_into([key], lambda i, n, m: scattered(out, []))
    assert tclient.get(key) == b"x" * 8192


def test_inline_mode_fills_host_ranges_from_the_frames(shared_agent: LocalAgent) -> None:
    with KVPoolClient(shared_agent.socket_path, mode="inline") as c:
        key = keys_for(1, salt=7)[0]
        data = os.urandom(10_000)
        assert c.put(key, data)
        out = torch.zeros(len(data), dtype=torch.uint8)
        dest = scattered(out, [3000])
        assert c.get_many_into([key], lambda i, n, m: dest) == [len(data)]
        assert gathered(dest) == data
