"""The WSUM sums of a window of tensor chunks, computed together where the tensors are.

WSUM (`kvpool.agent.checksums`) is a sum and a position-weighted sum of a chunk's 32-bit
words, so it splits: a chunk's sums are those of its parts, each part's weighted sum
shifted by the index of its first word. A put computes the sums of every chunk of a
window in a few torch kernels per 16 MiB of chunk bytes, wherever the source tensors are,
and reads them back once per window (not once per chunk):

- `plan_sums` (pure) cuts the window's chunks into *units*, at most `step_bytes` each,
  and groups the units that can be summed in one go: consecutive whole segments of one
  shape and dtype (stacked into one tensor: the 64 per-layer segments of a KV chunk are
  a few groups, not 64 times 3 kernels), else one unit alone (a slice of a large segment, a
  segment whose address is not 4-byte aligned, the last 1-3 bytes of an odd-sized chunk).
- `sum_rows` sums each group: its words as unsigned values (a uint32 view widened to
  int64: one kernel), times [1, i] (one kernel), summed along the words (one kernel):
  one (S0, S1) row per unit, weights from the unit's start.
- `chunk_sums` adds each chunk's rows on the host (numpy, modulo 2^64 as the definition).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

_cuda: Any = torch.cuda
STEP_BYTES = 1 << 24
"""Chunk bytes one group of kernels takes at most (16 MiB): bounds the int64 temporaries
(24 bytes a word: the widened words and their two products)."""
WORDS, BYTES, TAIL = "words", "bytes", "tail"


class SumUnit(NamedTuple):
    """Bytes [start, start + nbytes) of segment `segment` of the window's chunk `chunk`,
    whose first word is word `first` of the chunk; summed as `how`: WORDS (an int32 view
    of 4-byte aligned memory), BYTES (words assembled from bytes: the memory is not
    aligned) or TAIL (the chunk's last 1-3 bytes, one word padded with zeros). A tuple:
    a window of KV chunks has thousands."""

    chunk: int
    segment: int
    start: int
    nbytes: int
    first: int
    how: str


SegmentInfo = tuple[int, bool, Hashable]
"""What `plan_sums` needs of a segment: its bytes, whether its address is a multiple of
4, and what tensors it can be stacked with (its shape and dtype)."""


def plan_sums(chunks: Sequence[Sequence[SegmentInfo]],
              step_bytes: int = STEP_BYTES) -> list[list[SumUnit]]:
    """The groups of units the window's chunks are summed in, in order (so the rows of
    the groups, one a unit, come chunk by chunk). Every segment but a chunk's last is a
    multiple of 4 bytes (`gpu.wsum_aligned`). A group of more than one unit is whole
    WORDS segments with one stacking key, `step_bytes` at most together."""
    groups: list[list[SumUnit]] = []
    open_group: list[SumUnit] = []
    open_key: Hashable = None
    open_bytes = 0
    for c, segments in enumerate(chunks):
        word = 0
        for s, (nbytes, aligned, key) in enumerate(segments):
            whole = nbytes - nbytes % 4
            if aligned and whole == nbytes and 0 < nbytes <= step_bytes:
                if open_group and (key != open_key or open_bytes + nbytes > step_bytes):
                    groups.append(open_group)
                    open_group = []
                if not open_group:
                    open_key, open_bytes = key, 0
                open_group.append(SumUnit(c, s, 0, nbytes, word, WORDS))
                open_bytes += nbytes
                word += nbytes // 4
                continue
            if open_group:
                groups.append(open_group)
                open_group = []
            for start in range(0, whole, step_bytes):
                n = min(step_bytes, whole - start)
                groups.append([SumUnit(c, s, start, n, word, WORDS if aligned else BYTES)])
                word += n // 4
            if whole < nbytes:
                groups.append([SumUnit(c, s, whole, nbytes - whole, word, TAIL)])
                word += 1
    if open_group:
        groups.append(open_group)
    return groups


def rows_of(groups: Sequence[Sequence[SumUnit]]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's chunk and first word (the rows `sum_rows` makes, one a unit)."""
    units = [u for g in groups for u in g]
    return (np.fromiter((u.chunk for u in units), dtype=np.intp, count=len(units)),
            np.fromiter((u.first for u in units), dtype=np.uint64, count=len(units)))


def chunk_sums(rows: np.ndarray, chunk_of: np.ndarray, first: np.ndarray,
               chunks: int) -> tuple[list[int], list[int]]:
    """(S0, S1) of each chunk modulo 2^64 from the rows' (S0, S1 from the unit's start,
    int64 wrapped as the definition's modulo), their chunks and their first words."""
    rows = np.ascontiguousarray(rows, dtype=np.int64).view(np.uint64).reshape(-1, 2)
    s0 = np.zeros(chunks, dtype=np.uint64)
    s1 = np.zeros(chunks, dtype=np.uint64)
    np.add.at(s0, chunk_of, rows[:, 0])
    np.add.at(s1, chunk_of, rows[:, 1] + first * rows[:, 0])  # uint64: wraps modulo 2^64
    return s0.tolist(), s1.tolist()


