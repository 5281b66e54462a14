"""Each tier's chunks in eviction order, kept up to date as chunks come, go and are hit.

Keeping the order incrementally (instead of sorting a tier's whole index on
every eviction round) makes eviction cost O(1) or O(log n) per chunk, so a
tier can run with watermarks close together and stay nearly full.

The queues hold facts only (`policy.Entry` objects, owned by the tier); what
to evict is still decided by `policy.choose_victims`, which walks
`candidates()` and stops as soon as enough bytes are chosen. No I/O, no clock.

The S3-FIFO orders keep their lists in arrays indexed by the entries' slots
(`EntrySlots`: the DRAM and NVMe tiers' own, else `ObjectSlots`) and their ghost
lists as fingerprints (`GhostList`), so a queued chunk costs ~20 bytes of heap, not
an ordered dict's node, entry and key; the heap orders keep one int per heap row.

Orders (`EvictionOrder`):

- `adaptive` (default): S3-FIFO whose probation size tunes itself from ghost
  hits, with an LRU main queue, where a request's deeper chunks leave before
  the ones above them (`AdaptiveQueue`).
- `s3fifo`: S3-FIFO (Yang et al., SOSP 2023). New chunks enter a
  small probation FIFO; a chunk hit while there moves to the main FIFO, one
  that is not leaves first and is remembered in a ghost list, so it goes
  straight to main if it comes back. Main is a FIFO with reinsertion (a hit
  chunk goes round again, up to three times). Most KV chunks are never
  reused (a prompt's unique tail), and this keeps them from pushing out the
  shared prefixes that are. A prompt's last chunk (usually a partial block,
  unique to that prompt) enters probation at the front.
- `lru`, `lfu`, `prefix`: a lazy heap on `policy.order_key`, of ints that hold the
  entries' slots (`KeyedQueue`).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Generator, Iterator
from typing import Protocol

from .config import EvictionOrder
from .policy import Entry

SMALL_FRACTION = 0.2
"""Share of a tier's bytes the S3-FIFO probation queue may hold before it evicts from there."""
MAX_FREQ = 3
"""Reinsertions a hit chunk earns in S3-FIFO's main queue."""


class EvictionQueue(ABC):
    """One tier's entries in eviction order. Call from one thread (the event loop)."""

    slots: EntrySlots
    """Where the entries live (the tier's slots, or `ObjectSlots`)."""

    @abstractmethod
    def add(self, entry: Entry, *, tail: bool = False) -> None:
        """A chunk entered the tier; `tail`: it is the last chunk of its prompt."""

    @abstractmethod
    def touched(self, entry: Entry) -> None:
        """A chunk was hit, or its hits / last_seq / depth changed."""

    def touched_slot(self, slot: int, depth: int) -> None:
        """`touched` for the entry in `slot`, hit at `depth` (its facts updated already):
        the DRAM LOOKUP's path, which makes no view of the chunk."""
        self.touched(self.slots.entry_at(slot))

    @abstractmethod
    def discard(self, key: bytes) -> None:
        """A chunk left the tier (evicted, deleted, moved); call it while the tier still
        knows the key (a queue on the tier's slots finds the chunk through it)."""

    @abstractmethod
    def candidates(self) -> Generator[Entry, None, None]:
        """Entries in the order they should leave, lazily.

        The caller discards what it evicts and then closes the walk (use
        `contextlib.closing`): entries yielded but not discarded by then stay in
        the tier (protected, or enough was freed) and go back into the queue.
        Ends after at most one round over the queue.
        """

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: bytes) -> bool: ...


def new_queue(order: EvictionOrder, slots: EntrySlots | None = None) -> EvictionQueue:
    """A queue in `order`; `slots`: the tier's own slots for its entries, where it has them
    (the S3-FIFO orders keep theirs in arrays by slot; the heap orders hold the entries)."""
    if order is EvictionOrder.ADAPTIVE:
        return AdaptiveQueue(slots=slots)
    if order is EvictionOrder.S3FIFO:
        return S3FifoQueue(slots=slots)
    return KeyedQueue(order, slots)


