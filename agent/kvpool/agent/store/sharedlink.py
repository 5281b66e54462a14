"""The store's side of the shared tier (G4): presence checks, uploads, deletes, probes.

Nothing here makes a client wait on the shared store except LOOKUP's presence
check, and that within the tier's lookup budget, in threads of its own. Uploads
go through the bounded write-behind queue; deletes and probes run in the store's
background pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

from .. import policy as pol
from ..config import SharedTier, TierPolicy
from ..metrics import AgentMetrics
from ..tiers.base import ChunkRecord
from ..tiers.shared import SharedChunkTier
from ..writebehind import QueueStats, WriteBehindQueue

log = logging.getLogger(__name__)

PRESENCE_WAIT_THREADS = 8
"""Threads that wait out shared-tier presence checks."""
SHARED_PROBE_KEYS = 256
"""Most keys past the local prefix one LOOKUP asks the shared tier about."""
SHARED_PROBE_INTERVAL = 1.0
"""Seconds between health probes of an unhealthy shared tier."""


class SharedLink:
    def __init__(self, tier: SharedChunkTier, cfg: SharedTier | None, metrics: AgentMetrics,
                 background: Executor, policy: Callable[[], TierPolicy]) -> None:
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

    def healthy(self) -> bool:
        return self.tier.healthy()[0]

    async def prefix(self, keys: list[bytes]) -> int:
        """Leading keys the shared tier holds, answered within its lookup budget."""
        if not self.healthy():
            return 0
        keys = keys[:SHARED_PROBE_KEYS]
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
        rules = self._policy().tiers.shared
        return self.uploads is not None and not rules.write_through and pol.admits(rules, hits)

    def writes_through(self) -> bool:
        """Whether a freshly committed chunk is offered to G4 at once."""
        return self.uploads is not None and self._policy().tiers.shared.write_through

    def upload(self, rec: ChunkRecord) -> None:
        assert self.uploads is not None
        self.uploads.offer(rec)
        self.m.written_bytes["shared"].inc(rec.size)

    def queue_stats(self) -> QueueStats | None:
        return self.uploads.stats() if self.uploads is not None else None

    # -- deletes and probes

    def delete(self, key: bytes) -> asyncio.Future[None]:
        """Other nodes share the object: it goes too, in the background (best effort; an
        upload already in flight may still land, with the same, correct bytes)."""
        if self.uploads is not None:
            self.uploads.discard(key)
        return asyncio.get_running_loop().run_in_executor(self._background, self._delete, key)

    def _delete(self, key: bytes) -> None:
        try:
            self.tier.delete(key)
        except OSError as e:
            log.warning("shared delete of %s failed: %s", key.hex(), e)

    async def probe(self) -> None:
        """Ask an unhealthy shared tier, about once a second, whether it answers again."""
        if self.healthy() or time.monotonic() < self._next_probe:
            return
        self._next_probe = time.monotonic() + SHARED_PROBE_INTERVAL
        await asyncio.get_running_loop().run_in_executor(self._background, self.tier.probe)

    def close(self) -> None:
        """Upload what is queued for a moment, then stop."""
        if self.uploads is not None:
            self.uploads.close()
        self.tier.close()
        self._presence.shutdown(wait=False, cancel_futures=True)
