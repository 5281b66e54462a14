"""Checksum kinds: WSUM's definition, its device and CPU computations agreeing, what it
detects, the copy plan between lease extents and segments, and the agent keeping the
kind with the chunk (COMMIT, NVMe blob header)."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import pytest
import torch

from kvpool.agent import checksums, tensorsums, wsumkernel
from kvpool.agent import protocol as p
from kvpool.agent.gpu import Piece, plan_copies
from kvpool.agent.tiers import base

from .conftest import RawConn
from .test_nvme import chunk_file, nvme_agent, settle

KiB = 1 << 10


def wsum_by_definition(data: bytes, meta: bytes = b"") -> int:
    """The docstring's definition, word by word in Python integers."""
    padded = data + b"\0" * (-len(data) % 4)
    words = [int.from_bytes(padded[i : i + 4], "little") for i in range(0, len(padded), 4)]
    s0 = sum(words) % 2**64
    s1 = sum(i * u for i, u in enumerate(words)) % 2**64
    return checksums.wsum_finish(len(data), s0, s1, meta)


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 1000, 4099])
def test_the_cpu_wsum_is_the_definition_however_the_bytes_are_cut(size: int) -> None:
    data = random.Random(size).randbytes(size)
    cuts = sorted({0, size, *random.Random(size + 1).sample(range(size + 1), min(size, 4))})
    parts = [data[a:b] for a, b in itertools.pairwise(cuts)]
    assert checksums.compute(checksums.WSUM, parts, b"m") == wsum_by_definition(data, b"m")


def test_the_cpu_wsum_wraps_sums_modulo_2_64_like_the_definition() -> None:
    data = b"\xff" * (1 << 20)  # S1 far beyond 2^64
    assert checksums.compute(checksums.WSUM, [data]) == wsum_by_definition(data)


ROW = wsumkernel.ROW_BYTES


def test_the_compiled_wsum_loop_is_there_where_the_agent_is_installed() -> None:
    # llvmlite is the agent's dependency: without the loop WSUM falls back to numpy,
    # several times slower than XXH3, and nothing else would say so
    assert wsumkernel.kernel() is not None