_TIE_BITS, _SLOT_BITS = 48, 32
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_TIE_MASK = (1 << _TIE_BITS) - 1


def _ranks(order: EvictionOrder) -> Callable[[Entry], int]:
    """`policy.order_key` as one int that sorts the same (its facts are counts and request
    numbers: never negative, below 2^63)."""
    if order is EvictionOrder.LFU:
        return lambda e: (e.hits << 64) | e.last_seq
    if order is EvictionOrder.PREFIX:
        return lambda e: (e.last_seq << 64) | ((1 << 63) - e.depth)
    return lambda e: e.last_seq


class KeyedQueue(EvictionQueue):
    """Smallest `order_key(entry)` first, via a heap of ints whose stale rows are skipped.

    A row is one int: the chunk's rank in the order (`_ranks`), then the push it came
    from (so equal ranks leave in the order they were pushed), then the chunk's slot.
    A touch pushes a new row; the slot's latest push (`_push_of`) tells its current row
    from stale ones, which are skipped, and dropped when they outnumber the chunks.
    A queued chunk costs a row or two (~40-50 bytes each) and 9 bytes by slot, where a
    tuple row, its key and a dict entry cost ~250."""

    def __init__(self, order: EvictionOrder, slots: EntrySlots | None = None) -> None:
        self.slots = slots if slots is not None else ObjectSlots()
        self._rank = _ranks(order)
        self._heap: list[int] = []
        self._member = array("B")
        self._push_of = array("q")
        """By slot: the push of its current row."""
        self._pushes = 0
        self._count = 0

    def _push(self, slot: int, entry: Entry) -> None:
        self._pushes += 1
        self._push_of[slot] = self._pushes
        heapq.heappush(self._heap,
                       (((self._rank(entry) << _TIE_BITS) | self._pushes) << _SLOT_BITS) | slot)
        if len(self._heap) > 2 * self._count + 1024:
            self._compact()

    def _current(self, row: int) -> bool:
        slot = row & _SLOT_MASK
        return bool(self._member[slot]) and (
            self._push_of[slot] == (row >> _SLOT_BITS) & _TIE_MASK)

    def _compact(self) -> None:
        """Only the current rows (a sorted list is a heap)."""
        member, push_of = self._member, self._push_of
        self._heap = sorted(
            row for row in self._heap
            if member[row & _SLOT_MASK]
            and push_of[row & _SLOT_MASK] == (row >> _SLOT_BITS) & _TIE_MASK)

    def add(self, entry: Entry, *, tail: bool = False) -> None:
        slot = self.slots.assign(entry)
        while len(self._member) <= slot:
            self._member.append(0)
            self._push_of.append(0)
        if not self._member[slot]:
            self._member[slot] = 1
            self._count += 1
        self._push(slot, entry)

    def touched(self, entry: Entry) -> None:
        slot = self.slots.slot(entry)
        if 0 <= slot < len(self._member) and self._member[slot]:
            self._push(slot, entry)

    def touched_slot(self, slot: int, depth: int) -> None:
        if 0 <= slot < len(self._member) and self._member[slot]:
            self._push(slot, self.slots.entry_at(slot))

    def discard(self, key: bytes) -> None:
        slot = self.slots.find(key)
        if 0 <= slot < len(self._member) and self._member[slot]:
            self._member[slot] = 0
            self._count -= 1
            self.slots.forget(slot)

    def candidates(self) -> Generator[Entry, None, None]:
        offered: list[int] = []
        try:
            while self._heap:
                row = heapq.heappop(self._heap)
                if not self._current(row):
                    continue  # stale row: the chunk left or moved on
                slot = row & _SLOT_MASK
                offered.append(slot)
                yield self.slots.entry_at(slot)
        finally:
            for slot in offered:  # what the caller did not take goes back
                if self._member[slot]:
                    self._push(slot, self.slots.entry_at(slot))

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: bytes) -> bool:
        slot = self.slots.find(key)
        return 0 <= slot < len(self._member) and bool(self._member[slot])


