"""A tensor window's copies and checksums made together: the copy plan as flat arrays
(`kvpool.agent.cudacopy`), the copies made from it on the host and one `copy_` a piece
(the path a GPU falls back to), the batch call's absence said once, and the window's WSUM
sums (`kvpool.agent.tensorsums`) equal to the agent's definition for any layout.

CPU tensors throughout: the arrays and the sums are the same on a GPU, where only the
call that makes the copies differs (the whole window through a real agent is in
test_tensors.py)."""

from __future__ import annotations

import array
import ctypes
import logging

import pytest
import torch

from kvpool.agent import checksums, cudacopy, tensorsums
from kvpool.agent.gpu import DeviceArena, parts_of
from kvpool.agent.tensorsums import BYTES, TAIL, WORDS, SumUnit


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def packed(segments: list[torch.Tensor]) -> bytes:
    return b"".join(s.reshape(-1).view(torch.uint8).numpy().tobytes() for s in segments)


# --------------------------------------------------------------------------- copy plan


def test_a_refused_chunk_leaves_the_windows_plan_as_it_was() -> None:
    out: array.array[int] = array.array("q", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="does not fit in 7 bytes"):
        cudacopy.plan_flat([(0, 8)], [3, 4], 8, 0, out)
    with pytest.raises(ValueError, match="does not fit in 7 bytes"):
        cudacopy.plan_flat([(0, 4), (8, 4)], [3, 4], 8, 0, out)
    with pytest.raises(ValueError, match="extents hold 4 of"):
        cudacopy.plan_flat([(0, 4)], [8], 8, 0, out)
    assert out.tolist() == [1, 2, 3, 4]


def test_the_plan_numbers_segments_across_the_window_and_gives_their_addresses() -> None:
    a, b, c = _random(8, 1), _random(6, 2), _random(4, 3)
    plan = cudacopy.CopyPlan()
    plan.add([(100, 14)], [a, b], [8, 6], 14)
    plan.add([(200, 2), (300, 2)], [c], [4], 4)
    assert len(plan) == 4
    dst, src, sizes = plan.arrays(base=1 << 40, to_arena=True)
    arena = 1 << 40
    assert dst.tolist() == [arena + 100, arena + 108, arena + 200, arena + 300]
    assert src.tolist() == [a.data_ptr(), b.data_ptr(), c.data_ptr(), c.data_ptr() + 2]
    assert sizes.tolist() == [8, 6, 2, 2]
    back_dst, back_src, _ = plan.arrays(base=arena, to_arena=False)
    assert back_dst.tolist() == src.tolist() and back_src.tolist() == dst.tolist()


@pytest.mark.parametrize("how", ["host", "arrays", "per_piece"])
def test_every_way_of_making_the_plan_lays_out_the_chunks_and_reads_them_back(
        how: str) -> None:
    chunks = [[_random(1000, 4), _random(24, 5).view(torch.int32), _random(3, 6)],
              [_random(4096, 7).view(torch.bfloat16).reshape(2, 1024)]]
    extents = [[(4, 500), (1000, 527)], [(2000, 4096)]]
    mapping = memoryview(bytearray(8192))
    arena = DeviceArena(mapping, registrar=None)

    def make(plan: cudacopy.CopyPlan, to_arena: bool) -> None:
        if how == "host":
            plan.host_copy(arena.address, to_arena)
        elif how == "arrays":  # what the batch call is given, made one piece at a time
            dst, src, sizes = plan.arrays(arena.address, to_arena)
            for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
                ctypes.memmove(d, s, n)
        else:  # what a GPU does where the batch call is not available
            arena._copy_pieces(plan, to_arena)

    plan = cudacopy.CopyPlan()
    for ext, segs in zip(extents, chunks, strict=True):
        plan.add(ext, segs, [s.nbytes for s in segs], sum(s.nbytes for s in segs))
    make(plan, to_arena=True)
    for ext, segs in zip(extents, chunks, strict=True):
        assert b"".join(mapping[o : o + n] for o, n in ext) == packed(segs)

    out = [[torch.zeros_like(s) for s in segs] for segs in chunks]
    plan = cudacopy.CopyPlan()
    for ext, segs in zip(extents, out, strict=True):
        plan.add(ext, segs, [s.nbytes for s in segs], sum(s.nbytes for s in segs))
    make(plan, to_arena=False)
    assert [packed(o) for o in out] == [packed(c) for c in chunks]
    arena.close()


def test_a_driver_without_the_batch_call_is_said_once_and_copies_go_one_a_piece(
        caplog: pytest.LogCaptureFixture) -> None:
    loaded = cudacopy._Loaded("libc.so.6")  # a library with no cuMemcpyBatchAsync
    with caplog.at_level(logging.WARNING):
        assert loaded.get() is None
        assert loaded.get() is None
    said = [r.getMessage() for r in caplog.records if "one copy_ a piece" in r.getMessage()]
    assert len(said) == 1 and "cuMemcpyBatchAsync" in said[0]
    assert "cuMemcpyBatchAsync" in loaded.why


# --------------------------------------------------------------------------- the sums


def _info(seg: torch.Tensor) -> tensorsums.SegmentInfo:
    return seg.nbytes, seg.data_ptr() % 4 == 0, (seg.shape, seg.dtype)