@pytest.mark.parametrize("kernel", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("size", [
    ROW - 1, ROW, ROW + 1, 2 * ROW + 3, 5 * ROW + 126, 64 * KiB + 5, 257 * KiB + 2])
@pytest.mark.parametrize("offset", [0, 1, 2, 3, 5, 60])
def test_both_cpu_wsums_are_the_definition_at_any_size_alignment_and_cut(
        kernel: bool, size: int, offset: int) -> None:
    rng = random.Random(size * 64 + offset)
    data = rng.randbytes(size)
    # the chunk's bytes start `offset` bytes into their buffer: unaligned words and rows
    whole = memoryview(bytearray(rng.randbytes(offset)) + data)[offset:]
    cuts = sorted({0, size, *rng.sample(range(size + 1), 6)})
    parts = [whole[a:b] for a, b in itertools.pairwise(cuts)]
    want = wsum_by_definition(data, b"meta")
    assert checksums.wsum_finish(*checksums.wsum_sums(parts, kernel), b"meta") == want
    assert checksums.wsum_finish(*checksums.wsum_sums([whole], kernel), b"meta") == want


def test_the_streaming_wsum_takes_parts_down_to_single_bytes() -> None:
    data = random.Random(3).randbytes(3 * ROW + 7)
    h = checksums.Wsum()
    for i in range(len(data)):
        h.update(data[i : i + 1])
    assert h.intdigest(b"m") == wsum_by_definition(data, b"m")


@pytest.mark.parametrize("kernel", [True, False], ids=["compiled", "numpy"])
def test_both_cpu_wsums_wrap_every_sum_modulo_2_64_on_a_large_chunk(kernel: bool) -> None:
    # all words 2^32 - 1: S0 = n u and S1 = u n (n - 1) / 2, both far beyond 2^64 (the
    # compiled loop's row and lane sums wrap many times over), in closed form
    size = 64 << 20
    n, u = size // 4, 2**32 - 1
    got = checksums.wsum_sums([b"\xff" * size], kernel)
    assert got == (size, n * u % 2**64, u * n * (n - 1) // 2 % 2**64)


def device_wsum(segments: list[torch.Tensor], size: int, meta: bytes) -> int:
    """WSUM of one chunk the way a tensor put computes it (`kvpool.agent.tensorsums`)."""
    infos = [(s.nbytes, s.data_ptr() % 4 == 0, (s.shape, s.dtype)) for s in segments]
    groups = tensorsums.plan_sums([infos])
    rows = tensorsums.sum_rows(groups, [segments], torch.device("cpu"))
    s0, s1 = tensorsums.chunk_sums(rows.numpy(), *tensorsums.rows_of(groups), 1)
    return checksums.wsum_finish(size, s0[0], s1[0], meta)


@pytest.mark.parametrize("sizes", [[4096], [1000, 2000, 7], [4, 4, 4, 1], [65536, 12]])
def test_the_tensor_wsum_equals_the_agents(sizes: list[int]) -> None:
    g = torch.Generator().manual_seed(len(sizes))
    segments = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    data = b"".join(s.numpy().tobytes() for s in segments)
    assert device_wsum(segments, len(data), b"k") == \
        checksums.compute(checksums.WSUM, [data], b"k")


def test_the_tensor_wsum_of_a_view_not_aligned_in_its_storage_equals_the_agents() -> None:
    storage = torch.randint(0, 256, (4097,), dtype=torch.uint8)
    seg = storage[1:]  # its bytes start one byte into the storage: no int32 view of it
    assert device_wsum([seg], 4096, b"") == \
        checksums.compute(checksums.WSUM, [seg.numpy().tobytes()])


def test_wsum_detects_any_damage_confined_to_two_words() -> None:
    rng = random.Random(7)
    data = bytearray(rng.randbytes(4096))
    good = checksums.compute(checksums.WSUM, [bytes(data)])
    for _ in range(300):
        bad = bytearray(data)
        for word in rng.sample(range(1024), rng.choice([1, 2])):
            at = 4 * word + rng.randrange(4)
            bad[at] = (bad[at] + rng.randrange(1, 256)) % 256
        assert checksums.compute(checksums.WSUM, [bytes(bad)]) != good
    swapped = bytearray(data)
    swapped[0:4], swapped[400:404] = data[400:404], data[0:4]
    if data[0:4] != data[400:404]:
        assert checksums.compute(checksums.WSUM, [bytes(swapped)]) != good


def test_wsum_depends_on_the_size_and_the_metadata() -> None:
    assert checksums.compute(checksums.WSUM, [b"abc"]) != \
        checksums.compute(checksums.WSUM, [b"abc\0"])
    assert checksums.compute(checksums.WSUM, [b"abcd"], b"x") != \
        checksums.compute(checksums.WSUM, [b"abcd"], b"y")


def test_many_wsums_of_one_size_and_metadata_are_each_the_definitions() -> None:
    chunks = [os.urandom(4096) for _ in range(3)]
    sums = [checksums.wsum_sums([c])[1:] for c in chunks]
    packed = b"".join(s0.to_bytes(8, "little") + s1.to_bytes(8, "little") for s0, s1 in sums)
    assert checksums.wsum_finish_many(4096, packed, b"meta") == \
        [checksums.compute(checksums.WSUM, [c], b"meta") for c in chunks]


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown checksum kind"):
        checksums.compute(7, [b"x"])


@pytest.mark.parametrize(("extents", "segments", "size", "plan"), [
    ([(0, 8)], [8], 8, [Piece(0, 0, 0, 8)]),
    ([(100, 8)], [3, 5], 8, [Piece(100, 0, 0, 3), Piece(103, 1, 0, 5)]),
    ([(0, 4), (64, 4)], [8], 8, [Piece(0, 0, 0, 4), Piece(64, 0, 4, 4)]),
    ([(0, 5), (64, 3)], [2, 4, 2], 8,
     [Piece(0, 0, 0, 2), Piece(2, 1, 0, 3), Piece(64, 1, 3, 1), Piece(65, 2, 0, 2)]),
    ([(0, 6)], [4, 4], 6, [Piece(0, 0, 0, 4), Piece(4, 1, 0, 2)]),  # a larger destination
    ([(0, 4)], [0, 4], 4, [Piece(0, 1, 0, 4)]),  # empty segments are skipped
])
def test_the_copy_plan_walks_extents_and_segments_in_step(
        extents: list[tuple[int, int]], segments: list[int], size: int,
        plan: list[Piece]) -> None:
    assert plan_copies(extents, segments, size) == plan


def test_the_copy_plan_refuses_segments_too_small_for_the_chunk() -> None:
    with pytest.raises(ValueError, match="does not fit in 7 bytes"):
        plan_copies([(0, 8)], [3, 4], 8)


def test_the_agent_refuses_an_unknown_kind_and_keeps_the_lease_open(tmp_path: Path) -> None:
    from kvpool.bench.local import LocalAgent

    with LocalAgent("--no-lock", workdir=tmp_path, dram="16Mi") as agent:
        raw = RawConn(agent.socket_path)
        try:
            key, data = b"k" * 16, os.urandom(5000)
            alloc = raw.call(p.Alloc(1, key, len(data)))
            assert isinstance(alloc, p.AllocReply)
            bad = raw.call(p.Commit(2, alloc.lease, 1, 7))
            assert isinstance(bad, p.ErrorReply) and bad.code == p.ErrorCode.BAD_ARGUMENT
            # still open: the same lease commits with a kind the agent knows
            assert isinstance(raw.call(p.Commit(3, alloc.lease, 1, checksums.XXH3)),
                              p.CommitReply)
        finally:
            raw.close()


def test_a_wsum_chunk_keeps_its_kind_on_nvme_and_is_verified_there(tmp_path: Path) -> None:
    from kvpool.agent.client import KVPoolClient

    nvme_dir = tmp_path / "nvme"
    with nvme_agent(tmp_path) as agent, KVPoolClient(agent.socket_path) as c:
        chunks = {os.urandom(16): torch.randint(0, 256, (256 * KiB,), dtype=torch.uint8)
                  for _ in range(24)}
        for key, chunk in chunks.items():  # one by one: a window's leases would fill DRAM
            assert c.put_many([key], [chunk]) == [True]
        settle(c)
        down = [k for k in chunks if chunk_file(nvme_dir, k).exists()]
        assert len(down) >= 2
        blob = chunk_file(nvme_dir, down[0]).read_bytes()
        assert base.decode(blob).checksum_kind == checksums.WSUM  # verified on decode
        assert c.get(down[0], verify=True) == chunks[down[0]].numpy().tobytes()

        path = chunk_file(nvme_dir, down[1])
        damaged = bytearray(path.read_bytes())
        damaged[-100] ^= 0x04
        path.write_bytes(bytes(damaged))
        assert c.get(down[1]) is None  # a miss, never the damaged bytes