class EntrySlots(Protocol):
    """Where a queue's entries live: each has a small integer (its slot) while queued.

    A queue keeps its order in arrays indexed by slot, so a tier whose own index is
    slots (DRAM, `tiers/dram.py`) queues a chunk for ~20 bytes instead of an ordered
    dict's node, entry and key (~250). Other entries get slots from `ObjectSlots`."""

    def assign(self, entry: Entry) -> int:
        """The slot of an entry being added."""

    def slot(self, entry: Entry) -> int:
        """The slot of an entry, -1 if it has none."""

    def find(self, key: bytes) -> int:
        """The slot of a key, -1 if none (a queue's `discard` asks before the tier forgets
        the key)."""

    def entry_at(self, slot: int) -> Entry: ...

    def key_at(self, slot: int) -> bytes: ...

    def forget(self, slot: int) -> None:
        """The entry left the queue: its slot is no longer the queue's."""


class ObjectSlots:
    """Slots for entries that are objects of their own (the simulations', tests')."""

    def __init__(self) -> None:
        self._slots: dict[bytes, int] = {}
        self._entries: list[Entry | None] = []
        self._free: list[int] = []

    def assign(self, entry: Entry) -> int:
        slot = self._slots.get(entry.key)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._entries)
            if slot == len(self._entries):
                self._entries.append(None)
            self._slots[entry.key] = slot
        self._entries[slot] = entry
        return slot

    def slot(self, entry: Entry) -> int:
        return self._slots.get(entry.key, -1)

    def find(self, key: bytes) -> int:
        return self._slots.get(key, -1)

    def entry_at(self, slot: int) -> Entry:
        entry = self._entries[slot]
        assert entry is not None
        return entry

    def key_at(self, slot: int) -> bytes:
        return self.entry_at(slot).key

    def forget(self, slot: int) -> None:
        del self._slots[self.entry_at(slot).key]
        self._entries[slot] = None
        self._free.append(slot)


class GhostList:
    """Keys that left a queue, oldest first, as 64-bit fingerprints: ~20 bytes a key.

    What an `OrderedDict[bytes, None]` did for ~150 bytes a key (the key's `bytes`,
    the dict's entry, the order's node), for ghost lists as long as the queue itself.
    A fingerprint is the key's `hash()` (SipHash, seeded per process, so a client cannot
    aim keys at one probe run); two keys sharing one (about n^2 / 2^64) would both look
    remembered, which costs a placement, never data.

    `_ring` holds fingerprints in the order they were remembered (from `_head` on);
    `_cells`, an open-addressing table at most half full, holds ring position + 1 of
    each remembered fingerprint (0 empty, -1 a tombstone). A ring entry whose cell
    points elsewhere (forgotten, or remembered again later) is skipped."""

    def __init__(self) -> None:
        self._ring = array("q")
        self._head = 0
        self._cells = array("i", bytes(4 * 1024))
        self._mask = 1023
        self._live = 0
        self._dead = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: object) -> bool:
        return self._live > 0 and isinstance(key, bytes) and self._cell(hash(key)) >= 0

    def _cell(self, fp: int) -> int:
        """The table cell holding `fp`, or -1."""
        cells, ring, mask = self._cells, self._ring, self._mask
        i = fp & mask
        while True:
            c = cells[i]
            if c == 0:
                return -1
            if c > 0 and ring[c - 1] == fp:
                return i
            i = (i + 1) & mask

    def add(self, key: bytes) -> None:
        """Remember a key (one remembered already keeps its place)."""
        fp = hash(key)
        if self._cell(fp) >= 0:
            return
        if 2 * (self._live + self._dead + 1) > len(self._cells) or (
                len(self._ring) - self._head > 2 * self._live + 1024):
            self._rebuild(self._live + 1)
        self._ring.append(fp)
        self._place(fp, len(self._ring))
        self._live += 1

    def discard(self, key: bytes) -> None:
        at = self._cell(hash(key))
        if at >= 0:
            self._cells[at] = -1
            self._live -= 1
            self._dead += 1

    def pop_oldest(self) -> None:
        """Forget the key remembered longest ago."""
        ring = self._ring
        while self._head < len(ring):
            pos, self._head = self._head, self._head + 1
            if self._at(pos):
                self._cells[self._cell(ring[pos])] = -1
                self._live -= 1
                self._dead += 1
                return

    def _at(self, pos: int) -> bool:
        """Whether ring position `pos` is where its fingerprint is remembered."""
        at = self._cell(self._ring[pos])
        return at >= 0 and self._cells[at] == pos + 1

    def _place(self, fp: int, cell: int) -> None:
        cells, mask = self._cells, self._mask
        i = fp & mask
        while cells[i] > 0:
            i = (i + 1) & mask
        if cells[i] < 0:
            self._dead -= 1
        cells[i] = cell

    def _rebuild(self, need: int) -> None:
        """The remembered fingerprints alone, in order, in a table at most a quarter full."""
        ring = self._ring
        live = array("q", (ring[p] for p in range(self._head, len(ring)) if self._at(p)))
        size = 1024
        while size < 4 * need:
            size <<= 1
        self._ring, self._head = live, 0
        self._cells, self._mask, self._dead = array("i", bytes(4 * size)), size - 1, 0
        for pos, fp in enumerate(live):
            self._place(fp, pos + 1)


