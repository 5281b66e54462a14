"""The DRAM index the agent publishes in shared memory, so clients answer LOOKUP alone.

A LOOKUP over the socket waits its turn in the agent's one event loop; with a
few busy clients that wait, not the lookup, is the latency. The agent keeps
the keys of its visible DRAM chunks in a table in a sealed memfd and hands
the fd to each client at HELLO, after the arena's fd. A client maps it
read-only and answers a LOOKUP from it without a round trip.

Layout (little-endian), fixed for the life of the agent process:

    header, 64 bytes: magic u64 | version u32 | slots u32 | epoch u64 | flags u32 | pad
    slots x 64 bytes: seq u32 | state u32 | key 16 bytes | offset u64 | size u64
                      | checksum u64 | meta_hash u64 | checksum_kind u32 | pad u32

A LIVE slot also says where and what the chunk is when it lies in one extent of the arena
(`offset`, `size`, `checksum`, `checksum_kind`, and `meta_hash`, the XXH3-64 of its
metadata), so a client can read it without a lease (`leasefree`); `offset` all ones
(`NO_EXTENT`) says "ask the socket" (a chunk in several extents). The agent retires a
slot (DEAD, its seq changed) before the chunk's pages can be freed, whatever frees them
(`DramTier.remove` and `detach` are the only ways out of the index, and `release`, the
only way a visible chunk's pages are freed, comes after either): a reader that finds the
same seq after its copy copied the chunk's own bytes. A slot is one cache line.

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

The peer table. Where the agent reads peers and the pool has no NVMe tier (flag
PEER_TABLE), the same memfd also holds what the peer directory says of remote keys, at
the header's `peer_at` (a page boundary past the DRAM table), so a LOOKUP of keys in
DRAM or held by a readable peer is answered without a round trip too:

    peer header, 64 bytes: epoch u64 | slots u32 | max_slots u32 | pad
    MAX_PEERS x 4 bytes: each peer's state: gen u16 | readable << 16
    max_slots x 24 bytes: word u64 (seq u16 | gen u16 | peer u16 | state u16) | key 16 bytes

The same open addressing (XXH3-64 of the key, linear probing, tombstones) and the same
seqlock per slot (`seq` odd while the agent writes the slot; every word written in one
store) and epoch (odd while the table is rebuilt). A slot is HELD by the peer it names
while its `gen` equals that peer's: when a peer's entries go at once (its stream ended,
a resync) the agent bumps the peer's gen, one store, and all of its slots stop counting
(they are reused as tombstones are and go at the next rebuild). A peer's `readable` bit
is the agent's `PeerLink.readable` (not closed, not this agent, not suspect), written
when it changes. The table grows: it is rebuilt at twice its keys once it is 3/4 used,
up to `max_slots` (pages past its `slots` are never written, so they take no memory);
past 3/4 of that it overflows (epoch odd: LOOKUPs ask the socket) until keys go.

A key's answer is then what the socket's LOOKUP answers (DRAM, then NVMe, then peer,
then shared): 2 where DRAM holds it, else the peer tier's code where a readable peer
holds it, else the prefix ends; where the pool has a shared tier (flag SHARED_BELOW)
an answer that ends before the last key goes to the socket, as it may go on there.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import struct
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from xxhash import xxh3_64_intdigest

from . import lookupkernel
from .constants import KEY_BYTES, PAGE_BYTES, PEER_TIER_CODE
from .hostcopy import address_of
from .protocol import MAX_LOOKUP_KEYS

DRAM_CODES = bytes([2]) * MAX_LOOKUP_KEYS

MAGIC = 0x31584449_4C50564B  # "KVPLIDX1" read as a little-endian u64
VERSION = 2
"""2: slots of 64 bytes, with where and what a single-extent chunk is (1: 24, the key only)."""
HEADER = struct.Struct("<QIIQI")
HEADER_BYTES = 64
_EPOCH_AT = 16
_EPOCH = struct.Struct("<Q")
SLOT = struct.Struct("<II16sQQQQI4x")
"""seq, state, key, offset, size, checksum, meta_hash, checksum_kind."""
_PEER_SLOT = struct.Struct("<Q16s")
_STATE = struct.Struct("<I")
_SEQ = struct.Struct("<I")
SLOT_BYTES = SLOT.size
PEER_SLOT_BYTES = 24
_KEY_AT = 8
_KEY = struct.Struct("<16s")
_SEQ_STATE = struct.Struct("<II")
NO_EXTENT = (1 << 64) - 1
"""A LIVE slot's offset when the chunk is not in one extent: read it under a lease."""
Where = tuple[int, int, int, int, int]
"""What a LIVE slot says of its chunk: (offset, size, checksum, checksum_kind, meta_hash)."""
ASK = (NO_EXTENT, 0, 0, 0, 0)
"""The `Where` of a chunk only a lease may read (several extents)."""

