"""The G2 DRAM arena: one shared-memory file, mapped by the agent and its clients.

`Arena` maps the file (pre-faulted, because a first-touch page fault costs
about ten times a copy) and locks it in RAM when the process may.
`ExtentAllocator` hands out the arena's pages. A chunk may span several
extents, so a fragmented arena never refuses a write that its free bytes
could hold: utilisation stays near 100% under any mix of chunk sizes, at the
price of clients copying through a short list of (offset, length) runs.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import mmap
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import busguard, checksums
from .constants import PAGE_BYTES
from .hostcopy import address_of
from .protocol import Extents
from .units import human_size

log = logging.getLogger(__name__)

_HASH_PIECE_BYTES = 1 << 20
"""The agent checksums arena bytes read into one buffer of this size, piece by piece: the
piece is still in cache when the hash reads it, and no chunk costs its size in heap."""
MAX_EXTENTS = 1024
"""A chunk is never cut into more runs than this (keeps ALLOC replies small)."""


class ExtentAllocator:
    """First-best-fit page allocator over free runs, coalescing on free.

    Free runs are indexed by start, by end (to merge neighbours in O(1)) and in
    a list sorted by (length, start) for best fit. All sizes are in pages.
    """

    def __init__(self, total_bytes: int, page_bytes: int = PAGE_BYTES) -> None:
        self.page = page_bytes
        self.total_pages = total_bytes // page_bytes
        self.free_pages = self.total_pages
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        self._starts: list[int] = []
        """Free runs' starts, sorted: the run holding a page is found by bisection (a
        warm restart reserves every journaled chunk; a scan per chunk was quadratic)."""
        if self.total_pages:
            self._add_run(0, self.total_pages)

    @property
    def capacity_bytes(self) -> int:
        return self.total_pages * self.page

    @property
    def used_bytes(self) -> int:
        return (self.total_pages - self.free_pages) * self.page

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page)

    def alloc(self, nbytes: int) -> Extents | None:
        """Extents (byte offsets and lengths summing to nbytes), or None if it cannot fit."""
        need = self.pages_for(max(nbytes, 1))
        if need > self.free_pages:
            return None
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i < len(self._by_size):
            length, start = self._by_size[i]
            self._take(start, length, need)
            return [(start * self.page, nbytes)]
        # No single run fits: gather the largest runs (fewest extents).
        runs: list[tuple[int, int]] = []
        got = 0
        for length, start in reversed(self._by_size):
            runs.append((start, min(length, need - got)))
            got += runs[-1][1]
            if got >= need or len(runs) >= MAX_EXTENTS:
                break
        if got < need:
            return None
        extents: Extents = []
        remaining = nbytes
        for start, take in runs:
            self._take(start, self._by_start[start], take)
            nb = min(take * self.page, remaining)
            extents.append((start * self.page, nb))
            remaining -= nb
        return extents

    def free(self, extents: Extents) -> None:
        for offset, nbytes in extents:
            start = offset // self.page
            length = self.pages_for(max(nbytes, 1))
            self.free_pages += length
            prev_start = self._by_end.get(start)
            if prev_start is not None:
                prev_len = self._remove_run(prev_start)
                start, length = prev_start, length + prev_len
            next_len = self._by_start.get(start + length)
            if next_len is not None:
                self._remove_run(start + length)
                length += next_len
            self._add_run(start, length)

    def reserve(self, extents: Extents) -> bool:
        """Mark known extents used (rebuilding from a journal); False if any is not free."""
        for offset, nbytes in extents:
            start, length = offset // self.page, self.pages_for(max(nbytes, 1))
            run = self._run_containing(start)
            if run is None or run[0] + run[1] < start + length:
                return False
            run_start, run_len = run
            self._remove_run(run_start)
            self.free_pages -= length
            if start > run_start:
                self._add_run(run_start, start - run_start)
            tail = run_start + run_len - (start + length)
            if tail:
                self._add_run(start + length, tail)
        return True

    def largest_free_run_bytes(self) -> int:
        return self._by_size[-1][0] * self.page if self._by_size else 0

    # -- internals

    def _run_containing(self, page: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(self._starts, page) - 1
        if i < 0:
            return None
        start = self._starts[i]
        length = self._by_start[start]
        return (start, length) if page < start + length else None

    def _take(self, start: int, length: int, need: int) -> None:
        self._remove_run(start)
        self.free_pages -= need
        if length > need:
            self._add_run(start + need, length - need)

    def _add_run(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        bisect.insort(self._by_size, (length, start))
        bisect.insort(self._starts, start)

    def _remove_run(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        i = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[i]
        del self._starts[bisect.bisect_left(self._starts, start)]
        return length


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_MAPPED_WRITE_FAULTS = (errno.EFAULT, errno.ENOMEM)
"""What process_vm_writev answers for a page it cannot fault in: past the file's end (a
resize), or no free huge page to back a hole a resize left."""


def _remapper(ref: weakref.ReferenceType[Arena]) -> Callable[[], None]:
    """`Arena._remap` through a weak reference (the guard, which lives as long as the
    process, must not keep an arena alive)."""
    def remap() -> None:
        arena = ref()
        if arena is not None:
            arena._remap()
    return remap


class Arena:
    """The arena file, mapped shared, pre-faulted and (when permitted) locked.

    Every client of the arena's space holds a writable fd of this file, and a writable fd
    of a tmpfs file can be resized (a sealed memfd could not be, but a memfd dies with the
    agent, and a restart must find the arena again). A mapping touched past the file's end
    is SIGBUS, which would end the agent and every tenant with it. So the agent never
    touches its own mapping (it only keeps the pages resident and locked): it reads and
    writes the arena with pread/pwrite through its fd, which see a shrunk file as a short
    read instead of a fault, and it puts the file back to its size whenever it finds it
    resized. A client that resizes the arena destroys only bytes of its own space (which
    it could overwrite anyway: see the trust model in docs/reliability.md); a read that
    verifies them finds a checksum mismatch, a miss.

    hugetlbfs files take no write(2), so an arena on huge pages is written with
    process_vm_writev into the agent's own mapping: the kernel faults the pages in on the
    agent's behalf and answers a page past a shrunk end with EFAULT, where the agent's own
    store would be SIGBUS; the agent then puts the file back and writes on. What a peer
    read receives goes in the same way on tmpfs too (`write_run`), where it is allowed:
    cheaper than pwrite there. Reads use pread on both file systems.

    The one exception: on tmpfs, once the process's SIGBUS guard is installed
    (`busguard`: a load from a page past a shrunk file is answered with a zero page and
    counted), a peer read is received straight into the mapping and its checksum taken by
    reading the bytes there (`guard_counts`); after a fault the guard answered, `repair`
    puts the file back and maps it over the zero pages again before a read trusts the
    mapping.
    """

    def __init__(self, path: Path, size: int, *, lock: bool = True, huge_pages: bool = False):
        self.path = path
        self.size = size
        self.huge_pages = huge_pages
        self.locked_bytes = 0
        self.lock_error: str | None = None
        self.resizes = 0
        """How many times a client resized the file and the agent put it back."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self.reused = os.fstat(fd).st_size == size
            if not self.reused:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
            if not huge_pages:
                # Reserve tmpfs pages now: a full /dev/shm then fails here, at
                # start, instead of as SIGBUS on some later write.
                os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._piece = bytearray(_HASH_PIECE_BYTES)
        self._anchor: Any = ctypes.c_char.from_buffer(self.mm)
        self._base = ctypes.addressof(self._anchor)
        self._vm_writev = _libc().process_vm_writev
        self.mapped_writes = huge_pages
        """Whether `write_run` copies into the mapping through the kernel (always on huge
        pages; on tmpfs where process_vm_writev is allowed, as it is by default)."""
        if huge_pages:
            self._check_mapped_writes()
        else:
            self.mapped_writes = self._mapped_writes_work()
        self._guarded: busguard.Guard | None = None
        """The SIGBUS guard this arena's mapping is in (`guard_counts`), once it is."""
        self._unguard: Callable[[], object] = lambda: None
        if lock:
            self._lock()

    def _check_mapped_writes(self) -> None:
        """Fail at start, not at the first PUT, where process_vm_writev is refused (a
        seccomp profile stricter than the container runtimes' defaults, which allow it)."""
        first = os.pread(self.fd, 1, 0)
        try:
            self._write_mapped(0, memoryview(first))
        except OSError as e:
            self.close()
            raise OSError(e.errno, f"DRAM arena {self.path} is on huge pages, which the agent "
                                   f"writes with process_vm_writev: {e.strerror}") from None

    def _mapped_writes_work(self) -> bool:
        """Whether process_vm_writev may write the mapping (tmpfs takes pwrite where not)."""
        try:
            self._write_mapped(0, memoryview(os.pread(self.fd, 1, 0)))
        except OSError as e:
            log.info("DRAM arena %s: process_vm_writev refused (%s): peer reads write it "
                     "with pwrite", self.path, e.strerror)
            return False
        return True

    def _lock(self) -> None:
        addr = self._base
        if _libc().mlock(ctypes.c_void_p(addr), ctypes.c_size_t(self.size)) == 0:
            self.locked_bytes = self.size
        else:
            err = ctypes.get_errno()
            self.lock_error = f"mlock of {human_size(self.size)} failed: {os.strerror(err)}"
            if err in (errno.EPERM, errno.ENOMEM):
                self.lock_error += " (grant IPC_LOCK or raise RLIMIT_MEMLOCK)"
            log.warning("DRAM arena not locked: %s; continuing unlocked", self.lock_error)

    def restore_size(self) -> bool:
        """Put the file back to the arena's size if a client resized it; True if it had to."""
        actual = os.fstat(self.fd).st_size
        if actual == self.size:
            return False
        self.resizes += 1
        log.warning("DRAM arena %s was resized to %d bytes behind the agent (a client's fd); "
                    "restoring %d bytes: chunks in the lost range fail their checksums",
                    self.path, actual, self.size)
        os.ftruncate(self.fd, self.size)
        if not self.huge_pages:
            os.posix_fallocate(self.fd, 0, self.size)
        return True

    def client_fd(self) -> int:
        """The fd handed to a client at HELLO, once the file has its size (a client mapping a
        shrunk file would fault on its first copy)."""
        self.restore_size()
        return self.fd

    def write(self, extents: Extents, data: Any) -> None:
        src = memoryview(data).cast("B")
        self.restore_size()  # a pwrite past a shrunk end would grow a sparse file instead
        pos = 0
        for offset, nbytes in extents:
            if self.huge_pages:
                self._write_mapped(offset, src[pos : pos + nbytes])
            else:
                done = 0
                while done < nbytes:
                    done += os.pwrite(self.fd, src[pos + done : pos + nbytes], offset + done)
            pos += nbytes

    def write_run(self, offset: int, data: memoryview) -> None:
        """`write` of one run of bytes at `offset`: into the mapping through the kernel
        (`_write_mapped`) where it may, else with pwrite. On tmpfs the kernel's copy into
        the mapped pages costs less than pwrite's walk of the page cache (a lookup, a
        lock and a dirtying per 4 KiB page): the write that follows each 1 MiB piece a
        peer read receives (docs/benchmarks.md, "The peer tier between two nodes")."""
        if self.mapped_writes:
            self._write_mapped(offset, data)
        else:
            self.write([(offset, len(data))], data)

    @property
    def address(self) -> int:
        """The mapping's address, for the kernel's own reads of it (a peer reply's `send`,
        `peers.sendkernel`): a page past a shrunk file is EFAULT there, never SIGBUS."""
        return self._base

    @property
    def mapped_base(self) -> int:
        """The mapping's address where `write_run` copies into it through the kernel (the
        compiled peer receive writes there the same way, `peers.recvkernel`), else 0."""
        return self._base if self.mapped_writes and self._anchor is not None else 0

    def guard_counts(self) -> int:
        """The address of the SIGBUS guard's counts (`busguard`) where this arena's mapping
        may be read under the guard: a peer read is then received straight into the
        mapping and its checksum taken there (`peers.recvkernel`). 0 where it may not (no
        guard installed yet, an arena on huge pages, or one not written through its
        mapping): the read goes through a buffer and `process_vm_writev` as before."""
        if self._guarded is None:
            g = busguard.ready()
            if (g is None or self.huge_pages or not self.mapped_writes
                    or self._anchor is None
                    or not g.add(self._base, self.size, _remapper(weakref.ref(self)))):
                return 0
            self._guarded = g
            # Unguarded with the mapping, even one dropped without `close`: addresses mapped
            # again later must fault as anywhere else.
            self._unguard = weakref.finalize(self, g.remove, self._base)
        return self._guarded.counts_at

    def repair(self) -> None:
        """After the guard answered a load from this process's mappings with a zero page
        (a client shrank the file): the file put back to its size and mapped over every
        guarded range again, before any read trusts the mapping (`busguard.Guard.repair`;
        nothing to do otherwise)."""
        if self._guarded is not None:
            self._guarded.repair()

    def _remap(self) -> None:
        """This arena's file mapped over its mapping again, in place (the zero pages the
        guard put there go), pre-faulted and locked as at the start."""
        self.restore_size()
        libc = _libc()
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        flags = mmap.MAP_SHARED | 0x10 | mmap.MAP_POPULATE  # MAP_FIXED: the same addresses
        got = libc.mmap(self._base, self.size, mmap.PROT_READ | mmap.PROT_WRITE, flags,
                        self.fd, 0)
        if got != self._base:
            err = ctypes.get_errno()
            raise OSError(err, f"arena {self.path} cannot be mapped again: {os.strerror(err)}")
        if self.locked_bytes:
            _libc().mlock(ctypes.c_void_p(self._base), ctypes.c_size_t(self.size))

    def _write_mapped(self, offset: int, src: memoryview) -> None:
        """Copy `src` into the mapping at `offset` through the kernel (process_vm_writev to
        this process), so a page that cannot be faulted in is an error code, never SIGBUS."""
        if not len(src):
            return
        # The address of any buffer, read-only ones (bytes) included, uncopied (`src` holds
        # it meanwhile). Not numpy's: importing numpy was a quarter of an agent's start.
        held = address_of(src)
        local, remote = _IoVec(), _IoVec()
        done, nbytes = 0, src.nbytes
        while done < nbytes:
            local.base, local.len = held + done, nbytes - done
            remote.base, remote.len = self._base + offset + done, nbytes - done
            got = self._vm_writev(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote),
                                  1, 0)
            if got > 0:
                done += got
                continue
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            if err not in _MAPPED_WRITE_FAULTS or not self.restore_size():
                raise OSError(err, f"arena {self.path} cannot be written at {offset + done}: "
                                   f"{os.strerror(err)}")

    def _pread(self, offset: int, nbytes: int) -> bytes:
        data = os.pread(self.fd, nbytes, offset)
        if len(data) < nbytes:
            # Shrunk behind the agent: what was past the end is gone; read zeros there.
            self.restore_size()
            data += os.pread(self.fd, nbytes - len(data), offset + len(data))
        return data

    def read(self, extents: Extents) -> bytes:
        if len(extents) == 1:
            offset, nbytes = extents[0]
            return self._pread(offset, nbytes)
        return b"".join(self._pread(o, n) for o, n in extents)

    def checksum(self, extents: Extents, meta: bytes = b"", kind: int = checksums.XXH3) -> int:
        """The chunk's checksum of kind `kind` (`kvpool.agent.checksums`) over its extents."""
        return checksums.compute(kind, self._pieces(extents), meta)

    def _pieces(self, extents: Extents) -> Iterator[memoryview]:
        """The extents' bytes in order, in pieces valid until the next one is asked for."""
        piece = memoryview(self._piece)
        for offset, nbytes in extents:
            done = 0
            while done < nbytes:
                n = min(nbytes - done, len(piece))
                got = os.preadv(self.fd, [piece[:n]], offset + done)
                if got == 0:  # shrunk behind the agent: zeros from here, once restored
                    if not self.restore_size():
                        raise OSError(errno.EIO,
                                      f"arena {self.path} reads short at {offset + done}")
                    continue
                yield piece[:got]
                done += got

    def close(self) -> None:
        if self._guarded is not None:
            self._unguard()
            self._guarded = None
        if self._anchor is not None:
            if self.locked_bytes:
                _libc().munlock(ctypes.c_void_p(self._base), ctypes.c_size_t(self.size))
            self._anchor = None
            self.locked_bytes = 0
        self.mm.close()
        os.close(self.fd)
