"""Read leases of chunks sent with `sendfile`, held until TCP has their bytes acknowledged.

`sendfile` on a TCP socket queues references to the file's pages, not copies: bytes not
sent yet (a small receive window, a slow reader) and bytes sent but not acknowledged (a
retransmission resends from the same pages) still point at the chunk's arena extents when
`sendfile` returns. Were the read lease to end then, a DELETE, an eviction or a demotion
could free the extents, a put could rewrite them, and the peer would receive the new
bytes: a checksum failure on its side (a miss, never wrong KV) and an honest holder marked
suspect. So a connection's chunk leases end once the kernel no longer needs the pages:
once the peer acknowledged the chunk's last byte, or the connection was reset (which
purges its send queue). That holds for a peer on another host only: one on this kernel
acknowledges the pages themselves as they reach its receive queue, before it reads them,
and is sent arena chunks by copy instead (`server.ChunkSource`), with no lease held here.

The kernel's own counters say where a chunk ends and what is acknowledged, so no write of
the connection needs counting: right after a chunk's last byte went to the socket (nothing
written after it), the bytes the socket was ever given are its send queue (`SIOCOUTQ`:
unsent and unacknowledged) plus what was acknowledged (`tcp_info.tcpi_bytes_acked`). The
lease ends when `tcpi_bytes_acked` reaches that. Both are read at the look after a
chunk was handed (in the event loop's next turn, or at the one scheduled already: bytes
written after a chunk only move its end later, so one read serves every chunk handed
meanwhile) and, while leases wait, every `POLL` seconds (a timer, no busy loop). A
reader that has not acknowledged a chunk `timeout` seconds after its last byte was
handed (the bound a send has) gets its connection reset (SO_LINGER 0: the close drops
the queue) and only then are the leases released.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import math
import socket
import struct
import termios
import time
from collections import deque
from collections.abc import Callable
from typing import Any

POLL = 0.001
"""Seconds between checks while leases wait for their bytes' acknowledgement."""

_TCP_INFO = struct.Struct("<B119xQ")
"""`struct tcp_info` up to `tcpi_bytes_acked` (Linux 4.2+): `tcpi_state` is its first byte,
`tcpi_bytes_acked` the u64 at byte 120."""
_TCP_CLOSE = 7
"""`tcpi_state` of a connection that is over: reset or closed, its send queue purged."""
_LINGER_RESET = struct.pack("ii", 1, 0)


def _acked(sock: socket.socket) -> tuple[int, bool]:
    """(bytes the peer acknowledged, whether the connection is over and its queue gone)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    if len(info) < _TCP_INFO.size:  # a kernel before 4.2: leases end as the bytes go
        raise OSError("tcp_info without tcpi_bytes_acked")
    state, acked = _TCP_INFO.unpack(info)
    return acked, state == _TCP_CLOSE


def _queued(sock: socket.socket) -> int:
    """Bytes in the socket's send queue (not sent, or not acknowledged)."""
    queued: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, _INT))[0]
    return queued


_INT = bytes(4)


