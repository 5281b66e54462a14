"""Protocol fuzzing against a real agent process on a real socket and a real arena.

Whatever a client sends, the agent answers every frame with a reply of that op or with
one of the error codes docs/protocol.md lists for it, or closes the connection where the
docs say it does (BAD_FRAME, FRAME_TOO_LARGE, UNKNOWN_OP, a truncated or stalled frame);
it keeps serving, leaks no arena bytes and no leases, and answers within its timeouts.

- `test_any_byte_stream_*`: arbitrary byte streams (garbage, truncated frames, wrong and
  oversize length prefixes, arbitrary MessagePack, unknown tags, valid frames) checked
  frame by frame against `expected_stream`, a reading of docs/protocol.md's framing rules.
- `test_every_op_with_fuzzed_arguments`: well-framed requests of every op with wrong key
  lengths, huge/negative/zero sizes, random leases and checksums, oversize metadata, too
  many LOOKUP keys, wrongly typed, missing and extra fields.
- `test_op_sequences_match_a_model`: a Hypothesis state machine drives two zero-copy
  connections through sequences of ops and checks every reply, every byte read and the
  agent's lease and byte accounting against a model of the documented semantics.

CI runs a bounded number of examples; `--hypothesis-profile=kvpool-fuzz` runs many more
(docs/testing.md). Every socket read is bounded by REPLY_GUARD, so a hang fails the test.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvpool.agent import checksums
from kvpool.agent import protocol as p
from kvpool.agent.arena import MAX_EXTENTS, PAGE_BYTES
from kvpool.agent.client import KVPoolClient
from kvpool.agent.store import MAX_LEASES_PER_CLIENT
from kvpool.bench.local import LocalAgent

from .conftest import FUZZ_PROFILE

pytestmark = pytest.mark.fuzz

# Small limits, so that the edges (largest chunk, largest metadata, largest frame) are
# cheap to reach and a few large ALLOCs fill the arena.
MAX_CHUNK = 256 * 1024
MAX_META = 512
ARENA_BYTES = 16 << 20
FRAME_TIMEOUT = SEND_TIMEOUT = 3.0
"""The fuzzed agent's `frameTimeout` and `sendTimeout` (10 s each by default): the stall
test waits for the first, and waits no longer than it must."""
REPLY_GUARD = 20.0
"""Longest any read waits: past every timeout of the agent (the defaults' sum), so only a
hang trips it."""

POOL_KEYS = [bytes([0xA0 + i]) * 16 for i in range(4)]
"""The keys the fuzzers store under; deleted after every example."""
OPS = {int(op) for op in p.Op}
U64 = 2**64 - 1
I64_MIN = -(2**63)

REPLY_OF: dict[p.Op, type[p.Reply]] = {
    p.Op.HELLO: p.HelloReply, p.Op.LOOKUP: p.LookupReply, p.Op.ALLOC: p.AllocReply,
    p.Op.COMMIT: p.CommitReply, p.Op.ABORT: p.AbortReply, p.Op.ACQUIRE: p.AcquireReply,
    p.Op.RELEASE: p.ReleaseReply, p.Op.PUT: p.PutReply, p.Op.GET: p.GetReply,
    p.Op.DELETE: p.DeleteReply, p.Op.PIN: p.PinReply, p.Op.UNPIN: p.UnpinReply,
    p.Op.STATS: p.StatsReply, p.Op.READ: p.ReadReply, p.Op.WAIT: p.WaitReply,
}
E = p.ErrorCode
STATE_ERRORS: dict[p.Op, set[p.ErrorCode]] = {
    # The errors an op with valid arguments may still get, from docs/protocol.md: they
    # depend on what is stored, leased and free, which these tests do not predict.
    p.Op.HELLO: set(), p.Op.LOOKUP: set(), p.Op.ALLOC: {E.NO_SPACE, E.TOO_MANY_LEASES},
    # COMMIT of a spare lease (put-ahead) names its key and metadata: BAD_KEY or
    # BAD_ARGUMENT for them, or for a key other than its ALLOC's, depend on the lease.
    p.Op.COMMIT: {E.UNKNOWN_LEASE, E.BAD_KEY, E.BAD_ARGUMENT}, p.Op.ABORT: {E.UNKNOWN_LEASE},
    p.Op.ACQUIRE: {E.NOT_FOUND, E.TOO_MANY_LEASES, E.NO_SPACE},
    p.Op.RELEASE: {E.UNKNOWN_LEASE}, p.Op.PUT: {E.NO_SPACE}, p.Op.GET: {E.NOT_FOUND},
    p.Op.DELETE: set(), p.Op.PIN: {E.NOT_FOUND}, p.Op.UNPIN: set(), p.Op.STATS: set(),
    p.Op.READ: set(), p.Op.WAIT: set(),
}
CLOSING = {E.BAD_FRAME, E.FRAME_TOO_LARGE, E.UNKNOWN_OP}
"""The errors after which docs/protocol.md says the connection is closed."""


def budget(ci_examples: int, ci_steps: int = 50) -> settings:
    """CI's bounded run, or the kvpool-fuzz profile's many examples when that is loaded."""
    if settings.get_current_profile_name() == FUZZ_PROFILE:
        return settings()
    return settings(
        max_examples=ci_examples, stateful_step_count=ci_steps, deadline=None,
        # Each example talks to a real agent process, and the agent is shared by the
        # examples of a test on purpose: leaks must show up across them.
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def op_of(req: p.Request) -> p.Op:
    return p.Op(type(req).__struct_config__.tag)


# --------------------------------------------------------------------------- the agent


@dataclass
class Harness:
    """The fuzzed agent, a well-behaved client, and what "unharmed" means for them."""

    agent: LocalAgent
    client: KVPoolClient
    bystander: bytes
    hello: p.HelloReply
    base_used: int
    base_chunks: int
    base_pins: int

    @property
    def limit(self) -> int:
        return self.hello.max_frame_bytes

    def stats(self) -> dict[str, Any]:
        return self.client.stats()

    def assert_unharmed(self, touched: Iterable[bytes] = ()) -> None:
        """Alive, serving, and back to its baseline once the fuzzer's chunks are deleted.

        Callers close their fuzz connections first and wait for the agent's EOF, which it
        sends only after it has ended the connection's leases, so nothing here polls.
        """
        proc = self.agent.proc
        assert proc is not None and proc.poll() is None, f"agent died:\n{self.agent.log()}"
        for k in {*touched, *POOL_KEYS}:
            if len(k) == 16 and k != self.bystander:
                self.client.delete(k)
        st_ = self.stats()
        assert st_["leases"] == {"read": 0, "write": 0}, st_["leases"]
        dram = st_["tiers"]["dram"]
        assert dram["used_bytes"] == self.base_used, "arena bytes leaked"
        assert dram["chunks"] == self.base_chunks
        assert st_["pins"] == self.base_pins
        assert self.client.get(self.bystander) == b"bystander" * 100

    def assert_fresh_client_round_trips(self) -> None:
        k = os.urandom(16)
        modes: tuple[Literal["zero_copy", "inline"], ...] = ("zero_copy", "inline")
        for mode in modes:
            with KVPoolClient(self.agent.socket_path, mode=mode) as c:
                data = os.urandom(10_000)
                assert c.put(k, data, meta=b"m")
                assert c.get_with_meta(k, verify=True) == (data, b"m")
                assert c.delete(k)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    work = tmp_path_factory.mktemp("fuzz-agent")
    cfg = work / "agent.yaml"
    cfg.write_text(f"maxChunkBytes: {MAX_CHUNK}\nmaxMetaBytes: {MAX_META}\n"
                   f"frameTimeout: {FRAME_TIMEOUT}\nsendTimeout: {SEND_TIMEOUT}\n")
    with LocalAgent("--no-lock", "--config", str(cfg), workdir=work,
                    dram=str(ARENA_BYTES)) as agent, \
            KVPoolClient(agent.socket_path) as client:
        assert client.hello is not None
        bystander = os.urandom(16)
        client.put(bystander, b"bystander" * 100)
        client.pin(bystander)  # so that no fuzzed ALLOC can evict it
        st_ = client.stats()
        h = Harness(agent, client, bystander, client.hello, st_["tiers"]["dram"]["used_bytes"],
                    st_["tiers"]["dram"]["chunks"], st_["pins"])
        yield h
        h.assert_unharmed()
        h.assert_fresh_client_round_trips()


# --------------------------------------------------------------------------- a raw connection


class FuzzConn:
    """A bare socket that sends any bytes and reads replies with bounded waits."""

    def __init__(self, path: Path, *, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(REPLY_GUARD)
        self.sock.connect(str(path))
        self.buf = bytearray()
        self.arena_fd: int | None = None
        self.keep_fd = False
        self.send_failed = False
        if hello:
            self.keep_fd = True
            self.send(p.encode(p.Hello(0, p.PROTOCOL_VERSION)))
            reply = self.reply()
            assert isinstance(reply, p.HelloReply), reply
            self.keep_fd = False

    def send(self, data: bytes) -> None:
        """Send, tolerating an agent that has already closed (it may, mid-stream)."""
        if self.send_failed:
            return
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.send_failed = True

    def _recv(self) -> bool:
        """More bytes into the buffer; False at EOF. A hang raises TimeoutError."""
        try:
            msg, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
        except ConnectionResetError:
            # The agent closed with our unread bytes in its queue; anything it sent
            # before that has been read already.
            return False
        for fd in fds:
            if self.keep_fd and self.arena_fd is None:
                self.arena_fd = fd
            else:
                os.close(fd)
        if not msg:
            return False
        self.buf += msg
        return True

    def reply(self) -> p.Reply | None:
        """The next reply, or None when the agent has closed the connection."""
        while len(self.buf) < p.HEADER.size:
            if not self._recv():
                assert not self.buf, f"connection closed inside a reply: {bytes(self.buf)!r}"
                return None
        (n,) = p.HEADER.unpack_from(self.buf)
        while len(self.buf) < p.HEADER.size + n:
            if not self._recv():
                raise AssertionError("connection closed inside a reply")
        body = bytes(self.buf[p.HEADER.size : p.HEADER.size + n])
        del self.buf[: p.HEADER.size + n]
        reply: p.Reply = p.reply_decoder.decode(body)  # the agent's replies always decode
        return reply

    def call(self, req: p.Request) -> p.Reply:
        self.send(p.encode(req))
        reply = self.reply()
        assert reply is not None, f"agent closed the connection on {req!r}"
        return reply

    def finish(self) -> list[p.Reply]:
        """Half-close, read what is left up to the agent's EOF, close.

        The agent closes its end only after it has ended this connection's leases, so
        once this returns the agent's accounting no longer includes them.
        """
        replies: list[p.Reply] = []
        with contextlib.suppress(OSError):  # already closed by the agent
            self.sock.shutdown(socket.SHUT_WR)
        while (r := self.reply()) is not None:
            replies.append(r)
        self.close()
        return replies

    def close(self) -> None:
        self.sock.close()
        if self.arena_fd is not None:
            os.close(self.arena_fd)
            self.arena_fd = None


# --------------------------------------------------------------------------- the oracle


def argument_error(req: p.Request, limits: p.HelloReply) -> p.ErrorCode | None:
    """The error docs/protocol.md gives for a request's arguments alone, if any."""
    def bad(key: bytes) -> bool:
        return len(key) != 16

    match req:
        case p.Hello():
            return E.VERSION_MISMATCH if req.version != p.PROTOCOL_VERSION else None
        case p.Lookup() | p.Read() | p.Wait():
            if len(req.keys) > p.MAX_LOOKUP_KEYS:
                return E.BAD_ARGUMENT
            return E.BAD_KEY if any(bad(k) for k in req.keys) else None
        case p.Alloc():
            if bad(req.key):
                return E.BAD_KEY
            if not 0 < req.size <= limits.max_chunk_bytes or len(req.meta) > MAX_META:
                return E.BAD_ARGUMENT
            return None
        case p.Put():
            if bad(req.key):
                return E.BAD_KEY
            if not 0 < len(req.data) <= limits.max_chunk_bytes or len(req.meta) > MAX_META:
                return E.BAD_ARGUMENT
            if p.checksum(req.data, req.meta) != req.checksum:
                return E.CHECKSUM_MISMATCH
            return None
        case p.Commit():  # refused before the lease is looked at: an unknown checksum
            # kind, a spare asked for of a size no chunk may have
            if req.checksum_kind not in checksums.KINDS \
                    or not 0 <= req.next_size <= limits.max_chunk_bytes:
                return E.BAD_ARGUMENT
            return None
        case p.Acquire() | p.Get() | p.Delete() | p.Pin() | p.Unpin():
            return E.BAD_KEY if bad(req.key) else None
    return None


def in_arena(extents: p.Extents, limits: p.HelloReply) -> bool:
    return all(o >= 0 and n > 0 and o % PAGE_BYTES == 0 and o + n <= limits.arena_bytes
               for o, n in extents)


def check_reply(req: p.Request, reply: p.Reply, hello: bool, limits: p.HelloReply) -> None:
    """`reply` is one docs/protocol.md allows for `req` (state aside)."""
    op = op_of(req)
    assert reply.rid == req.rid, (req, reply)
    if isinstance(reply, p.ErrorReply):
        code = p.ErrorCode(reply.code)  # a code outside ErrorCode fails here
        assert code is not E.INTERNAL, f"the agent failed on {req!r}: {reply.message}"
    if not hello and op is not p.Op.HELLO:
        assert isinstance(reply, p.ErrorReply) and reply.code == E.HELLO_REQUIRED, (req, reply)
        return
    expected = argument_error(req, limits)
    if expected is not None:
        assert isinstance(reply, p.ErrorReply) and reply.code == expected, (req, reply)
        return
    if isinstance(reply, p.ErrorReply):
        assert reply.code in STATE_ERRORS[op], (req, reply)
        return
    assert type(reply) is REPLY_OF[op], (req, reply)
    match reply:
        case p.HelloReply():
            assert reply.version == p.PROTOCOL_VERSION
            assert (reply.arena_bytes, reply.max_frame_bytes) == (
                limits.arena_bytes, limits.max_frame_bytes)
        case p.LookupReply():
            assert isinstance(req, p.Lookup)
            assert reply.count == len(reply.tiers) <= len(req.keys)
            assert set(reply.tiers) <= {2, 3, 4}
        case p.AllocReply():
            assert isinstance(req, p.Alloc)
            if reply.exists:
                assert (reply.lease, reply.extents) == (0, [])
            else:
                assert reply.lease > 0 and 1 <= len(reply.extents) <= MAX_EXTENTS
                assert sum(n for _, n in reply.extents) == req.size
                assert in_arena(reply.extents, limits)
        case p.CommitReply():
            assert isinstance(req, p.Commit)
            if reply.spare:  # the put-ahead lease it asked for
                assert req.next_size > 0 and 1 <= len(reply.spare_extents) <= MAX_EXTENTS
                assert sum(n for _, n in reply.spare_extents) == req.next_size
                assert in_arena(reply.spare_extents, limits)
            else:
                assert reply.spare_extents == []
        case p.AcquireReply():
            assert 0 < reply.size <= limits.max_chunk_bytes and reply.lease > 0
            assert sum(n for _, n in reply.extents) == reply.size
            assert in_arena(reply.extents, limits) and reply.tier in {2, 3, 4}
        case p.GetReply():
            assert 0 < len(reply.data) <= limits.max_chunk_bytes and reply.tier in {2, 3, 4}
        case p.StatsReply():
            assert {"tiers", "leases", "clients"} <= reply.stats.keys()


@dataclass
class Expected:
    """What the agent must answer to one frame of a stream."""

    end: int
    """Stream offset where the frame ends: its reply is due once that much is sent."""
    request: p.Request | None = None
    error: p.ErrorCode | None = None
    """A frame-level error, after which the connection closes."""
    hello: bool = False
    """Whether HELLO had succeeded on the connection before this frame."""


class _Tagged(msgspec.Struct, array_like=True):
    """A MessagePack array led by an integer: a message, whatever its tag and fields."""

    tag: int


def classify(body: bytes) -> p.Request | p.ErrorCode:
    """A body's request, or the frame-level error docs/protocol.md gives for it."""
    try:
        req: p.Request = p.request_decoder.decode(body)
        return req
    except msgspec.DecodeError:  # the only error the protocol's decoder may raise
        pass
    try:
        tag = msgspec.msgpack.decode(body, type=_Tagged).tag
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return E.BAD_FRAME
    return E.UNKNOWN_OP if tag not in OPS else E.BAD_FRAME


def expected_stream(stream: bytes, limit: int, hello: bool) -> list[Expected]:
    """The replies due to a byte stream the client sends and then half-closes.

    Frames are split by their length prefix; a prefix over `limit` is refused at once, a
    frame cut short by the end of the stream gets no reply (the agent sees EOF and closes).
    """
    out: list[Expected] = []
    pos = 0
    while len(stream) - pos >= p.HEADER.size:
        (length,) = p.HEADER.unpack_from(stream, pos)
        if length > limit:
            out.append(Expected(pos + p.HEADER.size, error=E.FRAME_TOO_LARGE))
            break
        end = pos + p.HEADER.size + length
        if end > len(stream):
            break
        got = classify(stream[pos + p.HEADER.size : end])
        if isinstance(got, p.ErrorCode):
            out.append(Expected(end, error=got))
            break
        out.append(Expected(end, request=got, hello=hello))
        if isinstance(got, p.Hello) and got.version == p.PROTOCOL_VERSION:
            hello = True
        pos = end
    return out


def exchange(h: Harness, segments: list[bytes], *, hello: bool, pipelined: bool) -> None:
    """Send the segments on a fresh connection and check every reply and the final close.

    Pipelined: the whole stream at once, then the replies. Otherwise segment by segment,
    reading each reply as soon as its frame is complete.
    """
    stream = b"".join(segments)
    expected = expected_stream(stream, h.limit, hello)
    # Only PUT and ALLOC (with a COMMIT that guessed its lease) can store a chunk.
    touched = {e.request.key for e in expected if isinstance(e.request, p.Put | p.Alloc)}
    conn = FuzzConn(h.agent.socket_path, hello=hello)
    try:
        sent = 0
        due = iter(expected)
        pending = next(due, None)
        replies: list[p.Reply | None] = []
        chunks = [stream] if pipelined else segments
        for chunk in chunks:
            conn.send(chunk)
            sent += len(chunk)
            while pending is not None and pending.end <= sent:
                replies.append(conn.reply())
                pending = next(due, None) if pending.error is None else None
        with contextlib.suppress(OSError):  # the agent may have closed already
            conn.sock.shutdown(socket.SHUT_WR)
        while pending is not None:
            replies.append(conn.reply())
            pending = next(due, None) if pending.error is None else None
        closed = conn.reply()
        assert closed is None, f"a reply nothing asked for: {closed!r}"
    finally:
        conn.close()
    assert len(replies) == len(expected)
    for exp, reply in zip(expected, replies, strict=True):
        assert reply is not None, f"connection closed instead of answering {exp}"
        if exp.error is not None:
            assert isinstance(reply, p.ErrorReply) and reply.code == exp.error, (exp, reply)
            assert exp.error in CLOSING
        else:
            assert exp.request is not None
            check_reply(exp.request, reply, exp.hello, h.hello)
    h.assert_unharmed(touched)


# --------------------------------------------------------------------------- strategies

bad_keys = st.binary(max_size=40).filter(lambda k: len(k) != 16)
keys = st.one_of(st.sampled_from(POOL_KEYS), bad_keys, st.binary(min_size=16, max_size=16))
sizes = st.one_of(
    st.integers(1, 64 * 1024),
    st.sampled_from([0, -1, 1, PAGE_BYTES - 1, PAGE_BYTES, PAGE_BYTES + 1, MAX_CHUNK - 1,
                     MAX_CHUNK, MAX_CHUNK + 1, ARENA_BYTES, 2**31, 2**32, 2**63 - 1, I64_MIN,
                     U64]),
    st.integers(I64_MIN, U64),
)
metas = st.one_of(st.binary(max_size=32),
                  st.sampled_from([MAX_META, MAX_META + 1, 65536]).map(lambda n: b"m" * n))
datas = st.one_of(st.binary(min_size=1, max_size=256), st.just(b""),
                  st.sampled_from([MAX_CHUNK, MAX_CHUNK + 1]).map(lambda n: b"d" * n))
lease_ids = st.one_of(st.integers(0, 64), st.sampled_from([-1, 2**63 - 1, U64, I64_MIN]),
                      st.integers(I64_MIN, U64))
u64s = st.integers(I64_MIN, U64)  # the wire carries any int64/uint64; the agent must cope
lookup_keys = st.one_of(
    st.lists(keys, max_size=6),
    # At, just over, and far over the documented 8192 (the last is over the frame limit).
    st.tuples(st.sampled_from([8192, 8193, 20_000]), st.sampled_from(POOL_KEYS))
      .map(lambda nk: [nk[1]] * nk[0]),
)
versions = st.one_of(st.just(p.PROTOCOL_VERSION), st.integers(I64_MIN, U64))
rids = st.one_of(st.integers(0, 1000), st.sampled_from([U64, I64_MIN, -1]))
checksum_kinds = st.one_of(st.sampled_from([0, 1]), u64s)  # known kinds, and unknown ones
nodes = st.text(max_size=20)  # a hand-off's node name (at most 253 bytes: never past it here)



def engine_blocks(required: int) -> list[tuple[str, st.SearchStrategy[Any], int]]:
    """COMMIT's and PUT's trailing KV-event fields: block hashes, token ids, parent hash."""
    hashes = st.lists(st.integers(0, U64), max_size=4)
    return [("ints", hashes, required),
            ("ints", st.lists(st.integers(0, 2**32 - 1), max_size=4), required),
            ("optint", st.none() | st.integers(0, U64), required)]


FIELDS: dict[p.Op, list[tuple[str, st.SearchStrategy[Any], int]]] = {
    # (kind, valid values, how many leading fields are required) per op, after tag and rid.
    p.Op.HELLO: [("int", versions, 1), ("str", st.text(max_size=20), 1),
                 ("str", st.text(max_size=20), 1), ("int", u64s, 1),
                 ("str", st.text(max_size=20), 1), ("str", st.text(max_size=20), 1),
                 ("int", st.integers(0, 4096), 1), ("int", st.integers(0, 4096), 1)],
    p.Op.LOOKUP: [("keys", lookup_keys, 1)],
    # `dma` stays false: a connection's dma leases drain for writeLeaseTimeout after it
    # closes (test_dma_drain.py), past the baseline check after each example.
    # `to` (a hand-off's node): this agent has no peers, so it changes nothing.
    p.Op.ALLOC: [("bytes", keys, 2), ("int", sizes, 2), ("bytes", metas, 2),
                 ("bool", st.just(False), 2), ("str", nodes, 2)],
    p.Op.COMMIT: [("int", lease_ids, 2), ("int", u64s, 2), ("int", checksum_kinds, 2),
                  *engine_blocks(2), ("int", sizes, 2), ("bytes", keys, 2),
                  ("bytes", metas, 2), ("str", nodes, 2)],
    p.Op.ABORT: [("int", lease_ids, 1)],
    p.Op.ACQUIRE: [("bytes", keys, 1), ("bool", st.just(False), 1)],
    p.Op.RELEASE: [("int", lease_ids, 1)],
    p.Op.PUT: [("bytes", keys, 3), ("bytes", datas, 3), ("int", u64s, 3), ("bytes", metas, 3),
               *engine_blocks(3), ("str", nodes, 3)],
    p.Op.GET: [("bytes", keys, 1)],
    p.Op.DELETE: [("bytes", keys, 1), ("bool", st.booleans(), 1)],
    p.Op.PIN: [("bytes", keys, 1)],
    p.Op.UNPIN: [("bytes", keys, 1)],
    p.Op.STATS: [],
    p.Op.READ: [("keys", lookup_keys, 1)],
    p.Op.WAIT: [("keys", lookup_keys, 1)],
}
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(I64_MIN, U64) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
WRONG_TYPE: dict[str, st.SearchStrategy[Any]] = {
    "int": st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=4),
                     st.binary(max_size=4), st.lists(st.integers(0, 9), max_size=2)),
    "bytes": st.one_of(st.none(), st.booleans(), st.integers(0, 99), st.floats(),
                       st.text(max_size=16), st.lists(st.binary(max_size=2), max_size=2)),
    "str": st.one_of(st.none(), st.booleans(), st.integers(0, 99), st.binary(max_size=4)),
    "bool": st.one_of(st.none(), st.integers(0, 9), st.floats(), st.text(max_size=4),
                      st.binary(max_size=4)),
    "ints": st.one_of(st.none(), st.integers(0, 9), st.binary(max_size=4),
                      st.lists(st.text(max_size=2), min_size=1, max_size=2)),
    "optint": st.one_of(st.booleans(), st.floats(), st.text(max_size=4), st.binary(max_size=4),
                        st.lists(st.integers(0, 9), max_size=2)),
    "keys": st.one_of(st.none(), st.integers(0, 99), st.binary(max_size=16),
                      st.lists(st.one_of(st.integers(0, 9), st.text(max_size=2)),
                               min_size=1, max_size=3)),
}


