"""Chunk keys to small integers (slots) in flat arrays: a tier index for millions of chunks.

A `dict[bytes, ...]` costs about 140 bytes of heap per 16-byte key (the key's
`bytes` object, the dict's entry and index, an `int` per value); a tier's
per-chunk facts then live in parallel arrays indexed by the slot (see
`tiers/dram.py`). Here a key costs its 16 bytes in one `bytearray` plus a
4-byte cell of an open-addressing table kept at most half full: 24-32 bytes.

Linear probing from the key's `hash()` (SipHash, seeded per process: a client
choosing keys cannot aim them at one probe run). A cell holds 0 (empty), -1 (a
tombstone: probing goes on past it) or slot + 1. Tombstones are dropped when
the table is rebuilt, which it is once live and dead cells pass half of it (in one
compiled pass where `probekernel` is compiled: ~0.1 s at 10^6 keys, ~0.8 s in Python).

A slot outlives its key in the table: `remove` takes the key out (it is no
longer found) and `release` hands the slot back for reuse, so a tier can keep a
chunk that is still being read, or still being demoted, in its slot after its
key has gone (and `insert` can put it back). Keys are exactly `KEY_BYTES` long
(the protocol checks that).

One writer at a time (the caller serialises), but `find` may run in another thread
while a write is under way (NVMe's index is written by worker threads and read by
the event loop): a write changes one cell at a time, and a rebuild makes the whole
new table before it swaps it in, so a reader sees the old table or the new one.
A caller that claims a slot fills its row before `insert` makes the key findable.

`find_many` answers many keys at once (a LOOKUP's 128) in one compiled loop
(`probekernel`) over the same cells and keys. It reads the key bytes at an address taken
before the call, which a concurrent `claim` growing them would leave behind: only a table
written on the caller's own thread (DRAM's and the peer directory's, on the event loop)
may use it.
"""

from __future__ import annotations

import ctypes
import struct
from array import array
from collections.abc import Iterator, Sequence

from . import probekernel
from .constants import KEY_BYTES

_MIN_CELLS = 1 << 10
_EMPTY, _DEAD = 0, -1
NONE = (-1,)
"""`find_many`'s slot of a key not found."""


