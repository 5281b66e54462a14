"""Tensors as chunk sources and destinations: copies between tensors and the arena.

Imported only when a batch call meets a torch tensor (the light client never imports
torch). A chunk may be one tensor or several *segments* (e.g. one slice per layer for
K and V): the chunk's bytes are the segments' bytes in order, copied straight between
each segment and the lease extents, with no packed intermediate copy.

On CUDA the client's arena mapping is registered with CUDA once per mapping
(`cudaHostRegister`, through `_cuda.cudart()`), so a copy between a GPU tensor
and the arena is a DMA at the pinned-memory rate. A window's copies are planned as
integers as its leases come and made together at its fence, in one driver call
(`kvpool.agent.cudacopy`; one `copy_` a piece where that call is not available). They
go to a stream the caller may pass (default: the device's current stream). A read lease
is released, and a write committed, only after the copies that use it completed on that
stream: the window records an event after its copies and waits for that event (not for
the whole device). CPU tensors take the same path; their copies are made as planned
(one `memmove` a piece) and complete as made.

Writes carry the WSUM checksum kind (`kvpool.agent.checksums`), computed by torch
from the source tensors, every chunk of a window together on a stream of its own that
runs beside the copies (`kvpool.agent.tensorsums`), and read back once a window, so the
put is not capped by CPU hashing; the agent verifies it like XXH3 wherever it verifies a
chunk.
"""

from __future__ import annotations

import array
import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, overload

import numpy as np
import torch

from . import checksums, cudacopy, tensorsums
from . import protocol as p
from .cudacopy import CopyPlan
from .putwindows import CopiesOf
from .transport import (
    Check,
    Copies,
    Digest,
    Meanwhile,
    WindowConnection,
    read_window,
)

Segments = list[torch.Tensor]
log = logging.getLogger(__name__)
_cuda: Any = torch.cuda  # its Event, Stream and cudart() are untyped
QUEUE_BYTES = 32 << 20
"""Chunk bytes planned on a GPU before they are queued, without waiting for the window's
fence: the DMA of the first ones runs while the next are planned (32 MiB take ~0.6 ms of
DMA, several times what planning them takes)."""


class Fence(Protocol):
    """Marks the copies issued on a stream so far; `wait` returns once they completed."""

    def wait(self) -> None: ...


class CopyStream(Protocol):
    """Where copies are issued. `issue()` is a context in which torch ops go to this
    stream; `record()` fences what was issued so far."""

    def issue(self) -> AbstractContextManager[object]: ...

    def record(self) -> Fence: ...


class Registrar(Protocol):
    """Pins (and unpins) a host mapping for DMA; one call per mapping."""

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...


class _Completed:
    def wait(self) -> None:
        return None


