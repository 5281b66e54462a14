"""Background work offered on the event loop, done in a worker pool a batch at a time."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

BATCH_ITEMS = 64
BATCH_BYTES = 16 << 20
"""Most chunks (and chunk bytes) one batch of NVMe writes or file removals takes."""
BATCHES_IN_FLIGHT = 2
"""Batches of one kind running at once; what is offered meanwhile waits for the next."""

T = TypeVar("T")
R = TypeVar("R")


class Batches(Generic[T, R]):
    """Work offered on the event loop, done in a worker pool a batch at a time.

    One executor call per batch instead of one per chunk: a call costs two thread
    hand-offs (a queue put that wakes a worker, a callback that wakes the loop),
    which for a small chunk cost more than its file's syscalls. What is offered in
    one loop tick leaves together at the end of that tick; what is offered while
    `concurrency` batches are running waits for one to finish and goes in the next,
    so the busier the tier the larger the batches, and an idle tier adds no delay.

    `work(batch)` runs in the pool and must not raise (it reports per item in its
    result); `done(batch, result)` runs on the loop. `close()` runs what is still
    waiting in the calling thread: nothing offered is lost at shutdown.
    """

    def __init__(self, pool: Executor, work: Callable[[list[T]], R],
                 done: Callable[[list[T], R], None], *, weight: Callable[[T], int] | None = None,
                 key: Callable[[T], bytes] | None = None,
                 concurrency: int = BATCHES_IN_FLIGHT, max_items: int = BATCH_ITEMS,
                 max_weight: int = BATCH_BYTES) -> None:
        self.pool = pool
        self.work = work
        self.done = done
        self.weight = weight
        self.key = key
        """With a key: items of one key are done one after the other, in the order offered
        (an item waits while a running batch holds an earlier one of its key)."""
        self._busy: dict[bytes, int] = {}
        """Keys in running batches, with how many items of each."""
        self.concurrency = concurrency
        self.max_items = max_items
        self.max_weight = max_weight
        self.waiting: list[T] = []
        self.running = 0
        """Batches handed to the pool whose `done` has not run yet."""
        self.batches = 0
        """Batches handed to the pool so far (tests and profiling read it)."""
        self._scheduled = False

    def __len__(self) -> int:
        return len(self.waiting)

    def offer(self, item: T) -> None:
        self.waiting.append(item)
        if not self._scheduled and self.running < self.concurrency:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._start)

    def _take(self) -> list[T]:
        """The next batch from the front of `waiting`, within the caps; with a key, an
        item whose key a running batch (or an item left to wait) holds stays behind."""
        batch: list[T] = []
        left: list[T] = []
        total = 0
        held: set[bytes] = set()  # keys of items left to wait: later ones of them wait too
        for i, item in enumerate(self.waiting):
            if batch and (len(batch) >= self.max_items or (self.weight is not None
                                                           and total >= self.max_weight)):
                left.extend(self.waiting[i:])
                break
            if self.key is not None:
                k = self.key(item)
                if k in self._busy or k in held:
                    held.add(k)
                    left.append(item)
                    continue
            batch.append(item)
            if self.weight is not None:
                total += self.weight(item)
        self.waiting = left
        return batch

    def _hold(self, batch: list[T], n: int) -> None:
        if self.key is None:
            return
        for item in batch:
            k = self.key(item)
            count = self._busy.get(k, 0) + n
            if count:
                self._busy[k] = count
            else:
                del self._busy[k]

    def _start(self) -> None:
        self._scheduled = False
        loop = asyncio.get_running_loop()
        while self.waiting and self.running < self.concurrency:
            batch = self._take()
            if not batch:
                return  # all that waits is behind running batches of its keys
            try:
                fut = loop.run_in_executor(self.pool, self.work, batch)
            except RuntimeError:  # the pool is shut down: close() runs what waits
                self.waiting[:0] = batch
                return
            self._hold(batch, 1)
            self.running += 1
            self.batches += 1
            fut.add_done_callback(functools.partial(self._finished, batch))

    def _finished(self, batch: list[T], fut: asyncio.Future[R]) -> None:
        self.running -= 1
        self._hold(batch, -1)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:  # `work` must not raise: a bug, but one that must not hang us
            log.error("a batch of %d background jobs failed", len(batch), exc_info=exc)
        else:
            self.done(batch, fut.result())
        if self.waiting and not self._scheduled:
            self._start()

    def close(self) -> None:
        """Do what still waits, here and now (the loop is stopping: `done` is not called;
        call it once the pool is shut down, so no batch is running)."""
        self._busy.clear()
        while self.waiting:
            self.work(self._take())
