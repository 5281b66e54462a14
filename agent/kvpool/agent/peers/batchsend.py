"""A plain-TCP connection's FETCH replies sent a batch at a time from a worker thread, in
one compiled call (`sendkernel`) that never takes the GIL.

The socket stays the transport's (its reads, its close): while a batch is out on the
worker, the transport's reading is paused, so a read error cannot make it close the
socket under the worker (a closed descriptor's number may be reused at once: the worker
would send chunk bytes to another file), and nothing writes to the connection but the
worker (its requests are answered one batch at a time; `DirectSender` is quiet). Every
path that closes the socket on purpose waits for the worker first: the connection's
end (`send` returns only once the call is over, cancelled or not) and a reset of a
reader whose bytes stay unacknowledged (`Unacked.reset` aborts the transport once
`stop`'s future is done). `stop` ends a wait for room at once (an eventfd the call
polls beside the socket).

Workers are shared by every connection, `WORKERS` of them: a connection finding none
free sends its replies from the event loop (`DirectSender`), as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

from . import sendkernel
from .sendkernel import Batch, Kernel

WORKERS = 4
"""Batches out at once, over all connections (each a thread while it runs)."""

_pool: ThreadPoolExecutor | None = None
_busy = 0
"""Batches out now, over all connections."""


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvpool-peer-send")
    return _pool


class BatchSender:
    """Sends one plain-TCP connection's FETCH replies in batches (one batch at a time)."""

    def __init__(self, kernel: Kernel, transport: asyncio.Transport, fd: int) -> None:
        self.kernel = kernel
        self.transport = transport
        self.fd = fd
        self._stop = -1
        """An eventfd the call polls beside the socket: written, a wait for room ends."""
        self._stopped = False
        self.running: asyncio.Future[int] | None = None
        """The call out now."""

    @classmethod
    def make(cls, transport: asyncio.BaseTransport) -> BatchSender | None:
        """A sender for the transport's socket, or None where this path is not open (the
        kernel not compiled (yet), no socket)."""
        k = sendkernel.ready()
        sock = transport.get_extra_info("socket")
        if k is None or sock is None or not isinstance(transport, asyncio.Transport):
            return None
        return cls(k, transport, sock.fileno())

    def free(self) -> bool:
        """A batch may start now: a worker is free, the connection is not ending, and the
        transport has nothing queued before it."""
        t = self.transport
        return (_busy < WORKERS and not self._stopped and not t.is_closing()
                and t.get_write_buffer_size() == 0)

    async def send(self, batch: Batch, bound: float) -> int:
        """Send `batch` (each reply within `bound` seconds): the kernel's code; `batch`
        says how far it went. Returns, or raises CancelledError, only once the worker's
        call is over (a cancellation stops it first)."""
        global _busy
        if self._stop < 0:
            self._stop = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        ctx = batch.pack(self.fd, self._stop, bound)
        t = self.transport
        paused = t.is_reading()
        if paused:
            t.pause_reading()
        _busy += 1
        try:
            fut = self.running = asyncio.get_running_loop().run_in_executor(
                _executor(), self.kernel.call, ctx, self.kernel.fns_at)
        except BaseException:
            _busy -= 1
            raise
        cancelled = False
        try:
            while True:
                try:
                    code = await asyncio.shield(fut)
                    break
                except asyncio.CancelledError:
                    if fut.done() and not fut.cancelled():
                        code = fut.result()
                        cancelled = True
                        break
                    cancelled = True
                    self.stop()
        finally:
            _busy -= 1
            self.running = None
            if paused and not t.is_closing():
                t.resume_reading()
        if cancelled:
            raise asyncio.CancelledError
        return code

    def stop(self) -> asyncio.Future[int] | None:
        """End the batch out now at its next wait for room (it returns STOPPED), and start
        no other: the connection is ending. The future of the call out, if one is."""
        self._stopped = True
        if self._stop >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_write(self._stop, 1)
        return self.running

    def close(self) -> None:
        """The connection is over (no call out: `send` returned)."""
        self._stopped = True
        if self._stop >= 0 and self.running is None:
            os.close(self._stop)
            self._stop = -1
