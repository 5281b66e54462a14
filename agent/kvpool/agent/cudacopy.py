"""A tensor window's copies as flat arrays, made in one call: `cuMemcpyBatchAsync` on CUDA.

A window of tensor chunks is many copies (a chunk of 64 per-layer segments is 64 copies;
32k tokens of Llama-3-8B's KV are 8,192). Made one `copy_` at a time, each costs two tensor
views and a launch, several µs of Python per piece, far more than the DMA of a 512 KiB
piece. Here the window's pieces are planned as integers (`plan_flat`, no Python object a
piece), turned into address arrays with numpy (`CopyPlan.arrays`), and handed to the
driver in one call per window and direction (`BatchCopier`, CUDA 12.8+ drivers).

`cuMemcpyBatchAsync` is called through ctypes from the driver library (`libcuda.so.1`,
present wherever a GPU is). Its signature changed: the exported `cuMemcpyBatchAsync` is
the CUDA 12.8 one, with a `failIdx` argument before the stream, and drivers keep that
export as it is for binaries built against 12.8; CUDA 13.0 headers name the variant
without `failIdx` `cuMemcpyBatchAsync_v2`. We call the 12.8 export, whose arguments are
the same on every driver that has it. A driver without it, or any error it returns, makes
the caller fall back to one `copy_` per piece (`gpu.DeviceArena`), after one warning:
slower, never wrong (a batch that failed part-way is made again whole, the same bytes).
"""

from __future__ import annotations

import array
import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
"""The sources are read in stream order (after the work queued before the batch)."""
PIECE = 4
"""Integers a planned piece takes in `CopyPlan.pieces`: arena offset, segment number,
offset in the segment, bytes."""


def plan_flat(extents: Sequence[tuple[int, int]], segment_bytes: Sequence[int], size: int,
              first: int, out: array.array[int]) -> int:
    """Append to `out` the copies that move `size` chunk bytes between the lease `extents`
    (arena offset, length; in order) and the segments (their sizes, in order; numbered
    from `first`), each within one extent and one segment, as `PIECE` integers: arena
    offset, segment number, offset in the segment, bytes. Returns the pieces appended."""
    if len(extents) == 1 and extents[0][1] >= size:
        # The usual lease, one extent: a piece per segment, no step per byte range.
        offset, left, count = extents[0][0], size, 0
        for n, nbytes in enumerate(segment_bytes):
            step = min(nbytes, left)
            if step:
                out.extend((offset, first + n, 0, step))
                offset, left, count = offset + step, left - step, count + 1
            if not left:
                return count
        del out[len(out) - PIECE * count :]
        raise ValueError(f"chunk of {size} bytes does not fit in "
                         f"{sum(segment_bytes)} bytes of segments")
    begin = len(out)
    seg = at = 0
    left = size
    for offset, length in extents:
        length = min(length, left)
        while length > 0:
            while seg < len(segment_bytes) and at == segment_bytes[seg]:
                seg, at = seg + 1, 0
            if seg == len(segment_bytes):
                del out[begin:]
                raise ValueError(f"chunk of {size} bytes does not fit in "
                                 f"{sum(segment_bytes)} bytes of segments")
            step = min(length, segment_bytes[seg] - at)
            out.extend((offset, first + seg, at, step))
            offset, at, length, left = offset + step, at + step, length - step, left - step
    if left:
        del out[begin:]
        raise ValueError(f"the lease extents hold {size - left} of the chunk's {size} bytes")
    return (len(out) - begin) // PIECE


