"""A read window's copies into buffers on threads of their own, so that a window scales
with the cores it runs on.

A read of a window of chunks into buffers (`KVPoolClient.get_many_into` with buffer
destinations) copies each chunk out of the arena mapping and verifies it (XXH3, block by
block while the block is in cache): ~0.25-0.35 ms of the caller's thread per MiB, which
made that thread the limit of a window of peer chunks on a 16-core machine (0.76-0.88 of
a core busy while the agents had cores to spare: docs/benchmarks.md, "A window's copies
on threads of their own"). Here a chunk's copy and its check are one job on a small pool
of threads: `ctypes.memmove` and xxhash's update both let the GIL go, so the jobs run in
parallel with each other and with the caller, which goes on to the next reply. The
window's lease rules hold as before: the window waits for every job of a group
(`BufferCopies.fence`) before its RELEASEs go out, and on a failure too (`settle`).

The threads: `$KVPOOL_COPY_THREADS`, else one per four cores this process may run on, at
most `MAX_THREADS`; none on a machine of fewer than 8 cores, where the caller copies as
before (there the copies on more threads take the cores the agents need, and two copies
at once share the memory bandwidth: no gain was measured on 2 cores). Made on the first
copy, shared by every client of the process (a forked child makes its own).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from . import checksums
from . import protocol as p
from .chunkblocks import blocks

ENV_COPY_THREADS = "KVPOOL_COPY_THREADS"
MAX_THREADS = 4
"""Most copy threads a process makes by default (a window of 1 MiB chunks from a peer needs
~2 more cores than the caller's to keep up with a 5 GB/s link)."""
MIN_BYTES = 256 << 10
"""Chunks smaller than this are copied by the caller: a job's hand-off (~10-30 µs) would
cost more than it saves."""

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _forked() -> None:
    """A forked child has none of its parent's threads: its copies would wait for jobs no
    thread takes. It makes its own pool (and lock: the parent's may have been held by a
    thread that is not here) at its first copy."""
    global _pool, _lock
    _pool = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def default_threads(cores: int) -> int:
    """Copy threads for a process that may run on `cores` cores."""
    return 0 if cores < 8 else min(MAX_THREADS, cores // 4)


def threads() -> int:
    """Copy threads of this process: `$KVPOOL_COPY_THREADS` (0: none), else
    `default_threads` of the cores it may run on."""
    value = os.environ.get(ENV_COPY_THREADS, "").strip()
    if value:
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"{ENV_COPY_THREADS} must be a whole number of threads, not "
                             f"{value!r}") from None
        if n < 0:
            raise ValueError(f"{ENV_COPY_THREADS} must be 0 or more, not {n}")
        return n
    return default_threads(len(os.sched_getaffinity(0)))


def pool() -> ThreadPoolExecutor | None:
    """The process's copy threads (made on first use), or None where it has none."""
    global _pool
    if _pool is None:
        n = threads()
        if n == 0:
            return None
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(n, thread_name_prefix="kvpool-copy")
    return _pool


def start(arena: memoryview, base: int, extents: Sequence[tuple[int, int]],
          dst: memoryview, check: p.AcquireReply | None) -> Future[bool] | None:
    """A chunk's copy from its arena `extents` (the mapping at address `base`) into `dst`,
    and with `check` its verification, started on a copy thread: the future of
    `transport.copy_out`'s answer. None where this process has no copy threads or the
    chunk is small (the caller copies it). Raises here, as `copy_out` would, for extents
    outside the arena or more bytes than `dst` holds."""
    total = sum(n for _, n in extents)
    if total < MIN_BYTES or not base:
        return None
    workers = pool()
    if workers is None:
        return None
    limit = arena.nbytes
    if any(o < 0 or n < 0 or o + n > limit for o, n in extents):
        raise ValueError("a chunk's extents lie outside the arena")
    if total > dst.nbytes:
        raise ValueError(f"chunk of {total} bytes does not fit in {dst.nbytes}")
    # A writable export of the destination for as long as the job runs: a bytearray
    # cannot be resized (moved) under the copy meanwhile.
    held = (ctypes.c_char * dst.nbytes).from_buffer(dst)
    return workers.submit(_copy, base, list(extents), dst, held, check)


def _copy(base: int, extents: list[tuple[int, int]], dst: memoryview, held: ctypes.Array[
        ctypes.c_char], check: p.AcquireReply | None) -> bool:
    """The job (a copy thread): each block copied, then hashed while in cache (XXH3),
    without the GIL for either."""
    to = ctypes.addressof(held)
    h = xxhash.xxh3_64(check.meta) if check is not None and \
        check.checksum_kind == checksums.XXH3 else None
    for offset, pos, step in blocks(extents):
        ctypes.memmove(to + pos, base + offset, step)
        if h is not None:
            h.update(dst[pos : pos + step])
    if check is None:
        return True
    if h is not None:
        return int(h.intdigest()) == check.checksum
    return p.checksum(dst[: check.size], check.meta, check.checksum_kind) == check.checksum
