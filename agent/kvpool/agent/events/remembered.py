"""Chunks' identities kept on file, so a restarted agent's events name what engines named.

`TierEvents` keeps what each storing client said of its chunk (the engine's block hashes,
token ids, parent hash, block size, model) while any tier holds the chunk. This log keeps
the same beside the chunks (`AgentConfig.identities_path`: in the NVMe directory, whose
chunk files outlive a reboot of the node; without NVMe beside the arena's journal on its
tmpfs, which lives as long as the arena), so a restarted agent's inventories and removals
name the engine's blocks as before the restart, not kvpool's own keys.

Append-only like the commit journal (`journal.py`), with the same framing (`records.py`):
a `KEEP` record when a chunk takes an identity, a `FORGET` record when it has left every
tier; a torn tail (the agent killed mid-append) ends the replay there. At start the file
is rewritten with the identities of the chunks the tiers still hold, and again whenever it
holds more than twice as many records as live identities plus `COMPACT_FLOOR`. A write
that fails costs only the identity's survival of a restart (logged): events never wait
for the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

import msgspec

from .. import atomicfile
from ..records import frame, whole_records
from .identity import Identity

log = logging.getLogger("kvpool.agent.events")

KEEP, FORGET = 1, 2
COMPACT_FLOOR = 1024


class _Kept(msgspec.Struct, array_like=True):
    key: bytes
    hashes: bytes
    hash_code: str
    """The `array` type code of the hashes ("Q", or "q" when one is negative)."""
    parent: int | None
    tokens: bytes
    token_code: str
    block_size: int
    model: str


_enc = msgspec.msgpack.Encoder()
_dec_kept = msgspec.msgpack.Decoder(_Kept)
_dec_key = msgspec.msgpack.Decoder(bytes)


def _pack(key: bytes, ident: Identity) -> bytes:
    return _enc.encode(_Kept(key, ident.hashes.tobytes(), ident.hashes.typecode, ident.parent,
                             ident.tokens.tobytes(), ident.tokens.typecode, ident.block_size,
                             ident.model))


def _unpack(kept: _Kept) -> Identity:
    hashes, tokens = array(kept.hash_code), array(kept.token_code)
    hashes.frombytes(kept.hashes)
    tokens.frombytes(kept.tokens)
    return Identity(hashes, kept.parent, tokens, kept.block_size, kept.model)


def read(path: Path) -> dict[bytes, Identity]:
    """The identities the file says are live, up to a torn or undecodable record (none
    when it cannot be read)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("KV-event identities file %s unreadable: %s", path, e)
        return {}
    live: dict[bytes, Identity] = {}
    for kind, payload in whole_records(data):
        try:
            if kind == KEEP:
                kept = _dec_kept.decode(payload)
                live[kept.key] = _unpack(kept)
            elif kind == FORGET:
                live.pop(_dec_key.decode(payload), None)
        except (msgspec.DecodeError, ValueError):
            break
    return live


class IdentityLog:
    """The identities of the chunks one space holds, on file (see the module's doc)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1
        self.records = 0
        self.live: Callable[[], Iterable[tuple[bytes, Identity]]] = tuple
        """The identities to keep now, for compaction (set by the tracker that owns them)."""
        self.live_count: Callable[[], int] = int
        """How many `live` gives, asked at every append once the file is large: O(1)."""
        self._failed = False

    def load(self, held: Collection[bytes]) -> dict[bytes, Identity]:
        """The remembered identities of the chunks in `held`; the file is rewritten to hold
        just those (what the tiers lost while the agent was down is forgotten)."""
        kept = {k: v for k, v in read(self.path).items() if k in held}
        self._rewrite(kept.items())
        return kept

    def keep(self, key: bytes, ident: Identity) -> None:
        self._append(KEEP, _pack(key, ident))

    def forget(self, key: bytes) -> None:
        self._append(FORGET, _enc.encode(key))

    def _append(self, kind: int, payload: bytes) -> None:
        if self.fd < 0:
            return  # not loaded, or the file could not be written: nothing to append to
        if self.records >= COMPACT_FLOOR and self.records > 2 * self.live_count():
            self._rewrite(self.live())
            if self.fd < 0:
                return
        record = frame(kind, payload)
        try:
            written = os.write(self.fd, record)
            if written != len(record):
                raise OSError(f"short write: {written} of {len(record)} bytes")
        except OSError as e:
            self._give_up(e)
            return
        self.records += 1

    def _rewrite(self, live: Iterable[tuple[bytes, Identity]]) -> None:
        """Replace the file by one `KEEP` record per live identity (written whole)."""
        n = 0

        def records() -> Iterator[bytes]:
            nonlocal n
            for key, ident in live:
                yield frame(KEEP, _pack(key, ident))
                n += 1

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Not synced, as the appends are not: the file outlives the agent's crash; what a
            # power loss takes costs names (those chunks' events carry kvpool's keys).
            atomicfile.replace(self.path, records(), tmp=self.path.with_name(
                self.path.name + ".tmp"), fsync=False, fsync_dir=False)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError as e:
            self._give_up(e)
            return
        self.close()
        self.fd, self.records = fd, n

    def _give_up(self, e: OSError) -> None:
        """Stop writing: a restart then names these chunks by kvpool's keys, as it would
        with no file; a torn record would hide every record after it."""
        if not self._failed:
            log.error("KV-event identities file %s cannot be written (%s): a restart names "
                      "the chunks by kvpool's keys", self.path, e)
        self._failed = True
        self.close()
        with contextlib.suppress(OSError):  # a record it missed must not mislead a restart
            self.path.unlink()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