class KeyTable:
    """Keys to slots and back. Slots are 0, 1, 2, ... reused after `release`."""

    def __init__(self) -> None:
        self._cells = array("i", bytes(4 * _MIN_CELLS))
        self._mask = _MIN_CELLS - 1
        self._keys = bytearray()
        """KEY_BYTES per slot: the key each slot holds (or held, once released)."""
        self._free = array("i")
        """Released slots, reused last-in first-out."""
        self.live = 0
        """Keys in the table."""
        self._dead = 0

    @property
    def slots(self) -> int:
        """Slots ever handed out: arrays indexed by slot need this many rows."""
        return len(self._keys) // KEY_BYTES

    def __len__(self) -> int:
        return self.live

    def find(self, key: bytes) -> int:
        """The slot of `key`, or -1."""
        cells = self._cells
        mask = len(cells) - 1  # from the cells read: a rebuild swaps them in at once
        i = hash(key) & mask
        cell = cells[i]
        while cell:
            if cell > 0:
                at = (cell - 1) * KEY_BYTES
                if self._keys[at : at + KEY_BYTES] == key:
                    return cell - 1
            i = (i + 1) & mask
            cell = cells[i]
        return -1

    def find_many(self, keys: Sequence[bytes], want: bytes, homes: bytes,
                  compiled: bool = True) -> tuple[array[int], bytes]:
        """The slot of each of `keys` (-1: none) and, one byte a key, whether it was found
        (1) or not (0). `want` is the keys joined, `homes` their `homes`. On the thread
        that writes the table only (see the module). `compiled=False`: key by key in
        Python, as where the compiled loop is missing."""
        n = len(keys)
        if not self.live:
            return array("q", NONE) * n, bytes(n)
        kernels = probekernel.ready() if compiled else None
        if kernels is None:
            slots = array("q", map(self.find, keys))
            return slots, bytes(s >= 0 for s in slots)
        if len(want) != KEY_BYTES * n or len(homes) != 8 * n:
            raise ValueError(f"{n} keys need {KEY_BYTES * n} bytes of keys and {8 * n} of "
                             f"hashes")
        slots = array("q", bytes(8 * n))
        found = array("B", bytes(n))
        cells = self._cells
        kernels.probe(cells.buffer_info()[0], len(cells) - 1,
                      ctypes.addressof(ctypes.c_char.from_buffer(self._keys)), self.slots,
                      want, homes, n, slots.buffer_info()[0], found.buffer_info()[0])
        return slots, found.tobytes()

    def add(self, key: bytes) -> int:
        """A slot for a key not in the table (the caller checked with `find`)."""
        slot = self.claim(key)
        self.insert(slot)
        return slot

    def claim(self, key: bytes) -> int:
        """A slot holding `key` that is not in the table yet (`insert` puts it there)."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
        if self._free:
            slot = self._free.pop()
            self._keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] = key
        else:
            slot = self.slots
            self._keys += key
        return slot

    def insert(self, slot: int) -> None:
        """Make a claimed slot's key findable, or a removed one's again (not released;
        its key must not be in the table)."""
        if 2 * (self.live + self._dead + 1) > len(self._cells):
            self._rebuild(self.live + 1)
        self._place(self.key_at(slot), slot)
        self.live += 1

    def remove(self, key: bytes) -> int:
        """Take `key` out of the table; its slot (returned, -1 if absent) stays taken until
        `release`, and still answers `key_at`."""
        cells, keys, mask = self._cells, self._keys, self._mask
        i = hash(key) & mask
        while True:
            cell = cells[i]
            if cell == _EMPTY:
                return -1
            if cell > 0:
                at = (cell - 1) * KEY_BYTES
                if keys[at : at + KEY_BYTES] == key:
                    cells[i] = _DEAD
                    self.live -= 1
                    self._dead += 1
                    return cell - 1
            i = (i + 1) & mask

    def release(self, slot: int) -> None:
        """A removed key's slot may be handed out again."""
        self._free.append(slot)

    def release_where(self, column: array[int], value: int, most: int,
                      compiled: bool = True) -> int:
        """Take out of the table and release every key whose slot's row of `column` (u16 by
        slot, as the peer directory's holders) is `value`; how many. `most` bounds their
        number (room for their slots is made at once). One compiled pass over the cells
        (`probekernel`'s `sweep`): dropping a peer's 10^6 entries must not hold the event
        loop for the seconds a walk in Python takes. `compiled=False`: that walk, as where
        the compiled loop is missing. Their cells become tombstones, as `remove` leaves."""
        kernels = probekernel.ready() if compiled else None
        cells, free = self._cells, self._free
        gone = 0
        if kernels is None:
            for i, cell in enumerate(cells):
                if cell > 0 and column[cell - 1] == value:
                    cells[i] = _DEAD
                    free.append(cell - 1)
                    gone += 1
        else:
            if column.typecode != "H":
                raise ValueError(f"a column of u16 ('H'), got {column.typecode!r}")
            room = max(most, 0) + 1  # one more: a pass that fills it is not known complete
            while True:
                start = len(free)
                free.frombytes(bytes(4 * room))
                taken = kernels.sweep(cells.buffer_info()[0], len(cells),
                                      column.buffer_info()[0], len(column), value,
                                      free.buffer_info()[0] + 4 * start, room)
                del free[start + taken:]
                gone += taken
                if taken < room:
                    break
        self.live -= gone
        self._dead += gone
        return gone

    @property
    def cells(self) -> array[int]:
        """The open-addressing cells (0 empty, -1 a tombstone, else slot + 1), for a bulk
        reader (copy it: an array exporting its buffer cannot be replaced in place)."""
        return self._cells

    def key_buffer(self) -> bytearray:
        """Every slot's key, `KEY_BYTES` each by slot (a released slot's is the key it
        held), for a bulk reader in the table's thread (not a copy: read it, keep it not)."""
        return self._keys

    def key_at(self, slot: int) -> bytes:
        return bytes(self._keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES])

    def live_slots(self) -> Iterator[int]:
        """The slots of the keys in the table, in no particular order."""
        for cell in self._cells:
            if cell > 0:
                yield cell - 1

    def _place(self, key: bytes, slot: int, cells: array[int] | None = None) -> None:
        if cells is None:
            cells = self._cells
        mask = len(cells) - 1
        i = hash(key) & mask
        while cells[i] > 0:  # a tombstone is reused: the key is known to be absent
            i = (i + 1) & mask
        if cells[i] == _DEAD:
            self._dead -= 1
        cells[i] = slot + 1

    def _rebuild(self, need: int, compiled: bool = True) -> None:
        """A table at most a quarter full of `need` keys, without tombstones: in one
        compiled pass (`probekernel`'s `place`) where it is compiled (in Python a rebuild
        of 5·10^5 keys held the event loop ~0.5 s), else key by key."""
        size = _MIN_CELLS
        while size < 4 * need:
            size <<= 1
        cells = array("i", bytes(4 * size))
        kernels = probekernel.ready() if compiled else None
        old = self._cells
        if not (kernels is not None and self._keys and kernels.place(
                old.buffer_info()[0], len(old),
                ctypes.addressof(ctypes.c_char.from_buffer(self._keys)),
                cells.buffer_info()[0], size - 1)):
            for slot in self.live_slots():
                self._place(self.key_at(slot), slot, cells)
        self._cells, self._mask, self._dead = cells, size - 1, 0


def homes(keys: Sequence[bytes]) -> bytes:
    """Each key's `hash()` as a little-endian i64: what `KeyTable.find_many` starts from
    (one serves every table a LOOKUP asks)."""
    return struct.pack(f"<{len(keys)}q", *map(hash, keys))


class NameIds:
    """Small ints for the few strings many rows repeat (tenant names): a row holds a
    4-byte id, not a reference to a `str`. Ids are never reused."""

    def __init__(self) -> None:
        self.names: list[str] = []
        """Each id's name."""
        self._ids: dict[str, int] = {}

    def id_of(self, name: str) -> int:
        """`name`'s id, given it on first sight."""
        i = self._ids.get(name)
        if i is None:
            i = self._ids[name] = len(self.names)
            self.names.append(name)
        return i
