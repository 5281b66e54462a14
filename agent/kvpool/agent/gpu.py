"""Tensors as chunk sources and destinations: copies between tensors and the arena.

Imported only when a batch call meets a torch tensor (the light client never imports
torch). A chunk may be one tensor or several *segments* (e.g. one slice per layer for
K and V): the chunk's bytes are the segments' bytes in order, copied straight between
each segment and the lease extents, with no packed intermediate copy.

On CUDA the client's arena mapping is registered with CUDA once per mapping
(`cudaHostRegister`, through `_cuda.cudart()`), so a copy between a GPU tensor
and the arena is a DMA at the pinned-memory rate. Copies are issued on a stream the
caller may pass (default: the device's current stream). A read lease is released,
and a write committed, only after the copies that use it completed on that stream:
the window records an event after its copies and waits for that event (not for the
whole device). CPU tensors take the same path; their copies complete as issued.

Writes carry the WSUM checksum kind (`kvpool.agent.checksums`), computed by torch
from the source tensors on the same stream, so the put is not capped by CPU hashing;
the agent verifies it like XXH3 wherever it verifies a chunk.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from . import checksums
from . import protocol as p
from .transport import (
    Check,
    Copies,
    Digest,
    Meanwhile,
    WindowConnection,
    read_window,
    write_window,
)

Segments = list[torch.Tensor]
log = logging.getLogger(__name__)
_cuda: Any = torch.cuda  # its Event and cudart() are untyped
_SUM_BLOCK_WORDS = 1 << 22
"""Words one checksum step takes (16 MiB of chunk): bounds the int64 temporaries."""


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


def segments_of(chunk: torch.Tensor | Sequence[torch.Tensor], what: str) -> Segments:
    """The byte views (uint8, 1-D) of a chunk's segments, checked: contiguous, on a CPU
    or CUDA device, all on one device."""
    parts = [chunk] if isinstance(chunk, torch.Tensor) else list(chunk)
    if not parts:
        raise ValueError(f"{what} has no segments")
    device = parts[0].device
    out: Segments = []
    for n, seg in enumerate(parts):
        name = f"{what}, segment {n}" if len(parts) > 1 else what
        if not isinstance(seg, torch.Tensor):
            raise TypeError(f"{name} is a {type(seg).__name__}, not a tensor")
        if seg.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on device {seg.device}; kvpool copies between the "
                             "arena and CPU or CUDA tensors only")
        if seg.device != device:
            raise ValueError(f"{name} is on {seg.device}, segment 0 on {device}: the "
                             "segments of a chunk share one device")
        if not seg.is_contiguous():
            raise ValueError(f"{name} is not contiguous (shape {tuple(seg.shape)}, stride "
                             f"{seg.stride()}); pass .contiguous() or a contiguous slice")
        out.append(seg.reshape(-1).view(torch.uint8))
    return out


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
    the segments (in order), each piece within one extent and one segment."""
    pieces: list[Piece] = []
    seg = at = 0
    left = size
    for offset, length in extents:
        length = min(length, left)
        while length > 0:
            while seg < len(segment_bytes) and at == segment_bytes[seg]:
                seg, at = seg + 1, 0
            if seg == len(segment_bytes):
                raise ValueError(f"chunk of {size} bytes does not fit in "
                                 f"{sum(segment_bytes)} bytes of segments")
            step = min(length, segment_bytes[seg] - at)
            pieces.append(Piece(offset, seg, at, step))
            offset, at, length, left = offset + step, at + step, length - step, left - step
    if left:
        raise ValueError(f"the lease extents hold {size - left} of the chunk's {size} bytes")
    return pieces


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
    return all(s.numel() % 4 == 0 for s in segments[:-1])


