"""What an agent serves its peers: its chunks (DRAM and NVMe) and its inventory.

One asyncio server on `peers.port`. A connection first proves the pool's secret (`auth`);
one that cannot is counted, logged and closed before anything else is read. Then it
carries FETCH requests, answered in order (on plain TCP those already received behind
the first as one batch, sent by a worker thread in one compiled call, `BatchSender`: a
connection's memory is at most `FETCH_BATCH` reply headers; else one at a time from the
loop; on plain TCP the bytes go from the arena or the chunk file to the socket
with sendfile, never through a Python buffer; under TLS, which encrypts in this process,
through 256 KiB blocks; a chunk on its way to NVMe from its in-flight copy in memory)
and PUSH offers (hand-offs: the space decides, then reads the chunk from the sender as
any peer read; the offers of a batch are taken together, answered in order), or, after
a SUBSCRIBE, the inventory of every space followed by its changes (a bounded queue per
subscriber: one that falls behind is closed, and resyncs when it reconnects).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from . import auth, sendkernel, wire
from .batchsend import BatchSender
from .credentials import Credentials
from .direct import DirectSender
from .metrics import PeerMetrics
from .unacked import Unacked

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 5.0
"""Seconds a new connection has to prove the secret."""
HEARTBEAT_INTERVAL = 0.5
"""A subscription with nothing to say says so this often (the reader's liveness check)."""
STALL_TIMEOUT = 10.0
"""A subscriber that takes no bytes for this long is closed, and so is a reader that takes
longer than this to take one chunk."""
MAX_PENDING = 1 << 16
"""Changes queued for one subscriber; beyond it, it is closed (and resyncs)."""
MAX_CONNECTIONS = 1024
"""Peer connections served at once (each pool agent keeps `connections` + 1 to us)."""
FETCH_BATCH = 32
"""FETCH requests answered in one batch (`BatchSender`): those already buffered behind the
first (a reader sends a batch of up to 32 in one write)."""
FETCH_BATCH_BYTES = 32 << 20
"""Chunk bytes leased for one batch at most (a reader's batch is at most 32 MiB): the
chunks of a connection's pipelined FETCHes past it are leased only once the ones before
them are out, so a peer that stops reading keeps about this much of the arena from
eviction (and the next chunk, taken before the batch went; besides the chunks sent and
not yet acknowledged)."""
_owners = iter(range(-1, -(1 << 62), -1))
"""Lease owners of peer connections: negative, never a client connection's id."""


@dataclass(slots=True)
class ChunkSource:
    """Where a chunk's bytes are, for the time they are sent: `fd` (owned: closed by
    `close`) at the byte `ranges`, in order; or, with `data`, those bytes themselves (the
    heap copy of a chunk on its way from DRAM to NVMe: no file holds it yet; `fd` is -1).
    `address`: where the file is mapped in this process (the arena's: 0 for a chunk file).

    Bytes sent by reference (`sendfile`) stay the arena's pages until the kernel lets go
    of them. Between two hosts that is the peer's acknowledgement (`unacked`), but a
    reader on this kernel (kind's nodes, the demo's, network namespaces) is handed the
    pages themselves, acknowledged as they reach its receive queue and read later: the
    extent freed and rewritten meanwhile, it would receive the new bytes (a checksum
    failure there, and this holder marked suspect). So an arena chunk goes to such a reader
    by copy (`copy_out`), its lease ended as soon as the send is over. A chunk file is
    never rewritten in place (a rewrite is a new inode): its pages may be referenced."""

    size: int
    checksum: int
    kind: int
    meta: bytes
    tenant: str
    fd: int
    ranges: list[tuple[int, int]]
    release: Callable[[], None] = field(default=lambda: None)
    data: bytes | memoryview | None = None
    address: int = 0
    copy_out: bool = False
    """Sent by copy from the mapping at `address` (a batch's `send`): no byte of it is
    referenced once the send is over."""

    def copy_to(self, local: bool) -> bool:
        """Whether this source goes by copy to a reader (`local`: on this kernel), as an
        arena chunk must; marks it so (`copy_out`)."""
        self.copy_out = local and self.address != 0 and self.data is None
        return self.copy_out

    def memory_ranges(self) -> list[tuple[int, int]]:
        """`ranges` as (address, length) in the mapping."""
        return [(self.address + at, n) for at, n in self.ranges]

    def copied(self) -> ChunkSource:
        """The same chunk as bytes of this process (`data`), read now; this source's lease
        ends and its descriptor closes. A file cut under the read is a ConnectionError
        (the reply cannot go whole)."""
        try:
            pieces = [os.pread(self.fd, n, at) for at, n in self.ranges]
        finally:
            self.close()
        data = b"".join(pieces)
        if len(data) != self.size:
            raise ConnectionError(f"the arena ends {self.size - len(data)} bytes short of "
                                  "the chunk")
        return ChunkSource(self.size, self.checksum, self.kind, self.meta, self.tenant, -1,
                           [(0, self.size)], data=data)

    def close(self) -> None:
        try:
            self.release()
        finally:
            if self.fd >= 0:
                os.close(self.fd)


class Holdings(Protocol):
    """What a space offers its peers (`store.ChunkStore` implements it)."""

    async def peer_source(self, key: bytes, owner: int) -> ChunkSource | None: ...

    def peer_size(self, key: bytes) -> int:
        """Bytes to reserve for `key` if this space holds it in DRAM or NVMe, else 0."""
        ...

    def peer_inventory(self) -> Iterator[tuple[bytes, int]]: ...

    def disconnect(self, owner: int) -> None: ...

    async def take_push(self, key: bytes, size: int, sender: bytes) -> tuple[int, str]:
        """A hand-off offer of `key` (`size` bytes) from the agent whose id is `sender`:
        (a `wire.PUSH_*` status, why) once it is stored and pinned, or refused."""
        ...

    @property
    def handoff_bytes(self) -> int:
        """Arena bytes pinned by pushed chunks not read yet."""
        ...

    def peer_delete(self, key: bytes, sender: bytes) -> tuple[int, str]:
        """A DELETE of `key` made on the node of the agent whose id is `sender`: (a
        `wire.DELETED`, `NOT_HELD` or `DELETE_REFUSED` status, why)."""
        ...


class Subscriber:
    """One subscription's changes not sent yet, and how they are sent.

    Once the inventory is out (`live`), changes are written by a callback run in the
    loop's turn after the first of them was queued (`_flush`): what is queued by then goes
    in one write, a message per run of the same tenant and kind, with no wait added (the
    changes of one wake-up of the loop, say the chunks of a batch of peer reads settled
    together, go together). The stream's coroutine is not woken for them: it wakes to
    send a heartbeat, to drain a buffer past its limit, and to end. (A task woken per
    change, with its future, timer and `wait_for` of a drain, was a tenth of a reading
    agent's Python at 1 MiB chunks: each chunk it reads is a change its holder hears of.
    Changes held back up to 5 ms to go together took directory propagation from 1-3 ms
    to 5.5 ms, docs/benchmarks.md: changes are never held for more to come.)"""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: deque[tuple[str, int, bytes, int]] = deque()
        self.overflow = False
        self.live = False
        """The inventory is sent: `_flush` writes changes from now on."""
        self.sent = 0.0
        """The loop's time of the last message written (a heartbeat is due after
        `HEARTBEAT_INTERVAL` without one)."""
        self._loop = asyncio.get_running_loop()
        self._flushing = False
        self._waiter: asyncio.Future[None] | None = None

    def push(self, tenant: str, msg: int, key: bytes, size: int) -> None:
        if len(self.pending) >= MAX_PENDING:
            self.overflow = True
            self.wake()
            return
        self.pending.append((tenant, msg, key, size))
        if self.live and not self._flushing:
            self._flushing = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write what is queued, unless the transport's buffer is past its limit (the
        coroutine drains it, then writes) or the stream is over."""
        self._flushing = False
        if not self.live or not self.pending:
            return
        transport = self.writer.transport
        if transport.is_closing() or (transport.get_write_buffer_size()
                                      > transport.get_write_buffer_limits()[1]):
            self.wake()
            return
        self.write_pending()

    def write_pending(self) -> None:
        if self.pending:
            self.writer.write(b"".join(_deltas(self.pending)))
            self.sent = self._loop.time()

    def wake(self) -> None:
        """End the stream's `wait` now (a backlog, an overflow, or the subscription
        ended)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Until `wake`, or a heartbeat is due: one future and one timer. At once while
        changes wait (a `_flush` that found the buffer past its limit left them)."""
        if self.overflow or self.pending:
            return
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_at(self.sent + HEARTBEAT_INTERVAL, self.wake)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


class PeerServer:
    def __init__(self, spaces: dict[str, Holdings], credentials: Credentials, agent_id: bytes,
                 metrics: PeerMetrics, node: str = "") -> None:
        self.spaces = spaces
        self.node = node
        """This agent's node name, told to every subscriber (what push hints name)."""
        self.credentials = credentials
        self.agent_id = agent_id
        self.m = metrics
        self.tls = credentials.listening
        """The context the server listens with (None: plain TCP); each handshake uses the
        credentials' current one."""
        self._proven: dict[asyncio.Task[None], bytes] = {}
        """The secret each connection's client proved (`end_stale`)."""
        self.subscribers: set[Subscriber] = set()
        self._refusing: set[str] = set()
        """Peers whose last push was refused (logged once)."""
        self.on_subscribe: Callable[[bytes], None] | None = None
        """Called with a subscriber's agent id as its SUBSCRIBE comes (it follows this
        agent from then on: it takes this agent's DELETEs)."""
        self.connections = 0
        self.server: asyncio.Server | None = None
        self._serving: set[asyncio.Task[None]] = set()
        """Every connection's task, ended by `close`."""
        self._closing = False

    async def start(self, host: str, port: int) -> None:
        if self.tls is None:
            sendkernel.compile_soon()  # replies go from the event loop until it is compiled
        self.server = await asyncio.start_server(
            self._accepted, None if host == "*" else host, port, ssl=self.tls,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT if self.tls else None, reuse_address=True)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain function, not the coroutine itself: asyncio's stream server would run a
        # coroutine as a task nobody ends but the loop's final cancellation, and on Python
        # 3.11 its done-callback logs a cancelled one as an error with a traceback. This
        # server owns its connections' tasks and ends them in `close`.
        if self._closing:  # accepted as the agent stops: nothing to serve it
            writer.transport.abort()
            return
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    def end_stale(self) -> int:
        """End the connections proven with a secret no longer accepted (a rotation's grace
        is over); how many."""
        stale = [t for t, secret in self._proven.items() if self.credentials.stale(secret)]
        for t in stale:
            t.cancel()
        return len(stale)

    async def close(self) -> None:
        """Stop accepting and end every connection (their tasks are over on return)."""
        self._closing = True
        if self.server is not None:
            self.server.close()
        while self._serving:
            tasks = list(self._serving)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- what every subscriber hears

    def changed(self, tenant: str, key: bytes, holdings: Holdings, stored: bool) -> None:
        """A chunk entered (`stored`) or left a local tier of `tenant`'s space."""
        if not self.subscribers:
            return
        size = holdings.peer_size(key)
        if stored and size:
            msg = wire.ADD
        elif not stored and not size:
            msg = wire.REMOVE
        else:
            return  # still held elsewhere (demoted, promoted): nothing a peer needs to hear
        for sub in self.subscribers:
            sub.push(tenant, msg, key, size)

    # -- a connection

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _name(writer)
        owner = next(_owners)
        if self.connections >= MAX_CONNECTIONS:
            log.warning("peer %s refused: %d peer connections already", peer, MAX_CONNECTIONS)
            writer.close()
            return
        self.connections += 1
        # The leases of chunks sent with sendfile whose bytes are not acknowledged yet
        # (under TLS the bytes are copies: nothing to hold).
        sock = writer.get_extra_info("socket")
        direct = DirectSender.make(writer.transport) if self.tls is None else None
        batches: list[BatchSender] = []
        """The connection's batch sender, once the kernel is compiled (made at a FETCH)."""

        def on_reset() -> asyncio.Future[int] | None:
            # A reply from the loop ends now; a batch on a worker stops at its next wait,
            # and the transport's abort waits for it.
            if direct is not None:
                direct.abort()
            return batches[0].stop() if batches else None
        unacked = (Unacked(writer.transport, sock, STALL_TIMEOUT, on_reset)
                   if sock is not None and self.tls is None else None)
        cancelled = False
        try:
            try:
                client_id, secret = await asyncio.wait_for(self._handshake(reader, writer),
                                                           HANDSHAKE_TIMEOUT)
            except (auth.AuthError, asyncio.IncompleteReadError, TimeoutError, OSError,
                    ssl.SSLError) as e:
                self.m.auth_failures.inc()
                log.warning("peer connection from %s refused: %s", peer, e or type(e).__name__)
                return
            task = asyncio.current_task()
            assert task is not None
            self._proven[task] = secret
            task.add_done_callback(self._proven.pop)
            await self._requests(reader, writer, peer, owner, client_id, unacked, direct,
                                 batches)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ssl.SSLError):
            pass  # the peer went away
        except wire.WireError as e:
            self.m.protocol_errors.inc()
            log.warning("peer %s closed: %s", peer, e)
        except Exception:
            log.exception("serving peer %s failed", peer)
        finally:
            self.connections -= 1
            if direct is not None:
                direct.close()
            for b in batches:
                b.close()
            try:
                if unacked is not None:
                    # Before the close: the kernel would go on sending queued bytes from
                    # the chunks' pages after it; and before `disconnect`, which ends the
                    # leases.
                    await unacked.settle(wait=not cancelled)
            finally:  # cancelled again meanwhile: nothing of the connection is left held
                for h in self.spaces.values():
                    h.disconnect(owner)
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> tuple[bytes, bytes]:
        """The client's agent id, once it proved the secret, and the secret it proved (the
        one this agent's file holds now: a client accepts the previous one too during a
        rotation's grace, `Credentials.accepted`, and answers with the one proved)."""
        client_id, client_nonce = auth.parse_hello(await reader.readexactly(wire.HELLO.size))
        mine = auth.nonce()
        secret = self.credentials.secret
        writer.write(auth.hello(self.agent_id, mine) + auth.proof(
            secret, b"server", client_nonce, mine, client_id, self.agent_id))
        got = await reader.readexactly(wire.PROOF_BYTES)
        auth.check(auth.proof(secret, b"client", client_nonce, mine, client_id,
                              self.agent_id), got)
        writer.write(wire.ACCEPTED)
        await writer.drain()
        return client_id, secret

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        peer: str, owner: int, client_id: bytes,
                        unacked: Unacked | None, direct: DirectSender | None,
                        batches: list[BatchSender]) -> None:
        local = self.tls is None and auth.same_kernel(client_id)
        """The reader runs on this kernel: arena chunks go to it by copy (`ChunkSource`;
        under TLS every byte sent is a copy already)."""
        offers: deque[asyncio.Task[None]] = deque()
        """PUSH offers of this connection under way, in order: each answers once the one
        before it has (replies keep the requests' order)."""
        try:
            while True:
                if len(offers) >= wire.MAX_PUSH_BATCH:  # a batch's worth: no more meanwhile
                    await offers.popleft()
                op, rid, tlen, key = wire.request_head(
                    await reader.readexactly(wire.REQUEST.size))
                tenant = (await reader.readexactly(tlen)).decode(errors="replace") if tlen else ""
                if direct is not None and op != wire.OP_FETCH:
                    direct.quiet()  # what follows writes through the transport
                if op == wire.OP_PUSH:
                    (size,) = wire.PUSH.unpack(await reader.readexactly(wire.PUSH.size))
                    # Taken at once, not after the offers before it: the offers of a
                    # batch (one write) are all read before their first reply, so the
                    # reads of their chunks go out together.
                    offers.append(asyncio.ensure_future(self._push(
                        writer, peer, rid, tenant, key, size, client_id,
                        offers[-1] if offers else None)))
                    continue
                while offers:  # any other request's reply comes after theirs
                    await offers.popleft()
                if op == wire.OP_SUBSCRIBE:
                    if self.on_subscribe is not None:
                        self.on_subscribe(client_id)
                    await self._stream(reader, writer)
                    return
                if op == wire.OP_DELETE:
                    await self._delete(writer, peer, rid, tenant, key, client_id)
                    continue
                if unacked is not None and direct is not None and self.tls is None:
                    if not batches and (made := BatchSender.make(writer.transport)):
                        batches.append(made)
                    if batches and batches[0].free():
                        await self._fetch_batch(reader, writer, peer, owner, (rid, tenant, key),
                                                local, unacked, direct, batches[0])
                        continue
                await self._fetch(writer, peer, owner, rid, tenant, key, local, unacked,
                                  direct)
        finally:
            for task in offers:  # the connection is gone: its offers go with it
                task.cancel()
            await asyncio.gather(*offers, return_exceptions=True)

    async def _push(self, writer: asyncio.StreamWriter, peer: str, rid: int, tenant: str,
                    key: bytes, size: int, sender: bytes,
                    before: asyncio.Task[None] | None) -> None:
        """A hand-off offer: the space takes it (reading the chunk from the sender) or says
        why not; either way one reply, after the reply to the offer `before` it."""
        holdings = self.spaces.get(tenant)
        if holdings is None:
            status, why = wire.PUSH_REFUSED, f"this agent has no space of tenant {tenant!r}"
        else:
            status, why = await holdings.take_push(key, size, sender)
        result = {wire.PUSH_STORED: "ok", wire.PUSH_HELD: "held",
                  wire.PUSH_REFUSED: "refused"}.get(status, "error")
        self.m.received(peer, result)
        if status != wire.PUSH_REFUSED:
            self._refusing.discard(peer)
        elif peer not in self._refusing:  # once until a push from it is taken again
            self._refusing.add(peer)
            log.warning("push of %s from %s refused: %s", key.hex(), peer, why)
        if before is not None:
            await before
        writer.write(wire.encode_push_reply(status, rid, why))
        await writer.drain()

    async def _delete(self, writer: asyncio.StreamWriter, peer: str, rid: int, tenant: str,
                      key: bytes, sender: bytes) -> None:
        """A DELETE from a peer's node: this agent's copy goes (if the tenant's space has
        one and the sender is a peer it follows); one reply."""
        holdings = self.spaces.get(tenant)
        if holdings is None:
            status, why = wire.DELETE_REFUSED, f"this agent has no space of tenant {tenant!r}"
        else:
            status, why = holdings.peer_delete(key, sender)
        self.m.deleted(peer, "received", {wire.DELETED: "ok", wire.NOT_HELD: "absent"}.get(
            status, "refused"))
        if status == wire.DELETE_REFUSED and f"delete {peer}" not in self._refusing:
            self._refusing.add(f"delete {peer}")  # once per peer: it may send many
            log.warning("delete of %s from %s refused: %s", key.hex(), peer, why)
        writer.write(wire.encode_push_reply(status, rid, why))
        await writer.drain()

    async def _fetch(self, writer: asyncio.StreamWriter, peer: str, owner: int, rid: int,
                     tenant: str, key: bytes, local: bool, unacked: Unacked | None,
                     direct: DirectSender | None) -> None:
        start = time.monotonic()
        holdings = self.spaces.get(tenant)
        source = None if holdings is None else await holdings.peer_source(key, owner)
        if source is not None and source.copy_to(local):
            source = source.copied()  # (the loop's way has no send from the mapping)
        await self._reply(writer, peer, rid, source, unacked, direct, start)

    async def _reply(self, writer: asyncio.StreamWriter, peer: str, rid: int,
                     source: ChunkSource | None, unacked: Unacked | None,
                     direct: DirectSender | None, start: float) -> None:
        """One FETCH's reply from the event loop: ABSENT, or `source`'s bytes (its lease
        held by `unacked` until they are acknowledged, where sent with sendfile)."""
        if source is None:
            if direct is not None:
                direct.quiet()
            writer.write(wire.encode_reply(wire.ABSENT, rid))
            await writer.drain()
            self.m.served(peer, "absent", time.monotonic() - start)
            return
        whole = False
        try:
            head = wire.encode_reply(wire.OK, rid, kind=source.kind, size=source.size,
                                     checksum=source.checksum, meta=source.meta,
                                     tenant=source.tenant)
            if (direct is not None and source.data is None and source.fd >= 0
                    and direct.ready()):
                # Plain TCP, the bytes in a file: straight from this thread, the rest
                # from a writer callback (`direct`), bounded as below.
                if not direct.send(head, source.fd, source.ranges):
                    await direct.rest(STALL_TIMEOUT)
            else:
                if direct is not None:
                    direct.quiet()
                writer.write(head)
                # Bounded: a reader that stops reading must not hold the chunk's read
                # lease (keeping it from eviction) for longer than this.
                await asyncio.wait_for(_send(writer, source), STALL_TIMEOUT)
            whole = True
        except BaseException:
            self.m.served(peer, "error", time.monotonic() - start)
            raise
        finally:
            if unacked is not None and source.data is None and source.fd >= 0:
                # Sent with sendfile: the socket's queue refers to the chunk's pages until
                # the peer acknowledges them. The descriptor is not needed for that.
                os.close(source.fd)
                unacked.hold(source.release, whole)
            else:
                source.close()
        self.m.served(peer, "ok", time.monotonic() - start, source.size)

    async def _fetch_batch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           peer: str, owner: int, first: tuple[int, str, bytes],
                           local: bool, unacked: Unacked, direct: DirectSender,
                           batcher: BatchSender) -> None:
        """A FETCH and those already buffered behind it (a reader's batch, one write),
        answered in order: their sources taken and leased here, their replies sent by a
        worker in one compiled call (`BatchSender`: no Python, no wake-up of this loop per
        chunk); a chunk not in a file (the in-flight copy of a demotion) from the loop, in
        its place."""
        requests = [first]
        while len(requests) < FETCH_BATCH and (n := _buffered_fetch(reader)):
            data = await reader.readexactly(n)  # buffered: returns at once
            _, rid, tlen, key = wire.request_head(data[: wire.REQUEST.size])
            tenant = data[wire.REQUEST.size :].decode(errors="replace") if tlen else ""
            requests.append((rid, tenant, key))
        direct.quiet()
        batch = sendkernel.Batch()
        taken: list[ChunkSource | None] = []
        """The batch's sources (None: ABSENT), in order, until `_send_batch` settles them."""
        start = time.monotonic()
        batched = 0
        """Chunk bytes in `batch`."""
        leading: asyncio.Future[None] | None = None
        """The first reply's send, out on the worker while the loop takes the sources after
        it: awaited before anything else is sent (one batch out at a time)."""

        async def sent_first() -> None:
            nonlocal leading
            if leading is not None:
                out, leading = leading, None
                await out

        try:
            for n, (rid, tenant, key) in enumerate(requests):
                holdings = self.spaces.get(tenant)
                source = None if holdings is None else await holdings.peer_source(key, owner)
                if source is not None and (source.data is not None or source.fd < 0):
                    # Bytes in memory: the transport's way, after what is batched before it.
                    try:
                        await sent_first()
                        await self._send_batch(batcher, batch, taken, peer, start, unacked)
                    except BaseException:
                        source.close()
                        raise
                    batch, batched = sendkernel.Batch(), 0
                    await self._reply(writer, peer, rid, source, unacked, None, start)
                    start = time.monotonic()
                    continue
                if source is not None and batched and batched + source.size > FETCH_BATCH_BYTES:
                    try:  # the batch's worth of bytes: out first, then this one's
                        await sent_first()
                        await self._send_batch(batcher, batch, taken, peer, start, unacked)
                    except BaseException:
                        source.close()
                        raise
                    batch, batched, start = sendkernel.Batch(), 0, time.monotonic()
                if source is None:
                    batch.add(wire.encode_reply(wire.ABSENT, rid), -1, [])
                else:
                    batched += source.size
                    head = wire.encode_reply(
                        wire.OK, rid, kind=source.kind, size=source.size,
                        checksum=source.checksum, meta=source.meta, tenant=source.tenant)
                    if source.copy_to(local):
                        batch.add(head, -1, source.memory_ranges())
                    else:
                        batch.add(head, source.fd, source.ranges)
                taken.append(source)
                if source is not None and n == 0 and len(requests) > 1:
                    # The first chunk of a batch leaves now, before the sources of the
                    # others are taken (32 leases, the in-flight copies' and NVMe files'
                    # look-ups): the reader, and the client waiting for that chunk, have
                    # it that much sooner (docs/benchmarks.md, "A 1 MiB window's start").
                    # Its bytes still count in `batched`: the connection holds no more
                    # chunks' leases at once than a batch's worth, as before.
                    leading = asyncio.ensure_future(
                        self._send_batch(batcher, batch, taken, peer, start, unacked))
                    batch, taken = sendkernel.Batch(), []
                    start = time.monotonic()
            await sent_first()
            await self._send_batch(batcher, batch, taken, peer, start, unacked)
        finally:
            if leading is not None:  # an error or a cancellation while the first was out
                if not leading.done():
                    leading.cancel()
                with contextlib.suppress(BaseException):
                    await leading
            for left in taken:  # not handed to the worker (an error or a cancellation)
                if left is not None:
                    left.close()

    async def _send_batch(self, batcher: BatchSender, batch: sendkernel.Batch,
                          taken: list[ChunkSource | None], peer: str, start: float,
                          unacked: Unacked) -> None:
        """Send `batch` on a worker; then each chunk that went by reference, whole or in
        part, has its lease held until its bytes are acknowledged, the rest are released
        (sent by copy, or no byte of them is in the socket). Empties `taken`. Raises what
        ended the batch early."""
        if not taken:
            return
        code = sendkernel.ERRNO
        try:
            code = await batcher.send(batch, STALL_TIMEOUT)
        finally:
            done, partial = batch.done, batch.partial
            sources, taken[:] = list(taken), []
            for i, source in enumerate(sources):
                if i == done:  # the reply the batch ended in
                    self.m.served(peer, "error", time.monotonic() - start)
                if source is None:
                    if i < done:
                        self.m.served(peer, "absent", batch.end(i) - start)
                elif i < done or (i == done and partial):
                    if source.copy_out:
                        source.close()  # copied into the socket: no page of it referenced
                    else:
                        # Sent with sendfile (whole, or in part): the socket's queue refers
                        # to the chunk's pages until the peer acknowledges them (or a reset).
                        os.close(source.fd)
                        unacked.hold(source.release, i < done)
                    if i < done:
                        self.m.served(peer, "ok", batch.end(i) - start, source.size)
                else:
                    source.close()  # no byte of it is in the socket
        if code == sendkernel.DONE:
            return
        if code == sendkernel.TIMEOUT:
            raise TimeoutError("the reader took longer than its bound to take a chunk")
        if code == sendkernel.ENDED:
            raise ConnectionError("a chunk's file ends before its bytes")
        if code == sendkernel.STOPPED:
            raise ConnectionResetError("the connection was reset")
        raise OSError(batch.errno, os.strerror(batch.errno))

    async def _stream(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        sub = Subscriber(writer)
        self.subscribers.add(sub)  # first: no change between the inventory and the deltas
        # A subscriber sends nothing more: its end of the connection closing ends the
        # stream at once, and a byte from it is a protocol error.
        ended = asyncio.ensure_future(reader.read(1))
        ended.add_done_callback(lambda _: sub.wake())
        try:
            for tenant, holdings in list(self.spaces.items()):
                writer.write(wire.encode_stream(wire.BEGIN, tenant, sent_at=time.time()))
                batch: list[tuple[bytes, int]] = []
                for key, size in holdings.peer_inventory():
                    batch.append((key, size))
                    if len(batch) == wire.MAX_RECORDS:
                        writer.write(wire.encode_stream(wire.ADD, tenant, batch, time.time()))
                        batch = []
                        await asyncio.wait_for(writer.drain(), STALL_TIMEOUT)
                if batch:
                    writer.write(wire.encode_stream(wire.ADD, tenant, batch, time.time()))
            writer.write(wire.encode_stream(wire.SYNCED, self.node, sent_at=time.time()))
            sub.write_pending()
            sub.sent = asyncio.get_running_loop().time()
            sub.live = True  # changes are written as they come from now on
            while True:
                await asyncio.wait_for(writer.drain(), STALL_TIMEOUT)
                await sub.wait()
                if ended.done():
                    if ended.result():
                        raise wire.WireError("a subscriber sent bytes after SUBSCRIBE")
                    return
                if sub.overflow:
                    log.warning("a peer subscriber fell %d changes behind: closed, it resyncs",
                                MAX_PENDING)
                    return
                if sub.pending:
                    sub.write_pending()
                elif asyncio.get_running_loop().time() >= sub.sent + HEARTBEAT_INTERVAL:
                    writer.write(wire.encode_stream(wire.HEARTBEAT, sent_at=time.time()))
                    sub.sent = asyncio.get_running_loop().time()
        finally:
            sub.live = False
            ended.cancel()
            self.subscribers.discard(sub)


TLS_BLOCK = 256 << 10
"""Bytes read from the chunk's file per write under TLS."""


async def _send(writer: asyncio.StreamWriter, source: ChunkSource) -> None:
    loop = asyncio.get_running_loop()
    if source.data is not None:
        # Bytes in this process already (immutable: a DELETE or the demotion landing
        # meanwhile leaves them to this reply), written a block at a time so that the
        # transport's buffer stays bounded.
        view = memoryview(source.data)
        for at in range(0, len(view), TLS_BLOCK):
            writer.write(view[at : at + TLS_BLOCK])
            await writer.drain()
        return
    if writer.get_extra_info("sslcontext") is not None:
        # Under TLS the bytes are encrypted in this process anyway: each block is read
        # into a buffer of its own, which the transport keeps until it is encrypted.
        # (asyncio's sendfile fallback reuses one buffer, and a pipelined FETCH behind a
        # 16 MiB reply got bytes failing their checksum here.)
        for offset, n in source.ranges:
            for at in range(offset, offset + n, TLS_BLOCK):
                size = min(TLS_BLOCK, offset + n - at)
                block = await loop.run_in_executor(None, os.pread, source.fd, size, at)
                if len(block) != size:  # the file shrank under the read: the reply is cut
                    raise ConnectionError(f"the chunk's file ends at {at + len(block)}")
                writer.write(block)
                await writer.drain()
        return
    with open(source.fd, "rb", buffering=0, closefd=False) as f:
        for offset, n in source.ranges:
            await loop.sendfile(writer.transport, f, offset, n)  # os.sendfile: no copy here
    await writer.drain()


class Watch:
    """Tells the server of a space's chunks entering and leaving its local tiers (a
    `store.observer.TierObserver`); the shared tier's are every node's already.

    A chunk enters NVMe only by a demotion from DRAM, and stays announced all the way
    (served from its in-flight copy): its landing is no change for peers, and is not sent
    (it was, as a second ADD of every demoted chunk to every peer). A demotion that fails,
    or a DELETE meanwhile, is a removal, and is sent."""

    def __init__(self, server: PeerServer, tenant: str, holdings: Holdings) -> None:
        self.server, self.tenant, self.holdings = server, tenant, holdings

    def stored(self, tier: str, key: bytes) -> None:
        if tier not in ("shared", "nvme"):
            self.server.changed(self.tenant, key, self.holdings, True)

    def removed(self, tier: str, key: bytes) -> None:
        if tier != "shared":
            self.server.changed(self.tenant, key, self.holdings, False)


def _deltas(pending: deque[tuple[str, int, bytes, int]]) -> Iterator[bytes]:
    """The queued changes as stream messages, in order: a message per run of the same
    tenant and kind, at most `wire.MAX_RECORDS` records each. Empties the queue."""
    now = time.time()
    run: list[tuple[bytes, int]] = []
    current: tuple[str, int] | None = None
    while pending:
        tenant, msg, key, size = pending.popleft()
        if (tenant, msg) != current or len(run) == wire.MAX_RECORDS:
            if current is not None and run:
                yield wire.encode_stream(current[1], current[0], run, now)
            current, run = (tenant, msg), []
        run.append((key, size))
    if current is not None and run:
        yield wire.encode_stream(current[1], current[0], run, now)


def _buffered_fetch(reader: asyncio.StreamReader) -> int:
    """The length of the next request if it is a FETCH already whole in the reader's
    buffer (readable without a wait), else 0. (The buffer is asyncio's own: a reader
    without it gives 0, and each FETCH is answered as it is read.)"""
    buf = getattr(reader, "_buffer", None)
    if not isinstance(buf, bytearray) or len(buf) < wire.REQUEST.size:
        return 0
    if buf[0] != wire.OP_FETCH:
        return 0
    n = wire.REQUEST.size + int.from_bytes(buf[2:4], "little")
    return n if len(buf) >= n else 0


def _name(writer: asyncio.StreamWriter) -> str:
    """The peer's address, without its port (a metric label: one per peer, not per
    connection)."""
    addr = writer.get_extra_info("peername")
    if isinstance(addr, tuple) and addr:
        return str(addr[0])
    return str(addr)
