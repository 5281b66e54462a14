"""What one tenant (or the whole pool) is served from: socket config, arena, tiers, store."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from ..arena import Arena
from ..claim import SpaceClaim
from ..config import AgentConfig, TierPolicy
from ..constants import PAGE_BYTES
from ..events import TierEvents
from ..lookupindex import PEER_MAX_SLOTS, SharedIndex, slots_for
from ..metrics import AgentMetrics, Sample
from ..seenstores import SeenStores
from ..store import ChunkStore, open_journal, snapshot
from ..tiers.dram import DramTier
from ..tiers.factory import open_shared_tier
from ..tiers.nvme import NvmeTier

log = logging.getLogger("kvpool.agent")


class Space:
    def __init__(self, tenant: str, config: AgentConfig, metrics: AgentMetrics,
                 policy: TierPolicy) -> None:
        self.tenant = tenant
        """The tenant this space serves; "" for the one space of a pool without tenants."""
        self.config = config
        dram_cfg = config.tiers.dram
        # Before touching any of the space's files.
        self.claim = SpaceClaim(config.lock_path(), config.arena_path(), config.socket_path)
        self.arena = Arena(config.arena_path(), dram_cfg.size, lock=dram_cfg.lock,
                           huge_pages=dram_cfg.huge_pages)
        nvme = None
        if config.tiers.nvme is not None:
            nvme = NvmeTier(config.tiers.nvme.path, config.tiers.nvme.size)
        if config.state_dir is not None:
            config.state_dir.mkdir(parents=True, exist_ok=True)  # made at the first start
        shared = None
        if config.tiers.shared is not None:
            shared = open_shared_tier(config.tiers.shared, metrics,
                                      seen=SeenStores(*config.stores_paths()))
        journal, entries = open_journal(config)
        if not self.arena.reused:
            entries = []  # a new arena holds nothing the journal describes
        # The DRAM keys in shared memory, for clients that answer LOOKUP themselves; a
        # chunk takes at least a page, so the arena's pages bound the keys it holds.
        # With peers read and no NVMe tier, what the peer directory says too, so that a
        # LOOKUP of remote keys needs no round trip either (the directory fills it:
        # `PeerNetwork.publish`); with NVMe, a key past DRAM may be there, which only the
        # agent knows.
        peer_table = config.peers.enabled and nvme is None
        self.index = SharedIndex(slots_for(self.arena.size // PAGE_BYTES),
                                 lower_tiers=nvme is not None or shared is not None
                                 or config.peers.enabled,
                                 peer_slots=PEER_MAX_SLOTS if peer_table else 0,
                                 shared_below=shared is not None)
        dram = DramTier(self.arena, published=self.index)
        self.store = ChunkStore(config, dram, nvme, metrics, policy, journal, shared)
        self.events: TierEvents | None = None
        """KV events of this space's chunks (`attach_events`); None: events are off."""
        kept, dropped = self.store.recover(entries)
        if kept or dropped:
            log.info("warm restart%s: %d chunks kept from the arena, %d dropped",
                     f" of tenant {tenant}" if self.isolated else "", kept, dropped)

    def attach_events(self, events: TierEvents) -> None:
        """Publish this space's tier changes from now on, starting from what it holds."""
        self.events = events
        self.store.observe(events)
        events.start(self.store.held())

    @property
    def isolated(self) -> bool:
        """True when the pool has tenants: the socket decides a connection's tenant."""
        return bool(self.tenant)

    def samples(self) -> Iterator[Sample]:
        """The store's series; a tenant's state carries its name (counters are summed)."""
        for s in snapshot.samples(self.store.snapshot()):
            if self.isolated and not s.counter:
                s = Sample(s.name, s.doc, {**s.labels, "tenant": self.tenant}, s.value)
            yield s

    def close(self) -> None:
        self.store.close()
        if self.events is not None and self.events.remembered is not None:
            self.events.remembered.close()
        if self.store.journal is not None:
            self.store.journal.close()
        self.arena.close()
        self.index.close()
        self.claim.release()
