"""Reads into raw host memory: a window's copies and their checksums in one native call.

A read destination may be `HostRanges`: (address, bytes) ranges of host memory the caller
owns (e.g. the blocks of an inference engine's KV cache on the CPU), filled in order. The
copies from the arena into them are planned here as plain integers and made together,
once per group of a read window (`transport.read_window`), by one call of the compiled
loop of
`kvpool.agent.wsumkernel` (`copy_sums`): it copies each piece and sums its 32-bit words
in the same pass (WSUM, `kvpool.agent.checksums`), and it runs without the GIL.

Why one call and no Python per piece: an engine's own threads keep the GIL busy (vLLM's
engine loop steps while a request waits for its KV), and a thread that lets the GIL go
(any I/O, any torch call, any ctypes call) gets it back only at the interpreter's switch
interval (5 ms), so a read made of one copy and one checksum call per layer and block
waited milliseconds per call. Here a window lets the GIL go a few times per group.

Checksums: a WSUM chunk is verified from the sums the copy made; an XXH3 chunk (written
from buffers) is hashed from the destination after the copy. Without the compiled loop
(no llvmlite) or for pieces not made of whole words, each piece is copied with `memmove`
and verified from the destination: the same results, slower.
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from . import checksums, wsumkernel
from . import protocol as p

Check = Callable[[], bool]


@dataclass(frozen=True, slots=True)
class HostRanges:
    """A chunk's destination in host memory: byte ranges (address, length) filled in
    order. The caller keeps the memory alive and writable (`owner`, e.g. the tensors the
    addresses point into) until the read returns; the ranges hold at least the chunk."""

    ranges: Sequence[tuple[int, int]]
    owner: Any = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.ranges)


class HostTargets:
    """A read target (`transport.ReadTarget`) whose destinations are known before the read:
    chunk i of the call goes to host ranges i when it has `size` bytes and metadata `meta`
    (or metadata `same(meta)` says is the same), and any other chunk is declined (None).

    The ranges are given flat, as a compiled loop takes them: `ranges` the (address, bytes)
    pairs of every chunk one after the other, `starts` (one more than the chunks) where each
    chunk's pairs begin. A lease-free read of such a window makes its table reads, copies
    and checks in compiled calls (`leasekernel`). `meta_hash`: the metadata's XXH3-64, if
    the caller has it (else computed here)."""

    __slots__ = ("meta", "meta_hash", "owner", "ranges", "same", "size", "starts")

    def __init__(self, size: int, meta: bytes, ranges: Sequence[int], starts: Sequence[int],
                 *, same: Callable[[bytes], bool] | None = None, owner: Any = None,
                 meta_hash: int | None = None) -> None:
        self.size = size
        self.meta = meta
        self.meta_hash = xxhash.xxh3_64_intdigest(meta) if meta_hash is None else meta_hash
        self.same = same
        self.owner = owner
        """What the addresses point into, kept alive with the target."""
        self.ranges: array.array[int] = ranges if isinstance(ranges, array.array) \
            else array.array("Q", ranges)
        self.starts: array.array[int] = starts if isinstance(starts, array.array) \
            else array.array("Q", starts)

    def __call__(self, index: int, size: int, meta: bytes) -> HostRanges | None:
        if size != self.size or (meta != self.meta
                                 and (self.same is None or not self.same(meta))):
            return None
        if index + 1 >= len(self.starts):
            return None
        flat = self.ranges
        first, end = self.starts[index], self.starts[index + 1]
        return HostRanges([(flat[2 * k], flat[2 * k + 1]) for k in range(first, end)],
                          owner=self.owner)


def address_of(buffer: Any) -> int:
    """The address of a buffer's first byte, read-only ones included (a read-only mapping
    has no writable export for ctypes); the export ends at once, so the buffer can still
    be closed."""
    view = _PyBuffer()
    if ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(buffer), ctypes.byref(view), 0):
        raise TypeError("not a buffer")
    try:
        return view.buf or 0
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p),
                ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
                ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
                ("internal", ctypes.c_void_p)]


def plan(base: int, extents: Sequence[tuple[int, int]], ranges: Sequence[tuple[int, int]],
         size: int, out: list[int]) -> int:
    """Append to `out` the copies (source address, destination address, bytes) that move
    `size` chunk bytes from the lease `extents` (arena offsets from `base`, in order) into
    `ranges` (in order), each within one extent and one range; the number appended."""
    if len(extents) == 1 and extents[0][1] >= size:
        # A lease-free read's (and most leases'): one extent, so a piece per range, the
        # source advancing with it (a Python step per range, no more).
        src, left, count = base + extents[0][0], size, 0
        for dst, n in ranges:
            if n >= left:
                if left:
                    out += (src, dst, left)
                    count += 1
                return count
            if n:
                out += (src, dst, n)
                count += 1
                src, left = src + n, left - n
        if not left:
            return count
        del out[len(out) - 3 * count:]  # (too small: refused below, nothing appended)
    if sum(n for _, n in ranges) < size:
        raise ValueError(f"chunk of {size} bytes does not fit in "
                         f"{sum(n for _, n in ranges)} bytes of host ranges")
    count = 0
    left = size
    r = 0
    dst, room = ranges[0] if ranges else (0, 0)
    for offset, length in extents:
        src = base + offset
        length = min(length, left)
        while length > 0:
            while room == 0:
                r += 1
                dst, room = ranges[r]
            step = min(length, room)
            out += (src, dst, step)
            count += 1
            src, dst, room, length, left = src + step, dst + step, room - step, \
                length - step, left - step
    if left:
        raise ValueError(f"the lease extents hold {size - left} of the chunk's {size} bytes")
    return count


class HostReads:
    """Reads into `HostRanges`: planned by `add`, made by `run` (one call for everything
    added since the last run), each verified by the check `add` returned, asked once the
    `run` after it returned."""

    def __init__(self, arena: memoryview, base: int, verify: bool) -> None:
        self.arena = arena
        self.base = base
        self.verify = verify
        self._batch = _Batch()

    def add(self, lease: p.AcquireReply, out: HostRanges) -> Check:
        batch = self._batch
        first = len(batch.pieces) // 3
        count = plan(self.base, lease.extents, out.ranges, lease.size, batch.pieces)
        kind, wanted, meta, size = lease.checksum_kind, lease.checksum, lease.meta, lease.size

        def check() -> bool:
            assert batch.ran, "HostReads.run() first"
            if not self.verify:
                return True
            if kind == checksums.WSUM and batch.sums is not None:
                return batch.wsum(first, count, size, meta) == wanted
            views = [_view(d, n) for d, n in batch.triples(first, count)]
            return checksums.compute(kind, views, meta) == wanted
        return check

    def run(self) -> None:
        """Make every copy planned since the last run."""
        batch, self._batch = self._batch, _Batch()
        batch.run()


class _Batch:
    """Copies made in one call: flat (source, destination, bytes) triples, and after the
    call each piece's word sums."""

    def __init__(self) -> None:
        self.pieces: list[int] = []
        self.sums: list[int] | None = None
        self.ran = False

    def run(self) -> None:
        self.ran = True
        pieces = self.pieces
        if not pieces:
            return
        whole = not any(n & 3 for n in pieces[2::3])
        self.sums = wsumkernel.copy_sums(pieces) if whole else None
        if self.sums is None:
            for k in range(0, len(pieces), 3):
                ctypes.memmove(pieces[k + 1], pieces[k], pieces[k + 2])

    def triples(self, first: int, count: int) -> list[tuple[int, int]]:
        """(destination, bytes) of pieces `first` .. `first + count - 1`."""
        pieces = self.pieces
        return [(pieces[3 * k + 1], pieces[3 * k + 2]) for k in range(first, first + count)]

    def wsum(self, first: int, count: int, size: int, meta: bytes) -> int:
        """A chunk's WSUM from its pieces' sums (word indices from each piece's start)."""
        assert self.sums is not None
        sums, pieces = self.sums, self.pieces
        s0 = s1 = words = 0
        for k in range(first, first + count):
            p0 = sums[2 * k]
            s0 += p0
            s1 += sums[2 * k + 1] + words * p0
            words += pieces[3 * k + 2] >> 2
        return checksums.wsum_finish(size, s0 & checksums.U64, s1 & checksums.U64, meta)


def scatter(data: bytes, out: HostRanges) -> None:
    """Copy a chunk's bytes into `out`'s ranges in order (inline mode: no arena)."""
    pieces: list[int] = []
    source = (ctypes.c_char * len(data)).from_buffer_copy(data) if data else None
    if source is not None:
        plan(ctypes.addressof(source), [(0, len(data))], out.ranges, len(data), pieces)
    for k in range(0, len(pieces), 3):
        ctypes.memmove(pieces[k + 1], pieces[k], pieces[k + 2])


def _view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