def test_whole_segments_of_one_shape_are_summed_together_up_to_a_step() -> None:
    same = (torch.Size([8]), torch.uint8)
    other = (torch.Size([4]), torch.bfloat16)
    chunks = [[(8, True, same)] * 3, [(8, True, same), (8, True, other), (10, True, same)]]
    assert tensorsums.plan_sums(chunks, step_bytes=16) == [
        [SumUnit(0, 0, 0, 8, 0, WORDS), SumUnit(0, 1, 0, 8, 2, WORDS)],
        [SumUnit(0, 2, 0, 8, 4, WORDS), SumUnit(1, 0, 0, 8, 0, WORDS)],  # across chunks
        [SumUnit(1, 1, 0, 8, 2, WORDS)],  # another shape
        [SumUnit(1, 2, 0, 8, 4, WORDS)], [SumUnit(1, 2, 8, 2, 6, TAIL)],  # the odd end
    ]


def test_a_large_or_unaligned_segment_is_summed_alone_step_by_step() -> None:
    key = (torch.Size([40]), torch.uint8)
    chunks = [[(40, True, key), (8, False, key), (4, True, key)]]
    assert tensorsums.plan_sums(chunks, step_bytes=16) == [
        [SumUnit(0, 0, 0, 16, 0, WORDS)], [SumUnit(0, 0, 16, 16, 4, WORDS)],
        [SumUnit(0, 0, 32, 8, 8, WORDS)],
        [SumUnit(0, 1, 0, 8, 10, BYTES)],
        [SumUnit(0, 2, 0, 4, 12, WORDS)],
    ]


def _window() -> list[list[torch.Tensor]]:
    storage = _random(4097, 10)
    return [
        [_random(512, 100 + i).view(torch.bfloat16).reshape(4, 64) for i in range(64)],
        [_random(512, 200 + i).view(torch.bfloat16).reshape(4, 64) for i in range(64)],
        [_random(1000, 11), _random(2000, 12), _random(7, 13)],  # an unaligned tail
        [_random(4, 14), _random(4, 15), _random(4, 16), _random(1, 17)],
        [storage[1:]],  # no int32 view: its bytes start one byte into the storage
        [_random(4096, 18).view(torch.float64), _random(8, 19).view(torch.float64)],
        [_random(64, 20).bool(), _random(0, 21), _random(10000, 22)],
        [_random(0, 23)],
    ]


@pytest.mark.parametrize("step_bytes", [tensorsums.STEP_BYTES, 1024, 64, 4])
def test_a_windows_sums_are_each_chunks_wsum_by_the_agents_definition(
        step_bytes: int) -> None:
    chunks = _window()
    groups = tensorsums.plan_sums([[_info(s) for s in c] for c in chunks], step_bytes)
    rows = tensorsums.sum_rows(groups, chunks, torch.device("cpu"))
    s0, s1 = tensorsums.chunk_sums(rows.numpy(), *tensorsums.rows_of(groups), len(chunks))
    for c, segs in enumerate(chunks):
        data = packed(segs)
        assert checksums.wsum_finish(len(data), s0[c], s1[c], b"m") == \
            checksums.compute(checksums.WSUM, [data], b"m"), f"chunk {c}"


def test_the_sums_wrap_modulo_2_64_as_the_definition_does() -> None:
    # every word 2^32 - 1 over 16 MiB: S1 far beyond 2^64 in every step's row
    ones = torch.full((1 << 24,), 255, dtype=torch.uint8)
    chunks = [[ones], [ones[:64], ones]]
    groups = tensorsums.plan_sums([[_info(s) for s in c] for c in chunks], 1 << 22)
    rows = tensorsums.sum_rows(groups, chunks, torch.device("cpu"))
    s0, s1 = tensorsums.chunk_sums(rows.numpy(), *tensorsums.rows_of(groups), 2)
    for c, size in enumerate([1 << 24, (1 << 24) + 64]):
        n, u = size // 4, 2**32 - 1
        assert (s0[c], s1[c]) == (n * u % 2**64, u * n * (n - 1) // 2 % 2**64)


def test_a_chunks_segments_are_checked_without_a_view() -> None:
    segs = [torch.zeros(4, 8), torch.zeros(3)]
    assert parts_of(segs, "x") == segs  # the tensors themselves
    with pytest.raises(ValueError, match="x, segment 1 is not contiguous"):
        parts_of([torch.zeros(4), torch.zeros(4, 4).t()], "x")
    with pytest.raises(TypeError, match="x, segment 0 is a bytes"):
        parts_of([b"abcd", torch.zeros(4)], "x")  # type: ignore[list-item]


def test_a_windows_sums_queued_in_batches_come_back_for_every_chunk() -> None:
    # on a GPU a window's sums are queued with each batch of copies, collected at its fence
    from kvpool.agent.gpu import _WindowSums

    chunks = _window()
    sums = _WindowSums()
    cpu = torch.device("cpu")
    for i in (0, 2, 5):
        sums.add(i, chunks[i])
    sums.queue(cpu)
    for i in (1, 3, 4, 6, 7):
        sums.add(i, chunks[i])
    sums.queue(cpu)
    sums.collect()
    for i, segs in enumerate(chunks):
        data = packed(segs)
        assert checksums.wsum_finish(len(data), *sums.values[i]) == \
            checksums.compute(checksums.WSUM, [data]), f"chunk {i}"


def test_both_ways_of_widening_words_give_their_unsigned_values() -> None:
    words = torch.tensor([0, 1, -1, -2**31, 2**31 - 1, -12345], dtype=torch.int32)
    want = [0, 1, 2**32 - 1, 2**31, 2**31 - 1, 2**32 - 12345]
    cpu = torch.device("cpu")
    assert tensorsums.widen(words, cpu).tolist() == want
    assert tensorsums.masked(words, cpu).tolist() == want
    assert tensorsums.masked(words, cpu).dtype == torch.int64
