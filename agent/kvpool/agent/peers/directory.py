"""Which peer holds which chunk, for millions of remote chunks in a few flat arrays.

A remote chunk costs its key's 16 bytes and a 4-byte cell in a `KeyTable` (kept between
a quarter and half full), a 2-byte peer number and a 4-byte size: 30-38 bytes of heap
(`tests/peers/test_directory.py` measures it with tracemalloc). A key is credited to one
holder, the last that announced it; a removal by another holder leaves it be. The
directory is eventually consistent: a read of an entry that turns out stale falls back
(`tiers.peer`), never serves wrong bytes. A peer's entries all go at once (`drop_peer`) in
one compiled pass over the table, not a walk in Python: it runs on the event loop.

Where a space publishes a peer table (`publish`: `lookupindex.PeerIndex`, for clients that
answer LOOKUP from shared memory), every change is mirrored there as it is made here.

A key deleted in the pool (`forget`) is held off for `FORGET_SECONDS`: an ADD sent before a
holder took the DELETE may still be on its way, and a read of that holder's copy before it
does would bring the deleted chunk back here. Two announcements are not held off, so that a
key put again after a DELETE is seen as a new key is: the deleting node's (it took the
DELETE before it sent it: a read of it finds no deleted copy), and, at the end of the
holdoff, the last ADD held off, unless its holder removed the key meanwhile (a holder that
had the deleted copy sends its REMOVE as it takes the DELETE, within the holdoff; one whose
copy outlives it stored the key again). An inventory stream sends a chunk once: an ADD
dropped here would leave the key unlisted until that holder's next inventory.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from .. import probekernel
from ..keytable import KeyTable
from ..lookupindex import Entries, PeerIndex

FORGET_SECONDS = 10.0
"""How long announcements of a key deleted in the pool are held off (`peers.deleteHoldoff`):
the DELETE reaches every holder the agents follow well within it (one that is unreachable
gets it before its next inventory is taken). A key put again meanwhile on another node than
the deleting one is listed when the holdoff ends (`release`): never a deleted chunk."""
NO_PEER = -1
MAX_FORGOTTEN = 1 << 16
MAX_SIZE = 0xFFFFFFFF
"""Chunks larger than this (4 GiB) are not tracked: reads of them go to the shared tier."""


class PeerDirectory:
    def __init__(self, forget_for: float = FORGET_SECONDS,
                 max_entries: int | None = None) -> None:
        self.table = KeyTable()
        self.max_entries = max_entries
        """Most entries listed (`peers.maxEntries`: what the agent's memory is sized for);
        None: no limit."""
        self.refused = 0
        """New keys not listed for want of room (`kvpool_peer_directory_full_total`)."""
        self._peer = array("H")
        self._size = array("I")
        self._held = array("q")
        """Entries credited to each peer (by peer number): `count` at once, and the room
        `drop_peer` makes for their slots."""
        self._forget_for = forget_for
        self._forgotten: OrderedDict[bytes, tuple[float, int, int, int]] = OrderedDict()
        """Keys deleted in the pool, in the order of their holdoffs' ends: until when
        (monotonic) their ADDs are held off, the peer that deleted them (`NO_PEER`: this
        node), and the last ADD held off (peer, size; `NO_PEER`: none)."""
        self.holding = 0
        """How many of those hold an ADD back (`release` has work)."""
        self.published: PeerIndex | None = None
        """The peer table clients read (`publish`), if any."""

    def publish(self, index: PeerIndex) -> None:
        """Mirror every entry into `index` from now on, starting with those held now."""
        self.published = index
        index.entries = self.entries
        index.rebuild()

    def entries(self) -> Entries:
        """Every entry, as a peer table's rebuild takes them: the table's own arrays, read
        in one compiled pass (no temporary of 10^6 entries)."""
        return len(self.table), self.table.cells, self.table.key_buffer(), self._peer

    def __len__(self) -> int:
        return len(self.table)

    def add(self, key: bytes, peer: int, size: int) -> None:
        if not 0 < size <= MAX_SIZE:
            return
        if self._forgotten and self._held_off(key, peer, size):
            return
        slot = self.table.find(key)
        if slot < 0:
            if self.max_entries is not None and len(self.table) >= self.max_entries:
                # Full: the key is not listed (a LOOKUP goes on to the shared tier); a key
                # listed already may still change holder, and room comes back as keys go.
                self.refused += 1
                return
            slot = self.table.claim(key)
            if slot == len(self._peer):
                self._peer.append(peer)
                self._size.append(size)
            self._peer[slot], self._size[slot] = peer, size
            self.table.insert(slot)
        else:
            self._credit(self._peer[slot], -1)
            self._peer[slot], self._size[slot] = peer, size
        self._credit(peer, 1)
        if self.published is not None:
            self.published.add(key, peer)

    def remove(self, key: bytes, peer: int) -> None:
        """`peer` no longer holds `key` (another holder's entry stays)."""
        if self.holding:
            held = self._forgotten.get(key)
            if held is not None and held[2] == peer:  # the ADD held off was of its old copy
                self._forgotten[key] = (held[0], held[1], NO_PEER, 0)
                self.holding -= 1
        slot = self.table.find(key)
        if slot >= 0 and self._peer[slot] == peer:
            self.table.remove(key)
            self.table.release(slot)
            self._credit(peer, -1)
            if self.published is not None:
                self.published.remove(key)

    def forget(self, key: bytes, by: int = NO_PEER) -> None:
        """`key` was deleted in the pool, by the peer numbered `by` (`NO_PEER`: on this
        node): no holder is credited with it any more (each holder's REMOVE follows), and
        ADDs of it are held off for `FORGET_SECONDS` (one may be on its way from a holder
        that has not taken the DELETE yet), but `by`'s. An entry crediting `by` stays: its
        ADD, on another connection than its DELETE, may have come first (a read of it
        finds the copy stored after the DELETE, or none)."""
        slot = self.table.find(key)
        if slot >= 0 and (by == NO_PEER or self._peer[slot] != by):
            self.table.remove(key)
            self.table.release(slot)
            self._credit(self._peer[slot], -1)
            if self.published is not None:
                self.published.remove(key)
        now = time.monotonic()
        forgotten = self._forgotten
        old = forgotten.get(key)
        if old is not None and old[2] != NO_PEER:
            self.holding -= 1  # an ADD held off before this DELETE: deleted too
        forgotten[key] = (now + self._forget_for, by, NO_PEER, 0)
        forgotten.move_to_end(key)
        while forgotten and (len(forgotten) > MAX_FORGOTTEN
                             or next(iter(forgotten.values()))[0] <= now):
            self._end_holdoff()

    def _held_off(self, key: bytes, peer: int, size: int) -> bool:
        """Whether `peer`'s ADD of `key` waits for the end of the key's holdoff (kept as
        the one held off, the last announced)."""
        held = self._forgotten.get(key)
        if held is None or held[1] == peer:
            return False  # the deleting node's ADD is of a copy it stored after it
        until, by, was, _ = held
        if until <= time.monotonic():
            del self._forgotten[key]
            if was != NO_PEER:
                self.holding -= 1
            return False
        self._forgotten[key] = (until, by, peer, size)
        if was == NO_PEER:
            self.holding += 1
        return True

    def release(self, now: float | None = None) -> int:
        """End the holdoffs due by `now` (monotonic; None: now), listing the ADD each held
        off (its holder did not remove the key since: it holds a copy stored after the
        DELETE); how many. Called as the peers' stream messages come (a heartbeat every
        0.5 s at least)."""
        listed = 0
        forgotten = self._forgotten
        if now is None:
            now = time.monotonic()
        while forgotten and next(iter(forgotten.values()))[0] <= now:
            listed += self._end_holdoff()
        return listed

    def _end_holdoff(self) -> int:
        """The oldest holdoff ends: its ADD held off, if any, is listed (1) or not (0: none,
        or the deleting peer announced the key since, and is credited as the later one)."""
        key, (_, _, peer, size) = self._forgotten.popitem(last=False)
        if peer == NO_PEER:
            return 0
        self.holding -= 1
        if key in self:
            return 0
        self.add(key, peer, size)
        return 1

    def holder(self, key: bytes) -> tuple[int, int] | None:
        """(peer, size) of the key's holder, or None."""
        slot = self.table.find(key)
        if slot < 0:
            return None
        return self._peer[slot], self._size[slot]

    def codes(self, keys: Sequence[bytes], want: bytes, hashes: bytes, readable: bytes,
              local: bytes, code: int, compiled: bool = True) -> bytes:
        """A LOOKUP's keys at once, one byte each: 2 where `local` (a byte a key) says a
        local tier has it, else `code` where its holder is a peer that `readable` (a byte
        a peer number) says may be read, else 0. `want` is the keys joined, `hashes` their
        `keytable.homes`. `compiled=False`: in Python (`KeyTable.find_many`)."""
        slots, _ = self.table.find_many(keys, want, hashes, compiled)
        kernels = probekernel.ready() if compiled else None
        n = len(keys)
        if kernels is None:
            peers, count = self._peer, len(readable)
            return bytes(2 if local[i] else code if s >= 0 and peers[s] < count
                         and readable[peers[s]] else 0 for i, s in enumerate(slots))
        out = array("B", bytes(n))
        kernels.codes(slots.buffer_info()[0], n, self._peer.buffer_info()[0], len(readable),
                      readable, local, code, out.buffer_info()[0])
        return out.tobytes()

    def __contains__(self, key: bytes) -> bool:
        return self.table.find(key) >= 0

    def drop_peer(self, peer: int, compiled: bool = True) -> int:
        """Forget every entry of `peer` (its restart, a gap, unreachable); how many. On the
        event loop, when the pool is already stressed: one compiled pass over the table
        (`KeyTable.release_where`, ~35 ms at 10^6 entries on a loaded 2-core machine), not
        the walk in Python that took 0.3-1.3 s. `compiled=False`: a walk in Python, as where
        the compiled loop is missing."""
        if self.holding:  # its ADDs held off go too: its next inventory lists what it holds
            forgotten = self._forgotten
            for key in [k for k, h in forgotten.items() if h[2] == peer]:
                forgotten[key] = (*forgotten[key][:2], NO_PEER, 0)
                self.holding -= 1
        # In the peer table all of them go at once (one store), before the pass here.
        due = self.published is not None and self.published.drop(peer)
        gone = 0
        if self.count(peer):
            gone = self.table.release_where(self._peer, peer, self.count(peer), compiled)
            self._held[peer] = 0
        if due and self.published is not None:
            self.published.rebuild()  # the peer's gen wrapped: its old slots must go
        return gone

    def count(self, peer: int) -> int:
        """How many entries credit `peer` (kept as they change: no walk)."""
        return self._held[peer] if 0 <= peer < len(self._held) else 0

    def _credit(self, peer: int, n: int) -> None:
        held = self._held
        if peer >= len(held):
            held.frombytes(bytes(8 * (peer + 1 - len(held))))
        held[peer] += n