class Unacked:
    """The chunk leases of one plain-TCP connection whose bytes the kernel may still send.

    `hold` right after a chunk's last byte was handed to the socket; `settle` before the
    connection closes (a graceful close would leave the kernel sending from the pages
    after the leases ended: it waits for the acknowledgements, or resets)."""

    def __init__(self, transport: asyncio.WriteTransport, sock: socket.socket,
                 timeout: float,
                 on_reset: Callable[[], asyncio.Future[Any] | None] | None = None) -> None:
        self.transport = transport
        self.sock = sock
        self.timeout = timeout
        self.on_reset = on_reset
        """Called before a reset aborts the transport (a reply sent by the connection's
        `DirectSender` ends first); where it gives a future (a batch's call out on a
        worker, `BatchSender.stop`), the abort waits for it: the socket must not close
        under the worker."""
        self.pending: deque[tuple[float, float, Callable[[], None]]] = deque()
        """(end: acknowledged bytes that free it, deadline, release), in end order."""
        self._fresh: list[tuple[bool, float, Callable[[], None]]] = []
        """(sent whole, deadline, release) of chunks held since the last look, in order."""
        self._timer: asyncio.Handle | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._reset = False
        self._closed = False
        """Reset, and the socket closed since (its queue purged): leases end at once."""

    def hold(self, release: Callable[[], None], whole: bool = True) -> None:
        """Keep a chunk's lease (`release` ends it) until its bytes are acknowledged; one
        not sent `whole` (its send failed part way) until the connection is reset.

        Right after its last byte was handed to the socket: where it ends is read at the
        next look (`check`: in the loop's next turn, or the one scheduled already), once
        for every chunk held meanwhile. A later read counts the bytes of the replies
        after it too: its lease may end a little later, never before its bytes are
        acknowledged. (A `tcp_info` read and an ioctl per chunk, with a timer moved
        each, were a third of the holder's Python serving 1 MiB chunks.)"""
        if self._reset:
            if self._closed:
                release()
            else:  # the abort waits for a worker: released once the socket is closed
                self.pending.append((math.inf, math.inf, release))
                self._idle.clear()
            return
        self._fresh.append((whole, time.monotonic() + self.timeout, release))
        self._idle.clear()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_soon(self.check)

    def check(self) -> None:
        """Release what is acknowledged; reset a connection whose oldest chunk waited past
        its deadline; otherwise look again in `POLL` seconds (one look scheduled at a
        time: a connection polls once, not once for every chunk it holds). The chunks
        held since the last look join `pending` at the bytes the socket was handed by now
        (its send queue, read first, plus the bytes acknowledged, read after: a sum never
        short of where they end)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._reset:
            return  # its leases are released after the socket closes
        if not (self.pending or self._fresh):
            self._idle.set()
            return
        try:
            queued = _queued(self.sock) if self._fresh else 0
            acked, over = _acked(self.sock)
        except OSError:  # the socket is closed: a reset or failed connection, queue gone
            acked, over = 0, True
        if over:
            self._release_all()
            return
        if self._fresh:
            fresh, self._fresh = self._fresh, []
            end = float(queued + acked)
            for whole, deadline, release in fresh:
                self.pending.append((end if whole else math.inf, deadline, release))
        while self.pending and self.pending[0][0] <= acked:
            self.pending.popleft()[2]()
        if not self.pending:
            self._idle.set()
        elif self.pending[0][1] <= time.monotonic():
            self.reset()
        else:
            self._timer = asyncio.get_running_loop().call_later(POLL, self.check)

    def reset(self) -> None:
        """Abort the connection with a reset, which drops its send queue (and with it the
        page references), then release every lease (after the socket is closed: the
        transport closes it in a callback queued before ours)."""
        if self._reset:
            return
        self._reset = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with contextlib.suppress(OSError):  # closed already
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        waiting = self.on_reset() if self.on_reset is not None else None
        if waiting is None or waiting.done():
            self._abort()
        else:
            waiting.add_done_callback(lambda _: self._abort())

    def _abort(self) -> None:
        self.transport.abort()
        asyncio.get_running_loop().call_soon(self._release_all)

    def _release_all(self) -> None:
        if self._reset:
            self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.pending:
            self.pending.popleft()[2]()
        fresh, self._fresh = self._fresh, []
        for _, _, release in fresh:
            release()
        self._idle.set()

    async def settle(self, wait: bool) -> None:
        """Before the connection closes: every lease released, once its bytes are
        acknowledged (`wait`, bounded by the deadlines) or at once by a reset."""
        if self._fresh:
            self.check()
        if not self.pending:
            return
        if not wait or any(math.isinf(end) for end, _, _ in self.pending):
            self.reset()
        await self._idle.wait()
