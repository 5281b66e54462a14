"""Policy decisions as pure functions: which chunks leave a tier, and where to.

Nothing here does I/O or reads a clock; the store passes in what it knows
(`Entry` facts about each chunk, the time, the policy) and carries out the
answer. That keeps every decision table-testable.

Eviction orders (kept incrementally by `eviction.EvictionQueue`):

- `adaptive` (default): see `eviction.AdaptiveQueue`.
- `s3fifo`: see `eviction.S3FifoQueue`.
- `lru`: least recently used first.
- `lfu`: fewest hits first, least recently used among equals.
- `prefix`: least recently used *request* first and, within the
  chunks one request touched, the deepest first. A chunk is only useful if
  every chunk before it in its prefix is also cached, so evicting a prefix
  from its tail keeps what remains usable, where plain LRU (which saw the
  head touched first) would cut the head off and strand the tail.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from .config import AdmissionMode, EvictionOrder, OnEvict, TierName, TierPolicy, TierRules


class Entry(Protocol):
    """What the policy knows of a chunk in a tier."""

    @property
    def key(self) -> bytes: ...
    @property
    def size(self) -> int: ...
    @property
    def tenant(self) -> str: ...
    hits: int
    last_seq: int
    """Sequence number of the request that last touched it (one per LOOKUP, ALLOC, PUT)."""
    depth: int
    """Its position in that request's prefix (0 = first chunk)."""
    last_access: float
    """Wall-clock time of its last read or write."""


def order_key(order: EvictionOrder) -> Callable[[Entry], tuple[int, ...]]:
    """Sort key: smallest is evicted first."""
    if order is EvictionOrder.LFU:
        return lambda e: (e.hits, e.last_seq)
    if order is EvictionOrder.PREFIX:
        return lambda e: (e.last_seq, -e.depth)
    return lambda e: (e.last_seq,)


@dataclass(frozen=True, slots=True)
class Victim:
    key: bytes
    reason: str
    """`ttl`, `quota`, `watermark` or `capacity` (the metric label)."""


def expired(entries: Iterable[Entry], ttl: float | None, now: float,
            protected: Callable[[bytes], bool]) -> list[Victim]:
    """Chunks not accessed for longer than the tier's TTL."""
    if ttl is None:
        return []
    return [Victim(e.key, "ttl") for e in entries
            if now - e.last_access > ttl and not protected(e.key)]


def choose_victims(
    candidates: Iterable[Entry],
    *,
    tier: TierName,
    policy: TierPolicy,
    used: int,
    target: int,
    reason: str,
    protected: Callable[[bytes], bool],
    footprint: Callable[[Entry], int] = lambda e: e.size,
) -> list[Victim]:
    """Chunks to evict so that `used` falls to `target` bytes.

    `candidates` come in the tier's eviction order (an `EvictionQueue` walk)
    and are read only as far as needed. `footprint` is the bytes a chunk frees
    (whole arena pages in DRAM). Where tenants are configured, tenants over
    their quota in this tier lose their own chunks first (until back under
    quota), then chunks go lowest tenant priority first, eviction order within
    a priority. Protected chunks (pinned, leased) are never chosen, but count
    against their tenant's quota.
    """
    victims: list[Victim] = []
    if not policy.tenants:
        walk = iter(candidates)
        # Check before taking the next candidate: one taken and not chosen would count
        # as passed over (an S3-FIFO queue moves such a chunk out of probation).
        while used > target:
            e = next(walk, None)
            if e is None:
                break
            if not protected(e.key):
                victims.append(Victim(e.key, reason))
                used -= footprint(e)
        return victims

    ordered: list[Entry] = []
    usage: dict[str, int] = defaultdict(int)
    for e in candidates:
        # A pinned or leased chunk is never a victim, but its tenant holds it: it
        # counts against the quota, so the tenant's other chunks go instead.
        usage[e.tenant] += footprint(e)
        if not protected(e.key):
            ordered.append(e)
    chosen: set[bytes] = set()
    for t in policy.tenants:
        quota = t.quota.for_tier(tier)
        if quota is None or usage[t.name] <= quota:
            continue
        over = usage[t.name] - quota
        for e in ordered:
            if over <= 0:
                break
            if e.tenant != t.name:
                continue
            victims.append(Victim(e.key, "quota"))
            chosen.add(e.key)
            over -= footprint(e)
            used -= footprint(e)

    priority = {t.name: t.priority for t in policy.tenants}
    for e in sorted(ordered, key=lambda c: priority.get(c.tenant, 0)):  # stable: keeps order
        if used <= target:
            break
        if e.key in chosen:
            continue
        victims.append(Victim(e.key, reason))
        used -= footprint(e)
    return victims


def watermark_target(rules: TierRules, capacity: int, used: int) -> int | None:
    """Bytes to evict down to once `used` is above the high watermark, else None."""
    if capacity <= 0 or used <= rules.high_watermark * capacity:
        return None
    return int(rules.low_watermark * capacity)


def admits(rules: TierRules, hits: int) -> bool:
    """Whether a slower tier with these rules accepts a chunk hit `hits` times."""
    return rules.admission is AdmissionMode.ALWAYS or hits >= rules.min_hits


def demotes(rules: TierRules) -> bool:
    return rules.on_evict is OnEvict.DEMOTE


def should_promote(policy: TierPolicy, hits_below: int) -> bool:
    """Copy a chunk read from a slower tier up into DRAM?"""
    return policy.promotion.enabled and hits_below >= policy.promotion.min_hits


def prefetch_keys(policy: TierPolicy, keys: list[bytes], hit_count: int,
                  tiers: bytes) -> list[bytes]:
    """On a lookup whose prefix reaches below DRAM, the following chunks to load ahead.

    The chunks that a lookup found in slower tiers are about to be read; load
    the first `lookaheadChunks` of them into DRAM now, so the reads that follow
    are DRAM hits.
    """
    if not policy.prefetch.enabled or policy.prefetch.lookahead_chunks == 0:
        return []
    if tiers.count(2, 0, hit_count) == hit_count:  # all in DRAM (LOOKUP's common case)
        return []
    below = (keys[i] for i in range(hit_count) if tiers[i] != 2)
    return list(islice(below, policy.prefetch.lookahead_chunks))
