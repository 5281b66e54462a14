"""The DRAM commit journal: what the arena holds, so a restarted agent can trust it.

Beside the arena on the same tmpfs, an append-only file records every chunk
made visible (`commit`) and every chunk taken away (`drop`). An agent that
restarts (SIGKILL, rolling upgrade) replays it, re-verifies each chunk's
checksum against the arena bytes, and serves what passes. A torn last record
(the process died mid-append) fails its CRC and ends the replay there.

It also records the shared-tier deletes not yet confirmed by the store (`shared_delete`,
`shared_deleted`): a DELETE answered during a shared-tier outage is retried by the agent
that restarts, so another node never serves the chunk once the store is back. And the
hand-off pins of chunks pushed here by peers and not read yet (`handoff`,
`handoff_ended`), with the wall-clock time each ends unread: a restarted agent pins them
again until then, since the reader it was pushed for may not have read it yet.

The file is bounded by what the arena holds, not by how long the agent has run: once it
holds more than twice as many records as live chunks (plus `COMPACT_FLOOR`), it is
rewritten from the live chunks. An append that fails (the tmpfs is full) leaves the file
as it was and raises, so the caller can refuse the chunk it was about to make visible:
nothing is acknowledged that a restart would not find, and nothing refused is stored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec

from . import atomicfile
from .protocol import Extents
from .records import frame, whole_records

log = logging.getLogger(__name__)

COMMIT, DROP = 1, 2
SHARED_DELETE, SHARED_DELETED = 3, 4
"""A shared-tier delete to retry until the store confirms it; that confirmation (or the key
written to the store again, which makes its copy the one to keep)."""
HANDOFF, HANDOFF_ENDED = 5, 6
"""A pushed chunk pinned until its first read or a wall-clock time; that pin's end (read,
expired, deleted, taken over by a client's pin). A commit or drop of the key ends it too."""
COMPACT_FLOOR = 1024
"""Records allowed beyond twice the live chunks and pending deletes before the journal is
compacted."""


class JournalEntry(msgspec.Struct, array_like=True):
    key: bytes
    extents: Extents
    size: int
    checksum: int
    meta: bytes
    tenant: str
    checksum_kind: int = 0
    """Absent in journals written before checksum kinds: XXH3."""


class Handoff(msgspec.Struct, array_like=True):
    key: bytes
    until: float
    """Wall-clock seconds (`time.time`) at which the pin ends unread."""


