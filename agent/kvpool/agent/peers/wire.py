"""The peer wire protocol's frames (docs/protocol.md, "The peer protocol"): fixed
little-endian structs, each bounded, so a peer's frame can never make the agent allocate
more than a few KiB before the chunk bytes, which land in arena extents of the size the
directory announced.

After the handshake (`auth`), a connection carries either requests (FETCH, PUSH and
DELETE, answered in order: FETCHes and DELETEs one at a time, up to `MAX_PUSH_BATCH` PUSH
offers at once) or, after one SUBSCRIBE, the holder's inventory and its changes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..constants import KEY_BYTES

MAGIC = b"KVPP"
VERSION = 1

AGENT_ID_BYTES = 16
HELLO = struct.Struct(f"<4sH{AGENT_ID_BYTES}s32s")
"""magic, version, agent id (its kernel's tag, then random per process: `auth`), nonce."""
PROOF_BYTES = 32
ACCEPTED = b"\x01"
"""The server's answer to a good client proof: requests may follow."""

REQUEST = struct.Struct("<BBHI16s")
"""op, 0, tenant length, request id, key; then the tenant name."""
OP_FETCH = 1
OP_SUBSCRIBE = 2
OP_PUSH = 3
"""A hand-off offer: the sender holds the key (a chunk a client put with a hint naming
this node) and asks the receiver to take it; `PUSH` follows the tenant name. The
receiver decides (its pin quota, its spaces) before any byte moves, then reads the chunk
from the sender like any peer read (FETCH on its own connection), and answers
`PUSH_REPLY` once it is stored or refused."""
OP_DELETE = 4
"""A DELETE made on the sender's node (a client's, docs/cross-node.md#delete): the receiver
deletes its copy of the key in the tenant's space (DRAM and NVMe; the shared tier is the
sender's to delete) and answers `DELETE_REPLY`. Only from an agent the receiver follows."""
PUSH = struct.Struct("<Q")
"""The chunk's size in bytes."""
MAX_PUSH_BATCH = 32
"""PUSH offers a sender may have unanswered on one connection (a batch, sent in one
write): the receiver takes them together, its reads of their chunks in one pipelined
batch, and answers each in order; it reads no further request of that connection while
this many are unanswered."""
PUSH_REPLY = struct.Struct("<BBHI")
"""status, 0, message length, request id; then the message (why, for a refusal)."""
PUSH_STORED = 0
"""Received, verified, stored and pinned until read or `peers.handoffTtl`."""
PUSH_HELD = 1
"""The receiver holds the key already: nothing moved."""
PUSH_REFUSED = 2
"""Refused before any byte moved (pin quota, unknown tenant or sender, size)."""
PUSH_FAILED = 3
"""The receiver's read of the chunk failed (absent by then, timeout, corrupt, no room)."""
PUSH_STATUSES = (PUSH_STORED, PUSH_HELD, PUSH_REFUSED, PUSH_FAILED)
DELETE_REPLY = PUSH_REPLY
"""status, 0, message length, request id; then the message (why, for a refusal)."""
DELETED = 0
"""The receiver held the key in the space and has deleted it."""
NOT_HELD = 1
"""The receiver did not hold it (nothing to do; it is not read from a peer there either)."""
DELETE_REFUSED = 2
"""Unknown tenant space, or a sender the receiver does not follow: nothing deleted."""
DELETE_STATUSES = (DELETED, NOT_HELD, DELETE_REFUSED)
MAX_MESSAGE_BYTES = 1024

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
"""Every space's inventory has been sent: changes follow. Its tenant field holds the
sender's node name instead (what a push hint names; empty from an older agent)."""
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
    if op not in (OP_FETCH, OP_SUBSCRIBE, OP_PUSH, OP_DELETE):
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


def encode_push_reply(status: int, rid: int, message: str = "") -> bytes:
    m = message.encode()[:MAX_MESSAGE_BYTES]
    return PUSH_REPLY.pack(status, 0, len(m), rid & 0xFFFFFFFF) + m


def push_reply_head(data: bytes, statuses: tuple[int, ...] = PUSH_STATUSES
                    ) -> tuple[int, int, int]:
    """(status, message length, request id) of a PUSH reply's fixed part (of a DELETE
    reply's, with `DELETE_STATUSES`)."""
    status, _, mlen, rid = PUSH_REPLY.unpack(data)
    if status not in statuses:
        raise WireError(f"unknown reply status {status}")
    if mlen > MAX_MESSAGE_BYTES:
        raise WireError(f"push reply message of {mlen} bytes")
    return status, mlen, rid


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
