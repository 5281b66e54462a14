"""Write-behind uploads to the shared tier: bounded, never blocking, dropping when it must.

The store offers chunks (on admission, or on eviction from G3 with
`onEvict: demote`); `writeConcurrency` worker threads upload them. Offering
is O(1) and never waits: the shared tier is a cache of a cache, so when the
queue is full the OLDEST pending write is dropped (the newest chunks are the
likeliest to be asked for again) and counted, and while the tier is
unhealthy every pending and offered write is dropped and counted instead of
piling up behind a dead store. A failed upload is retried with exponential
backoff and jitter, unless the tier turned unhealthy meanwhile.

Pending writes are keyed by chunk key: offering a key that is already
pending does not queue a second upload (objects are content-addressed).
One key is never uploaded by two workers at once, nor while a delete of it holds
the key (`exclusive`): the store sees a key's writes and deletes in the order the
agent made them, so a delete never lands after a newer upload, nor an upload after
a newer delete.

The queue holds copies of the chunks, so it is bounded by bytes as well as by count:
pending and in-flight uploads together hold at most `max_bytes` (`DEFAULT_MAX_BYTES`
unless told), the oldest pending going first; a chunk that cannot fit even alone
beside the uploads in flight is dropped and counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .tiers.base import ChunkRecord, ChunkTier
from .tiers.shared import SharedTierUnavailable

if TYPE_CHECKING:
    from .metrics import AgentMetrics

log = logging.getLogger(__name__)


DEFAULT_MAX_BYTES = 256 << 20
"""Chunk bytes the queue may hold (pending and in flight): a count alone allowed
`depth` x the largest chunk (64 GiB with the defaults) of heap."""


class KeyBusy(Exception):
    """`exclusive` waited its time and the key's upload is still in flight."""


@dataclass(frozen=True, slots=True)
class QueueStats:
    pending: int
    in_flight: int
    written: int
    dropped: int


