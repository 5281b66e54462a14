"""G2: chunks held in the shared-memory arena, with their leases.

The DRAM tier owns the arena's index: which key lives in which extents, who
is reading it (read leases) and what is being written (write leases, not yet
visible). A chunk under a lease or a pin is never evicted or freed; a chunk
deleted while read is hidden at once and freed on its last release.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from xxhash import xxh3_64_intdigest

from ..arena import Arena, ExtentAllocator
from ..journal import JournalEntry
from ..keytable import KeyTable, NameIds
from ..lookupindex import ASK, SharedIndex, Where
from ..peers.links import ArenaTarget
from ..policy import Entry
from ..protocol import Extents, checksum
from .facts import FactRows, SlotFacts, hit_run


class DramChunk(SlotFacts):
    """One DRAM chunk: a view of its slot in the tier's arrays (made on demand, two words).

    Valid while the slot is taken: while the chunk is visible, read (hidden), or being
    demoted (detached, until `DramTier.release`). Its facts are `policy.Entry`'s
    (`SlotFacts`)."""

    __slots__ = ("_t", "slot")
    _t: DramTier

    def __init__(self, tier: DramTier, slot: int) -> None:
        self._t = tier
        self.slot = slot

    def __repr__(self) -> str:
        return f"DramChunk({self.key.hex()}, slot={self.slot})"

    @property
    def key(self) -> bytes:
        return self._t.index.key_at(self.slot)

    @property
    def extents(self) -> Extents:
        t, slot = self._t, self.slot
        offset = t._offset[slot]
        return [(offset, t._size[slot])] if offset >= 0 else list(t._spread[slot])

    @property
    def size(self) -> int:
        return self._t._size[self.slot]

    @property
    def checksum(self) -> int:
        return self._t._checksum[self.slot]

    @property
    def checksum_kind(self) -> int:
        return self._t._kind[self.slot]

    @property
    def meta(self) -> bytes:
        return self._t._meta[self.slot]

    @property
    def tenant(self) -> str:
        return self._t._tenants.names[self._t._tenant[self.slot]]

    @property
    def readers(self) -> int:
        return self._t._readers[self.slot]

    @property
    def hidden(self) -> bool:
        """Deleted or evicted while read: invisible, freed when the last reader releases."""
        return self._t._state[self.slot] == _HIDDEN


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


@dataclass(slots=True)
class Drain:
    """What a closed connection that copied by DMA still held, kept until `deadline`: its
    write leases' pages (open or fenced) from reuse, its read leases open."""

    deadline: float
    owner: int
    extents: Extents
    reads: list[int]


_LIVE, _HIDDEN, _DETACHED = 0, 1, 2
"""A slot's chunk is visible; read after it was deleted or evicted; being demoted."""


