"""What each request op does: decode is done, call the connection's store, build the reply."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from types import CoroutineType
from typing import TYPE_CHECKING, Any

from .. import __version__
from .. import protocol as p
from ..config import AgentConfig
from ..events.identity import identity
from ..metrics import AgentMetrics
from ..store import TIER_CODE, WAIT, CommitRequest, OpError, Storing, snapshot

if TYPE_CHECKING:
    from ..store.peerreads import PeerRead
    from .connection import Connection
    from .space import Space

Handler = Callable[["Connection", Any], Any]


class Dispatcher:
    """The op table every connection of the agent shares, and the limits it answers with."""

    def __init__(self, config: AgentConfig, metrics: AgentMetrics,
                 clients: Callable[[Space], int]) -> None:
        self.metrics = metrics
        self.max_frame_bytes = config.max_chunk_bytes + config.max_meta_bytes + 4096
        self.tenants = tuple(t.name for t in config.tenants)
        """The tenants the agent has a space of (none: a pool without tenants)."""
        self.frame_timeout = config.frame_timeout
        """Longest a client may take to send the rest of a frame it started."""
        self.send_timeout = config.send_timeout
        """Longest a reply may wait for its client to read; then the client is dropped."""
        ev = config.events
        self.events: dict[str, Any] | None = None if not ev.enabled else {
            "address": ev.address, "port": ev.port, "replay_port": ev.replay_port,
            "topic": ev.topic.value, "payload": ev.payload.value}
        """Where KV events are published (STATS says it, for `kvpool events --socket`)."""
        self.memory_released = False
        """A connection gave back a large receive buffer since the last `trim_memory`."""
        self._clients = clients
        """Connections a space has now (STATS reports them)."""
        self.handlers: dict[p.Op, Handler] = {
            p.Op.LOOKUP: _lookup,
            p.Op.ALLOC: _alloc,
            p.Op.COMMIT: _commit,
            p.Op.ABORT: _abort,
            p.Op.ACQUIRE: _acquire,
            p.Op.RELEASE: _release,
            p.Op.PUT: _put,
            p.Op.GET: _get,
            p.Op.DELETE: lambda c, r: p.DeleteReply(r.rid, c.store.delete(r.key, r.local)),
            p.Op.PIN: _pin,
            p.Op.UNPIN: _unpin,
            p.Op.STATS: lambda c, r: p.StatsReply(r.rid, self.stats(c.space)),
            p.Op.READ: _read,
            p.Op.WAIT: _wait,
        }
        self.quick: dict[int, Callable[[Connection, Any], Any]] = {
            int(p.Op.ACQUIRE): _acquire_now,
            int(p.Op.RELEASE): _release,
            int(p.Op.ALLOC): _alloc_now,
            int(p.Op.WAIT): _wait_now,
            int(p.Op.READ): _read,
        }
        """Ops a connection may answer as their frames arrive, without waking its task
        (`Connection._quick`): each answers now, or says not now: None (the task answers
        it, with no effect had), or, an ACQUIRE or a WAIT a peer read under way keeps from
        an answer, that read (the connection holds the request until it settles,
        `Connection._hold`, instead of waking its task to wait)."""

    async def dispatch(self, conn: Connection, op: p.Op, req: Any) -> Any:
        """The reply to one request (an `OpError` for what the client did wrong)."""
        reply = self.handlers[op](conn, req)
        if isinstance(reply, CoroutineType):  # an `async def` handler's (`isawaitable`
            reply = await reply                # asks an ABC of every reply that is not)
        return reply

    def stats(self, space: Space) -> dict[str, Any]:
        """STATS of one space: a tenant sees its own chunks and clients, nobody else's."""
        out: dict[str, Any] = snapshot.stats_reply(space.store.snapshot(), space.config.pool)
        if space.isolated:
            out["tenant"] = space.tenant
        out["clients"] = self._clients(space)
        if space.store.peer is not None:
            out["peers"] = space.store.peer.links()
        if self.events is not None:
            out["events"] = self.events
            if space.events is not None:  # what a subscriber that missed nothing holds
                out["events"] = {**self.events, "announced": space.events.announced()}
        out["agent_version"] = __version__
        return out


