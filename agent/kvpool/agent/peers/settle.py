"""Results of peer reads handed from worker threads to the event loop, without the worker
giving the GIL up to wake the loop.

A read's worker thread settles each chunk as soon as it is in (the client's read of it
waits for it). `loop.call_soon_threadsafe` wakes the loop by a `socket.send` of a byte to
its self-pipe, which gives the GIL up: the loop thread, woken by that very byte, takes
the GIL and runs the read's continuation (the insert, the client's answer) until its next
system call, and the worker, which needs the GIL back to receive the next chunk, waits
for it. That wait was 8% of a receiving thread's samples at 1 MiB chunks, more than the
chunk's checksum took (docs/benchmarks.md, "The peer tier between two nodes").

Here the worker queues the result and bumps an eventfd the loop watches, with a
non-blocking `write` of 8 bytes that keeps the GIL (`ctypes.PyDLL`: it never blocks, an
eventfd's counter does not fill), then goes on to its next receive, which gives the GIL up
while it waits for the network: the loop runs then. Results queued before the loop gets
to them are resolved in one wake-up.

That `write` still wakes the loop's thread while the worker holds the GIL: on a busy
machine the woken thread may run at once, only to wait for the GIL, and the worker,
preempted, holds it meanwhile (the bump was half of a receiving thread's GIL samples once
the receive itself was compiled). A worker about to make a compiled call can defer the
bump into it (`settle(..., defer=True)`, then `owed_fd` to the call, then `paid`): the
call writes the eventfd first thing, without the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar, Union

T = TypeVar("T")

Target = Union["asyncio.Future[T]", Callable[[T], None]]
"""Where a result goes: a future, or a callback the loop calls with it."""


def _gil_keeping_write() -> Callable[[int], None] | None:
    """A write of one increment to an eventfd that does not release the GIL, or None where
    the platform has none (eventfd is Linux's)."""
    if not hasattr(os, "eventfd"):
        return None
    try:
        libc = ctypes.PyDLL(ctypes.util.find_library("c") or None, use_errno=True)
        write = libc.write
    except (OSError, AttributeError):
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    one = ctypes.c_uint64(1)
    one_at = ctypes.addressof(one)

    def bump(fd: int) -> None:
        if write(fd, one_at, 8) < 0:
            err = ctypes.get_errno()
            if err != errno.EAGAIN:  # EAGAIN: the counter is full: a wake-up is due anyway
                raise OSError(err, os.strerror(err))

    bump.keep = one  # type: ignore[attr-defined]  # the increment outlives every call
    return bump


_bump = _gil_keeping_write()


class Settler(Generic[T]):
    """Settles futures (or calls callbacks) of one event loop from any thread (`settle`),
    many per wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._queue: list[tuple[Target[T], T]] = []
        self._armed = False
        """A wake-up is on its way: the loop drains the queue before it sleeps again."""
        self.wakes = 0
        """Wake-ups of the loop so far (one per run of results it had not drained yet)."""
        self._fd = -1
        """The eventfd while results are queued through it (-1 once closed)."""
        self._efd = -1
        """The eventfd until it is closed for good: not while a deferred bump is owed."""
        self._owed = 0
        """Deferred bumps not paid yet (`settle(..., defer=True)`, then `paid`)."""
        if _bump is not None:
            self._fd = self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            loop.add_reader(self._fd, self._drain)

    def settle(self, fut: Target[T], result: T, *, defer: bool = False) -> bool:
        """Set `result` on `fut` in the loop's thread, soon (once: a settled future is left
        as it is), or call `fut(result)` there where it is a callback (never inline: from
        the loop's thread too, it is queued). From any thread. With `defer`, a wake-up the loop
        needs is not made here: True says one is owed, and the caller writes 1 to
        `owed_fd` soon (a compiled call, without the GIL), then calls `paid` (or `pay`
        to have it made here); the eventfd stays open until then."""
        with self._lock:
            if self._fd >= 0:
                self._queue.append((fut, result))
                if not self._armed:
                    self._armed = True
                    self.wakes += 1
                    if defer:
                        self._owed += 1
                        return True
                    assert _bump is not None
                    _bump(self._fd)  # under the lock: `close` cannot free the fd meanwhile
                return False
        with contextlib.suppress(RuntimeError):  # the loop is closed: the agent is stopping
            self.loop.call_soon_threadsafe(_deliver, self.loop, fut, result)
        return False

    @property
    def owed_fd(self) -> int:
        """The eventfd a deferred wake-up is written to (open until every one is paid)."""
        return self._efd

    def paid(self) -> None:
        """A deferred wake-up was written: the eventfd may close now if `close` came."""
        with self._lock:
            self._owed -= 1
            if self._owed or self._fd >= 0 or self._efd < 0:
                return
            efd, self._efd = self._efd, -1
        os.close(efd)

    def pay(self) -> None:
        """Make a deferred wake-up here (the GIL kept, as `settle` does), then `paid`."""
        with self._lock:
            if self._efd >= 0:
                assert _bump is not None
                _bump(self._efd)
        self.paid()

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._fd)
        with self._lock:
            queued, self._queue = self._queue, []
            self._armed = False
        _deliver_all(self.loop, queued)

    def close(self) -> None:
        """Stop watching the eventfd (in the loop's thread); what is queued is resolved now,
        what is settled later goes by `call_soon_threadsafe`."""
        with self._lock:
            fd, self._fd = self._fd, -1
            efd = -1
            if not self._owed:  # else the last `paid` closes it: a worker writes to it yet
                efd, self._efd = self._efd, -1
        if fd < 0:
            return
        with contextlib.suppress(RuntimeError, AttributeError, ValueError):  # a closed loop
            self.loop.remove_reader(fd)
        if efd >= 0:
            os.close(efd)
        with self._lock:
            queued, self._queue = self._queue, []
        with contextlib.suppress(RuntimeError):  # a closed loop
            _deliver_all(self.loop, queued)


_drains = threading.local()


def after_drain(fn: Callable[[], None]) -> None:
    """Call `fn` once the results a `Settler` is delivering now are all delivered (a
    callback's work for many results at once: the store lands the chunks a drain brings
    together, `PeerReads._land`); outside of a drain, now. In the loop's thread."""
    ends: list[Callable[[], None]] | None = getattr(_drains, "ends", None)
    if ends is None:
        fn()
    else:
        ends.append(fn)


def _deliver_all(loop: asyncio.AbstractEventLoop,
                 queued: list[tuple[Target[T], T]]) -> None:
    """Every result to its target, then what their callbacks asked for once they all are
    (`after_drain`), each error reported as asyncio reports a callback's."""
    outer = getattr(_drains, "ends", None)
    ends: list[Callable[[], None]] = []
    _drains.ends = ends
    try:
        for fut, result in queued:
            _deliver(loop, fut, result)
    finally:
        _drains.ends = outer
        for fn in ends:
            try:
                fn()
            except Exception as e:  # (a bug: reported, the others still run)
                loop.call_exception_handler({"message": "peer read callback failed",
                                             "exception": e})


def _deliver(loop: asyncio.AbstractEventLoop, target: Target[T], result: T) -> None:
    """`result` to its future (unless settled already), or to its callback: one that
    raises is reported as asyncio reports a callback's error, and the rest of the queue
    is delivered all the same."""
    if isinstance(target, asyncio.Future):
        if not target.done():
            target.set_result(result)
        return
    try:
        target(result)
    except Exception as e:  # (a bug: one read's, not the others' queued with it)
        loop.call_exception_handler({"message": "peer read callback failed",
                                     "exception": e})
