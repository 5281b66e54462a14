"""What an agent reads from one peer: its inventory (a subscription) and its chunks.

The subscription is an asyncio stream on the event loop: it feeds the directories (one
per tenant space) with the peer's inventory and changes, and drops the peer's entries
when it ends (a gap, the peer's restart, or silence past `DEAD_AFTER`: unreachable); the
next inventory brings them back. Fetches run in worker threads on blocking sockets from
a bounded pool (`peers.connections`): a chunk's bytes go from the socket into the
arena extents it will be served from, then are verified there, all within the read's
deadline (every wait on the socket is bounded by what is left of it).

Into the arena through its file, never its mapping (a client may shrink the file under
the agent: a touched page past the end would be SIGBUS): on plain TCP by `splice`, socket
to pipe to the arena file, so the bytes never enter this process; under TLS, or on
hugetlbfs (which takes no splice or write(2)), through one bounded buffer per read
(`COPY_BLOCK`) and `Arena.write`. Never a `bytes` of the chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .. import checksums
from . import auth, wire
from .directory import PeerDirectory
from .metrics import PeerMetrics

log = logging.getLogger(__name__)

DEAD_AFTER = 10.0
"""Seconds of silence on a subscription (heartbeats come every half second) after which
the peer counts as unreachable: its entries are dropped."""
RETRY_MIN, RETRY_MAX = 0.2, 2.0
"""Seconds between attempts to reach a peer, doubling."""
SUSPECT_SECONDS = 30.0
"""A peer that served bytes failing their checksum is not read from for this long."""
COPY_BLOCK = 1 << 20
"""Bytes of the one buffer a read without splice goes through, and of a verification's
read-back."""
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_buffers = threading.local()


def _buffer() -> memoryview:
    """This worker thread's COPY_BLOCK buffer (made once: a fresh one per read would zero a
    MiB each time)."""
    buf: memoryview | None = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = memoryview(bytearray(COPY_BLOCK))
    return buf


@dataclass(frozen=True, slots=True)
class ArenaTarget:
    """Where a read puts a chunk: arena extents, written through the arena's file."""

    fd: int
    extents: list[tuple[int, int]]
    write: Callable[[list[tuple[int, int]], memoryview], None]
    """`Arena.write`: for reads that cannot splice."""
    splice: bool
    """The arena file takes splice(2) (not hugetlbfs)."""

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


