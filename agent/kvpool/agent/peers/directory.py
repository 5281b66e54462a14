"""Which peer holds which chunk, for millions of remote chunks in a few flat arrays.

A remote chunk costs its key's 16 bytes and a 4-byte cell in a `KeyTable` (kept between
a quarter and half full), a 2-byte peer number and a 4-byte size: 30-38 bytes of heap
(`tests/peers/test_directory.py` measures it with tracemalloc). A key is credited to one
holder, the last that announced it; a removal by another holder leaves it be. The
directory is eventually consistent: a read of an entry that turns out stale falls back
(`tiers.peer`), never serves wrong bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from .. import probekernel
from ..keytable import KeyTable

MAX_SIZE = 0xFFFFFFFF
"""Chunks larger than this (4 GiB) are not tracked: reads of them go to the shared tier."""


class PeerDirectory:
    def __init__(self) -> None:
        self.table = KeyTable()
        self._peer = array("H")
        self._size = array("I")

    def __len__(self) -> int:
        return len(self.table)

    def add(self, key: bytes, peer: int, size: int) -> None:
        if not 0 < size <= MAX_SIZE:
            return
        slot = self.table.find(key)
        if slot < 0:
            slot = self.table.claim(key)
            if slot == len(self._peer):
                self._peer.append(peer)
                self._size.append(size)
            self._peer[slot], self._size[slot] = peer, size
            self.table.insert(slot)
        else:
            self._peer[slot], self._size[slot] = peer, size

    def remove(self, key: bytes, peer: int) -> None:
        """`peer` no longer holds `key` (another holder's entry stays)."""
        slot = self.table.find(key)
        if slot >= 0 and self._peer[slot] == peer:
            self.table.remove(key)
            self.table.release(slot)

    def forget(self, key: bytes) -> None:
        """`key` was deleted in the pool: no holder is credited with it any more (each
        holder's REMOVE follows)."""
        slot = self.table.find(key)
        if slot >= 0:
            self.table.remove(key)
            self.table.release(slot)

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

    def drop_peer(self, peer: int) -> int:
        """Forget every entry of `peer` (its restart, a gap, unreachable); how many."""
        gone = [s for s in self.table.live_slots() if self._peer[s] == peer]
        for slot in gone:
            self.table.remove(self.table.key_at(slot))
            self.table.release(slot)
        return len(gone)

    def count(self, peer: int) -> int:
        return sum(1 for s in self.table.live_slots() if self._peer[s] == peer)