class SyncStream:
    """CPU tensors: every copy has completed when it returns."""

    def issue(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def record(self) -> Fence:
        return _Completed()


class _CudaFence:
    def __init__(self, stream: Any) -> None:
        self.event = _cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        self.event.synchronize()


class CudaStream:
    """A `torch.cuda.Stream`: fences are CUDA events recorded on it."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def issue(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self.stream)

    def record(self) -> Fence:
        return _CudaFence(self.stream)


class CudaRegistrar:
    """`cudaHostRegister` / `cudaHostUnregister` through torch's CUDA runtime binding."""

    def register(self, address: int, nbytes: int) -> None:
        err = _cuda.cudart().cudaHostRegister(address, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the arena mapping failed: error {err}")

    def unregister(self, address: int) -> None:
        err = _cuda.cudart().cudaHostUnregister(address)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostUnregister of the arena mapping failed: error {err}")


def default_registrar() -> Registrar | None:
    """CUDA's when this process has a GPU; None (nothing to pin) on a CPU-only host."""
    return CudaRegistrar() if torch.cuda.is_available() else None


def is_tensor(obj: object) -> bool:
    return isinstance(obj, torch.Tensor)


def is_chunk(obj: object) -> bool:
    """A tensor, or a list/tuple of tensors (segments), as a batch call accepts."""
    if isinstance(obj, torch.Tensor):
        return True
    return isinstance(obj, list | tuple) and bool(obj) and all(
        isinstance(s, torch.Tensor) for s in obj)


# --------------------------------------------------------------------------- decisions


def parts_of(chunk: torch.Tensor | Sequence[torch.Tensor], what: str) -> Segments:
    """A chunk's segments as they are (no view made: a view costs a few µs, and a KV chunk
    has one segment a layer for K and for V), checked: contiguous, on a CPU or CUDA
    device, all on one device."""
    parts = [chunk] if isinstance(chunk, torch.Tensor) else list(chunk)
    if not parts:
        raise ValueError(f"{what} has no segments")
    first = parts[0]
    device = first.device if isinstance(first, torch.Tensor) \
        and first.device.type in ("cpu", "cuda") else None
    for n, seg in enumerate(parts):
        if isinstance(seg, torch.Tensor) and seg.device == device and seg.is_contiguous():
            continue
        name = f"{what}, segment {n}" if len(parts) > 1 else what
        if not isinstance(seg, torch.Tensor):
            raise TypeError(f"{name} is a {type(seg).__name__}, not a tensor")
        if seg.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on device {seg.device}; kvpool copies between the "
                             "arena and CPU or CUDA tensors only")
        if seg.device != device:
            raise ValueError(f"{name} is on {seg.device}, segment 0 on {device}: the "
                             "segments of a chunk share one device")
        raise ValueError(f"{name} is not contiguous (shape {tuple(seg.shape)}, stride "
                         f"{seg.stride()}); pass .contiguous() or a contiguous slice")
    return parts


def segments_of(chunk: torch.Tensor | Sequence[torch.Tensor], what: str) -> Segments:
    """The byte views (uint8, 1-D) of a chunk's segments, checked as `parts_of` does."""
    return [tensorsums.byte_view(s) for s in parts_of(chunk, what)]


@dataclass(frozen=True, slots=True)
class Piece:
    """One copy: `nbytes` between arena offset `arena` and segment `segment` at `at`."""

    arena: int
    segment: int
    at: int
    nbytes: int


def plan_copies(extents: Sequence[tuple[int, int]], segment_bytes: Sequence[int],
                size: int) -> list[Piece]:
    """The copies that move `size` chunk bytes between the lease extents (in order) and
    the segments (in order), each piece within one extent and one segment
    (`cudacopy.plan_flat`, as objects)."""
    flat: array.array[int] = array.array("q")
    cudacopy.plan_flat(extents, segment_bytes, size, 0, flat)
    return [Piece(*flat[k : k + cudacopy.PIECE]) for k in range(0, len(flat), cudacopy.PIECE)]


def chunk_sizes(chunks: Sequence[Segments]) -> list[int]:
    """Each chunk's bytes (its segments')."""
    return [sum(s.nbytes for s in segs) for segs in chunks]


class HostChunks(Sequence[memoryview]):
    """Chunks' bytes on the host, each made as it is asked for (inline mode puts them a
    chunk at a time: a call's tensors are never all on the host at once)."""

    def __init__(self, chunks: Sequence[Segments]) -> None:
        self.chunks = chunks

    def __len__(self) -> int:
        return len(self.chunks)

    @overload
    def __getitem__(self, i: int) -> memoryview: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[memoryview]: ...

    def __getitem__(self, i: int | slice) -> memoryview | Sequence[memoryview]:
        if isinstance(i, slice):
            return HostChunks(self.chunks[i])
        return memoryview(chunk_bytes(self.chunks[i], f"the chunk of key {i}"))


def device_of(chunks: Sequence[Segments]) -> torch.device | None:
    """The one device of every segment of a call (None for no chunk)."""
    devices = {s.device for segs in chunks for s in segs}
    if len(devices) > 1:
        raise ValueError(f"one call copies to or from one device; got {sorted(map(str, devices))}")
    return next(iter(devices), None)


def as_copy_stream(stream: object, device: torch.device | None) -> CopyStream:
    """The caller's stream as a `CopyStream`: a torch.cuda.Stream, our protocol (tests'
    stub streams), or None for the device's current stream (CPU: copies are synchronous)."""
    if stream is None:
        if device is not None and device.type == "cuda":
            return CudaStream(torch.cuda.current_stream(device))
        return SyncStream()
    if hasattr(stream, "issue") and hasattr(stream, "record"):
        return stream
    if torch.cuda.is_available() and isinstance(stream, torch.cuda.Stream):
        if device is not None and device.type == "cuda" and stream.device != device:
            raise ValueError(f"stream is on {stream.device}, the tensors on {device}")
        return CudaStream(stream)
    raise TypeError(f"stream must be a torch.cuda.Stream or None, not {type(stream).__name__}")


# --------------------------------------------------------------------------- checksum


def wsum_aligned(segments: Segments) -> bool:
    """WSUM on the device needs every segment but the last to end on a 4-byte word."""
    return all(s.nbytes % 4 == 0 for s in segments[:-1])


def _sum_info(seg: torch.Tensor) -> tensorsums.SegmentInfo:
    return seg.nbytes, seg.data_ptr() % 4 == 0, (seg.shape, seg.dtype)


class _WindowSums:
    """The WSUMs of a window's chunks (a put's sources, a verified read's destinations):
    added as the leases come, queued in batches (`queue`, on the current stream; the
    chunks of a batch summed together), read back once the window's fence passed
    (`collect`)."""

    def __init__(self) -> None:
        self.indices: list[int] = []
        """The window index of each chunk added and not queued yet, with its segments."""
        self.chunks: list[Segments] = []
        self.values: dict[int, tuple[int, int]] = {}
        """(S0, S1) of each chunk collected, by window index."""
        self._queued: list[tuple[list[int], torch.Tensor, np.ndarray, np.ndarray]] = []

    def add(self, index: int, segments: Segments) -> None:
        self.indices.append(index)
        self.chunks.append(segments)

    def queue(self, device: torch.device) -> None:
        indices, chunks = self.indices, self.chunks
        self.indices, self.chunks = [], []
        groups = tensorsums.plan_sums([[_sum_info(s) for s in segs] for segs in chunks])
        rows = tensorsums.sum_rows(groups, chunks, device)
        if device.type == "cuda":  # read back with the window's fence, not a sync of its own
            host = torch.empty(rows.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            rows = host
        self._queued.append((indices, rows, *tensorsums.rows_of(groups)))

    def collect(self) -> None:
        for indices, rows, chunk_of, first in self._queued:
            s0, s1 = tensorsums.chunk_sums(rows.numpy(), chunk_of, first, len(indices))
            self.values.update(zip(indices, zip(s0, s1, strict=True), strict=True))
        self._queued = []


class _SideStreams:
    """A CUDA device's streams of our own: `sums` runs a window's checksum kernels beside
    its copies (they read the sources, not the arena); `copies` takes a batch of copies
    when the caller's stream is the legacy default stream, which the driver call refuses.
    Each waits for the caller's stream first, and the caller's stream for it after."""

    def __init__(self, device: torch.device) -> None:
        self.sums: Any = _cuda.Stream(device)
        self.copies: Any = _cuda.Stream(device)


_side: dict[torch.device, _SideStreams] = {}


def _side_streams(device: torch.device) -> _SideStreams:
    side = _side.get(device)
    if side is None:
        side = _side[device] = _SideStreams(device)
    return side


_checked: set[torch.device] = set()


def _check_batches(batcher: cudacopy.BatchCopier, device: torch.device) -> bool:
    """Once per device, before the batch call carries any chunk: pieces to pinned host
    memory and back through it, checked byte for byte. A call that fails or moves the
    wrong bytes (a driver that takes other arguments than ours) turns batching off
    (`cudacopy.loaded.disable`, one warning): slower copies, never wrong ones."""
    _checked.add(device)
    stream = _side_streams(device).copies
    with torch.cuda.stream(stream):
        src = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=device)
        back = torch.zeros_like(src)
    host = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    stream.synchronize()
    d, h, b = src.data_ptr(), host.data_ptr(), back.data_ptr()
    cuts = [(0, 1000), (1000, 3000), (4000, 96)]  # pieces of odd sizes: one call each way
    err = 0
    for dst, source in ((h, d), (b, h)):
        err = err or batcher.copy(np.array([dst + o for o, _ in cuts], dtype=np.uint64),
                                  np.array([source + o for o, _ in cuts], dtype=np.uint64),
                                  np.array([n for _, n in cuts], dtype=np.uint64),
                                  stream.cuda_stream)[0]
        stream.synchronize()
    if err:
        cudacopy.loaded.disable(f"cuMemcpyBatchAsync returned CUDA error {err} on {device}")
        return False
    if not (torch.equal(host, src.cpu()) and torch.equal(back, src)):
        cudacopy.loaded.disable(f"cuMemcpyBatchAsync moved the wrong bytes on {device}")
        return False
    return True


# --------------------------------------------------------------------------- the arena


ReadTarget = Callable[[int, int, bytes], Any]


class DeviceArena:
    """One arena mapping as seen by tensors: registered for DMA once, at creation, and
    unregistered at `close` (before the mapping is unmapped)."""

    def __init__(self, arena: memoryview, registrar: Registrar | None) -> None:
        self.tensor = torch.frombuffer(arena, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self.nbytes = self.tensor.numel()
        self._registrar = registrar
        if registrar is not None:
            try:
                registrar.register(self.address, self.nbytes)
            except Exception as e:  # e.g. the host's locked-memory limit: slower, not broken
                log.warning("arena mapping not registered for DMA (%s): GPU copies go "
                            "through pageable memory, several times slower", e)
                self._registrar = None

    def close(self) -> None:
        """Unregister and drop the tensor over the mapping (so it can be unmapped)."""
        if self._registrar is not None:
            registrar, self._registrar = self._registrar, None
            registrar.unregister(self.address)
        del self.tensor

    def copy(self, plan: CopyPlan, to_arena: bool, copier: CopyStream) -> object:
        """Make the planned copies (CPU tensors) or queue them on `copier` (CUDA): one
        driver call for them all where the arena is registered and the call works here,
        else one `copy_` a piece. Returns what must stay alive until the fence passed."""
        device = plan.segments[0].device
        if device.type == "cpu":
            with copier.issue():
                plan.host_copy(self.address, to_arena)
            cudacopy.uses["host"] += 1
            return plan
        if isinstance(copier, CudaStream) and self._registrar is not None:
            batch = self._batched(plan, to_arena, copier.stream)
            if batch is not None:
                return batch
        with copier.issue():
            self._copy_pieces(plan, to_arena)
        cudacopy.uses["per_piece"] += 1
        return plan

    def _batched(self, plan: CopyPlan, to_arena: bool, stream: Any) -> object | None:
        """The pieces in one `cuMemcpyBatchAsync` on `stream` (in its order); None, with
        nothing queued for good, where that call is not available or failed."""
        batcher = cudacopy.loaded.get()
        if batcher is None:
            return None
        # The driver call uses this thread's current context: the stream's device's.
        with torch.cuda.device(stream.device):
            if not batcher.has_context():
                return None  # (none on this thread yet: the copy_ path makes one)
            if stream.device not in _checked and not _check_batches(batcher, stream.device):
                return None
            on = stream
            if stream.cuda_stream == 0:
                on = _side_streams(stream.device).copies
                on.wait_stream(stream)
            err, batch = batcher.copy(*plan.arrays(self.address, to_arena), on.cuda_stream)
            if on is not stream:
                stream.wait_stream(on)  # the caller's fence covers them
        if err:
            # Some pieces may be queued: the copy_ path makes them all again after them
            # (the same bytes to the same places).
            cudacopy.loaded.disable(f"cuMemcpyBatchAsync returned CUDA error {err}")
            return None
        cudacopy.uses["batched"] += 1
        return batch, plan

    def _copy_pieces(self, plan: CopyPlan, to_arena: bool) -> None:
        views: dict[int, torch.Tensor] = {}
        pieces = plan.pieces
        for k in range(0, len(pieces), cudacopy.PIECE):
            offset, segment, at, nbytes = pieces[k : k + cudacopy.PIECE]
            seg = views.get(segment)
            if seg is None:
                seg = views[segment] = tensorsums.byte_view(plan.segments[segment])
            arena = self.tensor[offset : offset + nbytes]
            part = seg[at : at + nbytes]
            if to_arena:
                arena.copy_(part, non_blocking=True)
            else:
                part.copy_(arena, non_blocking=True)

    # -- batch windows: the client's window loops (`putwindows.write_windows` and
    # `transport.read_window`) with tensor copies as their copy step

    def write_copies(self, chunks: Sequence[Segments], metas: Sequence[bytes],
                     stream: object) -> CopiesOf:
        """The copy step of a put's windows of chunks from tensors: their copies into the
        leases go to `stream` and their WSUMs beside it; each window COMMITs once its own
        copies completed."""
        device = device_of(chunks)  # one device, checked before any ALLOC
        dma = device is not None and device.type == "cuda"
        return lambda lo, hi: _TensorCopies(self, stream, chunks=chunks[lo:hi],
                                            metas=metas[lo:hi], dma=dma)

    def get_window(self, conn: WindowConnection, keys: Sequence[bytes], start: int,
                   target: ReadTarget, sizes: list[int], verify: bool | None, stream: object,
                   buffers: Copies, meanwhile: Meanwhile = None) -> None:
        """Read a window into the tensors (or buffers) `target` gives: a tensor's copies go
        to `stream` (the first tensor's device's current one by default) and are verified,
        after the window's fence, only if `verify` is True; a buffer is copied by
        `buffers`, the way the client copies without tensors
        (`KVPoolClient.get_many_into`)."""
        # the destinations' device is known only once the ACQUIREs are answered
        copies = _TensorCopies(self, stream, buffers=buffers, verify=verify is True,
                               dma=torch.cuda.is_available())
        read_window(conn, copies, keys, start, target, sizes, meanwhile)

    @staticmethod
    def _verified(reply: p.AcquireReply, parts: Segments) -> bool:
        """The destination's bytes (`parts`, the chunk's bytes in order) match the chunk's
        checksum, computed on the host (read after the fence): there the checksum module's
        own loops (XXH3, the compiled WSUM) are several times faster than torch's."""
        host = [tensorsums.byte_view(s).cpu().numpy() for s in parts]
        return checksums.compute(reply.checksum_kind, host, reply.meta) == reply.checksum


def chunk_parts(segs: Segments, size: int) -> Segments:
    """The first `size` bytes of `segs` as tensors: the segments wholly in, then a byte
    view of the one the chunk ends in (a view only there)."""
    parts, left = [], size
    for s in segs:
        if left <= 0:
            break
        n = s.nbytes
        parts.append(s if n <= left else tensorsums.byte_view(s)[:left])
        left -= n
    return parts


def _intact() -> bool:
    return True


class _TensorCopies(Copies):
    """The copy step of a tensor window: the copies between the arena and the segments
    planned as the leases come and queued in batches (`QUEUE_BYTES`, a read group, the
    fence; CPU tensors: made as planned), on one `CopyStream`, fenced once for the window.
    A write's checksum is WSUM computed where the segments are, with each batch of copies
    (XXH3 of the arena bytes when they are cut inside a word); a read into a buffer goes
    to `buffers`."""

    def __init__(self, arena: DeviceArena, stream: object, chunks: Sequence[Segments] = (),
                 metas: Sequence[bytes] = (), buffers: Copies | None = None,
                 verify: bool = False, dma: bool = False) -> None:
        self.dma = dma
        self.arena = arena
        self.chunks = chunks
        self.metas = metas
        self.sizes = chunk_sizes(chunks)
        self.buffers = buffers
        self.verify = verify
        self._stream = stream
        self._copier: CopyStream | None = None
        """Made at the first tensor: the default stream is its device's current one."""
        self._device: torch.device | None = None
        self._plan = CopyPlan()
        self._planned = 0
        """Bytes in `_plan`."""
        self._ready: Any = None
        """A put's CUDA event recorded before its first copy: the sources are ready, and
        the checksums wait for that, not for the copies."""
        self._sums = _WindowSums()
        self._checks = _WindowSums()
        """A read's destinations on a GPU to verify: summed after the copies' fence, the
        window's together, one read back (not a device-to-host read a chunk)."""
        self._checked = 0
        self._keep: list[object] = []
        """What the copies queued use (the driver call's arrays, the segments): kept until
        the fence passed."""
        self._side: list[Any] = []
        """Our own streams with this window's work on them (waited for by `settle` too)."""

    def _on(self, segs: Segments, what: str) -> CopyStream:
        device = segs[0].device
        if self._copier is None:
            self._copier = as_copy_stream(self._stream, device)
        if self._device is None:
            self._device = device
        elif device != self._device:
            raise ValueError(f"{what} is on {device}, an earlier one on {self._device}: "
                             "one call, one device")
        return self._copier

    def write(self, index: int, lease: p.AllocReply) -> Digest:
        segs, size, meta = self.chunks[index], self.sizes[index], self.metas[index]
        copier = self._on(segs, f"the chunk of key {index}")
        if self._ready is None and isinstance(copier, CudaStream):
            self._ready = _cuda.Event()
            self._ready.record(copier.stream)
        summed = wsum_aligned(segs)
        if summed:
            self._sums.add(index, segs)
        self._add(lease.extents, segs, size, to_arena=True)
        tensor = self.arena.tensor

        def digest() -> tuple[int, int]:
            if not summed:  # segments cut mid-word: hash the arena bytes
                return checksums.xxh3((tensor[o : o + n].numpy() for o, n in lease.extents),
                                      meta), checksums.XXH3
            s0, s1 = self._sums.values[index]
            return checksums.wsum_finish(size, s0, s1, meta), checksums.WSUM
        return digest

    def read(self, index: int, lease: p.AcquireReply, out: Any) -> Check:
        if not is_chunk(out):
            assert self.buffers is not None
            return self.buffers.read(index, lease, out)
        what = f"the destination of key {index}"
        segs = parts_of(out, what)
        self._on(segs, what)
        self._add(lease.extents, segs, lease.size, to_arena=False)
        if not self.verify:
            return _intact
        parts = chunk_parts(segs, lease.size)
        if segs[0].device.type == "cuda" and lease.checksum_kind == checksums.WSUM \
                and wsum_aligned(parts):
            slot = self._checked
            self._checked += 1
            self._checks.add(slot, parts)  # summed after the fence, with the window's others
            return lambda: checksums.wsum_finish(lease.size, *self._checks.values[slot],
                                                 lease.meta) == lease.checksum
        return lambda: DeviceArena._verified(lease, parts)

    def _add(self, extents: Sequence[tuple[int, int]], segs: Segments, size: int,
             to_arena: bool) -> None:
        """Plan a chunk's copies; make them at once on the CPU (while the agent answers
        on; the checksums at the fence, the window's together); on a GPU queue them, and
        the checksums of the chunks planned, once `QUEUE_BYTES` are planned (so the sums
        too run beside the DMA, not after it)."""
        self._plan.add(extents, segs, [s.nbytes for s in segs], size)
        self._planned += size
        if segs[0].device.type == "cpu":
            self._flush(to_arena, sums=False)
        elif self._planned >= QUEUE_BYTES:
            self._flush(to_arena, sums=True)

    def _flush(self, to_arena: bool, sums: bool) -> None:
        """Queue (CPU: make) the copies planned so far, and with `sums` the checksums of
        the chunks added so far: on CUDA on a stream of their own, beside the copies."""
        copier, device = self._copier, self._device
        assert copier is not None and device is not None
        if len(self._plan):
            plan, self._plan, self._planned = self._plan, CopyPlan(), 0
            self._keep.append(self.arena.copy(plan, to_arena, copier))
        side = None
        if sums and self._sums.indices and isinstance(copier, CudaStream):
            side = _side_streams(device).sums
            if side not in self._side:
                self._side.append(side)
            side.wait_event(self._ready)  # the sources are ready (not the copies after)
        if sums and self._sums.indices:
            with torch.cuda.stream(side) if side is not None else copier.issue():
                self._sums.queue(device)

    def queue(self) -> None:
        if self._copier is not None and len(self._plan):
            self._flush(to_arena=bool(self.chunks), sums=True)

    def fence(self) -> None:
        if self._copier is not None:
            self._flush(to_arena=bool(self.chunks), sums=True)
            # The window's fence covers the sums too: the caller's stream waits for them
            # here, not at each batch (its later copies need not wait for them).
            for side in self._side:
                assert isinstance(self._copier, CudaStream)
                self._copier.stream.wait_stream(side)
            self._copier.record().wait()
            self._keep.clear()
            self._side.clear()
            self._sums.collect()
            if self._checks.indices:  # the destinations hold the copies now
                assert self._device is not None
                with self._copier.issue():
                    self._checks.queue(self._device)
                self._copier.record().wait()
                self._checks.collect()
        if self.buffers is not None:  # reads into host ranges are made at the fence
            self.buffers.fence()

    def settle(self) -> None:
        if self._copier is not None:
            with contextlib.suppress(Exception):
                self._copier.record().wait()
            for side in self._side:
                with contextlib.suppress(Exception):
                    side.synchronize()
        if self.buffers is not None:  # copies into buffers may still run on copy threads
            self.buffers.settle()


def chunk_bytes(chunk: torch.Tensor | Sequence[torch.Tensor], what: str) -> bytes:
    """A chunk's bytes on the host (inline mode, which has no arena to copy into)."""
    return b"".join(s.cpu().numpy().tobytes() for s in segments_of(chunk, what))


def scatter(data: bytes, out: torch.Tensor | Sequence[torch.Tensor], what: str) -> None:
    """Copy `data` into a chunk's segments in order (inline mode)."""
    segs = segments_of(out, what)
    pieces = plan_copies([(0, len(data))], [s.numel() for s in segs], len(data))
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
    for c in pieces:
        assert src is not None
        segs[c.segment][c.at : c.at + c.nbytes].copy_(src[c.arena : c.arena + c.nbytes])

