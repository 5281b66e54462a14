"""A small thread pool whose threads never hold the agent up at exit.

A shared store can hang a call for good (a stuck NFS server, a FIFO where an object should
be): the thread making it never returns. `concurrent.futures.ThreadPoolExecutor` joins its
threads when the interpreter exits, so one such call made SIGTERM unable to stop the agent.
These threads are daemons: a call stuck in one is abandoned at exit, and callers bound
their own waits (`Future.result(timeout=...)`). `max_queued` bounds the calls waiting for a
thread, so a store that stalls cannot pile up work behind it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class PoolFull(OSError):
    """Every thread is busy and `max_queued` calls already wait: refused, not queued."""


class DaemonPool(Executor):
    def __init__(self, threads: int, name: str, max_queued: int | None = None) -> None:
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._waiting = 0
        self._max_queued = max_queued
        self.threads = threads
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            if self._max_queued is not None and self._waiting >= self._max_queued:
                raise PoolFull(f"{self._waiting} calls already wait for a thread")
            self._waiting += 1
        fut: Future[T] = Future()
        self._work.put((fut, fn, args, kwargs))
        return fut

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            with self._lock:
                self._waiting -= 1
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; with `cancel_futures`, drop the ones not started. Never waits
        for a running call (it may never end): `wait` is accepted for the interface."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._work.put(None)
