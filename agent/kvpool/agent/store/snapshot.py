"""What one store holds and has counted, per tier, taken at one moment.

One snapshot feeds both STATS (`stats_reply`) and the Prometheus collector
(`samples`), so the two never disagree and neither reads metric objects back.
The hit and miss counts are the store's own (`LookupCounts`): a store serves one
space, so a tenant's STATS counts that tenant's lookups and nobody else's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..config import TIER_ORDER, TierName
from ..constants import LOOKUP_TIERS, PEER_TIER
from ..metrics import Sample
from ..writebehind import QueueStats


@dataclass(slots=True)
class LookupCounts:
    """Looked-up keys found (hits) and not found (misses) in each tier, since start."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOOKUP_TIERS, 0))
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOOKUP_TIERS, 0))

    def add(self, tier: str, hits: int, misses: int) -> None:
        self.hits[tier] += hits
        self.misses[tier] += misses


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    tier: TierName
    capacity_bytes: int
    used_bytes: int
    chunks: int
    hits: int
    misses: int
    healthy: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    tiers: list[TierSnapshot]
    """The configured tiers, fastest first."""
    counts: LookupCounts
    """Hits and misses of every tier, configured or not (a counter exists from the start)."""
    read_leases: int
    write_leases: int
    pins: int
    locked_bytes: int
    lock_error: str
    demoting: int = 0
    """Chunks on their way from DRAM to NVMe (demotions whose write is not done)."""
    demoting_bytes: int = 0
    """Their chunk bytes (held in the arena and in a heap copy until the write is done)."""
    removing: int = 0
    """Chunks out of the NVMe index whose files are yet to be removed."""
    shared_url: str = ""
    queue: QueueStats | None = None
    """The shared tier's write-behind queue, when there is one."""
    draining_reads: int = 0
    """Read leases of closed DMA connections, open until their drain ends (among
    `read_leases`)."""
    draining_bytes: int = 0
    """Arena pages of closed DMA connections' write leases, kept from reuse until their
    drain ends (among the DRAM tier's used bytes)."""
    peer_chunks: int | None = None
    """Remote chunks in the peer directory; None: the peer tier is off."""
    handoff_pins: int = 0
    """Chunks pushed here by peers (hand-offs), pinned until their first read or TTL."""
    handoff_bytes: int = 0
    """Their arena bytes, with those of pushes being received (the pin quota's count, as
    `kvpool_peer_handoff_pinned_bytes`)."""
    demoting_peak: int = 0
    demoting_peak_bytes: int = 0
    """The most of `demoting` and of `demoting_bytes` since the agent started."""


def stats_reply(snap: StoreSnapshot, pool: str) -> dict[str, object]:
    """The STATS map of one store (the server adds clients, tenant and version)."""
    tiers: dict[str, object] = {}
    for t in snap.tiers:
        row: dict[str, object] = {
            "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "chunks": t.chunks,
            "hits": t.hits, "misses": t.misses, "healthy": t.healthy,
        }
        if t.tier == "dram":
            row["locked_bytes"] = snap.locked_bytes
            row["lock_error"] = snap.lock_error
        else:
            row["reason"] = t.reason
        if t.tier == "nvme":
            row["inflight"] = snap.demoting
            row["inflight_bytes"] = snap.demoting_bytes
            row["inflight_peak"] = snap.demoting_peak
            row["inflight_peak_bytes"] = snap.demoting_peak_bytes
            row["removing"] = snap.removing
        if t.tier == "shared":
            q = snap.queue
            row = {"url": snap.shared_url, **row, "queue": {
                "pending": q.pending, "in_flight": q.in_flight, "written": q.written,
                "dropped": q.dropped} if q is not None else {}}
        tiers[t.tier] = row
    if snap.peer_chunks is not None:
        tiers[PEER_TIER] = {"chunks": snap.peer_chunks, "hits": snap.counts.hits[PEER_TIER],
                            "misses": snap.counts.misses[PEER_TIER], "healthy": True,
                            "handoff_pins": snap.handoff_pins,
                            "handoff_bytes": snap.handoff_bytes}
    return {
        "pool": pool,
        "tiers": tiers,
        "leases": {"read": snap.read_leases, "write": snap.write_leases},
        "draining": {"read_leases": snap.draining_reads, "bytes": snap.draining_bytes},
        "pins": snap.pins,
    }


def samples(snap: StoreSnapshot) -> Iterator[Sample]:
    """The store's series for the scrape-time collector (names in docs/metrics.md)."""
    peer = (PEER_TIER,) if snap.peer_chunks is not None else ()
    for tier in (*TIER_ORDER, *peer):
        labels: dict[str, str] = {"tier": tier}
        yield Sample("kvpool_tier_hits", "Looked-up keys found in the tier", labels,
                     snap.counts.hits[tier], counter=True)
        yield Sample("kvpool_tier_misses", "Looked-up keys not in the tier", labels,
                     snap.counts.misses[tier], counter=True)
    if snap.queue is not None:
        yield Sample("kvpool_shared_queue_depth", "Write-behind uploads waiting", {},
                     snap.queue.pending)
    elif any(t.tier == "shared" for t in snap.tiers):
        yield Sample("kvpool_shared_queue_depth", "Write-behind uploads waiting", {}, 0)
    for t in snap.tiers:
        labels = {"tier": str(t.tier)}
        yield Sample("kvpool_tier_capacity_bytes", "Tier capacity", labels, t.capacity_bytes)
        yield Sample("kvpool_tier_used_bytes", "Bytes held in the tier", labels, t.used_bytes)
        yield Sample("kvpool_tier_chunks", "Chunks held in the tier", labels, t.chunks)
        yield Sample("kvpool_tier_healthy", "1 when the tier serves", labels,
                     1 if t.healthy else 0)
    if snap.peer_chunks is not None:
        yield Sample("kvpool_tier_chunks", "Chunks held in the tier", {"tier": PEER_TIER},
                     snap.peer_chunks)
    if any(t.tier == "nvme" for t in snap.tiers):
        yield Sample("kvpool_nvme_demotions_in_flight", "Chunks on their way from DRAM to NVMe",
                     {}, snap.demoting)
        yield Sample("kvpool_nvme_demotions_in_flight_bytes",
                     "Chunk bytes on their way from DRAM to NVMe", {}, snap.demoting_bytes)
    yield Sample("kvpool_leases", "Open leases", {"kind": "read"}, snap.read_leases)
    yield Sample("kvpool_leases", "Open leases", {"kind": "write"}, snap.write_leases)
    yield Sample("kvpool_dram_locked_bytes", "Arena bytes locked in RAM", {}, snap.locked_bytes)
