"""Each tier's chunks in eviction order, kept up to date as chunks come, go and are hit.

Keeping the order incrementally (instead of sorting a tier's whole index on
every eviction round) makes eviction cost O(1) or O(log n) per chunk, so a
tier can run with watermarks close together and stay nearly full.

The queues hold facts only (`policy.Entry` objects, owned by the tier); what
to evict is still decided by `policy.choose_victims`, which walks
`candidates()` and stops as soon as enough bytes are chosen. No I/O, no clock.

Orders (`EvictionOrder`):

- `adaptive` (default): S3-FIFO whose probation size tunes itself from ghost
  hits, with an LRU main queue (`AdaptiveQueue`).
- `s3fifo`: S3-FIFO (Yang et al., SOSP 2023). New chunks enter a
  small probation FIFO; a chunk hit while there moves to the main FIFO, one
  that is not leaves first and is remembered in a ghost list, so it goes
  straight to main if it comes back. Main is a FIFO with reinsertion (a hit
  chunk goes round again, up to three times). Most KV chunks are never
  reused (a prompt's unique tail), and this keeps them from pushing out the
  shared prefixes that are. A prompt's last chunk (usually a partial block,
  unique to that prompt) enters probation at the front.
- `lru`, `lfu`, `prefix`: a lazy heap on `policy.order_key`.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Generator

from .config import EvictionOrder
from .policy import Entry, order_key

SMALL_FRACTION = 0.2
"""Share of a tier's bytes the S3-FIFO probation queue may hold before it evicts from there."""
MAX_FREQ = 3
"""Reinsertions a hit chunk earns in S3-FIFO's main queue."""


class EvictionQueue(ABC):
    """One tier's entries in eviction order. Call from one thread (the event loop)."""

    @abstractmethod
    def add(self, entry: Entry, *, tail: bool = False) -> None:
        """A chunk entered the tier; `tail`: it is the last chunk of its prompt."""

    @abstractmethod
    def touched(self, entry: Entry) -> None:
        """A chunk was hit, or its hits / last_seq / depth changed."""

    @abstractmethod
    def discard(self, key: bytes) -> None:
        """A chunk left the tier (evicted, deleted, moved)."""

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


def new_queue(order: EvictionOrder) -> EvictionQueue:
    if order is EvictionOrder.ADAPTIVE:
        return AdaptiveQueue()
    if order is EvictionOrder.S3FIFO:
        return S3FifoQueue()
    return KeyedQueue(order)


class KeyedQueue(EvictionQueue):
    """Smallest `order_key(entry)` first, via a heap whose stale rows are skipped."""

    def __init__(self, order: EvictionOrder) -> None:
        self.key = order_key(order)
        self.entries: dict[bytes, Entry] = {}
        self._heap: list[tuple[tuple[int, ...], int, bytes]] = []
        self._tie = itertools.count()

    def _push(self, entry: Entry) -> None:
        heapq.heappush(self._heap, (self.key(entry), next(self._tie), entry.key))
        if len(self._heap) > 4 * len(self.entries) + 1024:
            self._heap = [(self.key(e), next(self._tie), k) for k, e in self.entries.items()]
            heapq.heapify(self._heap)

    def add(self, entry: Entry, *, tail: bool = False) -> None:
        self.entries[entry.key] = entry
        self._push(entry)

    def touched(self, entry: Entry) -> None:
        if entry.key in self.entries:
            self._push(entry)

    def discard(self, key: bytes) -> None:
        self.entries.pop(key, None)

    def candidates(self) -> Generator[Entry, None, None]:
        offered: list[Entry] = []
        seen: set[bytes] = set()
        try:
            while self._heap:
                order, _, key = heapq.heappop(self._heap)
                entry = self.entries.get(key)
                if entry is None or key in seen or self.key(entry) != order:
                    continue  # stale row: the chunk left or moved on
                seen.add(key)
                offered.append(entry)
                yield entry
        finally:
            for entry in offered:  # what the caller did not take goes back
                if entry.key in self.entries:
                    self._push(entry)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries


