"""The DRAM index the agent publishes in shared memory, so clients answer LOOKUP alone.

A LOOKUP over the socket waits its turn in the agent's one event loop; with a
few busy clients that wait, not the lookup, is the latency. The agent keeps
the keys of its visible DRAM chunks in a table in a sealed memfd and hands
the fd to each client at HELLO, after the arena's fd. A client maps it
read-only and answers a LOOKUP from it without a round trip.

Layout (little-endian), fixed for the life of the agent process:

    header, 64 bytes: magic u64 | version u32 | slots u32 | epoch u64 | flags u32 | pad
    slots x 24 bytes: seq u32 | state u32 | key 16 bytes

An open-addressing table with linear probing; a key's home slot is its XXH3-64
(seed 0) modulo `slots` (a power of two). A slot
is EMPTY, LIVE (a visible DRAM chunk) or DEAD (a tombstone: the probe goes on
past it). Only the agent writes, from its event loop.

Torn reads. Each slot is a seqlock: the agent makes `seq` odd, writes state
and key, then makes it even; a reader that sees an odd `seq`, or a different
one after reading the slot, reads it again. A rebuild (too many tombstones)
makes the header's `epoch` odd while it rewrites the table; a reader that saw
the epoch odd or changed across its walk asks the socket instead. Python
cannot issue memory fences, so this relies on the store and load order of
x86-64 (TSO); on other machines the client does not use the table.

Trust. The fd is a memfd sealed against writes after the agent mapped it
(F_SEAL_FUTURE_WRITE: the agent's mapping stays writable, no new writable
mapping or write(2) can be made, not even through /proc/self/fd) and against
resizing (F_SEAL_SHRINK, F_SEAL_GROW), then F_SEAL_SEAL. A client can read
its tenant's keys and nothing else: each tenant space publishes its own.

What it answers. The table holds DRAM only. Where the pool has no tier below
DRAM its answer is the agent's; where it has one (flag LOWER_TIERS), a prefix
that ends before the last key may go on in NVMe or the shared tier, so only
an answer that covers every key is final and the rest go to the socket.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from xxhash import xxh3_64_intdigest

from .constants import KEY_BYTES

MAGIC = 0x31584449_4C50564B  # "KVPLIDX1" read as a little-endian u64
VERSION = 1
HEADER = struct.Struct("<QIIQI")
HEADER_BYTES = 64
_EPOCH_AT = 16
_EPOCH = struct.Struct("<Q")
SLOT = struct.Struct("<II16s")
_SEQ = struct.Struct("<I")
SLOT_BYTES = SLOT.size

EMPTY, LIVE, DEAD = 0, 1, 2
LOWER_TIERS = 1
"""Flag: the pool has a tier below DRAM (NVMe or shared), so a miss here is not final."""

MIN_SLOTS = 1 << 10
MAX_SLOTS = 1 << 21
"""24 B a slot: at most 48 MiB of table, for up to ~1.5M DRAM chunks (at 3/4 load)."""
MAX_LOAD = 0.75
"""Live and dead slots together past this share: the table is rebuilt without tombstones."""
READ_RETRIES = 16
"""Times a reader reads a slot the agent is writing before it gives up (asks the socket)."""

_EVEN = 0xFFFF_FFFF_FFFF_FFFE
_LIVE_WORD = LIVE << 32
"""A slot's first word (seq | state << 32) masked to an even seq, and LIVE's part of it."""

F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not in Python's fcntl module


def slots_for(max_chunks: int) -> int:
    """Table slots for a DRAM tier of at most `max_chunks` chunks: a power of two at
    least twice that (probes stay short), within MIN_SLOTS..MAX_SLOTS."""
    n = MIN_SLOTS
    while n < 2 * max_chunks and n < MAX_SLOTS:
        n <<= 1
    return n


def _home(key: bytes, mask: int) -> int:
    # Hashed, not the key's own bits: keys are opaque to the agent, and a client may
    # pick ones that share their leading bytes.
    return xxh3_64_intdigest(key) & mask


class SharedIndex:
    """The agent's side: a sealed memfd table of its visible DRAM keys."""

    def __init__(self, slots: int, lower_tiers: bool, name: str = "kvpool-lookup") -> None:
        if slots & (slots - 1) or slots < 1:
            raise ValueError(f"slots must be a power of two, got {slots}")
        self.slots = slots
        self.mask = slots - 1
        self.size = HEADER_BYTES + slots * SLOT_BYTES
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._mm = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                        | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._mm)
        HEADER.pack_into(self.view, 0, MAGIC, VERSION, slots, 0,
                         LOWER_TIERS if lower_tiers else 0)
        self.live = 0
        self.dead = 0
        self.epoch = 0
        self.overflowed = False
        """The table could not hold every key even rebuilt: the epoch stays odd (clients
        ask the socket) until enough keys go."""

    def _write_slot(self, i: int, state: int, key: bytes) -> None:
        at = HEADER_BYTES + i * SLOT_BYTES
        (seq,) = _SEQ.unpack_from(self.view, at)
        _SEQ.pack_into(self.view, at, (seq + 1) & 0xFFFFFFFF)  # odd: being written
        SLOT.pack_into(self.view, at, (seq + 1) & 0xFFFFFFFF, state, key)
        _SEQ.pack_into(self.view, at, (seq + 2) & 0xFFFFFFFF)  # even again, changed

    def _find(self, key: bytes) -> tuple[int | None, int | None]:
        """(slot holding key, first reusable slot on its probe path)."""
        i = _home(key, self.mask)
        free: int | None = None
        for _ in range(self.slots):
            _, state, k = SLOT.unpack_from(self.view, HEADER_BYTES + i * SLOT_BYTES)
            if state == EMPTY:
                return None, free if free is not None else i
            if state == LIVE and k == key:
                return i, free
            if state == DEAD and free is None:
                free = i
            i = (i + 1) & self.mask
        return None, free

    def add(self, key: bytes) -> bool:
        """A chunk became visible in DRAM. False when the table has no room for it short of
        a `rebuild` (which drops the tombstones, or finds the table too small)."""
        if self.overflowed:
            self.live += 1  # the table is off (epoch odd) until a rebuild fits again
            return True
        at, free = self._find(key)
        if at is not None:
            return True
        if free is None:
            return False
        _, state, _ = SLOT.unpack_from(self.view, HEADER_BYTES + free * SLOT_BYTES)
        if state == DEAD:
            self.dead -= 1
        elif self.live + self.dead + 1 > MAX_LOAD * self.slots:
            return False
        self._write_slot(free, LIVE, key)
        self.live += 1
        return True

    def remove(self, key: bytes) -> None:
        """A chunk left DRAM (evicted, demoted, deleted)."""
        if self.overflowed:
            self.live -= 1
            return
        at, _ = self._find(key)
        if at is None:
            return
        self._write_slot(at, DEAD, key)
        self.live -= 1
        self.dead += 1

    @property
    def crowded(self) -> bool:
        """Tombstones call for `rebuild`; after an overflow, once half the room is back."""
        if self.overflowed:
            return self.live < MAX_LOAD * self.slots / 2
        return (self.live + self.dead) > MAX_LOAD * self.slots

    def rebuild(self, keys: Iterable[bytes]) -> None:
        """Rewrite the table from the live keys, without tombstones. Readers that overlap
        it see the epoch odd or changed and ask the socket."""
        live = list(keys)
        self._set_epoch(self.epoch | 1)
        self.view[HEADER_BYTES:] = bytes(self.size - HEADER_BYTES)
        self.live = self.dead = 0
        self.overflowed = len(live) > MAX_LOAD * self.slots
        if self.overflowed:
            self.live = len(live)
            return  # epoch stays odd: the socket answers until keys go
        for key in live:
            _, free = self._find(key)
            assert free is not None
            SLOT.pack_into(self.view, HEADER_BYTES + free * SLOT_BYTES, 0, LIVE, key)
            self.live += 1
        self._set_epoch((self.epoch | 1) + 1)

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        _EPOCH.pack_into(self.view, _EPOCH_AT, epoch)

    def close(self) -> None:
        self.view.release()
        self._mm.close()
        os.close(self.fd)