async def _lookup(c: Connection, r: p.Lookup) -> p.LookupReply:
    count, tiers = await c.store.lookup(r.keys)
    if c.chunk_tokens:  # the prefill tokens served from the pool, per tier
        c.dispatcher.metrics.lookup_tokens(tiers, len(r.keys) - count, c.chunk_tokens)
    return p.LookupReply(r.rid, count, tiers)


async def _put(c: Connection, r: p.Put) -> p.PutReply:
    _check_hint(r.to)
    with _storing(c, r.key, r):
        return p.PutReply(r.rid, await c.store.put(r.key, r.data, r.checksum, r.meta,
                                                   c.tenant, r.to))


def _check_hint(to: str) -> None:
    """A hand-off hint names a node: refused (before anything is stored) past a name's
    length."""
    if len(to.encode()) > p.MAX_NODE_BYTES:
        raise OpError(p.ErrorCode.BAD_ARGUMENT,
                      f"hand-off hint 'to' of {len(to.encode())} bytes: a node name has at "
                      f"most {p.MAX_NODE_BYTES}")


async def _alloc(c: Connection, r: p.Alloc) -> p.AllocReply:
    _check_hint(r.to)
    granted = await c.store.alloc(r.key, r.size, r.meta, c.tenant, c.id, r.dma, r.to)
    if granted is None:
        return p.AllocReply(r.rid, 0, [], exists=True)
    return p.AllocReply(r.rid, granted.lease, granted.extents)


def _alloc_now(c: Connection, r: p.Alloc) -> p.AllocReply | None:
    """ALLOC answered at once (`_alloc` otherwise: its room is held by chunks on their way
    to NVMe, and it waits for them)."""
    _check_hint(r.to)
    granted = c.store.alloc_now(r.key, r.size, r.meta, c.tenant, c.id, r.dma, r.to)
    if granted is WAIT:
        return None
    if granted is None:
        return p.AllocReply(r.rid, 0, [], exists=True)
    return p.AllocReply(r.rid, granted.lease, granted.extents)


def _commit(c: Connection, r: p.Commit) -> p.CommitReply:
    refused = _commit_refused(c, r)
    if refused is not None:
        raise refused
    lease = c.store.dram.write_lease(r.lease)
    with _storing(c, (lease.key or r.key) if lease is not None else b"", r):
        stored = c.store.commit(r.lease, r.checksum, c.id, r.checksum_kind, r.key, r.meta,
                                r.to)
    return _committed(c, r, stored)


def commit_many(c: Connection, reqs: Sequence[p.Commit]) -> list[p.CommitReply | Exception]:
    """The replies to COMMITs that came together (a window's), in order; an exception is
    what that COMMIT's error reply says, the others unaffected. Their chunks are journaled
    in one write and made visible (`ChunkStore.commit_many`), then each one's spare lease
    (put-ahead) is granted."""
    refused = [_commit_refused(c, r) for r in reqs]
    asked = [r for r, e in zip(reqs, refused, strict=True) if e is None]
    storing: Storing | None = None
    if c.space.events is not None:  # what KV events say of each chunk stored
        storing = functools.partial(_storing_of, c, asked)
    results = iter(c.store.commit_many(
        [CommitRequest(r.lease, r.checksum, r.checksum_kind, r.key, r.meta, r.to)
         for r in asked], c.id, storing))
    out: list[p.CommitReply | Exception] = []
    for r, error in zip(reqs, refused, strict=True):
        stored = error if error is not None else next(results)
        out.append(stored if isinstance(stored, Exception) else _committed(c, r, stored))
    return out


def _committed(c: Connection, r: p.Commit, stored: bool) -> p.CommitReply:
    """The reply to a COMMIT whose lease was committed (`stored`: its chunk is the one
    kept), with a spare lease if it asked for one."""
    c.spares.discard(r.lease)
    reply = p.CommitReply(r.rid, stored)
    # The next put's lease, granted only after this one's chunk is in (best effort: none
    # when the connection holds its most spares or the arena has no room now).
    if r.next_size and len(c.spares) < p.MAX_SPARE_LEASES:
        spare = c.store.spare(r.next_size, c.tenant, c.id)
        if spare is not None:
            c.spares.add(spare.lease)
            reply.spare, reply.spare_extents = spare.lease, spare.extents
    return reply