class S3FifoQueue(EvictionQueue):
    def __init__(self, small_fraction: float = SMALL_FRACTION) -> None:
        self.small_fraction = small_fraction
        self.small: OrderedDict[bytes, Entry] = OrderedDict()
        self.main: OrderedDict[bytes, Entry] = OrderedDict()
        self.freq: dict[bytes, int] = {}
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.small_bytes = 0
        self.main_bytes = 0
        self._offered: dict[bytes, tuple[Entry, bool]] = {}
        """Yielded by the current walk and not yet kept or gone: (entry, from probation)."""

    def add(self, entry: Entry, *, tail: bool = False) -> None:
        key = entry.key
        self.discard(key)
        self.freq[key] = 0
        returning = key in self.ghost  # the ghost list's values are None: test membership
        self.ghost.pop(key, None)
        if returning or entry.hits > 0:
            # Seen before (left probation unhit, or was hit in another tier): main.
            self._push(entry, small=False)
            return
        self._push(entry, small=True)
        if tail:
            self.small.move_to_end(key, last=False)

    def touched(self, entry: Entry) -> None:
        if entry.key in self.freq:
            self.freq[entry.key] = min(MAX_FREQ, self.freq[entry.key] + 1)

    def discard(self, key: bytes) -> None:
        if self.freq.pop(key, None) is None:
            return
        offered = self._offered.pop(key, None)
        if offered is not None:
            self._left(key, small=offered[1])
            return
        entry = self.small.pop(key, None)
        if entry is not None:
            self.small_bytes -= entry.size
            self._left(key, small=True)
            return
        entry = self.main.pop(key, None)
        if entry is not None:
            self.main_bytes -= entry.size
            self._left(key, small=False)

    def _left(self, key: bytes, *, small: bool) -> None:
        if small:
            self._remember(key)

    def _remember(self, key: bytes) -> None:
        """Left probation without a second look: a return goes straight to main."""
        self.ghost[key] = None
        while len(self.ghost) > max(1024, len(self.main)):
            self.ghost.popitem(last=False)

    def _push(self, entry: Entry, *, small: bool) -> None:
        if small:
            self.small[entry.key] = entry
            self.small_bytes += entry.size
        else:
            self.main[entry.key] = entry
            self.main_bytes += entry.size

    def _pop(self, small: bool) -> Entry:
        queue = self.small if small else self.main
        _, entry = queue.popitem(last=False)
        if small:
            self.small_bytes -= entry.size
        else:
            self.main_bytes -= entry.size
        return entry

    def candidates(self) -> Generator[Entry, None, None]:
        # Every step moves a chunk from probation to main, spends one of its
        # reinsertions, or yields it, so the walk ends within this many steps.
        steps = (MAX_FREQ + 2) * len(self.freq) + 1
        try:
            for _ in range(steps):
                total = self.small_bytes + self.main_bytes
                from_small = bool(self.small) and (
                    not self.main or self.small_bytes >= self.small_fraction * total)
                if not from_small and not self.main:
                    return
                entry = self._pop(from_small)
                key = entry.key
                if self.freq[key] > 0:  # hit since it came in: it stays
                    self.freq[key] = 0 if from_small else self.freq[key] - 1
                    self._push(entry, small=False)
                    continue
                self._offered[key] = (entry, from_small)
                yield entry
        finally:
            # What the caller did not take (protected, or not needed) goes back to the
            # head of the queue it came from, in order: being looked at is not a hit.
            for entry, from_small in reversed(self._offered.values()):
                self._push(entry, small=from_small)
                (self.small if from_small else self.main).move_to_end(entry.key, last=False)
            self._offered.clear()

    def __len__(self) -> int:
        return len(self.freq)

    def __contains__(self, key: bytes) -> bool:
        return key in self.freq



ADAPT_MIN, ADAPT_MAX = 0.01, 0.99
"""Bounds of the adaptive queue's probation share: each queue keeps at least a sliver."""
ADAPT_START = 0.15
"""Probation share an adaptive queue starts from: S3-FIFO's paper value is 0.1, but on a
trace of a few thousand requests the start still shows, and 0.15 was the start with the
most margin over the best online policy on both bench workloads (docs/benchmarks.md)."""


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

    Main is LRU (a hit moves the chunk to main's far end) rather than
    S3-FIFO's FIFO with reinsertion: a finished conversation's chunks, hit
    a few times each, would otherwise go round main up to `MAX_FREQ` more
    times after their last use. Measured on both bench workloads, see
    docs/benchmarks.md. Each ghost list holds at most as many keys as the
    queue holds chunks (at least 1024), as ARC's do.
    """

    def __init__(self, start: float = ADAPT_START) -> None:
        super().__init__(small_fraction=start)
        self.main_ghost: OrderedDict[bytes, None] = OrderedDict()
        self._chain = -1
        """Depth of the last chunk hit or added in a run that extends a hit prefix, else -1."""

    def add(self, entry: Entry, *, tail: bool = False) -> None:
        key = entry.key
        if key not in self.freq:  # a re-add of a chunk still here is not a return
            self._adapt(key, entry.size)
        self.discard(key)
        from_main = key in self.main_ghost  # the values are None: test membership
        self.main_ghost.pop(key, None)
        super().add(entry, tail=tail)  # a probation ghost or an earlier hit: main
        # A new chunk right after a hit prefix (the chunk before it was just hit, or is
        # one of these) extends a prefix that is being reused: a conversation's next
        # turn. It joins its prefix in main rather than waiting in probation.
        extends = entry.depth > 0 and entry.depth == self._chain + 1
        self._chain = entry.depth if extends else -1
        if (from_main or (extends and not tail)) and key in self.small:
            self.small.pop(key)
            self.small_bytes -= entry.size
            self._push(entry, small=False)

    def _adapt(self, key: bytes, size: int) -> None:
        step = size / max(self.small_bytes + self.main_bytes, size, 1)
        if key in self.ghost:
            step *= max(1.0, len(self.main_ghost) / len(self.ghost))
            self.small_fraction = min(ADAPT_MAX, self.small_fraction + step)
        elif key in self.main_ghost:
            step *= max(1.0, len(self.ghost) / len(self.main_ghost))
            self.small_fraction = max(ADAPT_MIN, self.small_fraction - step)

    def touched(self, entry: Entry) -> None:
        self._chain = entry.depth
        if entry.key in self.main:
            self.main.move_to_end(entry.key)  # main is LRU
            return
        super().touched(entry)

    def _left(self, key: bytes, *, small: bool) -> None:
        ghost = self.ghost if small else self.main_ghost
        ghost[key] = None
        while len(ghost) > max(1024, len(self.freq)):
            ghost.popitem(last=False)
