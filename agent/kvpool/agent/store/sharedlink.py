"""The store's side of the shared tier (G4): presence checks, uploads, deletes, probes.

Nothing here makes a client wait on the shared store except LOOKUP's presence
check, and that within the tier's lookup budget, in threads of its own. Uploads
go through the bounded write-behind queue; deletes and probes run in the store's
background pool. A delete the store has not confirmed is kept in the commit journal
as well as here, so an agent restarted meanwhile retries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, ThreadPoolExecutor

from .. import policy as pol
from ..config import SharedTier, TierPolicy
from ..journal import Journal, pending_shared_deletes
from ..metrics import AgentMetrics
from ..tiers.base import ChunkRecord
from ..tiers.shared import SharedChunkTier
from ..writebehind import KeyBusy, QueueStats, WriteBehindQueue
from .deletes import Deletes
from .observer import NO_OBSERVER, TierObserver

log = logging.getLogger(__name__)

PRESENCE_WAIT_THREADS = 8
"""Threads that wait out shared-tier presence checks."""
SHARED_PROBE_KEYS = 256
"""Most keys past the local prefix one LOOKUP asks the shared tier about."""
SHARED_PROBE_INTERVAL = 1.0
"""Seconds between health probes of an unhealthy shared tier."""
PENDING_DELETES = 1 << 16
"""Most deletes kept for a retry while the shared tier cannot take them (the oldest go)."""
DELETE_WAITS_FOR_UPLOAD = 10.0
"""Seconds a shared delete waits for an upload of its key in flight to land (it must land
first, or it would bring the chunk back); past that the delete is retried later."""


class SharedLink:
    def __init__(self, tier: SharedChunkTier, cfg: SharedTier | None, metrics: AgentMetrics,
                 background: Executor, policy: Callable[[], TierPolicy],
                 journal: Journal | None = None, deletes: Deletes | None = None) -> None:
        self.tier = tier
        self.m = metrics
        self._background = background
        """Where deletes and probes run (the store's background pool)."""
        self._policy = policy
        self.uploads: WriteBehindQueue | None = None
        if cfg is not None:
            self.uploads = WriteBehindQueue(tier, cfg.write_queue_depth, cfg.write_concurrency,
                                            metrics)
        self._presence = ThreadPoolExecutor(PRESENCE_WAIT_THREADS,
                                            thread_name_prefix="kvpool-lookup")
        """Threads that wait out presence checks, so a slow store cannot hold up the reads
        and writes of the local tiers."""
        self._next_probe = 0.0
        self.pending_deletes: OrderedDict[bytes, int] = OrderedDict()
        """Keys deleted here whose object the store has not confirmed gone, each with its
        delete's number: retried until it has, and never read from the store meanwhile
        (another node must not bring the chunk back through us, nor we through it). The
        loop changes it; the delete threads only read it."""
        self._delete_number = itertools.count(1)
        self._journal = journal
        """Where the pending deletes are recorded too: an agent restarted before the store
        confirms them retries them (from `retry_deletes`, once the store is healthy)."""
        if journal is not None:
            self.pending_deletes.update(
                (key, next(self._delete_number))
                for key in pending_shared_deletes(journal.path)[-PENDING_DELETES:])
            journal.deletes = len(self.pending_deletes)
            journal.live_deletes = lambda: list(self.pending_deletes)
        self._retrying = False
        self.observer: TierObserver = NO_OBSERVER
        """Told of the chunks this agent knows the shared store to hold (`observe`)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.deletes = deletes if deletes is not None else Deletes()
        """The store's DELETEs: an upload of a copy made before one of its key is dropped."""

    def observe(self, observer: TierObserver) -> None:
        """Tell `observer` what this agent learns of the shared store: its own uploads
        landing, chunks it read there, and chunks it deleted or found gone or corrupt
        there. Other nodes' uploads and deletes are not seen (docs/events.md)."""
        self.observer = observer
        if self.uploads is not None:
            self.uploads.uploaded = self._landed

    def _know_loop(self) -> None:
        """Remember the event loop, for `_landed`: uploads land in worker threads, and
        some are offered from one (NVMe files passed on to G4), but each is decided on
        the loop first (`demotes`, `writes_through`)."""
        if self._loop is None:
            with contextlib.suppress(RuntimeError):
                self._loop = asyncio.get_running_loop()

    def _landed(self, key: bytes) -> None:
        """An upload landed (a write-behind worker's thread): announced on the loop."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(self.found, key)

    def found(self, key: bytes) -> None:
        """The store holds `key` (this agent's upload landed, or a read of it found it),
        unless this agent deleted it meanwhile."""
        if key not in self.pending_deletes:
            self.observer.stored("shared", key)

    def lost(self, key: bytes) -> None:
        """The store holds no good copy of `key` (a read found it absent or corrupt)."""
        self.observer.removed("shared", key)

    def healthy(self) -> bool:
        return self.tier.healthy()[0]

    def deleted(self, key: bytes) -> bool:
        """Deleted here, and the store's copy not yet confirmed gone."""
        return key in self.pending_deletes

    async def prefix(self, keys: list[bytes]) -> int:
        """Leading keys the shared tier holds, answered within its lookup budget."""
        if not self.healthy():
            return 0
        keys = keys[:SHARED_PROBE_KEYS]
        for i, k in enumerate(keys):
            if k in self.pending_deletes:
                keys = keys[:i]
                break
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(self._presence, self.tier.contains_many, keys)
        n = 0
        for k in keys:
            if not found.get(k):
                break
            n += 1
        return n

    # -- uploads

    def demotes(self, hits: int) -> bool:
        """Whether a chunk leaving the lowest local tier goes to G4 (when it is not there
        already by write-through)."""
        self._know_loop()  # every upload is decided here or in `writes_through`
        rules = self._policy().tiers.shared
        return self.uploads is not None and not rules.write_through and pol.admits(rules, hits)

    def writes_through(self) -> bool:
        """Whether a freshly committed chunk is offered to G4 at once."""
        self._know_loop()
        return self.uploads is not None and self._policy().tiers.shared.write_through

    def upload(self, rec: ChunkRecord, since: int | None = None) -> None:
        """Offer a chunk to the write-behind queue. `since`: the `deletes` mark when the
        copy was made, for a copy made before now (an NVMe file passed on to G4 is read
        in a worker thread after its chunk left NVMe): dropped if its key was deleted
        since, or its upload would bring the deleted chunk back, and for every node."""
        assert self.uploads is not None
        loop = self._loop
        if loop is not None and not _runs(loop) and not loop.is_closed():
            # A worker thread: the pending deletes and the journal are the loop's, the
            # settle must come before the offer, and a DELETE may come before both.
            loop.call_soon_threadsafe(self.upload, rec, since)
            return
        if since is not None and self.deletes.since(rec.key, since):
            return
        self._settle(rec.key)  # written again: this copy is the one
        self.uploads.offer(rec)
        self.m.written_bytes["shared"].inc(rec.size)

    def queue_stats(self) -> QueueStats | None:
        return self.uploads.stats() if self.uploads is not None else None

    # -- deletes and probes

    def delete(self, key: bytes) -> Coroutine[object, object, None]:
        """Other nodes share the object: it goes too, in the background. Until the store
        confirms it, the key is kept and retried (`retry_deletes`), and not read from the
        store; an upload still queued is dropped."""
        if self.uploads is not None:
            self.uploads.discard(key)
        if self._journal is not None:
            self._journal.shared_delete(key)  # first: a restart from here on retries it
        self.observer.removed("shared", key)
        number = self.pending_deletes[key] = next(self._delete_number)
        self.pending_deletes.move_to_end(key)
        while len(self.pending_deletes) > PENDING_DELETES:
            old = next(iter(self.pending_deletes))
            self._settle(old)
            log.error("shared delete of %s given up: %d deletes wait for the store",
                      old.hex(), PENDING_DELETES)
        return self._delete_now({key: number})  # the caller runs it in the background

    async def _delete_now(self, deletes: dict[bytes, int]) -> None:
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(self._background, self._delete, deletes)
        for key in done:
            self._settle(key, deletes[key])

    def _settle(self, key: bytes, number: int | None = None) -> None:
        """A pending delete is over (confirmed, given up, or the key uploaded again); with
        `number`, only that delete (a later one of the key is still to be done)."""
        if key not in self.pending_deletes or (
                number is not None and self.pending_deletes[key] != number):
            return
        del self.pending_deletes[key]
        if self._journal is not None:
            self._journal.shared_deleted(key)

    def _delete(self, deletes: dict[bytes, int]) -> list[bytes]:
        """Delete objects (a worker thread); the keys the store confirmed gone.

        Each under the key's hold on the upload queue: an upload of it in flight lands
        first (else it would bring the deleted chunk back), and one offered since waits
        for the delete. A delete overtaken meanwhile (the key uploaded again, or deleted
        again: that later delete does the work) is skipped: run late, after the new
        upload landed, it would lose an acknowledged chunk."""
        done: list[bytes] = []
        for key, number in deletes.items():
            try:
                with self._hold(key):
                    if self.pending_deletes.get(key) != number:
                        continue  # overtaken (a dict read: atomic beside the loop's writes)
                    self.tier.delete(key)
            except KeyBusy as e:
                log.warning("shared delete of %s waits: %s", key.hex(), e)
                continue  # retried with the others pending
            except OSError as e:
                log.warning("shared delete of %s failed, to be retried: %s", key.hex(), e)
                break  # the store is failing: the rest wait for the retry too
            done.append(key)
        return done

    def _hold(self, key: bytes) -> contextlib.AbstractContextManager[None]:
        if self.uploads is None:
            return contextlib.nullcontext()
        return self.uploads.exclusive(key, DELETE_WAITS_FOR_UPLOAD)

    async def retry_deletes(self) -> None:
        """Retry the deletes the store has not confirmed (housekeeping, while healthy)."""
        if self._retrying or not self.pending_deletes or not self.healthy():
            return
        self._retrying = True
        try:
            await self._delete_now(dict(self.pending_deletes))
        finally:
            self._retrying = False

    async def probe(self) -> None:
        """Ask an unhealthy shared tier, about once a second, whether it answers again;
        retry the deletes it has not confirmed once it does."""
        if self.healthy():
            await self.retry_deletes()
            return
        if time.monotonic() < self._next_probe:
            return
        self._next_probe = time.monotonic() + SHARED_PROBE_INTERVAL
        await asyncio.get_running_loop().run_in_executor(self._background, self.tier.probe)

    def close(self) -> None:
        """Upload what is queued for a moment, then stop."""
        if self.uploads is not None:
            self.uploads.close()
        self.tier.close()
        self._presence.shutdown(wait=False, cancel_futures=True)


def _runs(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread is running `loop`."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