class CopyPlan:
    """The copies of a window, planned as chunks come (`add`) and made together: the
    pieces as integers, and each segment's address (segments numbered in the order
    added). The segments themselves are kept too, alive until the copies are made, and
    for the one-`copy_`-a-piece path."""

    def __init__(self) -> None:
        self.pieces: array.array[int] = array.array("q")
        self.addresses: array.array[int] = array.array("Q")
        self.segments: list[Any] = []

    def __len__(self) -> int:
        return len(self.pieces) // PIECE

    def add(self, extents: Sequence[tuple[int, int]], segments: Sequence[Any],
            segment_bytes: Sequence[int], size: int) -> None:
        """Plan a chunk's copies between a lease's `extents` and its `segments` (tensors,
        contiguous, `segment_bytes` each)."""
        plan_flat(extents, segment_bytes, size, len(self.segments), self.pieces)
        self.segments.extend(segments)
        self.addresses.extend([s.data_ptr() for s in segments])

    def arrays(self, base: int, to_arena: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(destinations, sources, sizes) as uint64 arrays, one entry a piece: addresses in
        the arena mapping at `base` and in the segments."""
        pieces = np.frombuffer(self.pieces, dtype=np.int64).reshape(-1, PIECE).astype(np.uint64)
        arena = pieces[:, 0] + np.uint64(base)
        addresses = np.frombuffer(self.addresses, dtype=np.uint64)
        seg = addresses[pieces[:, 1].astype(np.intp)] + pieces[:, 2]
        sizes = np.ascontiguousarray(pieces[:, 3])
        return (arena, seg, sizes) if to_arena else (seg, arena, sizes)

    def host_copy(self, base: int, to_arena: bool) -> None:
        """Make the pieces between host memory (CPU tensors) and the arena mapping at
        `base`, one `memmove` each: the same addresses `arrays` gives, without numpy (a
        CPU chunk is copied as it is planned, a few pieces at a time)."""
        pieces, addresses = self.pieces, self.addresses
        for k in range(0, len(pieces), PIECE):
            arena = base + pieces[k]
            seg = addresses[pieces[k + 1]] + pieces[k + 2]
            if to_arena:
                ctypes.memmove(arena, seg, pieces[k + 3])
            else:
                ctypes.memmove(seg, arena, pieces[k + 3])


# --------------------------------------------------------------------------- CUDA


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """CUmemcpyAttributes: the order the sources are read in, location hints (none: they
    apply to managed memory only) and flags."""

    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _Location),
                ("dstLocHint", _Location), ("flags", ctypes.c_uint)]


@dataclass
class Batch:
    """One call's arguments, kept alive until the window's fence passed."""

    dst: np.ndarray
    src: np.ndarray
    sizes: np.ndarray
    attributes: _Attributes
    attribute_index: ctypes.c_size_t
    fail_index: ctypes.c_size_t


class BatchCopier:
    """`cuMemcpyBatchAsync` of the driver library (the CUDA 12.8 signature, see above)."""

    def __init__(self, lib: Any) -> None:
        fn = lib.cuMemcpyBatchAsync  # AttributeError on a driver older than 12.8
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # dsts, srcs, sizes
                       ctypes.c_size_t,  # count
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,  # attrs, idxs, num
                       ctypes.c_void_p,  # failIdx
                       ctypes.c_void_p]  # hStream
        current = lib.cuCtxGetCurrent
        current.restype = ctypes.c_int
        current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._fn = fn
        self._current = current

    def has_context(self) -> bool:
        """Whether this thread has a current CUDA context (the driver call needs one)."""
        ctx = ctypes.c_void_p()
        return self._current(ctypes.byref(ctx)) == 0 and bool(ctx.value)

    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray,
             stream: int) -> tuple[int, Batch]:
        """Queue the pieces on `stream` (not the legacy default stream, 0): the driver's
        result (0: queued) and what must stay alive until they completed."""
        order = _Attributes(srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        batch = Batch(dst, src, sizes, order, ctypes.c_size_t(0), ctypes.c_size_t(0))
        err = self._fn(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, len(sizes),
                       ctypes.addressof(batch.attributes), ctypes.addressof(batch.attribute_index),
                       1, ctypes.addressof(batch.fail_index), stream or None)
        return int(err), batch


class _Loaded:
    """The process's batch copier, loaded at first use; None once it is known not to work
    here (`why` says why)."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self.library = library
        self.copier: BatchCopier | None = None
        self.why = ""
        self._tried = False

    def get(self) -> BatchCopier | None:
        if not self._tried:
            self._tried = True
            try:
                self.copier = BatchCopier(ctypes.CDLL(self.library))
            except (OSError, AttributeError) as e:
                self.disable(f"no cuMemcpyBatchAsync in {self.library} ({e})")
        return self.copier

    def disable(self, why: str) -> None:
        """Stop batching for this process, saying so once."""
        if self.copier is not None or not self.why:
            log.warning("GPU copies are made one copy_ a piece (slower): %s", why)
        self.copier, self.why, self._tried = None, why, True


loaded = _Loaded()
uses: dict[str, int] = {"batched": 0, "per_piece": 0, "host": 0}
"""Windows copied each way by this process (`kvpool bench --gpu` reports them)."""


def report() -> dict[str, object]:
    """How this process's tensor windows were copied: windows each way, and the batch
    call's state ("cuMemcpyBatchAsync", or why it is not used, or "not tried")."""
    state = "cuMemcpyBatchAsync" if loaded.copier is not None else loaded.why or "not tried"
    return {"windows": dict(uses), "batch_call": state}
