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
from itertools import chain, pairwise
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


class HostBlocks:
    """Blocks of host memory as an engine's KV cache lays them out (vLLM's on the CPU), as
    destinations of chunks: block b of layer l is `nbytes` contiguous bytes at
    `bases[l] + b * stride` (b below `num_blocks`), and a chunk of `per` blocks is, for
    each layer in turn, its blocks in order: `size` bytes (`len(bases) * per * nbytes`) of
    metadata `meta` (or metadata `same(meta)` says is the same). `scratch_address`: one
    block's bytes where the blocks a read skips are copied (and dropped). The caller keeps
    the memory alive (`owner`). A read's target is `targets(block ids)`."""

    __slots__ = ("bases", "gaps", "meta", "meta_hash", "nbytes", "num_blocks", "owner", "per",
                 "plan", "same", "scratch_address", "size", "stride")

    def __init__(self, bases: Sequence[int], stride: int, nbytes: int, num_blocks: int,
                 per: int, meta: bytes, *, scratch_address: int, owner: Any = None,
                 same: Callable[[bytes], bool] | None = None,
                 meta_hash: int | None = None) -> None:
        if not bases or per < 1 or nbytes < 1 or stride < nbytes:
            raise ValueError("HostBlocks: at least one layer, one block a chunk, and blocks "
                             "that do not overlap")
        self.bases = list(bases)
        self.stride = stride
        self.nbytes = nbytes
        self.num_blocks = num_blocks
        self.per = per
        self.size = len(self.bases) * per * nbytes
        self.meta = meta
        self.meta_hash = xxhash.xxh3_64_intdigest(meta) if meta_hash is None else meta_hash
        self.same = same
        self.owner = owner
        self.scratch_address = scratch_address
        self.gaps = {b1 - b0 for b0, b1 in pairwise(self.bases)}
        """How far each layer starts from the previous one: a chunk's last range in a
        layer ends where its first in the next begins only if it spans one of these."""
        self.plan: Any = None
        """The compiled read's parameters for these blocks (`leasefree`'s, kept here)."""

    def targets(self, chunks: Sequence[Sequence[int]], skip: int = 0) -> BlockTargets:
        """The target of a read of `len(chunks)` chunks into these block ids (`per` a
        chunk); the first chunk's first `skip` blocks go to scratch."""
        ids = array.array("q", chain.from_iterable(chunks))
        if len(ids) != self.per * len(chunks):
            raise ValueError(f"kvpool: chunks of {self.per} blocks, not "
                             f"{[len(c) for c in chunks]}")
        return self.target(ids, skip)

    def target(self, ids: array.array[int], skip: int = 0) -> BlockTargets:
        """`targets`, the ids given flat (`per` a chunk, i64), as the compiled read takes
        them."""
        per = self.per
        if len(ids) % per:
            raise ValueError(f"kvpool: chunks of {per} blocks, not {len(ids)} ids in all")
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            self.check([ids[k : k + per].tolist() for k in range(0, len(ids), per)])
        return BlockTargets(self, ids, skip)

    def check(self, chunks: Sequence[Sequence[int]]) -> None:
        """One clear error for block ids outside the blocks."""
        for block_ids in chunks:
            if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
                raise ValueError(f"kvpool: block ids {list(block_ids)} out of the KV "
                                 f"cache's {self.num_blocks} blocks")

    def ranges(self, block_ids: Sequence[int], scratch_blocks: int = 0) -> HostRanges:
        """A chunk's destination: for each layer, its blocks in order (adjacent ones
        merged); the first `scratch_blocks` blocks go to scratch. The ids must be in the
        blocks (`check`)."""
        scratch, stride, nbytes = self.scratch_address, self.stride, self.nbytes
        first, n = block_ids[0] if block_ids else 0, len(block_ids)
        if n and not scratch_blocks and stride == nbytes \
                and list(block_ids) == list(range(first, first + n)):
            # the usual chunk: consecutive blocks, one range a layer
            return HostRanges([(base + first * stride, n * nbytes) for base in self.bases],
                              owner=self.owner)
        # The chunk's runs of blocks adjacent in memory, found once for every layer (a
        # block's range follows the previous one's only when the ids are consecutive and
        # blocks are packed), then each layer's ranges from them: a Python step per run
        # and layer, not per block and layer.
        ids = block_ids[scratch_blocks:]
        cuts = [k for k, (a, b) in enumerate(pairwise(ids), 1) if b != a + 1] \
            if stride == nbytes else list(range(1, len(ids)))
        edges = [0, *cuts, len(ids)] if len(ids) else [0]
        offsets = [(ids[s] * stride, (e - s) * nbytes) for s, e in pairwise(edges)]
        lead = [(scratch, nbytes)] * min(scratch_blocks, n)
        bases = self.bases
        if offsets and not lead \
                and offsets[-1][0] + offsets[-1][1] - offsets[0][0] not in self.gaps:
            # no layer's first range follows the previous layer's last in memory
            return HostRanges([(base + o, m) for base in bases for o, m in offsets],
                              owner=self.owner)
        out: list[tuple[int, int]] = []
        for base in bases:
            # Where a range may follow the previous one in memory (a layer's first, the
            # scratch block's), merged as everywhere; within a layer's runs it never does.
            for at, length in lead + [(base + o, m) for o, m in offsets[:1]]:
                if out and out[-1][0] + out[-1][1] == at:
                    out[-1] = (out[-1][0], out[-1][1] + length)
                else:
                    out.append((at, length))
            out += [(base + o, m) for o, m in offsets[1:]]
        return HostRanges(out, owner=self.owner)


class BlockTargets:
    """A read target (`transport.ReadTarget`) into blocks of host memory (`HostBlocks`):
    chunk i of the call goes to block ids `ids[i * per : (i + 1) * per]` when it has the
    blocks' chunk size and metadata, the first chunk's first `skip` blocks to scratch; any
    other chunk is declined (None). With `lease_free`, a window of such a target is read
    in one compiled call that also plans the destinations from the ids (`leasekernel`)."""

    __slots__ = ("blocks", "ids", "skip")

    def __init__(self, blocks: HostBlocks, ids: array.array[int], skip: int = 0) -> None:
        self.blocks = blocks
        self.ids = ids
        self.skip = skip

    def __len__(self) -> int:
        return len(self.ids) // self.blocks.per

    def __call__(self, index: int, size: int, meta: bytes) -> HostRanges | None:
        blocks = self.blocks
        if size != blocks.size or (meta != blocks.meta
                                   and (blocks.same is None or not blocks.same(meta))):
            return None
        per = blocks.per
        if not 0 <= index < len(self.ids) // per:
            return None
        block_ids = self.ids[index * per : (index + 1) * per].tolist()
        blocks.check([block_ids])
        return blocks.ranges(block_ids, self.skip if index == 0 else 0)

    def check(self) -> None:
        """One clear error where a block id is outside the blocks."""
        per = self.blocks.per
        self.blocks.check([self.ids[k : k + per].tolist()
                           for k in range(0, len(self.ids), per)])


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
