"""What an agent reads from one peer: its inventory (a subscription) and its chunks.

The subscription is an asyncio stream on the event loop: it feeds the directories (one
per tenant space) with the peer's inventory and changes, and drops the peer's entries
when it ends (a gap, the peer's restart, or silence past `DEAD_AFTER`: unreachable); the
next inventory brings them back. Reads are queued on the link (`fetch`, `fetch_many`) and
sent in pipelined batches: a worker thread takes up to `MAX_BATCH` queued reads
(`MAX_BATCH_BYTES`), sends their FETCHes in one write on one connection and receives the
replies in order, each chunk's bytes from the socket into the arena extents it will be
served from, checksummed as they pass. At most `peers.connections` batches (so
connections) are under way to a peer at once; what waits meanwhile queues, and joins the
next batch (the backpressure: the reader only asks for what it has reserved room for, and
the holder answers a connection's FETCHes one at a time). Every wait on a socket is
bounded by what is left of the read's deadline.

Into the arena without this process ever touching its mapping (a client may shrink the
file under the agent: a page past the end touched here would be SIGBUS): `recv_into` one
buffer of a copy block per worker thread (`chunkblocks`), checksummed there while in cache,
then `Arena.write_run` (the kernel's copy into the mapping, process_vm_writev: a page past a
shrunk file is EFAULT, not SIGBUS; pwrite where that is not allowed). One pass: no
read-back to verify, never a `bytes` of the chunk. (Splicing socket to pipe to arena
file moved the bytes without entering this process, but its read-back for the checksum
cost a quarter of a 16 MiB read: docs/benchmarks.md, "The peer tier between two nodes".)
On plain TCP into a mapped arena the same steps, the reply's head included, are one
compiled call that never takes the GIL (`recvkernel`); the thread takes it once a chunk,
to compare the checksum and settle the read. Into an arena under the SIGBUS guard
(`busguard`, `ArenaTarget.guard`) that call receives each piece straight into the
mapping and takes the checksum there: one copy instead of two.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import socket
import ssl
import struct
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

from .. import checksums
from ..chunkblocks import COPY_BLOCK, blocks
from . import auth, recvkernel, wire
from .credentials import Credentials
from .deletelog import DeleteLog, Item, Waiting
from .directory import PeerDirectory
from .linkrate import LinkRate
from .metrics import PeerMetrics
from .settle import Settler, Target

log = logging.getLogger(__name__)

DEAD_AFTER = 10.0
"""Seconds of silence on a subscription (heartbeats come every half second) after which
the peer counts as unreachable: its entries are dropped."""
SILENCE_SLACK = 0.5
"""Seconds past `DEAD_AFTER` a silent peer may go unnoticed (the deadline is moved on at
most this often)."""
RETRY_MIN, RETRY_MAX = 0.2, 2.0
"""Seconds between attempts to reach a peer, doubling."""
SUSPECT_SECONDS = 30.0
"""A peer that served bytes failing their checksum is not read from for this long."""
SLOW_SECONDS = 5.0
"""A peer whose read timed out is not read from for this long: the reads after it (the
rest of a window, the next prompt's) go to the shared tier or miss at once, where each
waited `peers.timeout` for the same peer."""
MAX_BATCH = 32
"""Most reads one batch (one connection's write of FETCHes) takes."""
MAX_BATCH_BYTES = 32 << 20
"""Most chunk bytes one batch takes (at least one read, whatever its size)."""
PUSH_TIMEOUT = 10.0
"""Seconds a hand-off push may take, the receiver's read of the chunk included (that
read's own limit is `PUSH_READ_TIMEOUT`: a push is not on a reader's path, so it gets
longer than `peers.timeout`)."""
PUSH_READ_TIMEOUT = 8.0
MAX_PENDING_DELETES = 1 << 16
"""DELETEs waiting for one peer (unreachable, or not answered yet); past it the oldest is
dropped (counted, logged)."""
REFUSED_KEEP = 600.0
"""Seconds a DELETE the peer refused (it does not follow this agent yet) waits for the
peer's subscription to this agent, which sends it again; past it, dropped (counted,
logged)."""
MAX_DELETE_BATCH = 256
"""DELETEs sent in one write."""
_buffers = threading.local()


def _buffer() -> memoryview:
    """This worker thread's buffer of one copy block (`COPY_BLOCK`), that chunks are
    received through (made once: a fresh one per read would zero a MiB each time)."""
    buf: memoryview | None = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = memoryview(bytearray(COPY_BLOCK))
    return buf


@dataclass(frozen=True, slots=True)
class ArenaTarget:
    """Where a read puts a chunk: arena extents, written through the arena's file."""

    fd: int
    extents: list[tuple[int, int]]
    write: Callable[[int, memoryview], None]
    """`Arena.write_run`: the bytes at an offset go in through it."""
    mapped: int = 0
    """The address of the arena's mapping where `write` copies into it through the kernel
    (`Arena.mapped_writes`): a compiled receive writes there the same way
    (`recvkernel`); 0 where it does not (pwrite)."""
    guard: int = 0
    """The SIGBUS guard's counts where the mapping may be read under it
    (`Arena.guard_counts`): a compiled receive then receives straight into the mapping and
    hashes the bytes there; 0 where not."""
    repair: Callable[[], None] | None = None
    """`Arena.repair`, with `guard`: the mapping made whole again after a fault the guard
    answered."""

    @property
    def room(self) -> int:
        return sum(n for _, n in self.extents)

    def first(self, size: int) -> list[tuple[int, int]]:
        """The extents' first `size` bytes."""
        out, left = [], size
        for offset, n in self.extents:
            if left <= 0:
                break
            out.append((offset, min(n, left)))
            left -= n
        return out


class SelfPeer(Exception):
    """The address is this agent's own (a discovery name resolves to every agent)."""


@dataclass(frozen=True, slots=True)
class Fetched:
    size: int
    checksum: int
    kind: int
    meta: bytes
    tenant: str


ABSENT = "absent"
FAILED = "error"
TIMEOUT = "timeout"
CORRUPT = "corrupt"
STORED = "ok"
HELD = "held"
REFUSED = "refused"
AUTH = "auth"
UNREACHABLE = "unreachable"
_PUSH_STATUS = {wire.PUSH_STORED: STORED, wire.PUSH_HELD: HELD, wire.PUSH_REFUSED: REFUSED,
                wire.PUSH_FAILED: FAILED}


@dataclass(slots=True)
class _Want:
    """A queued read: where its bytes go, its deadline, and the future its result settles."""

    tenant: str
    key: bytes
    target: ArenaTarget
    deadline: float
    done: Target[Fetched | str]
    """The future its result settles, or the callback the event loop calls with it."""
    settler: Settler[Fetched | str]
    queued: float = field(default_factory=time.monotonic)
    settled: bool = False
    """Its result was handed over (`PeerLink._settle`): a callback is called once."""
    ends: bool = False
    """The last read of its batch: no read queued after it joins that batch (`alone`)."""


class PeerLink:
    def __init__(self, index: int, host: str, port: int, *, credentials: Credentials,
                 agent_id: bytes, connections: int, directories: dict[str, PeerDirectory],
                 metrics: PeerMetrics) -> None:
        self.index = index
        self.host, self.port = host, port
        self.name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.credentials = credentials
        self.agent_id = agent_id
        self.directories = directories
        self.m = metrics
        self.synced = False
        """The peer's whole inventory is in the directories."""
        self.is_self = False
        self.closed = False
        self.failing = False
        """The last attempt to follow the peer failed (logged once until it works again)."""
        self.unreachable = False
        """The last attempt to follow the peer found no one there (no connection, or it
        ended, or fell silent), or failed its TLS handshake: a push to it is not tried
        meanwhile."""
        self.handshake_refused = False
        """The last attempt to follow the peer failed its handshake (`_refused`)."""
        self.last_heard = 0.0
        self.lag = 0.0
        """Seconds between the last stream message's sending and its arrival."""
        self.suspect_until = 0.0
        self.slow_until = 0.0
        """Not read from before these (monotonic): bytes that failed their checksum,
        a read that timed out while the peer answered nothing."""
        self.rate = LinkRate()
        """What the link delivers, measured by the batches: what a batch may ask for
        (`PeerReads._peer_unread`), and whether a timeout was the peer's or the link's."""
        self._slow_link_logged = 0.0
        self.on_change: Callable[[], None] | None = None
        """Called (from any thread) when `readable` may have changed, but for the end of
        a suspect or slow period (whoever publishes it times that, `unreadable_until`)."""
        self.node = ""
        """The peer's node name, as its inventory stream says it (what push hints name);
        kept when the stream ends: a node that goes down is still known by its name."""
        self.on_node: Callable[[PeerLink], None] | None = None
        """Called as the peer's stream first names its node (or another one), before the
        inventory's held ADDs are listed: the DELETEs waiting for that node go to this
        link (`PeerNetwork`, `awaynodes`)."""
        self.away: Counter[Item] = Counter()
        """The DELETEs waiting for nodes away (`AwayNodes.items`): until its node is known,
        the peer may be one of them, so its inventory's ADDs of these keys are held
        (`_held`), not listed, and listed at SYNCED unless a DELETE then waits for them."""
        self._held: list[tuple[str, bytes, int]] = []
        """ADDs of the inventory held until the node is known: (tenant, key, size)."""
        self.peer_id = b""
        """The peer's agent id, from the last handshake with it (who a push offer is from)."""
        self.connections = connections
        self._wants: deque[_Want] = deque()
        self._pumps = 0
        """Worker threads sending batches to the peer now (at most `connections`)."""
        self._idle: list[socket.socket] = []
        self._busy: set[socket.socket] = set()
        """Connections a worker has checked out (`close` shuts them down)."""
        self._proven: weakref.WeakKeyDictionary[socket.socket, bytes] = \
            weakref.WeakKeyDictionary()
        """The secret each connection of the pool proved (`end_stale`, `_checkin`)."""
        self._following: tuple[asyncio.StreamWriter, bytes] | None = None
        """The subscription's connection while it is up, and the secret it proved."""
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._settler: Settler[Fetched | str] | None = None
        """How workers hand read results to the event loop (made at the first read)."""
        recvkernel.compile_soon()  # reads go the Python way until it is compiled
        self.task: asyncio.Task[None] | None = None
        self.deletes: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        """DELETEs (tenant, key) made on this node, or on another one while this peer was
        unreachable from here, not yet delivered to the peer: sent as soon as it is
        reachable, and before this agent takes its inventory again (`run`), so a peer that
        was down never has this agent read a deleted chunk from it."""
        self.refused: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        """DELETEs the peer refused, until when (monotonic) each waits: a peer takes a
        DELETE only from an agent it follows, and one that has not subscribed to this
        agent yet (just started, this agent just restarted, or it cannot reach this one)
        refuses it. Its subscription (`followed`) sends them again; past `REFUSED_KEEP`
        they are dropped (counted, logged)."""
        self.follows = 0
        """Subscriptions of the peer to this agent seen (`followed`): a refusal answered to
        a DELETE sent before the last one is sent again at once, not held."""
        self.refused_dropped = False
        """A drop of a refused DELETE was logged (once until the peer takes one)."""
        self.taken: Counter[Item] = Counter()
        """DELETEs out of `deletes` in a batch on its way to the peer (a rewrite of `log`
        keeps them)."""
        self.log: DeleteLog | None = None
        """Where the DELETEs waiting for the peer are kept on file (`deletelog`: a restart
        sends them), None where the agent has no state directory. `queue_delete`'s caller
        records the DELETEs it queues; the link records what else changes."""

    @property
    def readable(self) -> bool:
        return not self.closed and not self.is_self \
            and time.monotonic() >= self.unreadable_until

    @property
    def unreadable_until(self) -> float:
        return max(self.suspect_until, self.slow_until)

    def state(self, now: float) -> tuple[str, float]:
        """What the link is now, for STATS, and for how many more seconds where that ends
        by itself: `refused` (its handshake failed: the pool's secret, or TLS),
        `unreachable` (no one answers at its address, or its stream ended: its chunks are
        not listed), `syncing` (its inventory is not all in yet),
        `suspect` (it served bytes that failed their checksum), `slow` (a read timed out
        while it answered nothing), else `ok`."""
        if self.handshake_refused:
            return "refused", 0.0
        if self.unreachable:
            return "unreachable", 0.0
        if not self.synced:
            return "syncing", 0.0
        if self.suspect_until > now:
            return "suspect", self.suspect_until - now
        if self.slow_until > now:
            return "slow", self.slow_until - now
        return "ok", 0.0

    def mark_suspect(self) -> None:
        self.suspect_until = time.monotonic() + SUSPECT_SECONDS
        self._changed()
        self.m.suspect.labels(self.m.pool, self.name).inc()
        log.error("peer %s served a chunk that failed its checksum: not read from for %g s",
                  self.name, SUSPECT_SECONDS)

    def mark_slow(self) -> None:
        """A read timed out (a worker thread): no read of this peer for `SLOW_SECONDS`."""
        was = self.readable
        self.slow_until = time.monotonic() + SLOW_SECONDS
        self._changed()
        if was:
            log.warning("peer %s: a read took longer than peers.timeout: not read from for "
                        "%g s", self.name, SLOW_SECONDS)

    def _measured(self, nbytes: int, sent: float, short: bool = False) -> None:
        """A batch's replies of `nbytes` came whole since its write at `sent` (`short`: then
        its deadline passed): the link's speed (`LinkRate`) and its gauge follow."""
        if nbytes:
            self.rate.measured(nbytes, time.monotonic() - sent, short)
            self.m.link_rate(self.name, self.rate.bytes_per_second or 0.0)

    def _slow_link(self) -> None:
        """A read timed out while the peer's other replies kept coming: the link is slower
        than its batches (the next ones are sized to it, `LinkRate`), the peer is not
        stopped: it stays readable. Logged at most once per `SLOW_SECONDS`."""
        now = time.monotonic()
        if now - self._slow_link_logged >= SLOW_SECONDS:
            self._slow_link_logged = now
            rate = self.rate.bytes_per_second or 0.0
            log.warning("peer %s: reads timed out on a slow link (%.0f MB/s measured): "
                        "the next batches are sized to it", self.name, rate / 1e6)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- the subscription (event loop)

    async def run(self) -> None:
        backoff = RETRY_MIN
        while not self.closed:
            writer: asyncio.StreamWriter | None = None
            try:
                tls = self.credentials.client_tls
                reader, opened = await asyncio.wait_for(asyncio.open_connection(
                    self.host, self.port, ssl=tls,
                    server_hostname=self.host if tls else None), DEAD_AFTER)
                writer = opened
                self.unreachable = False
                secret = await asyncio.wait_for(self._handshake(reader, opened), DEAD_AFTER)
                self._following = opened, secret
                self.handshake_refused = False
                while self.deletes:  # before its inventory: it must not list them
                    await asyncio.wait_for(self._deliver(reader, opened), DEAD_AFTER)
                opened.write(wire.encode_request(wire.OP_SUBSCRIBE, 0, bytes(16), ""))
                await self._follow(reader)
            except SelfPeer:
                self.is_self = True
                self._changed()
                log.info("peer address %s is this agent: not followed", self.name)
                return
            except auth.AuthError as e:
                self.m.auth_failures.inc()
                self._refused(str(e))
            except wire.WireError as e:
                self.m.protocol_errors.inc()
                log.warning("peer %s broke the protocol: %s", self.name, e)
            except ssl.SSLError as e:  # (its handshake: a certificate of another CA...)
                self._refused(f"TLS: {e}")
                self.failing = self.unreachable = True  # (no push is tried meanwhile)
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                self.handshake_refused = False
                if not self.failing:  # once per outage, not at every retry
                    log.warning("peer %s unreachable: %s", self.name,
                                str(e) or type(e).__name__)
                self.failing = self.unreachable = True
            finally:
                self._following = None
                if writer is not None:
                    writer.close()
                if self.synced or self.last_heard:
                    backoff = RETRY_MIN
                self._forget()
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, RETRY_MAX)

    def _refused(self, why: str) -> None:
        """The peer's handshake failed: it does not hold the pool's secret this agent
        accepts (a rotation one of them has not taken yet), or its certificate is not of
        the pool's CA. Logged once until a handshake works again."""
        if not self.handshake_refused:
            log.warning("peer %s refused: %s", self.name, why)
        self.handshake_refused = True

    def _forget(self) -> None:
        """The subscription ended: the peer's entries go until its inventory is back, and so
        do the idle connections to it (to a peer that restarted or went away, each would
        fail the next batch taken on it: a push batch is not retried)."""
        self.synced = False
        self.last_heard = 0.0
        self._held = []  # (an inventory cut short: the next one says it again)
        for d in self.directories.values():
            d.drop_peer(self.index)
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            with contextlib.suppress(OSError):
                s.close()

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> bytes:
        """Prove the pool's secret to the peer; the secret proved."""
        mine = auth.nonce()
        writer.write(auth.hello(self.agent_id, mine))
        theirs = await reader.readexactly(wire.HELLO.size + wire.PROOF_BYTES)
        secret, answer = self._answer(theirs, mine)
        writer.write(answer)
        if await reader.readexactly(1) != wire.ACCEPTED:
            raise auth.AuthError("the peer did not accept this agent's proof")
        return secret

    def _answer(self, theirs: bytes, mine: bytes) -> tuple[bytes, bytes]:
        """The secret the server's HELLO and proof `theirs` proved (one this agent accepts:
        the current, or during a rotation's grace the previous), and the client proof
        made with it."""
        server_id, server_nonce = auth.parse_hello(theirs[: wire.HELLO.size])
        if server_id == self.agent_id:
            raise SelfPeer
        self.peer_id = server_id
        secret = auth.proved(self.credentials.accepted(), b"server", mine, server_nonce,
                             self.agent_id, server_id, theirs[wire.HELLO.size:])
        return secret, auth.proof(secret, b"client", mine, server_nonce, self.agent_id,
                                  server_id)

    def end_stale(self) -> int:
        """End the connections to the peer proven with a secret no longer accepted (a
        rotation's grace is over): the idle ones now, the busy ones as they come back,
        the subscription (made again at once, with the secret accepted now); how many
        ended now."""
        stale: list[socket.socket] = []
        with self._lock:
            kept: list[socket.socket] = []
            for sock in self._idle:
                (stale if self._stale(sock) else kept).append(sock)
            self._idle = kept
        for sock in stale:
            with contextlib.suppress(OSError):
                sock.close()
        following = self._following
        if following is not None and self.credentials.stale(following[1]):
            following[0].transport.abort()
            return len(stale) + 1
        return len(stale)

    def _stale(self, sock: socket.socket) -> bool:
        """Whether a connection of the pool was proven with a secret no longer accepted."""
        return self.credentials.stale(self._proven.get(sock, b""))

    def queue_delete(self, tenant: str, key: bytes) -> None:
        """Queue a DELETE of `key` in `tenant`'s space for the peer (bounded)."""
        self.deletes[(tenant, key)] = None
        self.deletes.move_to_end((tenant, key))
        if len(self.deletes) > MAX_PENDING_DELETES:
            self._gone([self.deletes.popitem(last=False)[0]])
            self.m.deleted(self.name, "sent", "dropped")
            if not self.failing:
                log.warning("peer %s: more than %d deletes wait for it: the oldest dropped",
                            self.name, MAX_PENDING_DELETES)

    def take_deletes(self) -> list[tuple[str, bytes]]:
        """The next batch of queued DELETEs, out of the queue (`requeue` what fails)."""
        batch: list[tuple[str, bytes]] = []
        while self.deletes and len(batch) < MAX_DELETE_BATCH:
            batch.append(self.deletes.popitem(last=False)[0])
        self.taken.update(batch)
        return batch

    def _untake(self, batch: list[Item]) -> None:
        """`batch`'s DELETEs are back from their way to the peer."""
        self.taken.subtract(batch)
        for item in batch:
            if self.taken[item] <= 0:
                del self.taken[item]

    def _gone(self, items: list[Item]) -> None:
        if self.log is not None:
            self.log.gone(self.name, items)

    def delivered(self, items: list[Item]) -> None:
        """DELETEs the peer answered (deleted, or held no copy): they wait no more."""
        self._untake(items)
        self._gone(items)

    def answered(self, batch: list[Item], left: list[Item], refused: list[Item],
                 follows: int) -> None:
        """A batch sent while the peer's subscriptions seen were `follows`: its last `left`
        not delivered (first in line again), `refused` ones held (`hold_refused`), the
        others delivered."""
        refusing = set(refused)
        self.delivered([i for i in batch[: len(batch) - len(left)] if i not in refusing])
        if refused:
            self.hold_refused(refused, follows)
        if left:
            self.requeue(left)

    def requeue(self, batch: list[tuple[str, bytes]]) -> None:
        """DELETEs not delivered: first in line again (a newer one of a key stays)."""
        self._untake(batch)
        for item in reversed(batch):
            if item not in self.deletes:
                self.deletes[item] = None
                self.deletes.move_to_end(item, last=False)

    def _count_delete(self, status: int) -> bool:
        """Count a DELETE's answer; whether the peer refused it."""
        self.m.deleted(self.name, "sent", {wire.DELETED: "ok", wire.NOT_HELD: "absent"}.get(
            status, "refused"))
        return status == wire.DELETE_REFUSED

    def hold_refused(self, batch: list[tuple[str, bytes]], follows: int) -> bool:
        """DELETEs the peer refused, sent when its subscriptions seen were `follows`: held
        for its next subscription (bounded in number and time), or queued again at once
        where it subscribed meanwhile (whether they were). Event loop only."""
        if self.follows != follows:
            self.requeue(batch)
            return True
        self._untake(batch)
        until = time.monotonic() + REFUSED_KEEP
        held = []
        for item in batch:
            if item in self.deletes:
                continue  # made again meanwhile: it goes with the queue
            self.refused[item] = until
            self.refused.move_to_end(item)
            held.append(item)
        if self.log is not None:  # (on file with the wall-clock time it is dropped at)
            self.log.wait_each(self.name, held, time.time() + REFUSED_KEEP)
        while len(self.refused) > MAX_PENDING_DELETES:
            self._drop_refused(f"more than {MAX_PENDING_DELETES} refused deletes wait "
                               "for it to follow this agent: the oldest dropped")
        return False

    def followed(self) -> bool:
        """The peer subscribed to this agent, so it takes this agent's DELETEs now: the ones
        it refused are queued again (whether there were any). Event loop only."""
        self.follows += 1
        held = list(self.refused)
        self.refused.clear()
        self.requeue(held)
        if self.log is not None:  # no longer dropped at a time: until delivered
            self.log.wait_each(self.name, held)
        return bool(held)

    def expire_refused(self, now: float) -> None:
        """Drop the refused DELETEs that waited `REFUSED_KEEP` for the peer to follow."""
        while self.refused and next(iter(self.refused.values())) <= now:
            self._drop_refused(f"deletes it refused did not go for {REFUSED_KEEP:g} s (it "
                               "does not follow this agent): dropped")

    def _drop_refused(self, why: str) -> None:
        """Drop the oldest refused DELETE (counted, logged once)."""
        self._gone([self.refused.popitem(last=False)[0]])
        self.m.deleted(self.name, "sent", "dropped")
        if not self.refused_dropped:  # once until it takes a DELETE again
            self.refused_dropped = True
            log.warning("peer %s: %s", self.name, why)

    async def _deliver(self, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        """Send a batch of queued DELETEs on the subscription's connection, before its
        SUBSCRIBE, and read their answers."""
        batch = self.take_deletes()
        follows = self.follows
        refused: list[tuple[str, bytes]] = []
        delivered: list[Item] = []
        try:
            rids = [next(self._rids) & 0xFFFFFFFF for _ in batch]
            writer.write(b"".join(wire.encode_request(wire.OP_DELETE, rid, key, tenant)
                                  for rid, (tenant, key) in zip(rids, batch, strict=True)))
            for rid in rids:
                status, mlen, got = wire.push_reply_head(
                    await reader.readexactly(wire.DELETE_REPLY.size), wire.DELETE_STATUSES)
                await reader.readexactly(mlen)
                if got != rid:
                    raise wire.WireError(f"reply to request {got}, expected {rid}")
                if self._count_delete(status):
                    refused.append(batch[0])
                else:
                    delivered.append(batch[0])
                    self.refused_dropped = False
                batch = batch[1:]
        except BaseException:
            self.requeue(batch)
            raise
        finally:  # (queued again where the peer subscribed meanwhile: `run` sends them)
            self.delivered(delivered)
            if refused:
                self.hold_refused(refused, follows)

    def delete_many(self, batch: list[tuple[str, bytes]], deadline: float,
                    ) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
        """Send DELETEs of (tenant, key) to the peer in one write and read the answers (a
        worker thread): (the ones not delivered: no connection, no answer; the ones the
        peer refused, for `hold_refused`)."""
        refused: list[tuple[str, bytes]] = []
        try:
            sock = self._checkout(deadline)
        except (OSError, auth.AuthError, ssl.SSLError, wire.WireError):
            return batch, refused
        keep = False
        done = 0
        try:
            rids = [next(self._rids) & 0xFFFFFFFF for _ in batch]
            _bounded(sock, deadline)
            sock.sendall(b"".join(wire.encode_request(wire.OP_DELETE, rid, key, tenant)
                                  for rid, (tenant, key) in zip(rids, batch, strict=True)))
            for rid in rids:
                status, mlen, got = wire.push_reply_head(
                    _recv_exact(sock, wire.DELETE_REPLY.size, deadline), wire.DELETE_STATUSES)
                _recv_exact(sock, mlen, deadline)
                if got != rid:
                    raise wire.WireError(f"reply to request {got}, expected {rid}")
                if self._count_delete(status):
                    refused.append(batch[done])
                else:
                    self.refused_dropped = False
                done += 1
            keep = True
        except (OSError, wire.WireError, ssl.SSLError) as e:  # TimeoutError is an OSError
            log.warning("peer %s: deletes not delivered (tried again): %s", self.name,
                        str(e) or type(e).__name__)
        finally:
            self._checkin(sock, keep)
        return batch[done:], refused

    async def _follow(self, reader: asyncio.StreamReader) -> None:
        # One deadline for the whole stream, moved on as messages come (at most every
        # `SILENCE_SLACK` seconds, so a peer is cut after between `DEAD_AFTER` and that
        # much more of silence): a `wait_for` per message was a task per message, and
        # a reader of 1 MiB chunks sends its holder a message for nearly every one.
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(DEAD_AFTER + SILENCE_SLACK) as silence:
            while True:
                await self._message(reader)
                now = loop.time()
                if (silence.when() or now) - now < DEAD_AFTER:
                    silence.reschedule(now + DEAD_AFTER + SILENCE_SLACK)

    async def _message(self, reader: asyncio.StreamReader) -> None:
        """One message of the peer's inventory stream, into the directories."""
        head = await reader.readexactly(wire.STREAM.size)
        msg, tlen, count, sent_at = wire.stream_head(head)
        rest = await reader.readexactly(tlen + count * wire.RECORD.size)  # one wait, not two
        tenant = rest[:tlen].decode(errors="replace") if tlen else ""
        body = rest[tlen:] if tlen else rest
        self.last_heard = time.monotonic()
        self.lag = max(0.0, time.time() - sent_at)
        d = self.directories.get(tenant)  # a space this agent lacks: nothing to keep
        if msg == wire.BEGIN:
            if d is not None:
                d.drop_peer(self.index)
            self.m.resyncs.labels(self.m.pool, self.name).inc()
        elif msg == wire.ADD and d is not None:
            waiting = bool(self.refused or self.deletes)
            away = self.away if self.away and not self.node else None
            for key, size in wire.records(body):
                if waiting and self._deleting((tenant, key)):
                    continue  # a copy the peer is to delete (a DELETE it refused, or not
                    # sent yet): never listed, so never read (its REMOVE follows the DELETE)
                if away is not None and (tenant, key) in away:
                    self._held.append((tenant, key, size))  # (an away node's, maybe)
                    continue
                d.add(key, self.index, size)
        elif msg == wire.REMOVE and d is not None:
            for key, _ in wire.records(body):
                d.remove(key, self.index)
        elif msg == wire.SYNCED:
            if tenant and tenant != self.node:  # its node name (an older agent sends none)
                self.node = tenant
                if self.log is not None:
                    self.log.set_node(self.name, tenant)
                if self.on_node is not None:
                    self.on_node(self)
            self._list_held()
            self.synced = True
            self.failing = False
            log.info("peer %s: inventory received", self.name)
        for held in self.directories.values():
            if held.holding:  # ADDs held off after a DELETE, listed as their holdoffs end
                held.release()

    def _list_held(self) -> None:
        """List the inventory's held ADDs but those a DELETE now waits for (an away
        node's, this peer's node: `on_node` queued them)."""
        held, self._held = self._held, []
        for tenant, key, size in held:
            d = self.directories.get(tenant)
            if d is not None and not self._deleting((tenant, key)):
                d.add(key, self.index, size)

    def _deleting(self, item: Item) -> bool:
        """A DELETE of `item` waits for the peer (queued, or refused): its copy is never
        listed."""
        return item in self.deletes or item in self.refused

    def waiting(self) -> Waiting:
        """Every DELETE waiting for the peer (queued, on their way, refused), oldest first
        by kind, each with the wall-clock time it is dropped at (a refused one's) or 0."""
        out: Waiting = OrderedDict((item, 0.0) for item in (*self.taken, *self.deletes))
        wall, now = time.time(), time.monotonic()
        for item, until in self.refused.items():
            out[item] = wall + (until - now)
        return out

    # -- reads: queued on the event loop, sent in batches by worker threads

    def fetch_many(self, reads: list[tuple[str, bytes, ArenaTarget]], deadline: float,
                   executor: Executor,
                   then: list[Callable[[Fetched | str], None]] | None = None,
                   alone: bool = False) -> list[asyncio.Future[Fetched | str]]:
        """Queue reads of (tenant, key, target): each future settles with the chunk
        received into its target's arena extents and verified, or why not (ABSENT,
        FAILED, TIMEOUT, CORRUPT), by `deadline` (monotonic) at the latest. Reads queued
        together go out together (one batch, while within its caps). `then`: a callback
        per read instead, which the event loop calls with its result (once, never inline),
        and no futures are made (none returned). `alone`: these reads are a batch of their
        own, which no read queued after them joins (they go out while the reads after
        them are still being prepared: `spare`)."""
        loop = asyncio.get_running_loop()
        settler = self._settler
        if settler is None or settler.loop is not loop:
            if settler is not None:
                settler.close()
            settler = self._settler = Settler(loop)
        if then is None:
            futures = [loop.create_future() for _ in reads]
            wants = [_Want(t, k, target, deadline, fut, settler)
                     for (t, k, target), fut in zip(reads, futures, strict=True)]
        else:
            futures = []
            wants = [_Want(t, k, target, deadline, call, settler)
                     for (t, k, target), call in zip(reads, then, strict=True)]
        if alone and wants:
            wants[-1].ends = True
        with self._lock:
            self._wants.extend(wants)
            pumps = min(self.connections - self._pumps, len(self._wants))
            self._pumps += max(0, pumps)
        for _ in range(pumps):
            try:
                executor.submit(self._pump)
            except RuntimeError:  # the executor is shut down: the agent is stopping
                with self._lock:
                    self._pumps -= 1
                    left, self._wants = list(self._wants), deque()
                for w in left:
                    self._settle(w, FAILED)
        return futures

    def spare(self) -> int:
        """Connections that no batch uses now (of `connections`): how many batches more
        would go out at once."""
        with self._lock:
            return self.connections - self._pumps

    async def fetch(self, tenant: str, key: bytes, target: ArenaTarget, deadline: float,
                    executor: Executor) -> Fetched | str:
        return await self.fetch_many([(tenant, key, target)], deadline, executor)[0]

    def _pump(self) -> None:
        """A worker thread: batches of queued reads, one after the other, until none is
        left."""
        while True:
            with self._lock:
                batch = self._take()
                if not batch:
                    self._pumps -= 1
                    return
            try:
                self._batch(batch)
            except BaseException:  # every read is settled whatever happens
                for w in batch:
                    self._settle(w, FAILED)
                raise

    def _take(self) -> list[_Want]:
        """The next batch: queued reads in order, within the caps; reads past their
        deadline settled as timed out instead (under the lock)."""
        batch: list[_Want] = []
        total = 0
        now = time.monotonic()
        while self._wants and len(batch) < MAX_BATCH:
            w = self._wants[0]
            if w.deadline <= now or self.closed:
                self._wants.popleft()
                self._settle(w, TIMEOUT if w.deadline <= now else FAILED)
                continue
            if batch and total + w.target.room > MAX_BATCH_BYTES:
                break
            batch.append(self._wants.popleft())
            total += w.target.room
            if w.ends:
                break
        return batch

    def _settle(self, want: _Want, result: Fetched | str,
                defer: bool = False) -> Settler[Fetched | str] | None:
        """Count the read and hand its result to the event loop (once: a later call is
        ignored). `defer`: the settler, if it is owed the loop's wake-up (the next
        `receive` makes it, `Settler.settle`)."""
        if want.settled:
            return None
        want.settled = True
        seconds = time.monotonic() - want.queued
        if isinstance(result, Fetched):
            self.m.read(self.name, "ok", seconds, result.size)
        else:
            self.m.read(self.name, result, seconds)
            if result == CORRUPT:
                self.mark_suspect()
            elif result == TIMEOUT:
                if self.rate.stalled_since(want.queued):
                    self.mark_slow()
                else:
                    self._slow_link()
        return want.settler if want.settler.settle(want.done, result, defer=defer) else None

    def _batch(self, batch: list[_Want]) -> None:
        """Send the batch's FETCHes in one write on one connection, then receive each
        reply in order, settling each read as soon as it is in."""
        try:
            sock = self._checkout(batch[0].deadline)
        except TimeoutError:
            for w in batch:
                self._settle(w, TIMEOUT)
            return
        except (OSError, auth.AuthError, ssl.SSLError, wire.WireError) as e:
            log.warning("peer %s: no connection: %s", self.name, e)
            for w in batch:
                self._settle(w, FAILED)
            return
        keep = False
        done = got = 0
        sent = time.monotonic()
        rate = self.rate
        owed: Settler[Fetched | str] | None = None
        """The loop's wake-up for the last read settled, made by the next receive."""
        try:
            rids = [next(self._rids) & 0xFFFFFFFF for _ in batch]
            _bounded(sock, max(w.deadline for w in batch))
            sock.sendall(b"".join(wire.encode_request(wire.OP_FETCH, rid, w.key, w.tenant)
                                  for rid, w in zip(rids, batch, strict=True)))
            for rid, w in zip(rids, batch, strict=True):
                pays, owed = owed, None
                result = receive(sock, rid, w.target, w.deadline, wake=pays)
                done += 1
                if isinstance(result, Fetched):
                    got += result.size
                if isinstance(result, Fetched) or result == ABSENT:  # a whole reply came
                    rate.replied()
                suspect = isinstance(result, Fetched) and time.monotonic() < self.suspect_until
                if suspect:
                    # The peer served a corrupt chunk on another connection meanwhile (a
                    # client's first chunk goes alone, the rest of its batch on a second
                    # connection): nothing more from it lands, this chunk included.
                    result = FAILED
                owed = self._settle(w, result, defer=done < len(batch))
                if result == CORRUPT or suspect:
                    # A suspect peer is read from no more, the rest of this batch included
                    # (the connection goes: its replies are not waited for).
                    for rest in batch[done:]:
                        self._settle(rest, FAILED)
                    return
            keep = True
            self._measured(got, sent)
        except TimeoutError:
            self._measured(got, sent, short=True)
            for w in batch[done:]:
                self._settle(w, TIMEOUT)
        except (OSError, wire.WireError, ssl.SSLError) as e:
            log.warning("peer %s: read of %s failed: %s", self.name, batch[done].key.hex(), e)
            for w in batch[done:]:
                self._settle(w, FAILED)
        finally:
            if owed is not None:
                owed.pay()
            self._checkin(sock, keep)

    # -- hand-offs (a worker thread)

    def push_many(self, offers: list[tuple[str, bytes, int]],
                  deadline: float) -> list[tuple[str, str, float]]:
        """Offer the peer chunks of (tenant, key, size) this agent holds (hand-offs: it
        reads them from this agent and pins them until read), at most
        `wire.MAX_PUSH_BATCH`, in one write on one connection: it takes them together
        (its reads of them in one pipelined batch) and answers each in order. (result,
        the peer's message, when its answer came: monotonic) per offer, never waiting past
        `deadline`. Results: `metrics.PUSH_RESULTS`."""
        assert 0 < len(offers) <= wire.MAX_PUSH_BATCH
        try:
            sock = self._checkout(deadline)
        except TimeoutError:
            return _all(offers, TIMEOUT, "no connection to the peer within the push's time")
        except auth.AuthError as e:
            return _all(offers, AUTH, str(e))
        except (OSError, ssl.SSLError, wire.WireError) as e:
            return _all(offers, UNREACHABLE, str(e) or type(e).__name__)
        keep = False
        out: list[tuple[str, str, float]] = []
        try:
            rids = [next(self._rids) & 0xFFFFFFFF for _ in offers]
            _bounded(sock, deadline)
            sock.sendall(b"".join(wire.encode_request(wire.OP_PUSH, rid, key, tenant)
                                  + wire.PUSH.pack(size)
                                  for rid, (tenant, key, size) in zip(rids, offers,
                                                                       strict=True)))
            for rid in rids:
                status, mlen, got = wire.push_reply_head(
                    _recv_exact(sock, wire.PUSH_REPLY.size, deadline))
                message = _recv_exact(sock, mlen, deadline).decode(errors="replace")
                if got != rid:
                    raise wire.WireError(f"reply to request {got}, expected {rid}")
                out.append((_PUSH_STATUS[status], message, time.monotonic()))
            keep = True
        except TimeoutError:
            out += _all(offers[len(out):], TIMEOUT,
                        "the peer did not answer within the push's time")
        except (OSError, wire.WireError, ssl.SSLError) as e:
            out += _all(offers[len(out):], FAILED, str(e) or type(e).__name__)
        finally:
            self._checkin(sock, keep)
        return out

    def _checkout(self, deadline: float) -> socket.socket:
        with self._lock:
            if self._idle:
                sock = self._idle.pop()
                self._busy.add(sock)
                return sock
        sock = self._connect(deadline)
        with self._lock:
            if not self.closed:
                self._busy.add(sock)
                return sock
        sock.close()  # (the link closed while it connected: its arena may be going)
        raise OSError(errno.ESHUTDOWN, "the peer tier is stopping")

    def _checkin(self, sock: socket.socket, keep: bool) -> None:
        with self._lock:
            self._busy.discard(sock)
            if keep and not self.closed and not self._stale(sock):
                self._idle.append(sock)
                return
        sock.close()

    def _connect(self, deadline: float) -> socket.socket:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock = socket.create_connection((self.host, self.port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = self.credentials.client_tls
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=self.host)
            mine = auth.nonce()
            _bounded(sock, deadline)
            sock.sendall(auth.hello(self.agent_id, mine))
            theirs = _recv_exact(sock, wire.HELLO.size + wire.PROOF_BYTES, deadline)
            secret, answer = self._answer(theirs, mine)
            sock.sendall(answer)
            if _recv_exact(sock, 1, deadline) != wire.ACCEPTED:
                raise auth.AuthError("the peer did not accept this agent's proof")
        except BaseException:
            sock.close()
            raise
        self._proven[sock] = secret
        return sock

    def close(self) -> None:
        """Stop following and reading: idle connections close, and busy ones are shut down,
        so that the workers reading on them end now (the network waits for them before the
        arena they receive into goes: a reply's bytes landing after it was unmapped were
        written into whatever the process mapped there next)."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        self._changed()
        if self.task is not None:
            self.task.cancel()
        if self._settler is not None:
            self._settler.close()
        for s in idle:
            with contextlib.suppress(OSError):
                s.close()
        for s in busy:  # the worker's receive ends; the worker closes it
            with contextlib.suppress(OSError):
                socket.socket.shutdown(s, socket.SHUT_RDWR)  # (under TLS too: its socket)


def receive(sock: socket.socket, rid: int, target: ArenaTarget, deadline: float, *,
            compiled: bool = True, wake: Settler[Fetched | str] | None = None
            ) -> Fetched | str:
    """One FETCH reply on `sock` (the answer to request `rid`): the chunk's bytes into the
    target's extents, checksummed on the way; ABSENT or CORRUPT; or it raises (WireError,
    TimeoutError past `deadline`, OSError). On plain TCP into a mapped arena the whole reply
    is one compiled call that never takes the GIL (`recvkernel`: XXH3 chunks; the kernel
    hands any other head back, and the rest goes on here); in Python otherwise, or where
    `compiled` is False (the tests run both). `wake`: a settler owed the event loop's
    wake-up (`Settler.settle`'s `defer`), paid first thing, by the compiled call where
    there is one."""
    rx = (recvkernel.receiver(_buffer()) if compiled and target.mapped
          and not isinstance(sock, ssl.SSLSocket) else None)
    if rx is None:
        if wake is not None:
            wake.pay()
        return _receive_rest(sock, rid, target, _recv_head(sock, deadline), deadline)
    paid = False
    guard = target.guard if target.repair is not None else 0
    try:
        if sock.gettimeout() is not None:  # blocking: SO_RCVTIMEO bounds each receive
            sock.settimeout(None)
        for _ in range(2):
            code = rx.start(sock.fileno(), rid, target.room, deadline, target.mapped,
                            target.extents, -1 if wake is None or paid else wake.owed_fd,
                            guard)
            paid = True  # the call's first step
            if code != recvkernel.LOCAL or target.repair is None:
                break
            # A fault waits for its repair (nothing was received): the mapping made whole,
            # the reply taken again once.
            target.repair()
    finally:
        if wake is not None:
            if paid:
                wake.paid()
            else:
                wake.pay()
    while code == recvkernel.FAULT:  # a page past a shrunk file: put back, written here
        at, start, end = rx.fault()
        target.write(at, rx.buf[start:end])
        code = rx.resume()
    if code == recvkernel.LOCAL:
        # This agent's mapping failed the read, not the peer: a failed read (the
        # connection goes, its replies out of step), never CORRUPT.
        if target.repair is not None:
            target.repair()
        raise OSError(errno.EFAULT, "the arena was shrunk under the read (a client's fd)")
    if code == recvkernel.HEAD:
        return _receive_rest(sock, rid, target, rx.head, deadline)
    if code == recvkernel.TIMEOUT:
        raise TimeoutError
    if code == recvkernel.CLOSED:
        raise ConnectionError("the peer closed the connection")
    if code == recvkernel.ERRNO:
        raise OSError(rx.errno, os.strerror(rx.errno))
    head = wire.reply_head(rx.head)
    meta, owner = rx.meta_and_tenant(head.meta_len, head.tenant_len)
    if rx.digest != head.checksum:
        return CORRUPT
    return Fetched(head.size, head.checksum, head.kind, meta, owner)


def _receive_rest(sock: socket.socket, rid: int, target: ArenaTarget,
                  raw_head: bytearray, deadline: float) -> Fetched | str:
    """`receive` in Python from the reply's fixed part on."""
    head = wire.reply_head(raw_head)
    if head.rid != rid:
        raise wire.WireError(f"reply to request {head.rid}, expected {rid}")
    if head.status == wire.ABSENT:
        return ABSENT
    if head.size > target.room:  # the directory's size was stale: another chunk
        raise wire.WireError(f"chunk of {head.size} bytes, {target.room} reserved")
    meta = _recv_exact(sock, head.meta_len, deadline)
    owner = _recv_exact(sock, head.tenant_len, deadline).decode(errors="replace")
    pieces = _received(sock, target, target.first(head.size), deadline)
    if head.kind not in checksums.KINDS:
        for _ in pieces:  # received all the same: the connection stays in step
            pass
        return CORRUPT
    if checksums.compute(head.kind, pieces, meta) != head.checksum:
        return CORRUPT
    return Fetched(head.size, head.checksum, head.kind, meta, owner)


def _all(offers: list[tuple[str, bytes, int]], result: str,
         why: str) -> list[tuple[str, str, float]]:
    """The same end for every one of `offers`, now."""
    now = time.monotonic()
    return [(result, why, now)] * len(offers)


def _bounded(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _recv_head(sock: socket.socket, deadline: float) -> bytearray:
    """A reply's fixed part, as `_received` takes the bytes after it (on plain TCP: the
    socket blocking, `_recv_all`, no poll)."""
    buf = bytearray(wire.REPLY.size)
    if isinstance(sock, ssl.SSLSocket):
        _recv_into(sock, memoryview(buf), deadline)
    else:
        _recv_all(sock, memoryview(buf), deadline)
    return buf


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def _received(sock: socket.socket, target: ArenaTarget, extents: list[tuple[int, int]],
              deadline: float) -> Iterator[memoryview]:
    """Receive into the extents through this thread's buffer, each piece handed to the
    caller (the checksum, while the piece is in cache) before it is written; valid until
    the next piece is asked for. Every piece is received and written whatever the caller
    does with it."""
    buf = _buffer()
    fill = _recv_into if isinstance(sock, ssl.SSLSocket) else _recv_all
    for at, _, m in blocks(extents):
        piece = buf[:m]
        fill(sock, piece, deadline)
        yield piece
        target.write(at, piece)


_TIMEVAL = struct.Struct("@ll")


def _recv_all(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """`_recv_into` in as few calls as the kernel allows: the socket blocking, each call
    asking for all that is left (MSG_WAITALL) within what is left of the deadline
    (SO_RCVTIMEO), so that the bytes of a piece cost one system call, not one per
    segment that arrived. SO_RCVTIMEO stays set after it: every blocking receive on
    these sockets sets its own first (`_bounded`'s timeout mode, which the other
    receives and every send use, ignores it), so a piece costs two system calls, not
    five."""
    got = 0
    if sock.gettimeout() is not None:
        sock.settimeout(None)
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sec = int(left)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        _TIMEVAL.pack(sec, max(1, int((left - sec) * 1e6))))
        try:
            n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO ran out with nothing received
            raise TimeoutError from None
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        _bounded(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n