class WriteBehindQueue:
    def __init__(self, tier: ChunkTier, depth: int, concurrency: int,
                 metrics: AgentMetrics | None = None, *, retries: int = 3,
                 backoff_s: float = 0.1, max_backoff_s: float = 5.0, start: bool = True,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if depth < 1 or concurrency < 1:
            raise ValueError("depth and concurrency must be at least 1")
        self.tier = tier
        self.depth = depth
        self.concurrency = concurrency
        self.metrics = metrics
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_bytes = max_bytes
        self._pending: OrderedDict[bytes, ChunkRecord] = OrderedDict()
        self._pending_bytes = 0
        self._in_flight_bytes = 0
        self._cond = threading.Condition()
        self._in_flight = 0
        self._busy: set[bytes] = set()
        """Keys being uploaded, or held by `exclusive`: no worker takes them meanwhile."""
        self._closing = False
        self._stop = threading.Event()  # wakes workers sleeping in a backoff
        self._workers: list[threading.Thread] = []
        self.written = 0
        """Uploads that succeeded."""
        self.dropped = 0
        """Writes given up: overflow, unhealthy tier, retries exhausted, close."""
        self.uploaded: Callable[[bytes], None] | None = None
        """Called with the key of each upload that landed, in the worker's thread (KV
        events announce the chunk in the shared tier then)."""
        if start:
            self.start()

    def start(self) -> None:
        """Start the workers (a queue built with `start=False` only collects offers)."""
        if self._workers:
            return
        for i in range(self.concurrency):
            t = threading.Thread(target=self._work, name=f"kvpool-writebehind-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    @property
    def queue_depth(self) -> int:
        """Writes waiting for a worker (not counting uploads in flight)."""
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def stats(self) -> QueueStats:
        """A consistent snapshot: every offer is in exactly one of the four (an offer of
        a key already pending merges into it and is not counted again)."""
        with self._cond:
            return QueueStats(len(self._pending), self._in_flight, self.written, self.dropped)

    def offer(self, rec: ChunkRecord) -> None:
        """Queue an upload; returns at once. Never raises for a full queue or a dead store.

        The queue keeps the record until uploaded, so it must not point into the
        DRAM arena (which may reuse the memory): a memoryview is copied to bytes.
        Pass `bytes` to avoid the copy.
        """
        if not isinstance(rec.data, bytes):
            rec = dataclasses.replace(rec, data=bytes(rec.data))
        with self._cond:
            if self._closing or not self.tier.healthy()[0]:
                # Drop what waits too: it would only fail against a dead store.
                self._count_dropped(len(self._pending) + 1)
                self._pending.clear()
                self._pending_bytes = 0
            elif self._in_flight_bytes + rec.size > self.max_bytes:
                self._count_dropped(1)  # no room even alone: keep what waits
            elif rec.key not in self._pending:
                while self._pending and (
                        len(self._pending) >= self.depth
                        or self._held_bytes + rec.size > self.max_bytes):
                    _, old = self._pending.popitem(last=False)  # the oldest goes first
                    self._pending_bytes -= old.size
                    self._count_dropped(1)
                self._pending[rec.key] = rec
                self._pending_bytes += rec.size
                self._cond.notify()

    @property
    def _held_bytes(self) -> int:
        return self._pending_bytes + self._in_flight_bytes

    @property
    def held_bytes(self) -> int:
        """Chunk bytes the queue holds: pending and in flight."""
        with self._cond:
            return self._held_bytes

    def discard(self, key: bytes) -> bool:
        """Forget a pending upload (its chunk was deleted); False if none was pending."""
        with self._cond:
            rec = self._pending.pop(key, None)
            if rec is None:
                return False
            self._pending_bytes -= rec.size
            return True

    @contextlib.contextmanager
    def exclusive(self, key: bytes, timeout: float) -> Iterator[None]:
        """Hold `key`: wait (up to `timeout`, else `KeyBusy`) for an upload of it in
        flight to end, and start none until the block is left. A shared delete runs in
        here, so it lands after the upload it races and before the next one."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key in self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KeyBusy(f"an upload of {key.hex()} is still in flight")
                self._cond.wait(left)
            self._busy.add(key)
        try:
            yield
        finally:
            with self._cond:
                self._busy.discard(key)
                self._cond.notify_all()  # a worker may wait for this key's pending upload

    def drain(self, timeout: float) -> bool:
        """Wait until nothing is pending or in flight; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, drain_timeout: float = 5.0) -> int:
        """Upload what is pending for up to `drain_timeout`, drop the rest; stop the workers.

        Returns how many writes were dropped by the close.
        """
        if self._workers:
            self.drain(drain_timeout)
        with self._cond:
            self._closing = True
            left = len(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            self._count_dropped(left)
            self._cond.notify_all()
        self._stop.set()
        for t in self._workers:
            t.join(timeout=max(drain_timeout, 0.1))
        return left

    # -- workers

    def _work(self) -> None:
        while True:
            rec = self._next()
            if rec is None:
                return
            try:
                ok = self._upload(rec)
            except Exception:  # a worker must survive anything one upload throws
                log.exception("write-behind upload of %s failed", rec.key.hex())
                ok = False
            landed = self.uploaded
            if ok and landed is not None:
                landed(rec.key)  # before drain() returns: a drained queue was announced
            with self._cond:
                self._busy.discard(rec.key)
                self._in_flight -= 1
                self._in_flight_bytes -= rec.size
                if ok:
                    self.written += 1
                else:
                    self._count_dropped(1)
                self._cond.notify_all()

    def _next(self) -> ChunkRecord | None:
        with self._cond:
            while True:
                if self._closing:
                    return None
                rec = self._oldest_free()
                if rec is not None:
                    break
                self._cond.wait()
            del self._pending[rec.key]
            self._busy.add(rec.key)
            self._pending_bytes -= rec.size
            self._in_flight += 1
            self._in_flight_bytes += rec.size
            return rec

    def _oldest_free(self) -> ChunkRecord | None:
        """The oldest pending write whose key is not busy. Busy keys are at most the
        workers plus the deletes under way, so this looks at a few entries at most."""
        for key, rec in self._pending.items():
            if key not in self._busy:
                return rec
        return None

    def _upload(self, rec: ChunkRecord) -> bool:
        """One chunk, with retries; False when given up."""
        for attempt in range(self.retries + 1):
            if not self.tier.healthy()[0] or self._closing:
                return False
            try:
                self.tier.write(rec)
                return True
            except SharedTierUnavailable:
                return False
            except OSError as e:
                if attempt == self.retries or not self.tier.healthy()[0]:
                    log.warning("write-behind gives up on %s: %s", rec.key.hex(), e)
                    return False
                if self._stop.wait(self._backoff(attempt)):
                    return False
        return False

    def _backoff(self, attempt: int) -> float:
        # Full jitter: workers that failed together do not retry together.
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2**attempt))

    def _count_dropped(self, n: int) -> None:
        """Count dropped writes; called with the lock held, so `stats()` adds up."""
        if n <= 0:
            return
        self.dropped += n
        if self.metrics is not None:
            self.metrics.shared_dropped.inc(n)