EMPTY, LIVE, DEAD = 0, 1, 2
LOWER_TIERS = 1
"""Flag: the pool has a tier below DRAM (NVMe, peer or shared), so a miss here is not final
(to a reader that does not know the peer table)."""
PEER_TABLE = 2
"""Flag: the peer table is at `peer_at` and the pool has no NVMe tier: a key in neither
table ends the prefix, unless SHARED_BELOW."""
SHARED_BELOW = 4
"""Flag (with PEER_TABLE): the pool has a shared tier, so a prefix that ends in the tables
may go on there."""
_PEER_AT = struct.Struct("<Q")
_PEER_AT_AT = 32
DRAM_CODE = 2

MIN_SLOTS = 1 << 10
MAX_SLOTS = 1 << 20
"""64 B a slot: at most 64 MiB of table, for up to ~786k DRAM chunks (at 3/4 load; past
them the table is off: LOOKUPs and reads go to the socket). Version 1's slots were 24 B,
2^21 of them at most (48 MiB): the table's memory stays about what it was."""
MAX_LOAD = 0.75
"""Live and dead slots together past this share: the table is rebuilt without tombstones."""
READ_RETRIES = 16
"""Times a reader reads a slot the agent is writing before it gives up (asks the socket)."""

_EVEN = 0xFFFF_FFFF_FFFF_FFFE
_LIVE_WORD = LIVE << 32
"""A slot's first word (seq | state << 32) masked to an even seq, and LIVE's part of it."""

F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not in Python's fcntl module

PEER_HEADER = struct.Struct("<QII")
"""epoch, slots, max_slots, at the peer table's start."""
PEER_HEADER_BYTES = 64
MAX_PEERS = 1 << 16
"""Peer numbers a table has state words for (the directory's are u16)."""
PEER_STATE_BYTES = 4
READABLE = 1 << 16
"""A peer state word's bit: the peer may be read now."""
HELD = 1
"""A peer slot's state: its peer holds its key (while its gen is the peer's)."""
PEER_MIN_SLOTS = 1 << 10
PEER_MAX_SLOTS = 1 << 22
"""24 B a slot: at most 96 MiB of table (written only as far as it has grown), for up to
~3M remote keys (at 3/4 load)."""
_PAGE = 4096
_PREFAULT_PIECE = 1 << 20
"""Bytes of zeros written at a time when the DRAM table is faulted in (`_prefault`)."""


def _word(seq: int, gen: int, peer: int, state: int) -> int:
    """A peer slot's first word: seq u16 | gen u16 | peer u16 | state u16."""
    return seq | gen << 16 | peer << 32 | state << 48


Entries = tuple[int, "array[int]", Any, "array[int]"]
"""What a peer table's rebuild writes, the directory's `KeyTable` as it is: how many keys,
its cells (i32: 0 empty, -1 a tombstone, else slot + 1), its keys (16 bytes by slot, a
writable buffer) and the peer of each (u16 by slot)."""


def peer_table_bytes(max_slots: int) -> int:
    """The peer table's bytes (its header, the peers' states, `max_slots` slots)."""
    return PEER_HEADER_BYTES + MAX_PEERS * PEER_STATE_BYTES + max_slots * PEER_SLOT_BYTES


def slots_for(max_chunks: int) -> int:
    """Table slots for a DRAM tier of at most `max_chunks` chunks: a power of two at
    least twice that (probes stay short), within MIN_SLOTS..MAX_SLOTS."""
    n = MIN_SLOTS
    while n < 2 * max_chunks and n < MAX_SLOTS:
        n <<= 1
    return n


