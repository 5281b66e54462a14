"""The DRAM commit journal: what the arena holds, so a restarted agent can trust it.

Beside the arena on the same tmpfs, an append-only file records every chunk
made visible (`commit`) and every chunk taken away (`drop`). An agent that
restarts (SIGKILL, rolling upgrade) replays it, re-verifies each chunk's
checksum against the arena bytes, and serves what passes. A torn last record
(the process died mid-append) fails its CRC and ends the replay there.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgspec

from .protocol import Extents

_RECORD = struct.Struct("<BII")  # kind, payload length, crc32 of payload
COMMIT, DROP = 1, 2


class JournalEntry(msgspec.Struct, array_like=True):
    key: bytes
    extents: Extents
    size: int
    checksum: int
    meta: bytes
    tenant: str


_enc = msgspec.msgpack.Encoder()
_dec_entry = msgspec.msgpack.Decoder(JournalEntry)
_dec_key = msgspec.msgpack.Decoder(bytes)


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.records = 0

    def _append(self, kind: int, payload: bytes) -> None:
        os.write(self.fd, _RECORD.pack(kind, len(payload), zlib.crc32(payload)) + payload)
        self.records += 1

    def commit(self, entry: JournalEntry) -> None:
        self._append(COMMIT, _enc.encode(entry))

    def drop(self, key: bytes) -> None:
        self._append(DROP, _enc.encode(key))

    def rewrite(self, live: list[JournalEntry]) -> None:
        """Replace the journal by one commit record per live chunk (compaction)."""
        tmp = self.path.with_suffix(".journal.tmp")
        with open(tmp, "wb") as f:
            for entry in live:
                payload = _enc.encode(entry)
                f.write(_RECORD.pack(COMMIT, len(payload), zlib.crc32(payload)) + payload)
        os.replace(tmp, self.path)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.records = len(live)

    def close(self) -> None:
        os.close(self.fd)


def replay(path: Path) -> Iterator[JournalEntry]:
    """The chunks the journal says are live, in commit order."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    live: dict[bytes, JournalEntry] = {}
    pos = 0
    while pos + _RECORD.size <= len(data):
        kind, length, crc = _RECORD.unpack_from(data, pos)
        payload = data[pos + _RECORD.size : pos + _RECORD.size + length]
        if len(payload) != length or zlib.crc32(payload) != crc:
            break  # torn tail: the agent died while appending
        pos += _RECORD.size + length
        try:
            if kind == COMMIT:
                entry = _dec_entry.decode(payload)
                live[entry.key] = entry
            elif kind == DROP:
                live.pop(_dec_key.decode(payload), None)
        except msgspec.DecodeError:
            break
    yield from live.values()