# --------------------------------------------------------------------------- on the device


class _Constants:
    """Per device: the weights [[1, 1, ...], [0, 1, 2, ...]] (grown on demand) and the
    mask that widens int32 words to their unsigned value in int64."""

    def __init__(self) -> None:
        self._weights: dict[torch.device, torch.Tensor] = {}
        self._masks: dict[torch.device, torch.Tensor] = {}

    def weights(self, device: torch.device, n: int) -> torch.Tensor:
        w = self._weights.get(device)
        if w is None or w.shape[1] < n:
            size = max(n, 1 << 16)
            w = torch.stack([torch.ones(size, dtype=torch.int64, device=device),
                             torch.arange(size, dtype=torch.int64, device=device)])
            self._settle(device)
            self._weights[device] = w
        return w[:, :n]

    def mask(self, device: torch.device) -> torch.Tensor:
        m = self._masks.get(device)
        if m is None:
            # one dimension (not a 0-dim tensor): int32 & int64 then computes in int64
            m = torch.tensor([0xFFFFFFFF], dtype=torch.int64, device=device)
            self._settle(device)
            self._masks[device] = m
        return m

    @staticmethod
    def _settle(device: torch.device) -> None:
        if device.type == "cuda":
            # Made on whatever stream is current, read later on others: let it finish
            # (once per device and size).
            _cuda.synchronize(device)


_constants = _Constants()


def byte_view(seg: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes (uint8, 1-D)."""
    return seg.reshape(-1).view(torch.uint8)


def _bytes_as_words(b: torch.Tensor) -> torch.Tensor:
    """Whole words of bytes not aligned to 4 in their storage, as unsigned values (int64)."""
    w = b.view(-1, 4).to(torch.int64)
    return w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24)


def _unsigned_words(group: Sequence[SumUnit], chunks: Sequence[Sequence[torch.Tensor]],
                    device: torch.device) -> torch.Tensor:
    """The group's words as unsigned values in int64, one row a unit ([units, words])."""
    first = group[0]
    seg = chunks[first.chunk][first.segment]
    if first.how == BYTES:
        return _bytes_as_words(byte_view(seg)[first.start : first.start + first.nbytes])[None]
    if len(group) > 1:  # whole segments of one shape and dtype: stacked (one copy kernel)
        stacked = torch.stack([chunks[u.chunk][u.segment] for u in group])
        words = stacked.reshape(len(group), -1).view(torch.int32)
    elif first.start == 0 and first.nbytes == seg.nbytes:
        words = seg.reshape(1, -1).view(torch.int32)
    else:
        words = byte_view(seg)[first.start : first.start + first.nbytes].view(torch.int32)[None]
    return widen(words, device)


def widen(words: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 words as their unsigned values in int64."""
    try:
        return words.view(torch.uint32).to(torch.int64)  # zero-extended: one kernel
    except RuntimeError:  # a torch without uint32 conversions here
        return masked(words, device)


def masked(words: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`widen` by a mask, which int32 & int64 computes in int64 (one kernel too, slower on
    a CPU)."""
    return torch.bitwise_and(words, _constants.mask(device))


def _tail_row(unit: SumUnit, chunks: Sequence[Sequence[torch.Tensor]],
              device: torch.device) -> torch.Tensor:
    b = byte_view(chunks[unit.chunk][unit.segment])[unit.start : unit.start + unit.nbytes]
    padded = torch.zeros(4, dtype=torch.int64, device=device)
    padded[: unit.nbytes] = b.to(torch.int64)
    last = padded[0] | (padded[1] << 8) | (padded[2] << 16) | (padded[3] << 24)
    return torch.stack([last, torch.zeros_like(last)])[None]


def sum_rows(groups: Sequence[Sequence[SumUnit]], chunks: Sequence[Sequence[torch.Tensor]],
             device: torch.device) -> torch.Tensor:
    """One (S0, S1) row a unit ([units, 2], int64), queued on the current stream: S1
    weighs each unit's words from the unit's start (`chunk_sums` shifts them)."""
    rows = []
    for group in groups:
        if group[0].how == TAIL:
            rows.append(_tail_row(group[0], chunks, device))
            continue
        try:
            u = _unsigned_words(group, chunks, device)
        except RuntimeError:  # a dtype with no int32 view: its bytes, unit by unit
            for unit in group:
                seg = byte_view(chunks[unit.chunk][unit.segment])
                u = _bytes_as_words(seg[unit.start : unit.start + unit.nbytes])[None]
                rows.append((u[:, None, :] * _constants.weights(device, u.shape[1])).sum(2))
            continue
        rows.append((u[:, None, :] * _constants.weights(device, u.shape[1])).sum(2))
    if not rows:
        return torch.zeros((0, 2), dtype=torch.int64, device=device)
    return rows[0] if len(rows) == 1 else torch.cat(rows)