def dram_table_bytes(arena_bytes: int) -> int:
    """The DRAM table's shared memory for an arena of `arena_bytes`, as the agent makes it
    (`slots_for` its pages): every slot's page is touched once keys hash to it."""
    return HEADER_BYTES + slots_for(arena_bytes // PAGE_BYTES) * SLOT_BYTES


def _read_slot(view: memoryview, at: int) -> tuple[Any, ...] | None:
    """The DRAM slot at byte `at`, read whole between two equal even seqs (the seqlock);
    None when the agent kept writing it for READ_RETRIES reads."""
    for _ in range(READ_RETRIES):
        # seq read alone first: a copy of the whole slot may load its words in any order,
        # so its own seq field does not say what came before the rest.
        (first,) = _SEQ.unpack_from(view, at)
        slot = SLOT.unpack_from(view, at)
        if slot[0] == first and not first & 1 and _SEQ.unpack_from(view, at)[0] == first:
            return slot
    return None


def _home(key: bytes, mask: int) -> int:
    # Hashed, not the key's own bits: keys are opaque to the agent, and a client may
    # pick ones that share their leading bytes.
    return xxh3_64_intdigest(key) & mask


def _prefault(view: memoryview, nbytes: int) -> None:
    """Write zeros over the first `nbytes` of a fresh mapping, so its pages are in memory
    now: a chunk's first COMMIT into a page of the table otherwise takes the page fault
    (~3 µs, on this project's 2-core machine, in a COMMIT of ~20). The memory is the
    table's whole size either way once keys have hashed to every page (what the operator
    counts, `dram_table_bytes`)."""
    zeros = bytes(min(nbytes, _PREFAULT_PIECE))
    for at in range(0, nbytes, len(zeros)):
        n = min(len(zeros), nbytes - at)
        view[at : at + n] = zeros[:n]


class SharedIndex:
    """The agent's side: a sealed memfd table of its visible DRAM keys."""

    def __init__(self, slots: int, lower_tiers: bool, name: str = "kvpool-lookup",
                 peer_slots: int = 0, shared_below: bool = False) -> None:
        """`peer_slots`: the most slots of a peer table (PEER_TABLE; 0: none), for a pool
        that reads peers and has no NVMe tier; `shared_below`: it has a shared tier."""
        if slots & (slots - 1) or slots < 1:
            raise ValueError(f"slots must be a power of two, got {slots}")
        if peer_slots & (peer_slots - 1) or 0 < peer_slots < PEER_MIN_SLOTS:
            raise ValueError(f"peer_slots must be a power of two from {PEER_MIN_SLOTS}")
        self.slots = slots
        self.mask = slots - 1
        self.size = HEADER_BYTES + slots * SLOT_BYTES
        peer_at = 0
        if peer_slots:
            peer_at = -(-self.size // _PAGE) * _PAGE
            self.size = peer_at + peer_table_bytes(peer_slots)
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
        _prefault(self.view, HEADER_BYTES + slots * SLOT_BYTES)
        flags = LOWER_TIERS if lower_tiers or peer_slots else 0
        if peer_slots:
            flags |= PEER_TABLE | (SHARED_BELOW if shared_below else 0)
        HEADER.pack_into(self.view, 0, MAGIC, VERSION, slots, 0, flags)
        _PEER_AT.pack_into(self.view, _PEER_AT_AT, peer_at)
        self.peers: PeerIndex | None = None
        """The peer table (`PeerDirectory.publish` fills it), where there is one."""
        if peer_slots:
            self.peers = PeerIndex(self.view[peer_at:], peer_slots)
        self.live = 0
        self.dead = 0
        self.epoch = 0
        self.overflowed = False
        """The table could not hold every key even rebuilt: the epoch stays odd (clients
        ask the socket) until enough keys go."""

    def _write_slot(self, i: int, state: int, key: bytes, where: Where = ASK) -> None:
        at = HEADER_BYTES + i * SLOT_BYTES
        (seq,) = _SEQ.unpack_from(self.view, at)
        _SEQ.pack_into(self.view, at, (seq + 1) & 0xFFFFFFFF)  # odd: being written
        offset, size, checksum, kind, meta_hash = where
        SLOT.pack_into(self.view, at, (seq + 1) & 0xFFFFFFFF, state, key, offset, size,
                       checksum, meta_hash, kind)
        _SEQ.pack_into(self.view, at, (seq + 2) & 0xFFFFFFFF)  # even again, changed

    def _find(self, key: bytes) -> tuple[int | None, int | None]:
        """(slot holding key, first reusable slot on its probe path)."""
        i = _home(key, self.mask)
        free: int | None = None
        for _ in range(self.slots):
            _, state, k, *_ = SLOT.unpack_from(self.view, HEADER_BYTES + i * SLOT_BYTES)
            if state == EMPTY:
                return None, free if free is not None else i
            if state == LIVE and k == key:
                return i, free
            if state == DEAD and free is None:
                free = i
            i = (i + 1) & self.mask
        return None, free

    def add(self, key: bytes, where: Where = ASK) -> bool:
        """A chunk became visible in DRAM, where `where` says (`ASK`: only a lease may read
        it). False when the table has no room for it short of a `rebuild` (which drops the
        tombstones, or finds the table too small)."""
        if self.overflowed:
            self.live += 1  # the table is off (epoch odd) until a rebuild fits again
            return True
        at, free = self._find(key)
        if at is not None:
            self._write_slot(at, LIVE, key, where)  # (never: a chunk is removed first)
            return True
        if free is None:
            return False
        _, state, *_ = SLOT.unpack_from(self.view, HEADER_BYTES + free * SLOT_BYTES)
        if state == DEAD:
            self.dead -= 1
        elif self.live + self.dead + 1 > MAX_LOAD * self.slots:
            return False
        self._write_slot(free, LIVE, key, where)
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

    def rebuild(self, keys: Iterable[bytes], where: Callable[[bytes], Where] | None = None
                ) -> None:
        """Rewrite the table from the live keys (each where `where` says; None: `ASK`),
        without tombstones. Readers that overlap it see the epoch odd or changed and ask
        the socket (a lease-free read too: its slot's seq starts again from 0)."""
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
            offset, size, checksum, kind, meta_hash = ASK if where is None else where(key)
            SLOT.pack_into(self.view, HEADER_BYTES + free * SLOT_BYTES, 0, LIVE, key, offset,
                           size, checksum, meta_hash, kind)
            self.live += 1
        self._set_epoch((self.epoch | 1) + 1)

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        _EPOCH.pack_into(self.view, _EPOCH_AT, epoch)

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        self.view.release()
        self._mm.close()
        os.close(self.fd)


class PeerIndex:
    """The agent's side of the peer table (see the module): what the peer directory says,
    mirrored by it (`PeerDirectory.publish`), and each peer's state (`PeerNetwork`)."""

    def __init__(self, view: memoryview, max_slots: int) -> None:
        self._view = view
        self._head = view[:PEER_HEADER_BYTES]
        states_end = PEER_HEADER_BYTES + MAX_PEERS * PEER_STATE_BYTES
        self._states = view[PEER_HEADER_BYTES:states_end].cast("I")
        self._words = view[states_end:states_end + max_slots * PEER_SLOT_BYTES].cast("Q")
        self._table_at = states_end
        self.max_slots = max_slots
        self.slots = PEER_MIN_SLOTS
        self.mask = self.slots - 1
        self.used = 0
        """Slots not EMPTY: held (by a current gen or a stale one) or tombstones."""
        self.epoch = 0
        self.overflowed = False
        self._gen = array("H", [1]) * MAX_PEERS
        self._readable = bytearray(MAX_PEERS)
        self.entries: Callable[[], Entries] = lambda: (0, array("i"), b"", array("H"))
        """The directory's entries, what a rebuild writes (set by the directory)."""
        self._table_addr = address_of(self._words)
        self._gen_addr = self._gen.buffer_info()[0]
        PEER_HEADER.pack_into(self._head, 0, 0, self.slots, max_slots)
        lookupkernel.compile_soon()  # (its writes run in Python until it is compiled)

    # -- each peer

    def set_readable(self, peer: int, readable: bool) -> None:
        """The peer may be read now (`PeerLink.readable`), or not."""
        if 0 <= peer < MAX_PEERS and self._readable[peer] != readable:
            self._readable[peer] = readable
            self._put_state(peer)

    def drop(self, peer: int) -> bool:
        """Every entry of `peer` goes at once (its gen moves on; the directory drops them
        too). True when its gen wrapped: `rebuild` is due (stale slots would count)."""
        if not 0 <= peer < MAX_PEERS:
            return False
        gen = self._gen[peer] % 0xFFFF + 1
        self._gen[peer] = gen
        if gen == 1:
            self._set_epoch(self.epoch | 1)  # until the rebuild: ask the socket
        self._put_state(peer)
        return gen == 1

    def _put_state(self, peer: int) -> None:
        self._states[peer] = self._gen[peer] | (READABLE if self._readable[peer] else 0)

    # -- each key

    def _slot(self, i: int) -> tuple[int, bytes]:
        at = self._table_at + i * PEER_SLOT_BYTES + 8
        return self._words[3 * i], bytes(self._view[at:at + KEY_BYTES])

    def _free(self, word: int) -> bool:
        state = word >> 48
        return state != HELD or (word >> 16) & 0xFFFF != self._gen[(word >> 32) & 0xFFFF]

    def _find(self, key: bytes) -> tuple[int | None, int | None]:
        """(slot holding `key`, current or stale; first reusable slot on its path)."""
        i = xxh3_64_intdigest(key) & self.mask
        free: int | None = None
        for _ in range(self.slots):
            word, k = self._slot(i)
            if word >> 48 == EMPTY:
                return None, free if free is not None else i
            if word >> 48 == HELD and k == key:
                return i, free
            if free is None and self._free(word):
                free = i
            i = (i + 1) & self.mask
        return None, free

    def _write(self, i: int, word: int, key: bytes) -> None:
        w = 3 * i
        seq = self._words[w] & 0xFFFF
        self._words[w] = self._words[w] & ~0xFFFF | (seq + 1) & 0xFFFF  # odd: being written
        self._words[w + 1] = int.from_bytes(key[:8], "little")
        self._words[w + 2] = int.from_bytes(key[8:], "little")
        self._words[w] = word | (seq + 2) & 0xFFFF  # even again, changed

    def add(self, key: bytes, peer: int) -> None:
        """The directory credits `peer` with `key` (a new entry or a new holder)."""
        if self.overflowed or not 0 <= peer < MAX_PEERS:
            if self.overflowed:
                self.rebuild()  # (only when enough keys went: `rebuild` checks)
            return
        word = _word(0, self._gen[peer], peer, HELD)
        kernels = lookupkernel.ready()
        if kernels is not None and len(key) == KEY_BYTES:
            got = kernels.upsert(self._table_addr, self.mask, self._gen_addr, key, word, 0,
                                 self.used + 1 <= MAX_LOAD * self.slots)
            if got == 1:
                self.used += 1
            elif got == 2:
                self.rebuild()  # (the directory has the key already: the rebuild writes it)
            return
        at, free = self._find(key)
        if at is not None:
            self._write(at, word, key)
            return
        if free is None or (self._slot(free)[0] >> 48 == EMPTY
                            and self.used + 1 > MAX_LOAD * self.slots):
            self.rebuild()
            return
        if self._slot(free)[0] >> 48 == EMPTY:
            self.used += 1
        self._write(free, word, key)

    def remove(self, key: bytes) -> None:
        """The directory no longer credits anyone with `key`."""
        if self.overflowed:
            return
        kernels = lookupkernel.ready()
        if kernels is not None and len(key) == KEY_BYTES:
            kernels.upsert(self._table_addr, self.mask, self._gen_addr, key,
                           _word(0, 0, 0, DEAD), 1, 0)
            return
        at, _ = self._find(key)
        if at is not None:
            self._write(at, _word(0, 0, 0, DEAD), key)

    def rebuild(self) -> None:
        """Rewrite the table from the directory's entries, without tombstones or stale
        slots, at twice their number of slots (within MIN..max). Readers that overlap it
        see the epoch odd or changed and ask the socket."""
        n, cells, keys, peers = self.entries()
        if self.overflowed and n > MAX_LOAD * self.max_slots / 2:
            return  # stays off until half the room is back
        self._set_epoch(self.epoch | 1)
        self.overflowed = n > MAX_LOAD * self.max_slots
        if self.overflowed:
            return  # epoch stays odd: the socket answers until keys go
        slots = PEER_MIN_SLOTS
        while slots < 2 * n and slots < self.max_slots:
            slots <<= 1
        mask = slots - 1
        at = self._table_at
        # (no table-sized temporary)
        ctypes.memset(self._table_addr, 0, slots * PEER_SLOT_BYTES)
        kernels = lookupkernel.ready()
        if kernels is not None and n:
            # Straight from the directory's arrays: no temporary of 10^6 entries either.
            kernels.place(self._table_addr, mask, cells.buffer_info()[0], len(cells),
                          address_of(keys), peers.buffer_info()[0], self._gen_addr)
        else:
            gen = self._gen
            pack = _PEER_SLOT.pack_into
            for cell in cells:
                if cell <= 0:
                    continue
                slot = cell - 1
                key, peer = bytes(keys[KEY_BYTES * slot:KEY_BYTES * (slot + 1)]), peers[slot]
                i = xxh3_64_intdigest(key) & mask
                while self._words[3 * i]:
                    i = (i + 1) & mask
                pack(self._view, at + i * PEER_SLOT_BYTES, _word(0, gen[peer], peer, HELD),
                     key)
        self.slots, self.mask, self.used = slots, mask, n
        PEER_HEADER.pack_into(self._head, 0, self.epoch, slots, self.max_slots)
        self._set_epoch((self.epoch | 1) + 1)

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        _EPOCH.pack_into(self._head, 0, epoch)

    def close(self) -> None:
        self._words.release()
        self._states.release()
        self._head.release()
        self._view.release()


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
        self.peer_at = 0
        """Where the peer table starts (0: none)."""
        self.peer_max = 0
        if flags & PEER_TABLE:
            (peer_at,) = _PEER_AT.unpack_from(self.view, _PEER_AT_AT)
            if peer_at >= HEADER_BYTES + slots * SLOT_BYTES and \
                    size >= peer_at + PEER_HEADER_BYTES:
                _, _, peer_max = PEER_HEADER.unpack_from(self.view, peer_at)
                if peer_max and size >= peer_at + peer_table_bytes(peer_max):
                    self.peer_at, self.peer_max = peer_at, peer_max
                    # A key in neither table ends the prefix, unless a shared tier may
                    # carry it on.
                    self.final_misses = not flags & SHARED_BELOW
        self._words: Any = None
        """The table as numpy sees it, made at the first multi-key lookup (`_slot_words`)."""
        self._words_tried = False
        self._base = address_of(self._mm)
        """The mapping's address, for the compiled walk (`lookupkernel`)."""
        self.address = self._base
        """The same, for the compiled lease-free read (`leasekernel`)."""
        self._out = bytearray(MAX_LOOKUP_KEYS)

    @staticmethod
    def usable() -> bool:
        """The seqlock needs x86-64's ordering of stores and of loads (see the module)."""
        return platform.machine() in ("x86_64", "AMD64")

    def _state(self, key: bytes) -> int | None:
        """LIVE or EMPTY for `key`, or None when the agent kept writing its slot."""
        view = self.view
        i = _home(key, self.mask)
        for _ in range(self.slots):
            slot = _read_slot(view, HEADER_BYTES + i * SLOT_BYTES)
            if slot is None:
                return None
            _, state, k, *_ = slot
            if state == EMPTY:
                return EMPTY
            if state == LIVE and k == key:
                return LIVE
            i = (i + 1) & self.mask
        return EMPTY

    def epoch(self) -> int | None:
        """The DRAM table's epoch, or None while it is being rebuilt (or overflowed)."""
        (epoch,) = _EPOCH.unpack_from(self.view, _EPOCH_AT)
        return None if epoch & 1 else int(epoch)

    def locate(self, key: bytes) -> tuple[int, int, Where] | None:
        """Where a lease-free read finds `key`'s chunk: (its slot's byte offset in the
        table, the slot's seq, what the slot says), for a LIVE slot of a chunk in one
        extent; None when the table does not hold it so (absent, several extents, or a
        slot the agent kept writing). Read `epoch` before and `unchanged` after the copy."""
        view = self.view
        i = _home(key, self.mask)
        for _ in range(self.slots):
            at = HEADER_BYTES + i * SLOT_BYTES
            slot = _read_slot(view, at)
            if slot is None:
                return None
            seq, state, k, offset, size, checksum, meta_hash, kind = slot
            if state == EMPTY:
                return None
            if state == LIVE and k == key:
                if offset == NO_EXTENT:
                    return None
                return at, seq, (offset, size, checksum, kind, meta_hash)
            i = (i + 1) & self.mask
        return None

    def unchanged(self, at: int, seq: int, key: bytes, epoch: int) -> bool:
        """Whether the slot at `at` still holds `key` LIVE at `seq` in the table of
        `epoch`: asked after a lease-free copy, it says the agent did not retire the slot
        meanwhile, so the chunk's pages were not freed while they were copied. The slot is
        read before the epoch (a rebuild makes the epoch odd before it writes any slot)."""
        view = self.view
        now, state = _SEQ_STATE.unpack_from(view, at)
        (k,) = _KEY.unpack_from(view, at + _KEY_AT)
        (again,) = _SEQ.unpack_from(view, at)
        (epoch_now,) = _EPOCH.unpack_from(view, _EPOCH_AT)
        return bool(now == seq == again and state == LIVE and k == key and epoch_now == epoch)

    def _peer_state(self, key: bytes, slots: int) -> bool | None:
        """Whether a readable peer holds `key` (a peer table of `slots`), or None when the
        agent kept writing its slot."""
        view, mask = self.view, slots - 1
        table = self.peer_at + PEER_HEADER_BYTES + MAX_PEERS * PEER_STATE_BYTES
        i = _home(key, mask)
        for _ in range(slots):
            at = table + i * PEER_SLOT_BYTES
            for _ in range(READ_RETRIES):
                word, k = _PEER_SLOT.unpack_from(view, at)
                if not word & 1 and _PEER_SLOT.unpack_from(view, at)[0] == word:
                    break
            else:
                return None
            state = word >> 48
            if state == EMPTY:
                return False
            if state == HELD and k == key:
                peer = (word >> 32) & 0xFFFF
                (st,) = _STATE.unpack_from(
                    view, self.peer_at + PEER_HEADER_BYTES + peer * PEER_STATE_BYTES)
                return bool(st & READABLE) and st & 0xFFFF == (word >> 16) & 0xFFFF
            i = (i + 1) & mask
        return False

    def lookup(self, keys: Sequence[bytes]) -> int | None:
        """How many leading keys the pool holds, when the tables are the agent's whole
        answer (`answer`); None when only the socket can say."""
        codes = self.answer(keys)
        return None if codes is None else len(codes)

    def answer(self, keys: Sequence[bytes]) -> bytes | None:
        """The tier code of each key of the longest held prefix (2 DRAM, the peer tier's
        code), when that is the agent's whole answer; None when only the socket can say (a
        rebuild overlapped, a slot stayed torn, a key is malformed, or the prefix ends
        where a lower tier may go on)."""
        view = self.view
        n = len(keys)
        (epoch,) = _EPOCH.unpack_from(view, _EPOCH_AT)
        if epoch & 1:
            return None
        peer_epoch, peer_slots = 0, 0
        if self.peer_at:
            peer_epoch, peer_slots, _ = PEER_HEADER.unpack_from(view, self.peer_at)
            if peer_epoch & 1 or peer_slots & (peer_slots - 1) or peer_slots > self.peer_max:
                return None
        if n > MAX_LOOKUP_KEYS:
            return None
        if n >= lookupkernel.COMPILE_FROM:
            kernels = lookupkernel.ready()
            if kernels is None:
                lookupkernel.compile_soon()
        else:
            kernels = lookupkernel.ready()
        if kernels is not None:
            want = b"".join(keys)
            if len(want) != KEY_BYTES * n or (n and max(map(len, keys)) != KEY_BYTES):
                return None  # the socket's LOOKUP says what is wrong with it
            out = self._out
            got = kernels.walk(self._base, self.mask, self.peer_at, peer_slots - 1, want, n,
                               out, PEER_TIER_CODE)
            codes = None if got < 0 else bytes(out[:got])
        else:
            if keys and set(map(len, keys)) != {KEY_BYTES}:
                return None
            codes = self._walk(keys, peer_slots)
        if codes is None or _EPOCH.unpack_from(view, _EPOCH_AT)[0] != epoch:
            return None
        if self.peer_at and _EPOCH.unpack_from(view, self.peer_at)[0] != peer_epoch:
            return None
        if len(codes) < n and not self.final_misses:
            return None
        return codes

    def _walk(self, keys: Sequence[bytes], peer_slots: int) -> bytes | None:
        """`answer`'s codes without the compiled walk: DRAM's prefix (`_prefix`), then key
        by key in Python where the peer table goes on."""
        count = self._prefix(keys)
        if count is None:
            return None
        codes = bytearray(DRAM_CODES[:count])
        if not peer_slots:
            return bytes(codes)
        for key in keys[count:]:
            state = self._state(key)
            if state is None:
                return None
            if state == LIVE:
                codes.append(DRAM_CODE)
                continue
            held = self._peer_state(key, peer_slots)
            if held is None:
                return None
            if not held:
                break
            codes.append(PEER_TIER_CODE)
        return bytes(codes)

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