_enc = msgspec.msgpack.Encoder()
_dec_entry = msgspec.msgpack.Decoder(JournalEntry)
_dec_key = msgspec.msgpack.Decoder(bytes)
_dec_handoff = msgspec.msgpack.Decoder(Handoff)


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.size = os.fstat(self.fd).st_size
        self.records = 0
        self.live = 0
        """Chunks the records describe as live (commits less drops since the last rewrite)."""
        self.live_entries: Callable[[], Iterable[JournalEntry]] | None = None
        """What the arena holds now, for compaction; set by the store that owns the arena."""
        self.live_deletes: Callable[[], Iterable[bytes]] = tuple
        """The shared-tier deletes still pending, for compaction (set by the store)."""
        self.deletes = 0
        """Shared-tier deletes the records describe as pending."""
        self.live_handoffs: Callable[[], Iterable[Handoff]] = tuple
        """The hand-off pins now, for compaction (set by the store)."""
        self.handoffs = 0
        """Hand-off pins the records describe as live."""
        self._compact_at = COMPACT_FLOOR
        self.compactions = 0
        self.stale = False
        """A drop could not be written: a restart could bring the chunk back until the
        next compaction, which is tried at the next append."""

    def _append(self, kind: int, payload: bytes) -> None:
        record = frame(kind, payload)
        try:
            written = os.write(self.fd, record)
            if written != len(record):
                raise OSError(f"short write to {self.path}: {written} of {len(record)} bytes")
        except OSError:
            # A torn record would end every later replay there: cut it off.
            os.ftruncate(self.fd, self.size)
            raise
        self.size += len(record)
        self.records += 1

    def commit(self, entry: JournalEntry) -> None:
        """Record a chunk as visible; raises OSError (file unchanged) when it cannot."""
        self._maybe_compact()
        self._append(COMMIT, _enc.encode(entry))
        self.live += 1

    def commit_many(self, entries: list[JournalEntry]) -> None:
        """Record chunks as visible, in one write: all of them, or (OSError, the file
        unchanged) none."""
        if not entries:
            return
        self._maybe_compact()
        records = [frame(COMMIT, _enc.encode(e)) for e in entries]
        data = records[0] if len(records) == 1 else b"".join(records)
        try:
            written = os.write(self.fd, data)
            if written != len(data):
                raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")
        except OSError:
            os.ftruncate(self.fd, self.size)  # a torn record would end every later replay
            raise
        self.size += len(data)
        self.records += len(records)
        self.live += len(records)

    def drop(self, key: bytes) -> None:
        """Record a chunk as gone. Never raises: the chunk is gone from the index already,
        so a failure marks the journal stale and the next compaction leaves the chunk out."""
        try:
            self._maybe_compact()
            self._append(DROP, _enc.encode(key))
        except OSError as e:
            log.error("commit journal %s could not record a drop: %s; compacting at the "
                      "next chance", self.path, e)
            self.stale = True
        self.live = max(0, self.live - 1)

    def shared_delete(self, key: bytes) -> None:
        """Record a shared-tier delete to retry until the store confirms it. Never raises:
        the delete is answered and retried by this agent either way, only a restart
        before the store confirms it would forget it."""
        self._record_delete(SHARED_DELETE, key)
        self.deletes += 1

    def shared_deleted(self, key: bytes) -> None:
        """Record a shared-tier delete as done (or superseded by a new upload)."""
        self._record_delete(SHARED_DELETED, key)
        self.deletes = max(0, self.deletes - 1)

    def handoff(self, key: bytes, until: float) -> None:
        """Record a pushed chunk's pin (after its commit), ending unread at `until`
        (wall clock). Never raises: the pin holds either way, only a restart would lose
        it (the chunk stays, evictable)."""
        self._record(HANDOFF, _enc.encode(Handoff(key, until)), key)
        self.handoffs += 1

    def handoff_ended(self, key: bytes) -> None:
        """Record the end of a pushed chunk's pin."""
        self._record(HANDOFF_ENDED, _enc.encode(key), key)
        self.handoffs = max(0, self.handoffs - 1)

    def _record(self, kind: int, payload: bytes, key: bytes) -> None:
        try:
            self._maybe_compact()
            self._append(kind, payload)
        except OSError as e:
            log.error("commit journal %s could not record a hand-off pin of %s: %s",
                      self.path, key.hex(), e)

    def _record_delete(self, kind: int, key: bytes) -> None:
        try:
            self._maybe_compact()
            self._append(kind, _enc.encode(key))
        except OSError as e:
            log.error("commit journal %s could not record a shared-tier delete of %s: %s",
                      self.path, key.hex(), e)

    def _maybe_compact(self) -> None:
        if self.live_entries is None:
            return
        live = self.live + self.deletes + self.handoffs
        if not self.stale and self.records < max(self._compact_at, 2 * live + COMPACT_FLOOR):
            return
        try:
            self.rewrite(list(self.live_entries()), list(self.live_deletes()),
                         list(self.live_handoffs()))
        except OSError as e:
            # Retry after as many records again, not at every append (that would be quadratic).
            self._compact_at = 2 * self.records + COMPACT_FLOOR
            log.error("commit journal %s could not be compacted: %s", self.path, e)
            return
        self.compactions += 1

    def rewrite(self, live: list[JournalEntry], deletes: list[bytes] | None = None,
                handoffs: list[Handoff] | None = None) -> None:
        """Replace the journal by one commit record per live chunk, one delete record per
        pending shared-tier delete and one record per hand-off pin (after the commits: a
        commit ends a pin before it) (compaction)."""
        deletes = [] if deletes is None else deletes
        handoffs = [] if handoffs is None else handoffs
        records = (frame(kind, payload)
                   for kind, payloads in ((COMMIT, map(_enc.encode, live)),
                                          (SHARED_DELETE, map(_enc.encode, deletes)),
                                          (HANDOFF, map(_enc.encode, handoffs)))
                   for payload in payloads)
        # No fsync: the journal outlives the agent's crash, not the node's (its arena is in
        # memory and gone with a reboot), and its appends are not synced either.
        atomicfile.replace(self.path, records, tmp=self.path.with_suffix(".journal.tmp"),
                           fsync=False, fsync_dir=False, mode=0o600)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.size = os.fstat(self.fd).st_size
        self.records = len(live) + len(deletes) + len(handoffs)
        self.live, self.deletes, self.handoffs = len(live), len(deletes), len(handoffs)
        self._compact_at = COMPACT_FLOOR
        self.stale = False

    def close(self) -> None:
        os.close(self.fd)


def _records(path: Path) -> Iterator[tuple[int, bytes]]:
    """The journal's whole records (kind, payload), up to a torn tail."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    yield from whole_records(data)


def replay(path: Path) -> Iterator[JournalEntry]:
    """The chunks the journal says are live, in commit order."""
    live: dict[bytes, JournalEntry] = {}
    for kind, payload in _records(path):
        try:
            if kind == COMMIT:
                entry = _dec_entry.decode(payload)
                live[entry.key] = entry
            elif kind == DROP:
                live.pop(_dec_key.decode(payload), None)
        except msgspec.DecodeError:
            break
    yield from live.values()


def pending_shared_deletes(path: Path) -> list[bytes]:
    """The shared-tier deletes the journal says the store has not confirmed, oldest first."""
    pending: dict[bytes, None] = {}
    for kind, payload in _records(path):
        try:
            if kind == SHARED_DELETE:
                key = _dec_key.decode(payload)
                pending.pop(key, None)
                pending[key] = None
            elif kind == SHARED_DELETED:
                pending.pop(_dec_key.decode(payload), None)
        except msgspec.DecodeError:
            break
    return list(pending)


def pending_handoffs(path: Path) -> list[Handoff]:
    """The hand-off pins the journal says are live (a pin, with no commit, drop or end of
    its key after it), in the order they were taken."""
    pins: dict[bytes, Handoff] = {}
    for kind, payload in _records(path):
        try:
            if kind == HANDOFF:
                pin = _dec_handoff.decode(payload)
                pins.pop(pin.key, None)
                pins[pin.key] = pin
            elif pins and kind in (COMMIT, DROP, HANDOFF_ENDED):
                key = (_dec_entry.decode(payload).key if kind == COMMIT
                       else _dec_key.decode(payload))
                pins.pop(key, None)
        except msgspec.DecodeError:
            break
    return list(pins.values())