_OUT, _SMALL, _MAIN = 0, 1, 2
"""Where a slot is: not queued, in probation, in main."""
_OFFERED = 4
"""Added to _SMALL or _MAIN: yielded by the current walk, out of its queue until kept."""
_NIL = -1


class _View:
    """A queue's keys in order, read-only (for tests and logs: `list(q.small)`, `k in q.main`)."""

    def __init__(self, queue: S3FifoQueue, which: int) -> None:
        self._q, self._which = queue, which

    def __iter__(self) -> Iterator[bytes]:
        q = self._q
        slot = q._head[self._which]
        while slot != _NIL:
            yield q.slots.key_at(slot)
            slot = q._next[slot]

    def __contains__(self, key: object) -> bool:
        q = self._q
        slot = q.slots.find(key) if isinstance(key, bytes) else _NIL
        return slot >= 0 and slot < len(q._where) and q._where[slot] == self._which

    def __len__(self) -> int:
        return self._q._lens[self._which]

    def __bool__(self) -> bool:
        return self._q._head[self._which] != _NIL


class S3FifoQueue(EvictionQueue):
    """S3-FIFO: probation and main as doubly linked lists threaded through per-slot arrays."""

    def __init__(self, small_fraction: float = SMALL_FRACTION,
                 slots: EntrySlots | None = None) -> None:
        self.small_fraction = small_fraction
        self.slots: EntrySlots = slots if slots is not None else ObjectSlots()
        self._prev = array("i")
        self._next = array("i")
        self._where = array("B")
        self._freq = array("B")
        self._size = array("q")
        self._head = [_NIL, _NIL, _NIL]  # by _SMALL / _MAIN
        self._tail = [_NIL, _NIL, _NIL]
        self._lens = [0, 0, 0]
        self._count = 0
        self.ghost = GhostList()
        self.small_bytes = 0
        self.main_bytes = 0
        self._offered: list[int] = []
        """Slots yielded by the current walk, in order (kept or gone by its end)."""

    @property
    def small(self) -> _View:
        return _View(self, _SMALL)

    @property
    def main(self) -> _View:
        return _View(self, _MAIN)

    # -- the lists

    def _fit(self, slot: int) -> None:
        while len(self._where) <= slot:
            self._prev.append(_NIL)
            self._next.append(_NIL)
            self._where.append(_OUT)
            self._freq.append(0)
            self._size.append(0)

    def _link(self, slot: int, which: int, *, front: bool = False, before: int = _NIL) -> None:
        """Into list `which` at its far end, at its head (`front`), or just ahead of `before`
        (a slot in that list)."""
        prev, nxt, head, tail = self._prev, self._next, self._head, self._tail
        if before != _NIL:
            p = prev[before]
            prev[slot], nxt[slot], prev[before] = p, before, slot
            if p == _NIL:
                head[which] = slot
            else:
                nxt[p] = slot
        elif front:
            prev[slot], nxt[slot] = _NIL, head[which]
            if head[which] == _NIL:
                tail[which] = slot
            else:
                prev[head[which]] = slot
            head[which] = slot
        else:
            prev[slot], nxt[slot] = tail[which], _NIL
            if tail[which] == _NIL:
                head[which] = slot
            else:
                nxt[tail[which]] = slot
            tail[which] = slot
        self._where[slot] = which
        self._lens[which] += 1

    def _unlink(self, slot: int) -> None:
        which = self._where[slot]
        p, n = self._prev[slot], self._next[slot]
        if p == _NIL:
            self._head[which] = n
        else:
            self._next[p] = n
        if n == _NIL:
            self._tail[which] = p
        else:
            self._prev[n] = p
        self._lens[which] -= 1

    def _push(self, slot: int, *, small: bool, front: bool = False,
              before: int = _NIL) -> None:
        self._link(slot, _SMALL if small else _MAIN, front=front, before=before)
        if small:
            self.small_bytes += self._size[slot]
        else:
            self.main_bytes += self._size[slot]

    def _take(self, slot: int) -> None:
        """Out of its list (and its bytes out of the list's count)."""
        self._unlink(slot)
        if self._where[slot] == _SMALL:
            self.small_bytes -= self._size[slot]
        else:
            self.main_bytes -= self._size[slot]

    # -- the queue

    def _member(self, slot: int) -> bool:
        return 0 <= slot < len(self._where) and self._where[slot] != _OUT

    def add(self, entry: Entry, *, tail: bool = False) -> None:
        key = entry.key
        slot = self.slots.find(key)
        if self._member(slot):
            self._discard_slot(slot, key)
        self._admit(entry, key, tail, key in self.ghost)

    def _admit(self, entry: Entry, key: bytes, tail: bool, returning: bool) -> int:
        """Queue an entry that is not queued (`returning`: its key is in `ghost`); its slot."""
        slot = self.slots.assign(entry)
        self._fit(slot)
        self._freq[slot] = 0
        self._size[slot] = entry.size
        self._count += 1
        if returning:
            self.ghost.discard(key)
        if returning or entry.hits > 0:
            # Seen before (left probation unhit, or was hit in another tier): main.
            self._push(slot, small=False)
            return slot
        self._push(slot, small=True, front=tail)
        return slot

    def touched(self, entry: Entry) -> None:
        self.touched_slot(self.slots.slot(entry), entry.depth)

    def touched_slot(self, slot: int, depth: int) -> None:
        if self._member(slot) and self._freq[slot] < MAX_FREQ:
            self._freq[slot] += 1

    def discard(self, key: bytes) -> None:
        slot = self.slots.find(key)
        if self._member(slot):
            self._discard_slot(slot, key)

    def _discard_slot(self, slot: int, key: bytes) -> None:
        where = self._where[slot]
        if where & _OFFERED:
            small = where == _SMALL | _OFFERED
        else:
            small = where == _SMALL
            self._take(slot)
        self._where[slot] = _OUT
        self._count -= 1
        self._left(key, small=small)
        self.slots.forget(slot)

    def _left(self, key: bytes, *, small: bool) -> None:
        if small:
            self._remember(key)

    def _remember(self, key: bytes) -> None:
        """Left probation without a second look: a return goes straight to main."""
        self.ghost.add(key)
        while len(self.ghost) > max(1024, self._lens[_MAIN]):
            self.ghost.pop_oldest()

    def candidates(self) -> Generator[Entry, None, None]:
        # Every step moves a chunk from probation to main, spends one of its
        # reinsertions, or yields it, so the walk ends within this many steps.
        steps = (MAX_FREQ + 2) * self._count + 1
        head = self._head
        try:
            for _ in range(steps):
                total = self.small_bytes + self.main_bytes
                from_small = head[_SMALL] != _NIL and (
                    head[_MAIN] == _NIL or self.small_bytes >= self.small_fraction * total)
                if not from_small and head[_MAIN] == _NIL:
                    return
                slot = head[_SMALL if from_small else _MAIN]
                self._take(slot)
                if self._freq[slot] > 0:  # hit since it came in: it stays
                    self._freq[slot] = 0 if from_small else self._freq[slot] - 1
                    self._push(slot, small=False)
                    continue
                self._where[slot] = (_SMALL if from_small else _MAIN) | _OFFERED
                self._offered.append(slot)
                yield self.slots.entry_at(slot)
        finally:
            # What the caller did not take (protected, or not needed) goes back to the
            # head of the queue it came from, in order: being looked at is not a hit.
            for slot in reversed(self._offered):
                where = self._where[slot]
                if where & _OFFERED:
                    self._push(slot, small=where == _SMALL | _OFFERED, front=True)
            self._offered.clear()

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: bytes) -> bool:
        return self._member(self.slots.find(key))


