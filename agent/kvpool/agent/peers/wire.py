"""The peer wire protocol's frames (docs/protocol.md, "The peer protocol"): fixed
little-endian structs, each bounded, so a peer's frame can never make the agent allocate
more than a few KiB before the chunk bytes, which land in arena extents of the size the
directory announced.

After the handshake (`auth`), a connection carries either requests (FETCH, answered one
at a time, in order) or, after one SUBSCRIBE, the holder's inventory and its changes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..constants import KEY_BYTES

MAGIC = b"KVPP"
VERSION = 1

HELLO = struct.Struct("<4sH16s32s")
"""magic, version, agent id (random per process), nonce."""
PROOF_BYTES = 32
ACCEPTED = b"\x01"
"""The server's answer to a good client proof: requests may follow."""

REQUEST = struct.Struct("<BBHI16s")
"""op, 0, tenant length, request id, key; then the tenant name."""
OP_FETCH = 1
OP_SUBSCRIBE = 2

REPLY = struct.Struct("<BBHIQQI")
"""status, checksum kind, tenant length, request id, size, checksum, metadata length; then
the metadata, the chunk's tenant name and `size` chunk bytes (only when status is OK)."""
OK = 0
ABSENT = 1

STREAM = struct.Struct("<BBHId")
"""message, 0, tenant length, record count, the sender's wall clock; then the tenant
name and the records."""
BEGIN = 1
"""The inventory of one tenant space starts: what the reader had of it is gone."""
ADD = 2
"""Records: key and size of chunks the holder now holds."""
REMOVE = 3
"""Records: keys the holder no longer holds (key and 0)."""
SYNCED = 4
"""Every space's inventory has been sent: changes follow."""
HEARTBEAT = 5
STREAM_TYPES = frozenset({BEGIN, ADD, REMOVE, SYNCED, HEARTBEAT})
RECORD = struct.Struct("<16sQ")

MAX_TENANT_BYTES = 253
MAX_META_BYTES = 65536
MAX_RECORDS = 4096
"""Records per stream message: a message is at most 96 KiB."""


class WireError(Exception):
    """A frame that breaks the protocol: the connection is closed."""


@dataclass(frozen=True, slots=True)
class Request:
    op: int
    rid: int
    key: bytes
    tenant: str


def encode_request(op: int, rid: int, key: bytes, tenant: str) -> bytes:
    t = tenant.encode()
    return REQUEST.pack(op, 0, len(t), rid & 0xFFFFFFFF, key) + t


def request_head(data: bytes) -> tuple[int, int, int, bytes]:
    """(op, rid, tenant length, key) of a request's fixed part."""
    op, _, tlen, rid, key = REQUEST.unpack(data)
    if op not in (OP_FETCH, OP_SUBSCRIBE):
        raise WireError(f"unknown op {op}")
    if tlen > MAX_TENANT_BYTES:
        raise WireError(f"tenant name of {tlen} bytes")
    return op, rid, tlen, key


@dataclass(frozen=True, slots=True)
class ReplyHead:
    status: int
    kind: int
    tenant_len: int
    rid: int
    size: int
    checksum: int
    meta_len: int


def encode_reply(status: int, rid: int, *, kind: int = 0, size: int = 0, checksum: int = 0,
                 meta: bytes = b"", tenant: str = "") -> bytes:
    t = tenant.encode()
    return REPLY.pack(status, kind, len(t), rid & 0xFFFFFFFF, size, checksum,
                      len(meta)) + meta + t


def reply_head(data: bytes | bytearray) -> ReplyHead:
    head = ReplyHead(*REPLY.unpack(data))
    if head.status not in (OK, ABSENT):
        raise WireError(f"unknown reply status {head.status}")
    if head.meta_len > MAX_META_BYTES or head.tenant_len > MAX_TENANT_BYTES:
        raise WireError("reply metadata or tenant name too long")
    return head


def encode_stream(msg: int, tenant: str = "", records: list[tuple[bytes, int]] | None = None,
                  sent_at: float = 0.0) -> bytes:
    t = tenant.encode()
    recs = records or []
    return (STREAM.pack(msg, 0, len(t), len(recs), sent_at) + t
            + b"".join(RECORD.pack(k, s) for k, s in recs))


def stream_head(data: bytes) -> tuple[int, int, int, float]:
    """(message, tenant length, record count, sent at) of a stream message's fixed part."""
    msg, _, tlen, count, sent_at = STREAM.unpack(data)
    if msg not in STREAM_TYPES:
        raise WireError(f"unknown stream message {msg}")
    if tlen > MAX_TENANT_BYTES or count > MAX_RECORDS:
        raise WireError(f"stream message of {count} records, tenant of {tlen} bytes")
    return msg, tlen, count, sent_at


def records(data: bytes) -> list[tuple[bytes, int]]:
    return [(bytes(k), s) for k, s in RECORD.iter_unpack(data)]


assert RECORD.size == KEY_BYTES + 8