@st.composite
def request_bodies(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A MessagePack request body of any op, and whether every field has its op's type."""
    op = draw(st.sampled_from(list(p.Op)))
    fields = FIELDS[op]
    required = fields[0][2] if fields else 0
    well_typed = True
    rid: Any = draw(rids)
    if draw(st.integers(0, 19)) == 0:
        rid, well_typed = draw(WRONG_TYPE["int"]), False
    values: list[Any] = [int(op), rid]
    n = draw(st.integers(required, len(fields)))
    if required and draw(st.integers(0, 19)) == 0:
        n, well_typed = draw(st.integers(0, required - 1)), False  # a required field missing
    for kind, valid, _ in fields[:n]:
        if draw(st.integers(0, 15)) == 0:
            values.append(draw(WRONG_TYPE[kind]))
            well_typed = False
        else:
            values.append(draw(valid))
    if op is p.Op.PUT and n >= 3 and well_typed and draw(st.booleans()):
        values[4] = p.checksum(values[3], values[5] if n >= 4 else b"")
    if n == len(fields):
        # Trailing fields a newer client may add: ignored (docs: "Versioning").
        values += draw(st.lists(msgpack_values, max_size=2))
    return msgspec.msgpack.encode(values), well_typed


def frame(body: bytes) -> bytes:
    return p.HEADER.pack(len(body)) + body


@st.composite
def segments(draw: st.DrawFn) -> bytes:
    """One piece of a byte stream: a frame of some kind, or bytes no frame lines up with."""
    kind = draw(st.integers(0, 7))
    if kind == 0:
        return draw(st.binary(max_size=64))  # raw bytes, no length prefix
    if kind == 1:
        return frame(draw(st.binary(max_size=64)))  # garbage body
    if kind == 2:
        return frame(msgspec.msgpack.encode(draw(msgpack_values)))  # any MessagePack
    if kind == 3:  # a message with any tag
        tag = draw(st.one_of(st.integers(0, 20), st.integers(I64_MIN, U64)))
        return frame(msgspec.msgpack.encode([tag, *draw(st.lists(msgpack_values, max_size=3))]))
    if kind == 4:  # a length prefix that does not match the body
        body = draw(request_bodies())[0]
        return p.HEADER.pack(draw(st.integers(0, len(body) + 64))) + body
    if kind == 5:  # a length prefix over the limit (or far over it)
        return p.HEADER.pack(draw(st.one_of(st.integers(MAX_CHUNK, MAX_CHUNK + 16384),
                                            st.integers(0, 2**32 - 1))))
    if kind == 6:  # a valid frame cut short
        whole = frame(draw(request_bodies())[0])
        return whole[: draw(st.integers(0, len(whole)))]
    return frame(draw(request_bodies())[0])


# --------------------------------------------------------------------------- tests: frames


@budget(200)
@given(stream=st.lists(segments(), min_size=1, max_size=4), hello=st.booleans(),
       pipelined=st.booleans())
def test_any_byte_stream_gets_documented_replies_or_a_documented_close(
        harness: Harness, stream: list[bytes], hello: bool, pipelined: bool) -> None:
    exchange(harness, stream, hello=hello, pipelined=pipelined)


@budget(300)
@given(bodies=st.lists(request_bodies(), min_size=1, max_size=6), pipelined=st.booleans())
def test_every_op_with_fuzzed_arguments(
        harness: Harness, bodies: list[tuple[bytes, bool]], pipelined: bool) -> None:
    for body, well_typed in bodies:
        # The fields' types alone decide whether a body is a request; values never do.
        assert isinstance(classify(body), p.Request) is well_typed, body
    exchange(harness, [frame(b) for b, _ in bodies], hello=True, pipelined=pipelined)


@pytest.mark.parametrize("message", [
    [200, 1], [255, 1], [-1, 1], [0, 1], [16, 1], [U64, 1, b"k" * 16], [2**40], [99],
])
def test_any_integer_tag_that_names_no_op_is_unknown_op(harness: Harness, message: list[Any],
                                                        ) -> None:
    """Regression: only fixint tags 0..127 were recognised, so [200, 1] got BAD_FRAME."""
    for body in (msgspec.msgpack.encode(message),
                 # The same array behind a 16-bit length header, as some encoders write it.
                 b"\xdc" + struct.pack(">H", len(message)) + msgspec.msgpack.encode(message)[1:]):
        conn = FuzzConn(harness.agent.socket_path)
        conn.send(frame(body))
        reply = conn.reply()
        assert isinstance(reply, p.ErrorReply) and reply.code == E.UNKNOWN_OP, reply
        assert conn.finish() == []
    harness.assert_unharmed()


DEEP = b"\x91" * 100_000 + b"\xc0"
"""An array nested 100,000 deep: past any interpreter's recursion limit."""


@pytest.mark.parametrize("body", [
    b"\x94\x01\x01\x01\xa2\xff\xfe",  # HELLO whose client name is invalid UTF-8
    b"\x95\x01\x01\x01\xa0\xa1\x80",  # ... whose tenant is
    b"\x93\x0d\x01" + DEEP,  # STATS with a deeply nested (ignored) trailing field
    b"\x93\x02\x01" + DEEP,  # LOOKUP whose keys are nested arrays
    b"\x92\x63" + DEEP,  # an unknown op, nested too deep to read past its tag
], ids=["utf8-client", "utf8-tenant", "deep-trailing", "deep-keys", "deep-unknown-op"])
@pytest.mark.parametrize("hello", [False, True])
def test_undecodable_strings_and_nesting_get_bad_frame(harness: Harness, body: bytes,
                                                       hello: bool) -> None:
    """Regression: msgspec raised UnicodeDecodeError / RecursionError, which the server did
    not catch: the connection closed with no reply and a traceback was logged per frame."""
    assert p.peek_tag(body) in (None, 1, 2, 13)  # never raises
    with pytest.raises(msgspec.DecodeError):
        p.request_decoder.decode(body)
    conn = FuzzConn(harness.agent.socket_path, hello=hello)
    conn.send(frame(body))
    reply = conn.reply()
    assert isinstance(reply, p.ErrorReply) and reply.code == E.BAD_FRAME, reply
    assert conn.finish() == []
    harness.assert_unharmed()


def test_peek_tag_reads_every_integer_encoding() -> None:
    enc = msgspec.msgpack.encode
    assert [p.peek_tag(enc([t, 1])) for t in (5, 200, 70_000, U64, -1, I64_MIN)] == [
        5, 200, 70_000, U64, -1, I64_MIN]
    assert p.peek_tag(b"\xdc\x00\x02\xcc\xc8\x01") == 200
    for body in (b"", b"\xc1", enc([]), enc([True, 1]), enc(["3", 1]), enc({"op": 3}),
                 enc([3, 1]) + b"\x00"):
        assert p.peek_tag(body) is None, body


# --------------------------------------------------------------------------- tests: timeouts


def _closed_within(conn: FuzzConn, guard: float) -> bool:
    conn.sock.settimeout(guard)
    try:
        return conn.reply() is None
    except TimeoutError:
        return False


def test_clients_stalled_inside_a_frame_body_or_a_length_prefix_are_dropped(
        harness: Harness) -> None:
    """Two clients, each holding a read lease, go silent at once (so the frame timeout is
    waited once for both): one inside a frame's body, one inside a length prefix. The
    agent drops both, ending their leases."""
    stalls = {"frame body": p.HEADER.pack(100) + b"\x93\x0d",  # 2 of 100 promised bytes
              "length prefix": b"\x05\x00"}  # half a length prefix
    conns: dict[str, FuzzConn] = {}
    try:
        for where, partial in stalls.items():
            conn = conns[where] = FuzzConn(harness.agent.socket_path)
            lease = conn.call(p.Acquire(1, harness.bystander))
            assert isinstance(lease, p.AcquireReply)
            conn.send(partial)  # then silence
        for where, conn in conns.items():
            assert _closed_within(conn, FRAME_TIMEOUT + 10), f"stalled {where} never timed out"
    finally:
        for conn in conns.values():
            conn.finish()  # returns once the agent has closed (and so ended the lease)
    harness.assert_unharmed()


def test_lease_budget_is_enforced_and_returned_on_close(harness: Harness) -> None:
    conn = FuzzConn(harness.agent.socket_path)
    batch = 512  # pipelined in batches, so that neither side's socket buffer fills
    for start in range(0, MAX_LEASES_PER_CLIENT, batch):
        conn.send(b"".join(p.encode(p.Acquire(r, harness.bystander))
                           for r in range(start, start + batch)))
        for _ in range(batch):
            assert isinstance(conn.reply(), p.AcquireReply)
    for req in (p.Acquire(1, harness.bystander), p.Alloc(2, POOL_KEYS[0], 10)):
        reply = conn.call(req)
        assert isinstance(reply, p.ErrorReply) and reply.code == E.TOO_MANY_LEASES, reply
    assert harness.stats()["leases"]["read"] == MAX_LEASES_PER_CLIENT
    assert conn.finish() == []
    harness.assert_unharmed()


# --------------------------------------------------------------------------- tests: sequences


@dataclass(eq=False)
class ChunkModel:
    data: bytes
    meta: bytes
    checksum: int

    @property
    def pages(self) -> int:
        return -(-len(self.data) // PAGE_BYTES)


@dataclass
class WriteModel:
    key: bytes
    size: int
    meta: bytes
    extents: p.Extents


@dataclass
class ReadModel:
    chunk: ChunkModel
    extents: p.Extents


@dataclass
class ConnModel:
    conn: FuzzConn
    arena: mmap.mmap
    writes: dict[int, WriteModel] = field(default_factory=dict)
    reads: dict[int, ReadModel] = field(default_factory=dict)

    def bytes_at(self, extents: p.Extents) -> bytes:
        return b"".join(self.arena[o : o + n] for o, n in extents)


def _overlaps(a: p.Extents, b: p.Extents) -> bool:
    return any(o1 < o2 + n2 and o2 < o1 + n1 for o1, n1 in a for o2, n2 in b)


small_sizes = st.integers(1, 3 * PAGE_BYTES)
"""Chunk sizes the model stores: a whole example never comes near filling the arena, so
nothing is evicted and the model knows exactly what is stored."""


class AgentModel(RuleBasedStateMachine):
    """Two zero-copy connections driven through any sequence of ops, against a model."""

    write_leases = Bundle("write_leases")
    read_leases = Bundle("read_leases")

    def __init__(self, h: Harness) -> None:
        super().__init__()
        self.h = h
        self.conns: list[ConnModel | None] = [None, None]
        self.visible: dict[bytes, ChunkModel] = {}
        self.pins: set[bytes] = set()
        self.rid = 0

    # -- helpers

    def _connect(self, i: int) -> None:
        conn = FuzzConn(self.h.agent.socket_path, hello=False)
        conn.keep_fd = True
        reply = conn.call(p.Hello(self._rid(), p.PROTOCOL_VERSION, "fuzz"))
        assert isinstance(reply, p.HelloReply) and conn.arena_fd is not None
        arena = mmap.mmap(conn.arena_fd, reply.arena_bytes, flags=mmap.MAP_SHARED)
        conn.keep_fd = False
        self.conns[i] = ConnModel(conn, arena)

    def _conn(self, i: int) -> ConnModel:
        if self.conns[i] is None:
            self._connect(i)
        c = self.conns[i]
        assert c is not None
        return c

    def _rid(self) -> int:
        self.rid += 1
        return self.rid

    def _call(self, i: int, req: p.Request, expect: type[p.Reply] | p.ErrorCode) -> p.Reply:
        reply = self._conn(i).conn.call(req)
        if isinstance(expect, p.ErrorCode):
            assert isinstance(reply, p.ErrorReply) and reply.code == expect, (req, reply)
        else:
            assert type(reply) is expect, (req, reply)
        check_reply(req, reply, True, self.h.hello)
        return reply

    def _ended(self, i: int) -> None:
        """The connection is gone: the agent aborted its writes and released its reads."""
        c = self.conns[i]
        assert c is not None
        c.arena.close()
        c.conn.close()
        self.conns[i] = None

    def _live_extents(self) -> list[p.Extents]:
        return [e for c in self.conns if c is not None
                for e in [w.extents for w in c.writes.values()]
                + [r.extents for r in c.reads.values()]]

    def _expected_pages(self) -> int:
        chunks = {id(ch): ch for ch in self.visible.values()}
        writes = 0
        for c in self.conns:
            if c is not None:
                chunks.update((id(r.chunk), r.chunk) for r in c.reads.values())
                writes += sum(-(-w.size // PAGE_BYTES) for w in c.writes.values())
        return sum(ch.pages for ch in chunks.values()) + writes

    def _lease_owned(self, i: int, lease: int, kind: str) -> bool:
        c = self.conns[i]
        return c is not None and lease in (c.writes if kind == "write" else c.reads)

    # -- rules

    @initialize()
    def connect_both(self) -> None:
        self._connect(0)
        self._connect(1)

    @rule(i=st.integers(0, 1), key=st.sampled_from(POOL_KEYS),
          data=st.binary(min_size=1, max_size=2 * PAGE_BYTES), meta=st.binary(max_size=16))
    def put(self, i: int, key: bytes, data: bytes, meta: bytes) -> None:
        reply = self._call(i, p.Put(self._rid(), key, data, p.checksum(data, meta), meta),
                           p.PutReply)
        assert isinstance(reply, p.PutReply)
        assert reply.stored is (key not in self.visible), "first stored copy must win"
        if reply.stored:
            self.visible[key] = ChunkModel(data, meta, p.checksum(data, meta))

    @rule(i=st.integers(0, 1), key=keys, size=sizes, meta=metas, checksum=u64s)
    def put_invalid(self, i: int, key: bytes, size: int, meta: bytes, checksum: int) -> None:
        data = b"x" * max(0, min(size, MAX_CHUNK + 1))
        req = p.Put(self._rid(), key, data, checksum, meta)
        expected = argument_error(req, self.h.hello)
        if expected is None or len(p.encode(req)) - p.HEADER.size > self.h.limit:
            return  # valid after all (`put` covers those), or a frame the agent refuses
        self._call(i, req, expected)

    @rule(target=write_leases, i=st.integers(0, 1), key=st.sampled_from(POOL_KEYS),
          size=small_sizes, meta=st.binary(max_size=16))
    def alloc(self, i: int, key: bytes, size: int, meta: bytes) -> Any:
        reply = self._call(i, p.Alloc(self._rid(), key, size, meta), p.AllocReply)
        assert isinstance(reply, p.AllocReply)
        assert reply.exists is (key in self.visible)
        if reply.exists:
            return multiple()
        for other in self._live_extents():
            assert not _overlaps(reply.extents, other), "extents handed out twice"
        self._conn(i).writes[reply.lease] = WriteModel(key, size, meta, reply.extents)
        return (i, reply.lease)

    @rule(i=st.integers(0, 1), key=keys, size=sizes, meta=metas)
    def alloc_invalid(self, i: int, key: bytes, size: int, meta: bytes) -> None:
        req = p.Alloc(self._rid(), key, size, meta)
        expected = argument_error(req, self.h.hello)
        if expected is None:
            return  # valid, possibly huge: the model keeps the arena far from full
        self._call(i, req, expected)

    @rule(lease=consumes(write_leases), seed=st.integers(0, 2**32), good=st.booleans(),
          checksum=st.integers(0, U64))
    def write_and_commit(self, lease: tuple[int, int], seed: int, good: bool,
                         checksum: int) -> None:
        i, lid = lease
        if not self._lease_owned(i, lid, "write"):
            return self._unknown(i, p.Commit(self._rid(), lid, checksum))
        c = self._conn(i)
        w = c.writes.pop(lid)
        data = random.Random(seed).randbytes(w.size)
        pos = 0
        for o, n in w.extents:
            c.arena[o : o + n] = data[pos : pos + n]
            pos += n
        # COMMIT trusts the client's checksum (the agent never reads zero-copy bytes);
        # a wrong one is stored as sent: zero-copy readers get it and verify, an inline
        # GET is verified by the agent (a miss, see `get`).
        digest = p.checksum(data, w.meta) if good else checksum
        self._call(i, p.Commit(self._rid(), lid, digest), p.CommitReply)
        if w.key not in self.visible:  # else another copy was committed first and wins
            self.visible[w.key] = ChunkModel(data, w.meta, digest)

    @rule(lease=consumes(write_leases))
    def abort(self, lease: tuple[int, int]) -> None:
        i, lid = lease
        if not self._lease_owned(i, lid, "write"):
            return self._unknown(i, p.Abort(self._rid(), lid))
        self._conn(i).writes.pop(lid)
        self._call(i, p.Abort(self._rid(), lid), p.AbortReply)

    @rule(target=read_leases, i=st.integers(0, 1), key=st.sampled_from(POOL_KEYS))
    def acquire(self, i: int, key: bytes) -> Any:
        req = p.Acquire(self._rid(), key)
        chunk = self.visible.get(key)
        if chunk is None:
            self._call(i, req, E.NOT_FOUND)
            return multiple()
        reply = self._call(i, req, p.AcquireReply)
        assert isinstance(reply, p.AcquireReply)
        assert (reply.size, reply.checksum, reply.meta, reply.tier) == (
            len(chunk.data), chunk.checksum, chunk.meta, 2)
        c = self._conn(i)
        assert c.bytes_at(reply.extents) == chunk.data, "leased bytes are not the chunk's"
        for w in (w for cm in self.conns if cm is not None for w in cm.writes.values()):
            assert not _overlaps(reply.extents, w.extents), "a read lease on writable bytes"
        c.reads[reply.lease] = ReadModel(chunk, reply.extents)
        return (i, reply.lease)

    @precondition(lambda self: self.visible)
    @rule(target=read_leases, i=st.integers(0, 1), data=st.data())
    def acquire_a_stored_chunk(self, i: int, data: st.DataObject) -> Any:
        """Reads of what is stored: the cases where leases, DELETE and re-PUT meet."""
        return self.acquire(i, data.draw(st.sampled_from(sorted(self.visible))))

    @rule(lease=consumes(read_leases))
    def release(self, lease: tuple[int, int]) -> None:
        i, lid = lease
        if not self._lease_owned(i, lid, "read"):
            return self._unknown(i, p.Release(self._rid(), lid))
        c = self._conn(i)
        r = c.reads.pop(lid)
        # Never evicted, moved or freed while the lease was open, even if deleted.
        assert c.bytes_at(r.extents) == r.chunk.data, "bytes changed under a read lease"
        self._call(i, p.Release(self._rid(), lid), p.ReleaseReply)

    @rule(lease=st.one_of(write_leases, read_leases), other_conn=st.booleans(),
          op=st.sampled_from([p.Commit, p.Abort, p.Release]), checksum=st.integers(0, U64))
    def lease_op_on_a_lease_it_does_not_fit(self, lease: tuple[int, int], other_conn: bool,
                                            op: type[p.Request], checksum: int) -> None:
        """A lease of the other connection, of the other kind, or already ended."""
        i, lid = lease
        i = 1 - i if other_conn else i
        kind = "read" if op is p.Release else "write"
        if self._lease_owned(i, lid, kind):
            return
        req = p.Commit(self._rid(), lid, checksum) if op is p.Commit else op(self._rid(), lid)
        self._unknown(i, req)

    @rule(i=st.integers(0, 1), lid=lease_ids,
          op=st.sampled_from([p.Commit, p.Abort, p.Release]))
    def lease_op_on_a_random_lease(self, i: int, lid: int, op: type[p.Request]) -> None:
        kind = "read" if op is p.Release else "write"
        if not self._lease_owned(i, lid, kind):
            self._unknown(i, p.Commit(self._rid(), lid, 0) if op is p.Commit
                          else op(self._rid(), lid))

    def _unknown(self, i: int, req: p.Request) -> None:
        self._call(i, req, E.UNKNOWN_LEASE)

    @rule(i=st.integers(0, 1), key=st.sampled_from(POOL_KEYS))
    def get(self, i: int, key: bytes) -> None:
        req = p.Get(self._rid(), key)
        if key not in self.visible:
            self._call(i, req, E.NOT_FOUND)
        elif self.visible[key].checksum != p.checksum(self.visible[key].data,
                                                      self.visible[key].meta):
            # The agent verifies what it hands out by value: bytes that do not match their
            # checksum are a miss, never data, and the chunk is dropped (its pin stays, as
            # for a chunk evicted; a reader's lease keeps its bytes until it releases).
            self._call(i, req, E.NOT_FOUND)
            del self.visible[key]
        else:
            chunk = self.visible[key]
            reply = self._call(i, req, p.GetReply)
            assert isinstance(reply, p.GetReply)
            assert (reply.data, reply.meta, reply.checksum, reply.tier) == (
                chunk.data, chunk.meta, chunk.checksum, 2)

    @rule(i=st.integers(0, 1), key=st.sampled_from(POOL_KEYS))
    def delete(self, i: int, key: bytes) -> None:
        req = p.Delete(self._rid(), key)
        reply = self._call(i, req, p.DeleteReply)
        assert isinstance(reply, p.DeleteReply)
        assert reply.existed is (key in self.visible)
        self.visible.pop(key, None)  # a reader's lease keeps the bytes until it releases
        self.pins.discard(key)

    @rule(i=st.integers(0, 1), key=st.sampled_from(POOL_KEYS), unpin=st.booleans())
    def pin_or_unpin(self, i: int, key: bytes, unpin: bool) -> None:
        req = p.Unpin(self._rid(), key) if unpin else p.Pin(self._rid(), key)
        if unpin:
            self._call(i, req, p.UnpinReply)
            self.pins.discard(key)
        elif key in self.visible:
            self._call(i, req, p.PinReply)
            self.pins.add(key)
        else:
            self._call(i, req, E.NOT_FOUND)

    @rule(i=st.integers(0, 1), ks=st.lists(st.sampled_from(POOL_KEYS), max_size=6))
    def lookup(self, i: int, ks: list[bytes]) -> None:
        req = p.Lookup(self._rid(), ks)
        reply = self._call(i, req, p.LookupReply)
        assert isinstance(reply, p.LookupReply)
        count = 0
        while count < len(ks) and ks[count] in self.visible:
            count += 1
        assert (reply.count, reply.tiers) == (count, b"\x02" * count)

    @rule(i=st.integers(0, 1), key=bad_keys, op=st.sampled_from(
        [p.Acquire, p.Get, p.Delete, p.Pin, p.Unpin, p.Lookup, p.Alloc, p.Put]))
    def key_op_with_a_bad_key(self, i: int, key: bytes, op: type[p.Request]) -> None:
        """Any op on a key that is not 16 bytes is refused before it looks at anything."""
        rid = self._rid()
        req = (p.Lookup(rid, [POOL_KEYS[0], key]) if op is p.Lookup
               else p.Alloc(rid, key, 10) if op is p.Alloc
               else p.Put(rid, key, b"d", p.checksum(b"d")) if op is p.Put
               else op(rid, key))
        self._call(i, req, E.BAD_KEY)

    @rule(i=st.integers(0, 1))
    def stats_match_the_model(self, i: int) -> None:
        reply = self._call(i, p.Stats(self._rid()), p.StatsReply)
        assert isinstance(reply, p.StatsReply)
        s = reply.stats
        reads = sum(len(c.reads) for c in self.conns if c is not None)
        writes = sum(len(c.writes) for c in self.conns if c is not None)
        assert s["leases"] == {"read": reads, "write": writes}
        dram = s["tiers"]["dram"]
        assert dram["used_bytes"] == self.h.base_used + self._expected_pages() * PAGE_BYTES
        assert dram["chunks"] == self.h.base_chunks + len(self.visible)
        assert s["pins"] == self.h.base_pins + len(self.pins)

    @rule(i=st.integers(0, 1), version=versions)
    def hello_again(self, i: int, version: int) -> None:
        """A repeated HELLO is answered (with the fd again); a wrong version changes nothing."""
        req = p.Hello(self._rid(), version)
        self._call(i, req, p.HelloReply if version == p.PROTOCOL_VERSION
                   else E.VERSION_MISMATCH)

    @rule(i=st.integers(0, 1), body=request_bodies(), garbage=st.binary(max_size=16),
          kind=st.integers(0, 3))
    def bad_frame_closes_the_connection(self, i: int, body: tuple[bytes, bool],
                                        garbage: bytes, kind: int) -> None:
        c = self._conn(i)
        raw, well_typed = body
        if kind == 0:
            frames, code = frame(b"\xc1" + garbage), E.BAD_FRAME
        elif kind == 1:
            if well_typed:
                return
            # (a body past the frame limit is refused by its length before it is decoded)
            frames, code = frame(raw), E.FRAME_TOO_LARGE if len(raw) > self.h.limit \
                else E.BAD_FRAME
        elif kind == 2:
            frames, code = frame(msgspec.msgpack.encode([99, self._rid()])), E.UNKNOWN_OP
        else:
            frames, code = p.HEADER.pack(self.h.limit + 1), E.FRAME_TOO_LARGE
        c.conn.send(frames)
        reply = c.conn.reply()
        assert isinstance(reply, p.ErrorReply) and reply.code == code, reply
        assert c.conn.reply() is None, "the connection stayed open after a frame-level error"
        self._ended(i)

    @rule(i=st.integers(0, 1), cut=st.integers(0, 64))
    def hang_up(self, i: int, cut: int) -> None:
        """The client goes away, maybe in the middle of a frame: no reply, leases end."""
        c = self._conn(i)
        whole = p.encode(p.Alloc(self._rid(), POOL_KEYS[0], 100))
        c.conn.send(whole[: min(cut, len(whole) - 1)])
        assert c.conn.finish() == []
        self._ended(i)

    def teardown(self) -> None:
        for i, c in enumerate(self.conns):
            if c is not None:
                c.conn.finish()
                self._ended(i)
        self.h.assert_unharmed()


def test_op_sequences_match_a_model(harness: Harness) -> None:
    run_state_machine_as_test(lambda: AgentModel(harness), settings=budget(60))