ADAPT_MIN, ADAPT_MAX = 0.01, 0.99
"""Bounds of the adaptive queue's probation share: each queue keeps at least a sliver."""
ADAPT_START = 0.1
"""Probation share an adaptive queue starts from (S3-FIFO's paper value). Other starts were
swept on both bench workloads: none was better at every capacity once the client's put
windows are modelled (docs/benchmarks.md)."""


class AdaptiveQueue(S3FifoQueue):
    """S3-FIFO whose probation share tunes itself from ghost hits, as ARC tunes its split.

    Two ghost lists remember recent leavers: `ghost` the chunks that left
    probation unhit, `main_ghost` those that left main. A chunk that comes
    back after leaving probation says probation was too short to see its
    reuse (a recency workload: a conversation resending its last turn
    minutes later), so probation grows; one that comes back after leaving
    main says main was too small for the reused set (a frequency workload:
    shared prefixes), so probation shrinks. Each step is the returning
    chunk's share of the bytes, scaled ARC-style by how much shorter its
    ghost list is than the other, so the rarer signal moves the split as
    much as the common one. Either way the returning chunk goes to main.

    A request-level signal, read from the chunks' depths: new chunks written
    right after a hit prefix (the chunk at the depth before was just hit, or
    is one of them) extend a prefix that is being reused, a conversation's
    next turn, and join it in main instead of waiting in probation (a
    prompt's tail still goes to probation's front). Without it, on a chat
    workload a turn's new chunks aged in probation apart from the
    conversation they continue, and the order fell 1-2 pt below LRU.

    Deeper chunks first within a request: a chunk hit or added right after
    the chunk one depth above it in the same request (LOOKUP touches a
    prefix, and a put adds its misses, in depth order) is linked just ahead
    of that chunk when both are in the same list, so of a request's run the
    deepest leaves first. A cached chunk serves a hit only while every chunk
    above it is cached too (prefix hits), so queueing a run in depth order,
    as plain FIFO and LRU do, evicts first the one chunk whose loss wastes
    all the others. This closed the default's last gap to the best
    libCacheSim policy (0.55 pt below MQ at 5% of the bundled trace, now
    within 0.5 pt at every capacity, and no lower anywhere measured; see
    docs/benchmarks.md). The `prefix` order breaks its ties the same way.

    Main is LRU (a hit moves the chunk to main's far end) rather than
    S3-FIFO's FIFO with reinsertion: a finished conversation's chunks, hit
    a few times each, would otherwise go round main up to `MAX_FREQ` more
    times after their last use. Measured on both bench workloads, see
    docs/benchmarks.md. Each ghost list holds at most as many keys as the
    queue holds chunks (at least 1024), as ARC's do.
    """

    def __init__(self, start: float = ADAPT_START, slots: EntrySlots | None = None) -> None:
        super().__init__(small_fraction=start, slots=slots)
        self.main_ghost = GhostList()
        self._chain = -1
        """Depth of the last chunk hit or added in a run that extends a hit prefix, else -1."""
        self._last = _NIL
        """Slot of the chunk hit or added last (_NIL once it leaves): the one above the next
        chunk of its request, which then goes just ahead of it (deeper leaves first)."""
        self._last_depth = -1

    def _above(self, slot: int, depth: int, which: int) -> int:
        """The slot to link `slot` (at `depth`) into list `which` just ahead of: the chunk hit
        or added last, if it is one depth above (the same request's previous chunk), another
        chunk, and in that list; else _NIL (the list's far end)."""
        last = self._last
        if depth > 0 and depth == self._last_depth + 1 and last != _NIL and last != slot \
                and self._where[last] == which:
            return last
        return _NIL

    def _discard_slot(self, slot: int, key: bytes) -> None:
        if slot == self._last:
            self._last = _NIL  # its slot may soon hold another chunk
        super()._discard_slot(slot, key)

    def add(self, entry: Entry, *, tail: bool = False) -> None:
        key = entry.key
        slot = self.slots.find(key)
        member = self._member(slot)
        if member:
            self._discard_slot(slot, key)
        in_ghost, from_main = key in self.ghost, key in self.main_ghost  # each asked once
        if not member:  # a re-add of a chunk still here is not a return
            self._adapt(entry.size, in_ghost, from_main)
        if from_main:
            self.main_ghost.discard(key)
        slot = self._admit(entry, key, tail, in_ghost)  # a probation ghost or a hit: main
        # A new chunk right after a hit prefix (the chunk before it was just hit, or is
        # one of these) extends a prefix that is being reused: a conversation's next
        # turn. It joins its prefix in main rather than waiting in probation.
        extends = entry.depth > 0 and entry.depth == self._chain + 1
        self._chain = entry.depth if extends else -1
        to_main = (from_main or (extends and not tail)) and self._where[slot] == _SMALL
        # Behind the request's previous chunk, if it is in the same list: deeper leaves
        # first (a prompt's tail stays at probation's front, to leave before all of them).
        before = _NIL if tail else self._above(
            slot, entry.depth, _MAIN if to_main else self._where[slot])
        if to_main or before != _NIL:
            self._take(slot)
            self._push(slot, small=not to_main and self._where[slot] == _SMALL, before=before)
        self._last, self._last_depth = slot, entry.depth

    def _adapt(self, size: int, in_ghost: bool, in_main_ghost: bool) -> None:
        step = size / max(self.small_bytes + self.main_bytes, size, 1)
        if in_ghost:
            step *= max(1.0, len(self.main_ghost) / len(self.ghost))
            self.small_fraction = min(ADAPT_MAX, self.small_fraction + step)
        elif in_main_ghost:
            step *= max(1.0, len(self.ghost) / len(self.main_ghost))
            self.small_fraction = max(ADAPT_MIN, self.small_fraction - step)

    def touched_slot(self, slot: int, depth: int) -> None:
        self._chain = depth
        if not 0 <= slot < len(self._where):
            self._last = _NIL
            return
        where = self._where[slot]
        if where == _MAIN:
            self._unlink(slot)  # main is LRU, the request's deeper chunks ahead
            self._link(slot, _MAIN, before=self._above(slot, depth, _MAIN))
        elif where != _OUT and self._freq[slot] < MAX_FREQ:
            self._freq[slot] += 1  # as S3-FIFO's
        self._last, self._last_depth = (slot if where != _OUT else _NIL), depth

    def _left(self, key: bytes, *, small: bool) -> None:
        ghost = self.ghost if small else self.main_ghost
        ghost.add(key)
        while len(ghost) > max(1024, self._count):
            ghost.pop_oldest()