def _slot_words(view: memoryview, slots: int) -> Any:
    """The table as a (slots, 3) numpy array of little-endian u64 words: seq | state << 32
    and the key's two halves; None without numpy (a light client: keys walk one by one)."""
    try:
        import numpy as np
    except ImportError:
        return None
    return np.frombuffer(view, dtype="<u8", count=slots * SLOT_BYTES // 8,
                         offset=HEADER_BYTES).reshape(slots, SLOT_BYTES // 8)


class IndexReader:
    """The client's side: the agent's table mapped read-only."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise ValueError("lookup index smaller than its header")
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.view = memoryview(self._mm)
        magic, version, slots, _, flags = HEADER.unpack_from(self.view, 0)
        if magic != MAGIC or version != VERSION or size < HEADER_BYTES + slots * SLOT_BYTES:
            self.close()
            raise ValueError("not a kvpool lookup index of this version")
        self.mask = slots - 1
        self.slots = slots
        self.final_misses = not flags & LOWER_TIERS
        self._words: Any = None
        """The table as numpy sees it, made at the first multi-key lookup (`_slot_words`)."""
        self._words_tried = False

    @staticmethod
    def usable() -> bool:
        """The seqlock needs x86-64's ordering of stores and of loads (see the module)."""
        return platform.machine() in ("x86_64", "AMD64")

    def _state(self, key: bytes) -> int | None:
        """LIVE or EMPTY for `key`, or None when the agent kept writing its slot."""
        view = self.view
        i = _home(key, self.mask)
        for _ in range(self.slots):
            at = HEADER_BYTES + i * SLOT_BYTES
            for _ in range(READ_RETRIES):
                seq, state, k = SLOT.unpack_from(view, at)
                if not seq & 1 and _SEQ.unpack_from(view, at)[0] == seq:
                    break
            else:
                return None
            if state == EMPTY:
                return EMPTY
            if state == LIVE and k == key:
                return LIVE
            i = (i + 1) & self.mask
        return EMPTY

    def lookup(self, keys: Sequence[bytes]) -> int | None:
        """How many leading keys are in DRAM, when that is the agent's whole answer; None
        when only the socket can say (a rebuild overlapped, a slot stayed torn, a key is
        malformed, or the prefix ends where a lower tier may go on)."""
        view = self.view
        (epoch,) = _EPOCH.unpack_from(view, _EPOCH_AT)
        if epoch & 1:
            return None
        if keys and set(map(len, keys)) != {KEY_BYTES}:
            return None  # the socket's LOOKUP says what is wrong with it
        count = self._prefix(keys)
        if count is None or _EPOCH.unpack_from(view, _EPOCH_AT)[0] != epoch:
            return None
        if count < len(keys) and not self.final_misses:
            return None
        return count

    def _prefix(self, keys: Sequence[bytes]) -> int | None:
        """Leading keys LIVE in the table, or None where a slot stayed torn.

        With numpy, every key's home slot is read in three passes: most keys are
        decided there (LIVE with this key, or EMPTY), and only the rest walk their
        probe in Python (`_state`). A Python walk per key costs ~2 us, too much for
        a 128-key prefix; the passes cost a fraction of that per key.
        """
        if not self._words_tried and len(keys) > 1:
            self._words_tried = True
            self._words = _slot_words(self.view, self.slots)
        if self._words is None or len(keys) < 2:
            count = 0
            for key in keys:
                state = self._state(key)
                if state is None:
                    return None
                if state != LIVE:
                    break
                count += 1
            return count
        import numpy as np

        words = self._words  # (slots, 3) u64: seq | state << 32, then the key's two halves
        n = len(keys)
        homes = np.fromiter(map(xxh3_64_intdigest, keys), dtype=np.uint64, count=n)
        homes &= np.uint64(self.mask)
        # The seqlock, a pass at a time: each pass is a C loop of its own, so all of its
        # loads come after the previous pass's (x86-64 keeps loads in order, see the
        # module). A slot is settled when its first word was even before and unchanged
        # after the pass that read the whole slot.
        before = words[homes, 0]
        slots = words.take(homes, axis=0)
        after = words[homes, 0]
        want = np.frombuffer(b"".join(keys), dtype="<u8").reshape(n, 2)
        live_word = (before & _EVEN) | _LIVE_WORD  # a settled LIVE slot's first word
        live = ((slots[:, 0] == live_word) & (after == live_word)
                & (slots[:, 1] == want[:, 0]) & (slots[:, 2] == want[:, 1]))
        if live.all():
            return n
        for i in np.flatnonzero(~live).tolist():
            word = int(before[i])
            if word == after[i] and not word & 1 and word >> 32 == EMPTY:
                return i  # its home slot is empty: not in the table
            walked = self._state(keys[i])  # a tombstone, another key, or torn: walk on
            if walked is None:
                return None
            if walked != LIVE:
                return i
        return n

    def close(self) -> None:
        self._words = None  # drops numpy's export of the view, which release() refuses
        self.view.release()
        self._mm.close()