class _Ramp:
    """0, 1, 2, ... as int64 on a device, grown on demand (the weights of S1)."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        ramp = self._by_device.get(device)
        if ramp is None or ramp.numel() < n:
            ramp = torch.arange(max(n, 1 << 16), dtype=torch.int64, device=device)
            if device.type == "cuda":
                # Made on whatever stream is current, read later on others: let it finish
                # (once per device and size).
                _cuda.synchronize(device)
            self._by_device[device] = ramp
        return ramp[:n]


_ramp = _Ramp()


def _words(seg: torch.Tensor) -> torch.Tensor:
    """The bytes of `seg` (uint8, whole words only) as unsigned 32-bit values in int64."""
    try:
        return seg.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    except RuntimeError:  # a byte view not aligned to 4 bytes in its storage
        b = seg.view(-1, 4).to(torch.int64)
        return b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)


def wsum_partials(segments: Segments) -> tuple[torch.Tensor, list[int]]:
    """The chunk's WSUM sums in steps, computed where the segments are (on the caller's
    stream when issued inside it): [S0, S1 with step-local weights] per step as int64
    (wrapping modulo 2^64, as the definition does), and each step's first word index.
    `wsum_from_partials` finishes them on the host. Needs `wsum_aligned(segments)`."""
    rows: list[torch.Tensor] = []
    firsts: list[int] = []
    word = 0
    device = segments[0].device
    for seg in segments:
        nbytes = seg.numel()
        whole = nbytes - nbytes % 4
        for start in range(0, whole, 4 * _SUM_BLOCK_WORDS):
            u = _words(seg[start : min(whole, start + 4 * _SUM_BLOCK_WORDS)])
            rows.append(torch.stack([u.sum(), (u * _ramp.get(device, u.numel())).sum()]))
            firsts.append(word)
            word += u.numel()
        if whole < nbytes:  # the chunk's last bytes (only the last segment may end mid-word)
            tail = torch.zeros(4, dtype=torch.int64, device=device)
            tail[: nbytes - whole] = seg[whole:].to(torch.int64)
            last = tail[0] | (tail[1] << 8) | (tail[2] << 16) | (tail[3] << 24)
            rows.append(torch.stack([last, torch.zeros_like(last)]))
            firsts.append(word)
            word += 1
    if not rows:
        return torch.zeros((0, 2), dtype=torch.int64, device=device), firsts
    return torch.stack(rows), firsts


def wsum_from_partials(size: int, partials: torch.Tensor, firsts: list[int],
                       meta: bytes) -> int:
    """The WSUM checksum from `wsum_partials`, read back once the copies' fence passed."""
    s0 = s1 = 0
    for (part_s0, part_s1), first in zip(partials.cpu().tolist(), firsts, strict=True):
        part_s0 &= checksums.U64
        s0 += part_s0
        s1 += (part_s1 & checksums.U64) + first * part_s0
    return checksums.wsum_finish(size, s0, s1, meta)


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

    def _copy(self, pieces: list[Piece], segments: Segments, to_arena: bool) -> None:
        for c in pieces:
            arena = self.tensor[c.arena : c.arena + c.nbytes]
            seg = segments[c.segment][c.at : c.at + c.nbytes]
            if to_arena:
                arena.copy_(seg, non_blocking=True)
            else:
                seg.copy_(arena, non_blocking=True)

    # -- batch windows: the client's window loops (`transport.write_window` and
    # `read_window`) with tensor copies as their copy step

    def put_window(self, conn: WindowConnection, keys: Sequence[bytes],
                   chunks: Sequence[Segments], metas: Sequence[bytes], start: int,
                   results: list[Any], stream: object,
                   blocks: Sequence[p.EngineBlocks | None] | None = None,
                   to: str = "") -> None:
        """Put a window of chunks from tensors: their copies into the leases and their
        WSUMs go to `stream`, the window COMMITs once they completed (handed off `to` a
        node, when named)."""
        device = device_of(chunks)  # one device, checked before any ALLOC
        copies = _TensorCopies(self, stream, chunks=chunks, metas=metas,
                               dma=device is not None and device.type == "cuda")
        write_window(conn, copies, keys, copies.sizes, metas, start, results, blocks, to)

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

    def _verified(self, reply: p.AcquireReply, segs: Segments) -> bool:
        """The destination's bytes match the chunk's checksum (read after the fence)."""
        left, parts = reply.size, []
        for s in segs:
            take = min(left, s.numel())
            if take:
                parts.append(s[:take])
            left -= take
        on_device = any(s.device.type != "cpu" for s in parts)
        if on_device and reply.checksum_kind == checksums.WSUM and wsum_aligned(parts):
            return wsum_from_partials(reply.size, *wsum_partials(parts),
                                      reply.meta) == reply.checksum
        # On the host the checksum module's own loops (XXH3, the compiled WSUM) are several
        # times faster than torch's word sums.
        host = [s.cpu().numpy() for s in parts]
        return checksums.compute(reply.checksum_kind, host, reply.meta) == reply.checksum


class _TensorCopies(Copies):
    """The copy step of a tensor window: copies between the arena and the segments issued
    on one `CopyStream`, fenced once for the window. A write's checksum is WSUM computed
    where the segments are (XXH3 of the arena bytes when they are cut inside a word); a
    read into a buffer goes to `buffers`."""

    def __init__(self, arena: DeviceArena, stream: object, chunks: Sequence[Segments] = (),
                 metas: Sequence[bytes] = (), buffers: Copies | None = None,
                 verify: bool = False, dma: bool = False) -> None:
        self.dma = dma
        self.arena = arena
        self.chunks = chunks
        self.metas = metas
        self.sizes = [sum(s.numel() for s in segs) for segs in chunks]
        self.buffers = buffers
        self.verify = verify
        self._stream = stream
        self._copier: CopyStream | None = None
        """Made at the first tensor: the default stream is its device's current one."""
        self._device: torch.device | None = None

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
        with self._on(segs, f"the chunk of key {index}").issue():
            self.arena._copy(plan_copies(lease.extents, [s.numel() for s in segs], size),
                             segs, to_arena=True)
            partials = wsum_partials(segs) if wsum_aligned(segs) else None
        tensor = self.arena.tensor

        def digest() -> tuple[int, int]:
            if partials is None:  # segments cut mid-word: hash the arena bytes
                return checksums.xxh3((tensor[o : o + n].numpy() for o, n in lease.extents),
                                      meta), checksums.XXH3
            return wsum_from_partials(size, *partials, meta), checksums.WSUM
        return digest

    def read(self, index: int, lease: p.AcquireReply, out: Any) -> Check:
        if not is_chunk(out):
            assert self.buffers is not None
            return self.buffers.read(index, lease, out)
        what = f"the destination of key {index}"
        segs = segments_of(out, what)
        pieces = plan_copies(lease.extents, [s.numel() for s in segs], lease.size)
        with self._on(segs, what).issue():
            self.arena._copy(pieces, segs, to_arena=False)
        if not self.verify:
            return lambda: True
        return lambda: self.arena._verified(lease, segs)

    def fence(self) -> None:
        if self._copier is not None:
            self._copier.record().wait()
        if self.buffers is not None:  # reads into host ranges are made at the fence
            self.buffers.fence()

    def settle(self) -> None:
        if self._copier is not None:
            with contextlib.suppress(Exception):
                self._copier.record().wait()


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

