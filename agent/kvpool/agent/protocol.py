"""The agent's socket protocol, shared by the server and the client.

A frame is a 4-byte little-endian body length followed by a MessagePack body.
The body is an array whose first element is the message tag: for requests the
op code, for replies the op code of the request answered, or 0 for an error.
The second element is the request id (`rid`) the client chose; replies carry
it back, so requests may be pipelined. See `docs/protocol.md`.

Only control frames cross the socket in zero-copy mode (ALLOC/COMMIT,
ACQUIRE/RELEASE): chunk bytes go through the shared arena whose fd the client
receives with the HELLO reply (SCM_RIGHTS). PUT/GET carry the bytes inline.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec
import xxhash

from . import checksums

PROTOCOL_VERSION = 1
HEADER = struct.Struct("<I")
MAX_LOOKUP_KEYS = 8192
MAX_SPARE_LEASES = 4
"""Spare write leases (COMMIT's `next_size`) one connection holds at most: one per chunk
size, for this many sizes."""
MAX_TENANT_BYTES = 253
"""The longest tenant name a HELLO may claim (UTF-8 bytes): every chunk record (journal,
NVMe header, shared object) carries it, so it must stay small."""
MAX_NODE_BYTES = 253
"""The longest node name a hand-off hint (COMMIT's and PUT's `to`) may give (UTF-8 bytes):
a Kubernetes node name is a DNS subdomain."""


class Op(IntEnum):
    HELLO = 1
    LOOKUP = 2
    ALLOC = 3
    COMMIT = 4
    ABORT = 5
    ACQUIRE = 6
    RELEASE = 7
    PUT = 8
    GET = 9
    DELETE = 10
    PIN = 11
    UNPIN = 12
    STATS = 13
    READ = 14
    WAIT = 15


class ErrorCode(IntEnum):
    """Every error the agent answers with; the connection stays open unless noted."""

    BAD_FRAME = 1
    """The body is not a valid message (closes the connection)."""
    FRAME_TOO_LARGE = 2
    """The length prefix exceeds the limit announced at HELLO (closes the connection)."""
    UNKNOWN_OP = 3
    """The tag names no op (closes the connection: the rest of the stream is suspect)."""
    BAD_KEY = 4
    """A key is not exactly 16 bytes."""
    BAD_ARGUMENT = 5
    """A size, checksum or metadata field is out of range."""
    NOT_FOUND = 6
    """The key is in no tier (or failed its checksum, which is the same to a client)."""
    NO_SPACE = 7
    """The arena cannot fit the chunk even after evicting everything evictable (then nothing
    is evicted), or the connection's uncommitted writes hold half of the arena."""
    UNKNOWN_LEASE = 8
    """The lease id is not open on this connection (never granted, released, expired)."""
    CHECKSUM_MISMATCH = 9
    """Inline PUT bytes do not match the checksum sent with them."""
    VERSION_MISMATCH = 10
    """HELLO asked for a protocol version the agent does not speak."""
    HELLO_REQUIRED = 11
    """The first request on a connection must be HELLO."""
    TOO_MANY_LEASES = 12
    """The connection holds the most leases allowed; release some first."""
    INTERNAL = 13
    """An unexpected failure inside the agent; the message says what."""
    TENANT_MISMATCH = 14
    """HELLO named a tenant other than the one this socket serves (pools with tenants); the
    message says whether the agent has a space of that tenant at all."""
    TOO_MANY_CONNECTIONS = 15
    """The socket's space holds the most connections allowed (closes the connection)."""


class EngineBlocks(NamedTuple):
    """The engine blocks a chunk covers, for KV events (docs/events.md): the engine's
    block hashes in order, the token ids of those blocks, and the hash of the block
    before the first (None: the prompt's first block, or unknown)."""

    hashes: Sequence[int]
    token_ids: Sequence[int] = ()
    parent: int | None = None


def with_blocks(req: Commit | Put, blocks: EngineBlocks | None) -> Commit | Put:
    """`req` carrying what KV events say of its chunk (nothing when `blocks` is None)."""
    if blocks is not None:
        req.block_hashes = list(blocks.hashes)
        req.token_ids = list(blocks.token_ids)
        req.parent_block_hash = blocks.parent
    return req


# --------------------------------------------------------------------------- requests


class Request(msgspec.Struct, array_like=True, tag_field="op"):
    rid: int


class Hello(Request, tag=int(Op.HELLO)):
    version: int
    client: str = ""
    tenant: str = ""
    fingerprint_id: int = 0
    # What KV-aware routers need (docs/events.md); all optional, older clients omit them.
    pod: str = ""
    """The engine pod this client serves: its events topic is kv@<pod>@<model>."""
    model: str = ""
    """The model the engine serves (the topic's second part)."""
    block_size: int = 0
    """Tokens per engine block (the events' block_size); 0: unknown."""
    chunk_tokens: int = 0
    """Tokens per chunk key (LOOKUP counts the prefill tokens it serves); 0: unknown."""


class Lookup(Request, tag=int(Op.LOOKUP)):
    keys: list[bytes]


class Alloc(Request, tag=int(Op.ALLOC)):
    key: bytes
    size: int
    meta: bytes = b""
    dma: bool = False
    """The lease's copies run on a device (a GPU's DMA) and may outlive the connection:
    if it closes, the agent keeps the pages from reuse for `writeLeaseTimeout` (a drain)."""
    to: str = ""
    """As COMMIT's (a hand-off): when the key is stored already (`exists`), the agent
    pushes that chunk to this node; otherwise the COMMIT's `to` does."""


class Commit(Request, tag=int(Op.COMMIT)):
    lease: int
    checksum: int
    checksum_kind: int = 0
    """How `checksum` is defined (`kvpool.agent.checksums`): 0 XXH3-64, 1 WSUM."""
    block_hashes: list[int] = []
    """The engine block hashes the chunk covers, in order (KV events); [] unknown."""
    token_ids: list[int] = []
    """The token ids the chunk covers (KV events); [] unknown."""
    parent_block_hash: int | None = None
    """The engine hash of the block before the chunk's first; None: first or unknown."""
    # Put-ahead (docs/protocol.md#put-ahead); older clients omit these, older agents ignore them.
    next_size: int = 0
    """Ask for a spare write lease of this many bytes in the reply: the connection's next
    put of that size needs no ALLOC round trip. 0: none."""
    key: bytes = b""
    """The chunk's key when `lease` is a spare (granted without one); else empty or the
    lease's own key."""
    meta: bytes = b""
    """The chunk's metadata when `lease` is a spare (ignored otherwise)."""
    to: str = ""
    """Hand-off (docs/cross-node.md#hand-off): the node that will read the chunk; the agent
    pushes it there after COMMIT (peers on), where it stays pinned until read. "": none."""


class Abort(Request, tag=int(Op.ABORT)):
    lease: int


class Acquire(Request, tag=int(Op.ACQUIRE)):
    key: bytes
    dma: bool = False
    """As ALLOC's: if the connection closes, the chunk stays leased for the drain."""


class Release(Request, tag=int(Op.RELEASE)):
    lease: int


class Put(Request, tag=int(Op.PUT)):
    key: bytes
    data: bytes
    checksum: int
    meta: bytes = b""
    block_hashes: list[int] = []
    """As COMMIT's: what KV events say of the chunk."""
    token_ids: list[int] = []
    parent_block_hash: int | None = None
    to: str = ""
    """As COMMIT's: the node that will read the chunk (a hand-off)."""


class Get(Request, tag=int(Op.GET)):
    key: bytes


class Delete(Request, tag=int(Op.DELETE)):
    key: bytes
    local: bool = False
    """This node's copy only (DRAM and NVMe): the shared tier's and other nodes' copies
    stay (docs/cross-node.md#delete)."""


class Pin(Request, tag=int(Op.PIN)):
    key: bytes


class Unpin(Request, tag=int(Op.UNPIN)):
    key: bytes


class Stats(Request, tag=int(Op.STATS)):
    pass


class Read(Request, tag=int(Op.READ)):
    """DRAM chunks the client read without a lease (docs/protocol.md, "Reads without a
    lease"): told, so the agent counts them as reads (the eviction order, read bytes, a
    hand-off's first read)."""

    keys: list[bytes]


class Wait(Request, tag=int(Op.WAIT)):
    """Keys a peer read may be bringing into DRAM (docs/protocol.md, "Waiting for peer
    chunks"): answered once one of them before the first still coming is in DRAM, or none
    is coming, so a client reads them without a lease as they land instead of holding an
    ACQUIRE for each."""

    keys: list[bytes]


AnyRequest = (
    Hello | Lookup | Alloc | Commit | Abort | Acquire | Release | Put | Get | Delete | Pin
    | Unpin | Stats | Read | Wait
)

# --------------------------------------------------------------------------- replies

Extents = list[tuple[int, int]]
"""(offset, length) runs in the arena that together hold a chunk, in order."""


class Reply(msgspec.Struct, array_like=True, tag_field="op"):
    rid: int


class ErrorReply(Reply, tag=0):
    code: int
    message: str


class HelloReply(Reply, tag=int(Op.HELLO)):
    version: int
    agent_version: str
    pool: str
    arena_bytes: int
    max_chunk_bytes: int
    max_meta_bytes: int
    max_frame_bytes: int
    max_leases: int
    tenant: str = ""
    """The connection's tenant: the socket's in a pool with tenants, else the one claimed."""
    peers: bool = False
    """The agent reads chunks from peers (and answers WAIT); older agents omit it."""


class LookupReply(Reply, tag=int(Op.LOOKUP)):
    count: int
    tiers: bytes
    """One byte per hit key: the G-level (2 DRAM, 3 NVMe, 4 shared) it was found in."""


class AllocReply(Reply, tag=int(Op.ALLOC)):
    lease: int
    extents: Extents
    exists: bool = False
    """The key is already stored: nothing to write (deduplicated), lease is 0."""


class CommitReply(Reply, tag=int(Op.COMMIT)):
    stored: bool = True
    """False when the key was stored meanwhile, or (a spare's) already: deduplicated, the
    first copy kept. Older agents omit it (true)."""
    spare: int = 0
    """The spare write lease COMMIT's `next_size` asked for; 0: none granted (put with ALLOC)."""
    spare_extents: Extents = []
    """Where the spare lease's chunk goes in the arena."""


class AbortReply(Reply, tag=int(Op.ABORT)):
    pass


class AcquireReply(Reply, tag=int(Op.ACQUIRE)):
    lease: int
    size: int
    checksum: int
    extents: Extents
    meta: bytes
    tier: int
    checksum_kind: int = 0
    """The kind of `checksum`, as its COMMIT recorded it."""


class ReleaseReply(Reply, tag=int(Op.RELEASE)):
    pass


class PutReply(Reply, tag=int(Op.PUT)):
    stored: bool
    """False when the key was already stored (deduplicated)."""


class GetReply(Reply, tag=int(Op.GET)):
    data: bytes
    checksum: int
    meta: bytes
    tier: int
    checksum_kind: int = 0


class DeleteReply(Reply, tag=int(Op.DELETE)):
    existed: bool


class PinReply(Reply, tag=int(Op.PIN)):
    pass


class UnpinReply(Reply, tag=int(Op.UNPIN)):
    pass


class StatsReply(Reply, tag=int(Op.STATS)):
    stats: dict[str, Any]


class ReadReply(Reply, tag=int(Op.READ)):
    pass


class WaitReply(Reply, tag=int(Op.WAIT)):
    tiers: bytes
    """A byte per key asked, in order, up to the first a peer read brings: 2 in DRAM now,
    0 not coming (read it through ACQUIRE: it may be in NVMe, the shared tier, or nowhere),
    then 5 for that first key coming (it and those after it: WAIT again)."""


AnyReply = (
    ErrorReply | HelloReply | LookupReply | AllocReply | CommitReply | AbortReply | AcquireReply
    | ReleaseReply | PutReply | GetReply | DeleteReply | PinReply | UnpinReply | StatsReply
    | ReadReply | WaitReply
)

T = TypeVar("T")

class Decoder(Generic[T]):
    """A msgspec decoder that raises only msgspec.DecodeError (or ValidationError).

    msgspec itself also raises UnicodeDecodeError for a str field holding invalid UTF-8
    and RecursionError for arrays or maps nested deeper than the interpreter's stack
    (even inside ignored trailing fields). The server answers DecodeError with
    BAD_FRAME; anything else would end the connection with no reply at all, and log a
    traceback for every such frame.
    """

    def __init__(self, type_: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)

    def decode(self, buf: bytes | bytearray | memoryview) -> T:
        try:
            return self._decoder.decode(buf)
        except (UnicodeDecodeError, RecursionError) as e:
            raise msgspec.DecodeError(f"malformed MessagePack: {e}") from None


_encoder = msgspec.msgpack.Encoder()
# Any, as msgspec's own Decoder of a union is typed: callers narrow with isinstance.
request_decoder: Decoder[Any] = Decoder(AnyRequest)
reply_decoder: Decoder[Any] = Decoder(AnyReply)


def encode(msg: Request | Reply) -> bytes:
    """A whole frame: length prefix and body."""
    body = _encoder.encode(msg)
    return HEADER.pack(len(body)) + body


def checksum(data: Any, meta: bytes = b"", kind: int = checksums.XXH3) -> int:
    """The chunk's checksum of kind `kind` over its metadata and bytes: what COMMIT and
    PUT carry (PUT: always XXH3-64). Kinds are defined in `kvpool.agent.checksums`."""
    if kind == checksums.XXH3 and not meta:
        return int(xxhash.xxh3_64_intdigest(data))
    return checksums.compute(kind, [data], meta)


class ProtocolError(Exception):
    """An error reply from the agent, raised in the client."""

    def __init__(self, code: int, message: str) -> None:
        try:
            self.code: ErrorCode | int = ErrorCode(code)
            name = self.code.name
        except ValueError:
            self.code = code
            name = str(code)
        super().__init__(f"{name}: {message}")
        self.message = message


class _Head(msgspec.Struct, array_like=True):
    """Just the tag of a body: an array-like struct ignores the elements after it."""

    tag: int


_head_decoder: Decoder[_Head] = Decoder(_Head)


def peek_tag(body: bytes | memoryview) -> int | None:
    """The tag of a body that is not a valid request, if it is an array led by an integer.

    The server tells an unknown op (UNKNOWN_OP) from a malformed request of a
    known op (BAD_FRAME) by it, so every integer encoding counts: negative,
    uint8..uint64, and arrays of any length header, not only fixints.
    """
    try:
        return _head_decoder.decode(body).tag
    except msgspec.MsgspecError:
        return None