def _commit_refused(c: Connection, r: p.Commit) -> OpError | None:
    """Why a COMMIT is refused before anything is done (its lease stays open), or None."""
    if not 0 <= r.next_size <= c.store.config.max_chunk_bytes:
        return OpError(p.ErrorCode.BAD_ARGUMENT,
                       f"next_size {r.next_size} is outside 0..{c.store.config.max_chunk_bytes}")
    try:
        _check_hint(r.to)
    except OpError as e:
        return e
    return None


def _storing_of(c: Connection, reqs: Sequence[p.Commit], i: int,
                key: bytes) -> contextlib.AbstractContextManager[None]:
    return _storing(c, key, reqs[i])


def _storing(c: Connection, key: bytes,
             r: p.Commit | p.Put) -> contextlib.AbstractContextManager[None]:
    """What KV events say of `key` if it is stored meanwhile: the blocks the client named."""
    events = c.space.events
    if events is None:
        return contextlib.nullcontext()
    return events.storing(key, identity(r.block_hashes, r.token_ids, r.parent_block_hash,
                                        c.block_size, c.model))


def _abort(c: Connection, r: p.Abort) -> p.AbortReply:
    c.store.abort(r.lease, c.id)
    c.spares.discard(r.lease)
    return p.AbortReply(r.rid)


def _release(c: Connection, r: p.Release) -> p.ReleaseReply:
    c.store.release(r.lease, c.id)
    return p.ReleaseReply(r.rid)


def _pin(c: Connection, r: p.Pin) -> p.PinReply:
    c.store.pin(r.key)
    return p.PinReply(r.rid)


def _unpin(c: Connection, r: p.Unpin) -> p.UnpinReply:
    c.store.unpin(r.key)
    return p.UnpinReply(r.rid)


async def _acquire(c: Connection, r: p.Acquire) -> p.AcquireReply:
    if c.out and c.store.waits(r.key):
        # The replies held back for one send (a window's ACQUIREs before this one) go
        # now, not after this chunk's read from a peer or NVMe: the client copies those
        # chunks meanwhile (`transport.read_window`).
        await c.flush()
    g = await c.store.acquire(r.key, c.id, r.dma)
    return p.AcquireReply(r.rid, g.lease, g.size, g.checksum, g.extents, g.meta, g.tier,
                          g.checksum_kind)


def _acquire_now(c: Connection, r: p.Acquire) -> p.AcquireReply | PeerRead | None:
    """ACQUIRE of a chunk in DRAM, answered at once; of a chunk a peer read is bringing,
    that read (answered as it lands); None otherwise (`_acquire`: a chunk to read from
    below waits for it, a miss may ask the shared tier)."""
    g = c.store.acquire_now(r.key, c.id, r.dma)
    if g is None:
        return c.store.landing(r.key)
    return p.AcquireReply(r.rid, g.lease, g.size, g.checksum, g.extents, g.meta, g.tier,
                          g.checksum_kind)


def _wait_now(c: Connection, r: p.Wait) -> p.WaitReply | PeerRead:
    """WAIT answered now: a key in DRAM before the first coming, or none coming; else the
    read of the first coming, whose settling may answer it (the reads it started are
    under way then, and not started again when it is asked again: `ChunkStore.landed`)."""
    codes, first = c.store.landed(r.keys)
    reply = _wait_reply(r, codes, first)
    if reply is not None:
        return reply
    assert first is not None  # (what `_wait_reply` waits for)
    return first


def _wait_reply(r: p.Wait, codes: bytes, first: PeerRead | None) -> p.WaitReply | None:
    """WAIT's reply for `ChunkStore.landed`'s answer, or None while it waits for `first`."""
    if first is not None and TIER_CODE["dram"] not in codes:
        return None
    return p.WaitReply(r.rid, codes)


async def _wait(c: Connection, r: p.Wait) -> p.WaitReply:
    if c.out:  # the replies before it go now, not after the landing it waits for
        await c.flush()
    while True:
        codes, first = c.store.landed(r.keys)
        reply = _wait_reply(r, codes, first)
        if reply is not None:
            return reply
        assert first is not None  # (what `_wait_reply` waits for)
        await first.wait()  # (each read settles within `peers.timeout`)


def _read(c: Connection, r: p.Read) -> p.ReadReply:
    c.store.read_told(r.keys)
    return p.ReadReply(r.rid)


async def _get(c: Connection, r: p.Get) -> p.GetReply:
    data, digest, meta, tier, kind = await c.store.get(r.key)
    return p.GetReply(r.rid, data, digest, meta, tier, kind)
