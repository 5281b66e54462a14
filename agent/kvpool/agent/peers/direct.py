"""FETCH replies on plain TCP, sent straight from the event loop's thread.

A reply is its head (`wire.encode_reply`) and its chunk's byte ranges in a file (the
arena, or an NVMe chunk file). Both go to the non-blocking socket in this process, the
head with a `send` flagged `MSG_MORE` (the kernel holds it for the bytes that follow: on
this TCP_NODELAY socket it was a segment of its own, one more packet per chunk for both
ends to process, the reader woken for the head alone), the bytes with `os.sendfile` (the
kernel queues references to the file's pages: `unacked` holds the chunk's lease until
they are acknowledged), as far as the socket's buffer takes them; the rest each time the
socket has room again, from a writer callback the loop calls, the reply's coroutine woken
only once it is all out.

What it replaces, per chunk that did not fit the buffer at once (most chunks of a
pipelined batch of 1 MiB chunks, once the reader's window is full): the head through the
transport, then `loop.sendfile` under `wait_for`: a task, the transport's empty-buffer
waiter, its reading paused and resumed, a writer registered per call and a future per
wait, which were a sixth of the holding agent's Python per chunk (docs/benchmarks.md,
"The peer tier between two nodes").

The transport keeps the connection (its reads, its close): a reply is sent this way only
while the transport's own buffer is empty, and nothing else writes to the connection
until the reply is out (a connection's requests are answered one at a time). The
writer callback is registered with the loop's own `_add_writer`, as asyncio's
`loop.sendfile` does for a transport's socket (the public `add_writer` refuses a
transport's descriptor); a loop without it (not asyncio's selector loop) is not offered
this path (`DirectSender.make` gives None).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
from collections.abc import Callable
from typing import Any


class DirectSender:
    """Sends one plain-TCP connection's FETCH replies (one at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.BaseTransport,
                 fd: int, add_writer: Callable[..., Any],
                 remove_writer: Callable[[int], object]) -> None:
        self.loop = loop
        self.transport = transport
        self.fd = fd
        self._add_writer = add_writer
        self._remove_writer = remove_writer
        self._head = bytearray()
        self._sent = 0
        """Bytes of `_head` the socket took."""
        self._file = -1
        self._ranges: list[tuple[int, int]] = []
        self._waiter: asyncio.Future[None] | None = None
        self._registered = False
        """The writer callback is registered with the loop."""
        self._deadline = 0.0
        """The loop's time by which the reply waiting now must be out."""
        self._watch: asyncio.TimerHandle | None = None

    @classmethod
    def make(cls, transport: asyncio.BaseTransport) -> DirectSender | None:
        """A sender for the transport's socket, or None where this path is not open (no
        socket, or a loop without a writer registration for a transport's socket)."""
        loop = asyncio.get_running_loop()
        add = getattr(loop, "_add_writer", None)
        remove = getattr(loop, "_remove_writer", None)
        sock = transport.get_extra_info("socket")
        if add is None or remove is None or sock is None:
            return None
        return cls(loop, transport, sock.fileno(), add, remove)

    def ready(self) -> bool:
        """A reply may be sent now: the transport has nothing queued before it."""
        transport = self.transport
        assert isinstance(transport, asyncio.WriteTransport)
        return not transport.is_closing() and transport.get_write_buffer_size() == 0

    def send(self, head: bytes, file: int, ranges: list[tuple[int, int]]) -> bool:
        """Start a reply: `head`, then the `ranges` (offset, length) of `file`. True when
        the socket took all of it now; else `rest` sends what is left. Raises OSError
        when the connection failed, ConnectionError when the file ends before a range
        (the reply cannot be completed: the connection must close)."""
        self._head, self._sent = bytearray(head), 0  # (writable: `_send_more` exports it)
        self._file, self._ranges = file, list(ranges)
        return self._step()

    async def rest(self, timeout: float) -> None:
        """Send the rest of the reply as the socket takes it; TimeoutError when that takes
        more than `timeout` seconds (a reader that stops reading must not hold the
        chunk's lease longer), ConnectionResetError when `abort`ed. The writer callback
        stays registered after a reply that went out whole (the next reply of a batch
        mostly waits for room too): the callback unregisters itself when it finds no reply
        waiting, and `quiet` before anything else writes to the connection."""
        waiter = self._waiter = self.loop.create_future()
        self._deadline = self.loop.time() + timeout
        if self._watch is None:  # one timer for many replies, not one each
            self._watch = self.loop.call_at(self._deadline, self._expire)
        if not self._registered:
            self._add_writer(self.fd, self._writable)
            self._registered = True
        try:
            await waiter
        except BaseException:
            self._unregister()
            raise
        finally:
            self._waiter = None

    def quiet(self) -> None:
        """Before the transport writes to the connection: the writer callback goes (the
        transport registers its own when its buffer fills; a callback left here would be
        replaced, then remove the transport's)."""
        self._unregister()

    def _expire(self) -> None:
        """The watch's timer: a reply past its deadline fails; while one waits, the timer
        is set again for its deadline; else it lapses."""
        self._watch = None
        if self._waiter is None or self._waiter.done():
            return
        if self.loop.time() >= self._deadline:
            self._fail(TimeoutError("the reader took longer than its bound to take a chunk"))
        else:
            self._watch = self.loop.call_at(self._deadline, self._expire)

    def close(self) -> None:
        """The connection is over."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self.abort()

    def abort(self) -> None:
        """The connection is being reset: a reply waiting for room ends now (before the
        socket closes: its writer callback must not outlive the descriptor)."""
        self._fail(ConnectionResetError("the connection was reset"))

    def _writable(self) -> None:
        waiter = self._waiter
        if waiter is None:
            self._unregister()  # no reply under way: the socket's room is no news
            return
        if waiter.done():  # out, its coroutine not run yet: the next reply may need room
            return
        try:
            if self._step():
                waiter.set_result(None)
        except OSError as e:
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        # The callback goes at once, not when the reply's coroutine next runs: a failed
        # connection's transport closes the socket in the loop's next turn.
        self._unregister()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)

    def _unregister(self) -> None:
        if self._registered:
            self._registered = False
            self._remove_writer(self.fd)

    def _step(self) -> bool:
        """Send what the socket takes now; True once the reply is out."""
        ranges = self._ranges
        # MSG_MORE only where bytes follow: a head held with nothing behind it would wait
        # for the kernel's 200 ms timer.
        more = socket.MSG_MORE if ranges else 0
        while self._sent < len(self._head):
            try:
                self._sent += _send_more(self.fd, self._head, self._sent, more)
            except BlockingIOError:
                return False
        while ranges:
            offset, n = ranges[0]
            try:
                sent = os.sendfile(self.fd, self._file, offset, n)
            except BlockingIOError:
                return False
            if sent == 0:  # the file ends before the range: the reply is cut
                raise ConnectionError(f"the chunk's file ends at {offset}")
            if sent < n:
                ranges[0] = (offset + sent, n - sent)
            else:
                ranges.pop(0)
        return True


_libc = ctypes.CDLL(None, use_errno=True)
_libc_send = _libc.send
_libc_send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc_send.restype = ctypes.c_ssize_t


def _send_more(fd: int, data: bytearray, at: int, flags: int) -> int:
    """`send(2)` of `data[at:]` with `flags` on the transport's own descriptor: bytes sent,
    BlockingIOError when the socket has no room. (asyncio's socket wrapper has no `send`,
    and a socket object of our own would be a second descriptor: epoll would keep the
    first's registration, the writer callback's, alive after the transport closes it.)"""
    n = len(data) - at
    r = _libc_send(fd, (ctypes.c_char * n).from_buffer(data, at), n,
                   flags | socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    if r < 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:
            return 0  # (the caller asks again)
        if err in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise BlockingIOError(err, os.strerror(err))
        raise OSError(err, os.strerror(err))
    return int(r)
