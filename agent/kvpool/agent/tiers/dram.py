"""G2: chunks held in the shared-memory arena, with their leases.

The DRAM tier owns the arena's index: which key lives in which extents, who
is reading it (read leases) and what is being written (write leases, not yet
visible). A chunk under a lease or a pin is never evicted or freed; a chunk
deleted while read is hidden at once and freed on its last release.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..arena import Arena, ExtentAllocator
from ..journal import JournalEntry
from ..lookupindex import SharedIndex
from ..protocol import Extents, checksum


@dataclass(slots=True)
class DramChunk:
    key: bytes
    extents: Extents
    size: int
    checksum: int
    meta: bytes
    tenant: str
    checksum_kind: int = 0
    readers: int = 0
    hits: int = 0
    last_seq: int = 0
    depth: int = 0
    last_access: float = 0.0
    hidden: bool = False
    """Deleted or evicted while read: invisible, freed when the last reader releases."""


@dataclass(slots=True)
class WriteLease:
    id: int
    key: bytes
    extents: Extents
    size: int
    meta: bytes
    tenant: str
    owner: int
    deadline: float


@dataclass(slots=True)
class ReadLease:
    id: int
    chunk: DramChunk
    owner: int


@dataclass
class DramTier:
    arena: Arena
    alloc: ExtentAllocator = field(init=False)
    chunks: dict[bytes, DramChunk] = field(default_factory=dict)
    """Index of visible chunks."""
    writes: dict[int, WriteLease] = field(default_factory=dict)
    reads: dict[int, ReadLease] = field(default_factory=dict)
    pins: set[bytes] = field(default_factory=set)
    held: dict[int, int] = field(default_factory=dict)
    """Open leases (read and write) per owner, for the per-client budget."""
    fenced: dict[int, Extents] = field(default_factory=dict)
    """Pages of expired write leases, per owner, kept from reuse until it disconnects."""
    published: SharedIndex | None = None
    """The visible keys as clients read them from shared memory (`lookupindex`), if any."""
    _next_lease: int = 1

    def __post_init__(self) -> None:
        self.alloc = ExtentAllocator(self.arena.size)

    # -- capacity

    @property
    def capacity_bytes(self) -> int:
        return self.alloc.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the arena taken: visible chunks, hidden ones still read, pending writes."""
        return self.alloc.used_bytes

    # -- index

    def get(self, key: bytes) -> DramChunk | None:
        return self.chunks.get(key)

    def journal_entries(self) -> Iterator[JournalEntry]:
        """The commit journal's view of the visible chunks (what a compaction keeps)."""
        for c in self.chunks.values():
            yield JournalEntry(c.key, c.extents, c.size, c.checksum, c.meta, c.tenant,
                               c.checksum_kind)

    def read_verified(self, chunk: DramChunk) -> bytes | None:
        """A chunk's bytes from the arena, or None when they no longer match its checksum.

        Every client of a space can write anywhere in its arena (and resize the file), so
        bytes the agent hands out by value are checked first: hashing costs a fraction of
        the copy it guards (docs/reliability.md, the trust model within a tenant)."""
        data = self.arena.read(chunk.extents)
        good = checksum(data, chunk.meta, chunk.checksum_kind) == chunk.checksum
        return data if good else None

    def protected(self, key: bytes) -> bool:
        """Pinned or read right now: never evicted."""
        chunk = self.chunks.get(key)
        return key in self.pins or (chunk is not None and chunk.readers > 0)

    def insert(self, key: bytes, extents: Extents, size: int, checksum: int, meta: bytes,
               tenant: str, checksum_kind: int = 0) -> DramChunk:
        chunk = DramChunk(key, extents, size, checksum, meta, tenant, checksum_kind)
        self.chunks[key] = chunk
        if self.published is not None:
            if not self.published.add(key):
                self.published.rebuild(self.chunks)  # with this key: it is in self.chunks
            self._tidy_published()
        return chunk

    def remove(self, key: bytes) -> DramChunk | None:
        """Take a chunk out of the index; its space is freed now or on its last release."""
        chunk = self.chunks.pop(key, None)
        if chunk is None:
            return None
        if self.published is not None:
            self.published.remove(key)
            self._tidy_published()
        if chunk.readers:
            chunk.hidden = True
        else:
            self.alloc.free(chunk.extents)
        return chunk

    def detach(self, key: bytes) -> DramChunk | None:
        """Take an unread chunk out of the index keeping its pages: the caller frees them
        (a chunk being demoted keeps its pages until its NVMe copy has landed)."""
        chunk = self.chunks.get(key)
        if chunk is None or chunk.readers:
            return None
        del self.chunks[key]
        if self.published is not None:
            self.published.remove(key)
            self._tidy_published()
        return chunk

    def _tidy_published(self) -> None:
        assert self.published is not None
        if self.published.crowded:
            self.published.rebuild(self.chunks)

    # -- leases

    def _lease_id(self) -> int:
        lease, self._next_lease = self._next_lease, self._next_lease + 1
        return lease

    def open_write(self, key: bytes, extents: Extents, size: int, meta: bytes, tenant: str,
                   owner: int, timeout: float) -> WriteLease:
        lease = WriteLease(self._lease_id(), key, extents, size, meta, tenant, owner,
                           time.monotonic() + timeout)
        self.writes[lease.id] = lease
        self._hold(owner, 1)
        return lease

    def close_write(self, lease_id: int, owner: int) -> WriteLease | None:
        lease = self.writes.get(lease_id)
        if lease is None or lease.owner != owner:
            return None
        del self.writes[lease_id]
        self._hold(owner, -1)
        return lease

    def open_read(self, chunk: DramChunk, owner: int) -> ReadLease:
        chunk.readers += 1
        lease = ReadLease(self._lease_id(), chunk, owner)
        self.reads[lease.id] = lease
        self._hold(owner, 1)
        return lease

    def close_read(self, lease_id: int, owner: int) -> bool:
        lease = self.reads.get(lease_id)
        if lease is None or lease.owner != owner:
            return False
        del self.reads[lease_id]
        self._hold(owner, -1)
        chunk = lease.chunk
        chunk.readers -= 1
        if chunk.hidden and chunk.readers == 0:
            self.alloc.free(chunk.extents)
        return True

    def _hold(self, owner: int, n: int) -> None:
        left = self.held.get(owner, 0) + n
        if left:
            self.held[owner] = left
        else:
            del self.held[owner]

    def leases_of(self, owner: int) -> tuple[list[int], list[int]]:
        """Every lease an owner holds (a scan: for disconnects, not the hot path)."""
        return (
            [i for i, w in self.writes.items() if w.owner == owner],
            [i for i, r in self.reads.items() if r.owner == owner],
        )

    def expired_writes(self, now: float) -> list[WriteLease]:
        # A spare (keyless, put-ahead) never expires: fenced, its pages would stay taken
        # until its connection closes anyway, one more at each idle spell; it stays usable.
        return [w for w in self.writes.values() if w.deadline < now and w.key]

    def expire_writes(self, now: float) -> int:
        """End write leases idle past their deadline; returns how many.

        Their pages are fenced, not freed: the writer may be slow, not gone (an engine
        stalled by its GPU), still holding the mapping and a copy in flight, and pages
        handed to another chunk now would get its late bytes. They are freed when the
        writer's connection closes (`unfence`)."""
        expired = self.expired_writes(now)
        for lease in expired:
            self.close_write(lease.id, lease.owner)
            self.fenced.setdefault(lease.owner, []).extend(lease.extents)
        return len(expired)

    def unfence(self, owner: int) -> None:
        """The owner's connection closed: the pages of its expired writes can be reused."""
        extents = self.fenced.pop(owner, None)
        if extents:
            self.alloc.free(extents)

    @property
    def fenced_bytes(self) -> int:
        return sum(n for extents in self.fenced.values() for _, n in extents)
