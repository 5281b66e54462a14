"""NVMe's in-memory index: chunk keys to their files' facts, in flat arrays.

A pool of 1 TiB of NVMe at 64 KiB chunks holds 16 million chunk files, so the
index costs what DRAM's does (`tiers/dram.py`): a key maps to a slot through a
`KeyTable`, and a chunk's facts (its file's bytes, tenant, hits, last request,
depth, last access) are rows of parallel arrays by slot; an `NvmeChunk` is a
view of a row, made on demand. NVMe's eviction queue threads its order through
arrays by the same slots (`eviction.EntrySlots`, implemented here).

Threads: worker threads write files and index them (`put`), and take a chunk
whose file is bad or gone out of the index (`unindex`); the event loop reads the
index, updates hit facts and runs the eviction queue. Writers hold the tier's
lock; readers need none (`KeyTable.find` is safe against one writer). A slot is
handed back for reuse only on the event loop, and only once its key is out of
the table and the slot out of the eviction queue (`forget`, `reap`): until then
a removed key's slot is an orphan, still found by the queue under its key, so a
view the loop holds never turns into another chunk's, and a queue never loses
track of a slot a worker took out of the index.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..config import EvictionOrder
from ..eviction import EvictionQueue, new_queue
from ..keytable import KeyTable, NameIds
from ..policy import Entry
from .facts import FactRows, SlotFacts

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


class NvmeChunk(SlotFacts):
    """One NVMe chunk: a view of its slot's row (made on demand, three words); its
    `policy.Entry` facts are `SlotFacts`.

    Two views are equal when they are of one slot and one write of it: a view taken
    before a rewrite, a delete or an eviction of its key equals no view taken after
    (read-ahead copies are kept only while the chunk they were read from is there)."""

    __slots__ = ("_t", "slot", "stamp")
    _t: NvmeIndex

    def __init__(self, index: NvmeIndex, slot: int) -> None:
        self._t = index
        self.slot = slot
        self.stamp = index._stamp[slot]

    def __repr__(self) -> str:
        return f"NvmeChunk({self.key.hex()}, slot={self.slot})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, NvmeChunk) and other._t is self._t
                and other.slot == self.slot and other.stamp == self.stamp)

    def __hash__(self) -> int:
        return hash((self.slot, self.stamp))

    @property
    def key(self) -> bytes:
        return self._t.table.key_at(self.slot)

    @property
    def size(self) -> int:
        """Bytes the file takes (header + chunk)."""
        return self._t._size[self.slot]

    @property
    def tenant(self) -> str:
        return self._t._tenants.names[self._t._tenant[self.slot]]


class NvmeIndex:
    """Indexed NVMe chunks by key: `get`, `in`, iteration (keys), `values()`, `len()`."""

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.table = KeyTable()
        self._lock = lock if lock is not None else threading.Lock()
        """The tier's: held by every writer, and by the loop when it hands slots back."""
        self._size = array("q")
        self._tenant = array("I")
        self._tenants = NameIds()
        self.facts = FactRows()
        self._stamp = array("Q")
        """The write a slot's facts come from (one count for the index): tells views apart."""
        self._writes = 0
        self._queued = array("B")
        """1 while the eviction queue holds the slot."""
        self._orphans: dict[bytes, int] = {}
        """Keys taken out of the table whose slots are not handed back yet."""

    # -- reads (any thread)

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.table.find(key) >= 0

    def __iter__(self) -> Iterator[bytes]:
        """The indexed keys, in no particular order."""
        return map(self.table.key_at, self.table.live_slots())

    def get(self, key: bytes) -> NvmeChunk | None:
        slot = self.table.find(key)
        return None if slot < 0 else NvmeChunk(self, slot)

    def values(self) -> Iterator[NvmeChunk]:
        """The indexed chunks, in no particular order."""
        return (NvmeChunk(self, slot) for slot in self.table.live_slots())

    def new_queue(self, order: EvictionOrder, first: str) -> EvictionQueue:
        """An eviction queue in `order` on these slots holding every indexed chunk, added
        smallest `first` ("last_access" or "last_seq") first; it replaces the queue
        there was (which is dropped: slots only it held are handed back)."""
        queue = new_queue(order, self)
        with self._lock:
            self._queued = array("B", bytes(len(self._queued)))
            for slot in self._orphans.values():
                self.table.release(slot)
            self._orphans.clear()
        slots = self._slots_by(first)
        for lo in range(0, len(slots), 1 << 16):  # a few Python ints at a time
            for slot in slots[lo : lo + (1 << 16)].tolist():
                queue.add(NvmeChunk(self, slot))
        return queue

    def _slots_by(self, fact: str) -> NDArray[np.int64]:
        """The indexed slots, smallest `fact` first, sorted as one numpy column: not as a
        list of views (16 million views would take gigabytes). The numpy views of the
        arrays are gone on return (an array exporting its buffer cannot grow, and a
        worker thread may index a file meanwhile)."""
        import numpy as np

        cells = np.array(self.table.cells, dtype=np.int64)
        live = cells[cells > 0] - 1
        values = np.array(self.facts.access if fact == "last_access" else self.facts.seq)
        return live[np.argsort(values[live], kind="stable")]

    # -- writes (the caller holds the tier's lock)

    def put(self, key: bytes, size: int, tenant: str, now: float) -> int:
        """Index a file just written for `key` (its bytes `size`; `now`: its last access),
        replacing what the key had. Returns the bytes the key's previous file took (0)."""
        table = self.table
        slot = table.find(key)
        old = 0
        if slot >= 0:
            old = self._size[slot]
            fresh = False
        else:
            fresh = True
            slot = self._orphans.pop(key, -1)  # its slot is still queued: the same one
            if slot < 0:
                slot = table.claim(key)
                if slot == len(self._size):
                    self._add_row()
        tenant_id = self._tenants.id_of(tenant)
        # The row is whole before the key is findable (a reader in another thread).
        self._size[slot], self._tenant[slot] = size, tenant_id
        self.facts.set(slot, 0, 0, 0, now)
        self._writes += 1
        self._stamp[slot] = self._writes
        if fresh:
            table.insert(slot)
        return old

    def _add_row(self) -> None:
        for column in (self._size, self._tenant, self._stamp, self._queued):
            column.append(0)
        self.facts.add_row()

    def unindex(self, key: bytes) -> int:
        """Take a key out of the index; the bytes its file takes, -1 if it was not there.
        Its slot stays taken (an orphan) until the event loop hands it back."""
        slot = self.table.remove(key)
        if slot < 0:
            return -1
        self._orphans[key] = slot
        return self._size[slot]

    # -- on the event loop

    def reap(self, key: bytes) -> None:
        """Hand back the slot of a key taken out of the index, unless the eviction queue
        still holds it (then it goes when the queue lets go of it: `forget`)."""
        with self._lock:
            slot = self._orphans.get(key, -1)
            if slot >= 0 and not self._queued[slot]:
                del self._orphans[key]
                self.table.release(slot)

    # the slots of its chunks, for NVMe's eviction queue (`eviction.EntrySlots`)

    def assign(self, entry: Entry) -> int:
        slot: int = entry.slot  # type: ignore[attr-defined]  # an NvmeChunk
        self._queued[slot] = 1
        return slot

    def slot(self, entry: Entry) -> int:
        return entry.slot  # type: ignore[attr-defined,no-any-return]  # an NvmeChunk

    def find(self, key: bytes) -> int:
        """The slot of a key, indexed or an orphan (the queue may hold it still), or -1."""
        slot = self.table.find(key)
        if slot < 0 and self._orphans:
            return self._orphans.get(key, -1)
        return slot

    def entry_at(self, slot: int) -> NvmeChunk:
        return NvmeChunk(self, slot)

    def key_at(self, slot: int) -> bytes:
        return self.table.key_at(slot)

    def forget(self, slot: int) -> None:
        """The queue let go of `slot`: handed back if its key is out of the index."""
        self._queued[slot] = 0
        if self._orphans:
            self.reap(self.table.key_at(slot))
