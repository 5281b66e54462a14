"""Framed records of the agent's append-only files: the commit journal (`journal.py`), the
KV-event identities file (`events.remembered`) and the peer DELETEs waiting
(`peers.deletelog`).

A record is its kind (a byte), its payload's length and CRC32 (little-endian u32s), then
the payload. An agent killed mid-append leaves a torn last record: its length or CRC does
not match, and reading stops there.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

_HEAD = struct.Struct("<BII")  # kind, payload length, crc32 of payload
HEAD_BYTES = _HEAD.size
"""Bytes of a record before its payload: a reader adds them up to find where a torn tail
starts."""


def frame(kind: int, payload: bytes) -> bytes:
    """One record, ready to append."""
    return _HEAD.pack(kind, len(payload), zlib.crc32(payload)) + payload


def whole_records(data: bytes) -> Iterator[tuple[int, bytes]]:
    """The whole records (kind, payload) at the start of `data`, up to a torn tail."""
    pos = 0
    while pos + _HEAD.size <= len(data):
        kind, length, crc = _HEAD.unpack_from(data, pos)
        payload = data[pos + _HEAD.size : pos + _HEAD.size + length]
        if len(payload) != length or zlib.crc32(payload) != crc:
            return  # torn tail: the agent died while appending
        pos += _HEAD.size + length
        yield kind, payload