@dataclass
class DramTier:
    arena: Arena
    alloc: ExtentAllocator = field(init=False)
    index: KeyTable = field(default_factory=KeyTable)
    """Visible chunks' keys to their slots; a chunk's facts are rows of the arrays below.

    Flat arrays, not an object per chunk: at a million chunks an object, its extents
    list and a dict entry cost ~700 bytes of heap a chunk, these ~100 (docs/benchmarks.md,
    issue 20)."""
    writes: dict[int, WriteLease] = field(default_factory=dict)
    reads: dict[int, ReadLease] = field(default_factory=dict)
    pins: set[bytes] = field(default_factory=set)
    held: dict[int, int] = field(default_factory=dict)
    """Open leases (read and write) per owner, for the per-client budget."""
    fenced: dict[int, Extents] = field(default_factory=dict)
    """Pages of expired write leases, per owner, kept from reuse until it disconnects."""
    draining: list[Drain] = field(default_factory=list)
    """Closed DMA connections' pages and read leases, kept until their drain ends (oldest
    first: every drain is as long)."""
    published: SharedIndex | None = None
    """The visible keys as clients read them from shared memory (`lookupindex`), if any."""
    _next_lease: int = 1
    hit: Callable[[int, int, int, float], None] = field(init=False, repr=False, compare=False)
    """`FactRows.hit` of the chunk in a slot, bound once: LOOKUP calls it per key."""

    def __post_init__(self) -> None:
        self.alloc = ExtentAllocator(self.arena.size)
        self._offset = array("q")
        """Byte offset of a chunk in one extent (nearly all); -1: its extents are in `_spread`."""
        self._spread: dict[int, tuple[tuple[int, int], ...]] = {}
        self._size = array("q")
        self._checksum = array("Q")
        self._kind = array("B")
        self._meta: list[bytes] = []
        """Mostly the one empty `bytes` object, shared."""
        self._tenant = array("I")
        self._tenants = NameIds()
        self._readers = array("i")
        self.facts = FactRows()
        self.hit = self.facts.hit
        self._state = array("B")

    # -- capacity

    @property
    def capacity_bytes(self) -> int:
        return self.alloc.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the arena taken: visible chunks, hidden ones still read, pending writes."""
        return self.alloc.used_bytes

    # -- the arena's pages and bytes (the store asks here: the tier owns the allocator and
    # the mapping)

    @property
    def page_bytes(self) -> int:
        return self.alloc.page

    def footprint(self, size: int) -> int:
        """Arena bytes a chunk of `size` takes: whole pages."""
        return self.alloc.pages_for(size) * self.alloc.page

    def allocate(self, size: int) -> Extents | None:
        """Free extents for `size` bytes, or None (the store evicts and tries again)."""
        return self.alloc.alloc(size)

    def reserve(self, extents: Extents) -> bool:
        """Take exactly these extents (a restart re-admitting journaled chunks)."""
        return self.alloc.reserve(extents)

    def free(self, extents: Extents) -> None:
        self.alloc.free(extents)

    def write_extents(self, extents: Extents, data: Any) -> None:
        self.arena.write(extents, data)

    def read_extents(self, extents: Extents) -> bytes:
        """The bytes in `extents`, unverified (`read_verified` checks a chunk's)."""
        return self.arena.read(extents)

    def checksum_of(self, extents: Extents, meta: bytes, kind: int) -> int:
        return self.arena.checksum(extents, meta, kind)

    @property
    def address(self) -> int:
        """The arena's mapping address, where a peer reply to a reader on this kernel is
        copied from (`Arena.address`)."""
        return self.arena.address

    def dup_fd(self) -> int:
        """A descriptor of the arena file of the caller's own (it closes it)."""
        return os.dup(self.arena.fd)

    def fetch_target(self, extents: Extents) -> ArenaTarget:
        """Where a peer read puts a chunk: `extents`, written by `Arena.write_run`, the
        file's size restored first (a pwrite past a shrunk end would grow a sparse file)."""
        return self.fetch_targets([extents])[0]

    def fetch_targets(self, runs: list[Extents]) -> list[ArenaTarget]:
        """`fetch_target` of each of a batch's chunks, the file's size checked once for
        them all (an `fstat`, and the GIL let go, per batch, not per chunk: the targets
        are made in one turn of the loop, before any of their reads starts)."""
        arena = self.arena
        arena.restore_size()
        guard = arena.guard_counts()
        return [ArenaTarget(arena.fd, extents, arena.write_run, arena.mapped_base, guard,
                            arena.repair) for extents in runs]

    # -- pins

    def pinned(self, key: bytes) -> bool:
        return key in self.pins

    def pin(self, key: bytes) -> None:
        self.pins.add(key)

    def unpin(self, key: bytes) -> None:
        self.pins.discard(key)

    def repin(self, unpinned: Iterable[bytes], pinned: Iterable[bytes]) -> None:
        """A policy's pins applied: `unpinned` no longer, `pinned` now."""
        self.pins.difference_update(unpinned)
        self.pins.update(pinned)

    # -- index

    def finder(self) -> Callable[[bytes], int]:
        """The index's own key -> slot lookup (-1: none), for a loop over many keys to bind
        once (LOOKUP: no call layer per key)."""
        return self.index.find

    def find_many(self, keys: Sequence[bytes], want: bytes,
                  hashes: bytes) -> tuple[array[int], bytes]:
        """Each key's slot (-1: none) and whether it is visible here (1 or 0 a key):
        `KeyTable.find_many` (LOOKUP: the index is written on the event loop only)."""
        return self.index.find_many(keys, want, hashes)

    def hit_run(self, slots: array[int], n: int, seq: int, now: float) -> None:
        """The chunks in the first `n` of `slots` hit by LOOKUP `seq`, each at its index
        as its depth (`hit` of each, in one call: `facts.hit_run`)."""
        hit_run(self.facts, slots, n, seq, now)

    def __len__(self) -> int:
        """Visible chunks."""
        return len(self.index)

    def get(self, key: bytes) -> DramChunk | None:
        slot = self.index.find(key)
        return None if slot < 0 else DramChunk(self, slot)

    def __contains__(self, key: bytes) -> bool:
        return self.index.find(key) >= 0

    def __iter__(self) -> Iterator[bytes]:
        """The visible chunks' keys, in no particular order."""
        return map(self.index.key_at, self.index.live_slots())

    def entries(self) -> Iterator[DramChunk]:
        """The visible chunks, in no particular order."""
        return (DramChunk(self, slot) for slot in self.index.live_slots())

    # the slots of its chunks, for its eviction queue (`eviction.EntrySlots`)

    def assign(self, entry: Entry) -> int:
        return self.slot(entry)

    def slot(self, entry: Entry) -> int:
        return entry.slot  # type: ignore[attr-defined,no-any-return]  # a DramChunk: hot

    def find(self, key: bytes) -> int:
        return self.index.find(key)

    def entry_at(self, slot: int) -> DramChunk:
        return DramChunk(self, slot)

    def key_at(self, slot: int) -> bytes:
        return self.index.key_at(slot)

    def forget(self, slot: int) -> None:
        """Nothing to do: the slot is the tier's until the chunk is released."""

    def journal_entries(self) -> Iterator[JournalEntry]:
        """The commit journal's view of the visible chunks (what a compaction keeps), least
        recently used first: a restart admits them in this order."""
        for slot in sorted(self.index.live_slots(), key=self.facts.seq.__getitem__):
            c = DramChunk(self, slot)
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
        if key in self.pins:
            return True
        slot = self.index.find(key)
        return slot >= 0 and self._readers[slot] > 0

    def insert(self, key: bytes, extents: Extents, size: int, checksum: int, meta: bytes,
               tenant: str, checksum_kind: int = 0, *, hits: int = 0, seq: int = 0,
               depth: int = 0, now: float = 0.0) -> DramChunk:
        """Make a chunk visible (the key must not be: the store checks first), with its
        hits so far and the request (`seq`, `depth`) and time (`now`) of its last access."""
        slot = self.index.add(key)
        tenant_id = self._tenants.id_of(tenant)
        if slot == len(self._size):
            self._add_row()
        offset = extents[0][0] if len(extents) == 1 else -1
        self._offset[slot], self._size[slot] = offset, size
        self._checksum[slot], self._kind[slot] = checksum, checksum_kind
        self._meta[slot], self._tenant[slot] = meta, tenant_id
        self._readers[slot] = 0
        self.facts.set(slot, hits, seq, depth, now)
        self._state[slot] = _LIVE
        if offset < 0:
            self._spread[slot] = tuple(extents)
        if self.published is not None:
            if not self.published.add(key, self._where(slot)):
                # with this key: it is in the index
                self.published.rebuild(iter(self), self._where_of)
            self._tidy_published()
        return DramChunk(self, slot)

    def _where(self, slot: int) -> Where:
        """What the published table says of the chunk in `slot`, for lease-free reads: its
        one extent and checksum, or `ASK` (several extents: a lease reads them)."""
        offset = self._offset[slot]
        if offset < 0:
            return ASK
        return (offset, self._size[slot], self._checksum[slot], self._kind[slot],
                xxh3_64_intdigest(self._meta[slot]))

    def _where_of(self, key: bytes) -> Where:
        return self._where(self.index.find(key))

    def _add_row(self) -> None:
        for column in (self._offset, self._size, self._checksum, self._kind, self._tenant,
                       self._readers, self._state):
            column.append(0)
        self.facts.add_row()
        self._meta.append(b"")

    def remove(self, key: bytes) -> DramChunk | None:
        """Take a chunk out of the index; its space is freed now or on its last release."""
        slot = self.index.remove(key)
        if slot < 0:
            return None
        if self.published is not None:
            self.published.remove(key)
            self._tidy_published()
        chunk = DramChunk(self, slot)
        if self._readers[slot]:
            self._state[slot] = _HIDDEN
        else:
            self.release(chunk)
        return chunk

    def detach(self, key: bytes) -> DramChunk | None:
        """Take an unread chunk out of the index keeping its pages and its slot: the caller
        gives them back with `release` (a chunk being demoted keeps its pages until its
        NVMe copy has landed)."""
        slot = self.index.find(key)
        if slot < 0 or self._readers[slot]:
            return None
        self.index.remove(key)
        self._state[slot] = _DETACHED
        if self.published is not None:
            self.published.remove(key)
            self._tidy_published()
        return DramChunk(self, slot)

    def release(self, chunk: DramChunk) -> None:
        """Free a chunk out of the index: its pages, then its slot. The slot's facts stay
        readable until the next `insert` reuses it.

        The only way a visible chunk's pages are freed, and only for a chunk `remove` or
        `detach` took out of the index: both retire its published slot first, so a client
        reading it without a lease sees the slot changed before any other chunk can get
        these pages (docs/protocol.md, "Reads without a lease")."""
        slot = chunk.slot
        self.alloc.free(chunk.extents)
        self._spread.pop(slot, None)
        self._meta[slot] = b""  # the chunk's metadata is not kept alive by a free slot
        self.index.release(slot)

    def _tidy_published(self) -> None:
        assert self.published is not None
        if self.published.crowded:
            self.published.rebuild(iter(self), self._where_of)

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
        self._readers[chunk.slot] += 1
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
        slot = lease.chunk.slot
        self._readers[slot] -= 1
        if self._state[slot] == _HIDDEN and self._readers[slot] == 0:
            self.release(lease.chunk)
        return True

    def _hold(self, owner: int, n: int) -> None:
        left = self.held.get(owner, 0) + n
        if left:
            self.held[owner] = left
        else:
            del self.held[owner]

    def write_lease(self, lease_id: int) -> WriteLease | None:
        return self.writes.get(lease_id)

    def writes_of(self, owner: int) -> list[WriteLease]:
        """An owner's open write leases (a scan: for disconnects, not the hot path)."""
        return [w for w in self.writes.values() if w.owner == owner]

    def leases_held(self, owner: int) -> int:
        """Open leases (read and write) of `owner`."""
        return self.held.get(owner, 0)

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

    def drain(self, owner: int, writes: list[WriteLease], deadline: float) -> None:
        """The owner's connection closed while a device may still copy into its write
        leases' pages or out of its read leases' chunks: end its writes, but keep their
        pages (and those of its expired writes) from reuse and its reads open until
        `deadline` (`end_drains`)."""
        extents = self.fenced.pop(owner, [])
        for lease in writes:
            if self.close_write(lease.id, owner) is not None:
                extents.extend(lease.extents)
        reads = [i for i, r in self.reads.items() if r.owner == owner]
        if extents or reads:
            self.draining.append(Drain(deadline, owner, extents, reads))

    def end_drains(self, now: float) -> int:
        """Free the pages and end the reads of the drains past their deadline; how many."""
        ended = 0
        while self.draining and self.draining[0].deadline <= now:
            d = self.draining.pop(0)
            if d.extents:
                self.alloc.free(d.extents)
            for lease_id in d.reads:
                self.close_read(lease_id, d.owner)
            ended += 1
        return ended

    # -- figures (the store's snapshot)

    @property
    def read_leases(self) -> int:
        return len(self.reads)

    @property
    def write_leases(self) -> int:
        return len(self.writes)

    @property
    def pin_count(self) -> int:
        return len(self.pins)

    @property
    def locked_bytes(self) -> int:
        """Arena bytes locked in RAM."""
        return self.arena.locked_bytes

    @property
    def lock_error(self) -> str:
        """Why the arena is not locked in RAM ("" when it is, or was not asked to be)."""
        return self.arena.lock_error or ""

    @property
    def draining_reads(self) -> int:
        """Read leases of closed DMA connections, kept open until their drain ends."""
        return sum(len(x.reads) for x in self.draining)

    @property
    def fenced_bytes(self) -> int:
        return sum(n for extents in self.fenced.values() for _, n in extents)

    @property
    def draining_bytes(self) -> int:
        """Pages of write leases held by drains (read chunks count as chunks)."""
        return sum(n for d in self.draining for _, n in d.extents)