class PeerLink:
    def __init__(self, index: int, host: str, port: int, *, secret: bytes, agent_id: bytes,
                 connections: int, tls: ssl.SSLContext | None,
                 directories: dict[str, PeerDirectory], metrics: PeerMetrics) -> None:
        self.index = index
        self.host, self.port = host, port
        self.name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.secret = secret
        self.agent_id = agent_id
        self.tls = tls
        self.directories = directories
        self.m = metrics
        self.synced = False
        """The peer's whole inventory is in the directories."""
        self.is_self = False
        self.closed = False
        self.failing = False
        """The last attempt to follow the peer failed (logged once until it works again)."""
        self.last_heard = 0.0
        self.lag = 0.0
        """Seconds between the last stream message's sending and its arrival."""
        self.suspect_until = 0.0
        self._slots = threading.BoundedSemaphore(connections)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self.task: asyncio.Task[None] | None = None

    @property
    def readable(self) -> bool:
        return not self.closed and not self.is_self and time.monotonic() >= self.suspect_until

    def mark_suspect(self) -> None:
        self.suspect_until = time.monotonic() + SUSPECT_SECONDS
        self.m.suspect.labels(self.m.pool, self.name).inc()
        log.error("peer %s served a chunk that failed its checksum: not read from for %g s",
                  self.name, SUSPECT_SECONDS)

    # -- the subscription (event loop)

    async def run(self) -> None:
        backoff = RETRY_MIN
        while not self.closed:
            writer: asyncio.StreamWriter | None = None
            try:
                reader, opened = await asyncio.wait_for(asyncio.open_connection(
                    self.host, self.port, ssl=self.tls,
                    server_hostname=self.host if self.tls else None), DEAD_AFTER)
                writer = opened
                await asyncio.wait_for(self._handshake(reader, opened), DEAD_AFTER)
                opened.write(wire.encode_request(wire.OP_SUBSCRIBE, 0, bytes(16), ""))
                await self._follow(reader)
            except SelfPeer:
                self.is_self = True
                log.info("peer address %s is this agent: not followed", self.name)
                return
            except auth.AuthError as e:
                self.m.auth_failures.inc()
                log.warning("peer %s refused: %s", self.name, e)
            except wire.WireError as e:
                self.m.protocol_errors.inc()
                log.warning("peer %s broke the protocol: %s", self.name, e)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError) as e:
                if not self.failing:  # once per outage, not at every retry
                    log.warning("peer %s unreachable: %s", self.name,
                                str(e) or type(e).__name__)
                self.failing = True
            finally:
                if writer is not None:
                    writer.close()
                if self.synced or self.last_heard:
                    backoff = RETRY_MIN
                self._forget()
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, RETRY_MAX)

    def _forget(self) -> None:
        """The subscription ended: the peer's entries go until its inventory is back."""
        self.synced = False
        self.last_heard = 0.0
        for d in self.directories.values():
            d.drop_peer(self.index)

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        mine = auth.nonce()
        writer.write(auth.hello(self.agent_id, mine))
        theirs = await reader.readexactly(wire.HELLO.size + wire.PROOF_BYTES)
        writer.write(self._answer(theirs, mine))
        if await reader.readexactly(1) != wire.ACCEPTED:
            raise auth.AuthError("the peer did not accept this agent's proof")

    def _answer(self, theirs: bytes, mine: bytes) -> bytes:
        """The client proof for the server's HELLO and proof `theirs`, once that checks."""
        server_id, server_nonce = auth.parse_hello(theirs[: wire.HELLO.size])
        if server_id == self.agent_id:
            raise SelfPeer
        auth.check(auth.proof(self.secret, b"server", mine, server_nonce, self.agent_id,
                              server_id), theirs[wire.HELLO.size:])
        return auth.proof(self.secret, b"client", mine, server_nonce, self.agent_id, server_id)

    async def _follow(self, reader: asyncio.StreamReader) -> None:
        while True:
            head = await asyncio.wait_for(reader.readexactly(wire.STREAM.size), DEAD_AFTER)
            msg, tlen, count, sent_at = wire.stream_head(head)
            tenant = (await reader.readexactly(tlen)).decode(errors="replace")
            body = await reader.readexactly(count * wire.RECORD.size)
            self.last_heard = time.monotonic()
            self.lag = max(0.0, time.time() - sent_at)
            d = self.directories.get(tenant)  # a space this agent lacks: nothing to keep
            if msg == wire.BEGIN:
                if d is not None:
                    d.drop_peer(self.index)
                self.m.resyncs.labels(self.m.pool, self.name).inc()
            elif msg == wire.ADD and d is not None:
                for key, size in wire.records(body):
                    d.add(key, self.index, size)
            elif msg == wire.REMOVE and d is not None:
                for key, _ in wire.records(body):
                    d.remove(key, self.index)
            elif msg == wire.SYNCED:
                self.synced = True
                self.failing = False
                log.info("peer %s: inventory received", self.name)

    # -- fetches (worker threads)

    def fetch_into(self, tenant: str, key: bytes, target: ArenaTarget,
                   deadline: float) -> Fetched | str:
        """The chunk's bytes received into `target` and verified there, or why not
        (ABSENT, FAILED, TIMEOUT, CORRUPT); never waits past `deadline` (monotonic)."""
        start = time.monotonic()
        result = self._fetch(tenant, key, target, deadline)
        if isinstance(result, Fetched):
            self.m.read(self.name, "ok", time.monotonic() - start, result.size)
        else:
            self.m.read(self.name, result, time.monotonic() - start)
            if result == CORRUPT:
                self.mark_suspect()
        return result

    def _fetch(self, tenant: str, key: bytes, target: ArenaTarget,
               deadline: float) -> Fetched | str:
        try:
            sock = self._checkout(deadline)
        except TimeoutError:
            return TIMEOUT
        except (OSError, auth.AuthError, ssl.SSLError, wire.WireError) as e:
            log.warning("peer %s: no connection: %s", self.name, e)
            return FAILED
        keep = False
        try:
            rid = next(self._rids) & 0xFFFFFFFF
            _bounded(sock, deadline)
            sock.sendall(wire.encode_request(wire.OP_FETCH, rid, key, tenant))
            head = wire.reply_head(_recv_exact(sock, wire.REPLY.size, deadline))
            if head.rid != rid:
                raise wire.WireError(f"reply to request {head.rid}, expected {rid}")
            if head.status == wire.ABSENT:
                keep = True
                return ABSENT
            if head.size > target.room:  # the directory's size was stale: another chunk
                raise wire.WireError(f"chunk of {head.size} bytes, {target.room} reserved")
            meta = _recv_exact(sock, head.meta_len, deadline)
            owner = _recv_exact(sock, head.tenant_len, deadline).decode(errors="replace")
            extents = target.first(head.size)
            if target.splice and not isinstance(sock, ssl.SSLSocket):
                _splice_into(sock, target.fd, extents, deadline)
            else:
                _copy_into(sock, target, extents, deadline)
            keep = True
            if head.kind not in checksums.KINDS or checksums.compute(
                    head.kind, _read_back(target.fd, extents), meta) != head.checksum:
                return CORRUPT
            return Fetched(head.size, head.checksum, head.kind, meta, owner)
        except TimeoutError:
            return TIMEOUT
        except (OSError, wire.WireError, ssl.SSLError) as e:
            log.warning("peer %s: read of %s failed: %s", self.name, key.hex(), e)
            return FAILED
        finally:
            self._checkin(sock, keep)

    def _checkout(self, deadline: float) -> socket.socket:
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError
        try:
            with self._lock:
                if self._idle:
                    return self._idle.pop()
            return self._connect(deadline)
        except BaseException:
            self._slots.release()
            raise

    def _checkin(self, sock: socket.socket, keep: bool) -> None:
        if keep and not self.closed:
            with self._lock:
                self._idle.append(sock)
        else:
            sock.close()
        self._slots.release()

    def _connect(self, deadline: float) -> socket.socket:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock = socket.create_connection((self.host, self.port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
            mine = auth.nonce()
            _bounded(sock, deadline)
            sock.sendall(auth.hello(self.agent_id, mine))
            theirs = _recv_exact(sock, wire.HELLO.size + wire.PROOF_BYTES, deadline)
            sock.sendall(self._answer(theirs, mine))
            if _recv_exact(sock, 1, deadline) != wire.ACCEPTED:
                raise auth.AuthError("the peer did not accept this agent's proof")
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            with contextlib.suppress(OSError):
                s.close()


def _bounded(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def _copy_into(sock: socket.socket, target: ArenaTarget, extents: list[tuple[int, int]],
               deadline: float) -> None:
    """Receive into the extents through this thread's bounded buffer."""
    buf = _buffer()
    for offset, n in extents:
        done = 0
        while done < n:
            m = min(n - done, len(buf))
            _recv_into(sock, buf[:m], deadline)
            target.write([(offset + done, m)], buf[:m])
            done += m


def _splice_into(sock: socket.socket, fd: int, extents: list[tuple[int, int]],
                 deadline: float) -> None:
    """Move the bytes from the socket into the file at the extents with splice(2), through a
    pipe: they never enter this process."""
    r, w = os.pipe()
    try:
        with contextlib.suppress(OSError):  # a bigger pipe: fewer calls; the default works
            fcntl.fcntl(w, _F_SETPIPE_SZ, COPY_BLOCK)
        src = sock.fileno()
        poll = select.poll()
        poll.register(src, select.POLLIN)
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        for offset, n in extents:
            done = 0
            while done < n:
                try:
                    got = os.splice(src, w, min(n - done, COPY_BLOCK), flags=flags)
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0 or not poll.poll(left * 1000):
                        raise TimeoutError from None
                    continue
                if got == 0:
                    raise ConnectionError("the peer closed the connection")
                while got:
                    put = os.splice(r, fd, got, offset_dst=offset + done, flags=os.SPLICE_F_MOVE)
                    if put <= 0:
                        raise OSError(errno.EIO, "the arena file took no bytes")
                    done += put
                    got -= put
    finally:
        os.close(r)
        os.close(w)


def _read_back(fd: int, extents: list[tuple[int, int]]) -> Iterator[memoryview]:
    """The extents' bytes as the arena file holds them, in pieces of this thread's buffer
    (each valid until the next is asked for), for the checksum."""
    buf = _buffer()
    for offset, n in extents:
        done = 0
        while done < n:
            got = os.preadv(fd, [buf[: min(n - done, len(buf))]], offset + done)
            if got == 0:
                raise OSError(errno.EIO, f"the arena reads short at {offset + done}")
            yield buf[:got]
            done += got


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        _bounded(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n
