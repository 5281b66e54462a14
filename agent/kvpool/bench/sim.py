"""Offline cache simulators for the trace part of `kvpool bench`: pure functions.

A trace is a list of requests, each the list of its prefix blocks. Every
simulator uses the agent's *prefix semantics*: a request's hits are its
leading blocks that are cached when it arrives (a block after the first miss
is recomputed anyway, so it does not count); then every block of the request
is referenced in order (touched if cached, inserted if not), the way the
replay reads its hits and writes its misses.

- `lru`: plain least-recently-used over the block references.
- `queue_sim`: the agent's own eviction queues (`eviction.new_queue`) driven
  offline as the replay drives the agent: a request's misses written by one
  `put_many`, whose ALLOCs evict (one victim per block into a full cache) a
  window at a time before its COMMITs queue the blocks: what each agent order
  reaches, to check the replays against.
- `belady`: Belady's MIN, the offline policy that on a miss evicts the cached
  block whose next reference is farthest in the future (or does not insert
  the new block at all when *its* next reference is the farthest: caching is
  optional, as for any cache that may bypass). MIN maximises *reference*
  hits, and that count (`BeladyResult.reference_hits`) is a true upper bound
  on the reference hits, hence on the prefix hits, of every policy at that
  capacity. Its *prefix* hits (`BeladyResult.prefix_hits`, what the bench
  reports as `optimal`) are not provably optimal under prefix semantics: a
  policy that keeps whole prefixes could in principle beat it. It is the
  reference point the literature uses, and the bound is reported beside it.

Both run in O(references x log capacity); the bundled trace (122k references)
takes well under a second.
"""

from __future__ import annotations

import contextlib
import heapq
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.agent.client import BATCH_WINDOW
from kvpool.agent.config import EvictionOrder
from kvpool.agent.eviction import new_queue

Trace = Sequence[Sequence[int]]
"""Blocks per request, in arrival order."""

NEVER = 1 << 62
"""Next-use index of a block that is never referenced again."""


@dataclass(frozen=True, slots=True)
class SimResult:
    references: int
    """Block references in the trace (every block of every request)."""
    prefix_hits: int
    """Leading cached blocks summed over requests: the hits a KV-cache can use."""
    reference_hits: int
    """References that found their block cached, wherever in the request."""

    @property
    def hit_ratio(self) -> float:
        """Prefix hits per block reference: the figure the bench reports."""
        return self.prefix_hits / self.references if self.references else 0.0

    @property
    def reference_hit_ratio(self) -> float:
        return self.reference_hits / self.references if self.references else 0.0


BeladyResult = SimResult


def unbounded(trace: Trace) -> SimResult:
    """A cache that never evicts: the ceiling at any capacity."""
    return lru(trace, capacity=NEVER)


def lru(trace: Trace, capacity: int) -> SimResult:
    """Plain LRU holding at most `capacity` blocks."""
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    cache: OrderedDict[int, None] = OrderedDict()
    refs = prefix_hits = ref_hits = 0
    for blocks in trace:
        leading = True
        for b in blocks:
            refs += 1
            if b in cache:
                cache.move_to_end(b)
                ref_hits += 1
                if leading:
                    prefix_hits += 1
                continue
            leading = False
            if capacity == 0:
                continue
            cache[b] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return SimResult(refs, prefix_hits, ref_hits)


@dataclass(slots=True)
class _Chunk:
    """What a DRAM chunk tells its eviction queue (`policy.Entry`), one block per chunk."""

    key: bytes
    last_seq: int
    depth: int
    size: int = 1
    tenant: str = ""
    hits: int = 0
    last_access: float = 0.0


def queue_sim(trace: Trace, capacity: int, order: EvictionOrder, *,
              window: int = BATCH_WINDOW) -> SimResult:
    """The agent's eviction queue for `order`, holding at most `capacity` blocks, as the
    replay (`replay.replay`) drives it.

    Mirrors the store: a request's LOOKUP touches its leading cached blocks
    (hits + 1, its sequence number and depth); the rest are written by one
    `put_many`, which ALLOCs them `window` at a time (the client's batch window)
    before it COMMITs any of them. Each ALLOC of a block not cached reserves a
    block, and into a full cache (cached plus reserved) it first evicts the
    first candidate of the queue's walk (the walk stops there); an ALLOC of a
    cached block does nothing. Then the window's COMMITs insert its blocks,
    the request's last block marked as its tail. So a window's evictions are
    chosen before any of its blocks are queued: at 5% of the bundled trace's
    blocks the adaptive order's hit ratio is 0.5 pt lower with the client's
    window of 128 than with `window=1` (a put per block). An ALLOC with nothing
    left to evict is refused (its block is not stored), as the agent's NO_SPACE;
    the agent's other refusal, a connection's uncommitted writes past half the
    arena, is not modelled: the cache should hold at least two windows.
    """
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    if window < 1:
        raise ValueError("window must be >= 1")
    queue = new_queue(order)
    cached: dict[bytes, _Chunk] = {}
    reserved = 0
    refs = prefix_hits = ref_hits = 0
    for seq, blocks in enumerate(trace, start=1):
        keys = [b.to_bytes(16, "little") for b in blocks]
        refs += len(keys)
        hits = 0
        for depth, key in enumerate(keys):  # LOOKUP: only its prefix touches a chunk
            chunk = cached.get(key)
            if chunk is None:
                break
            hits += 1
            chunk.hits += 1
            chunk.last_seq, chunk.depth = seq, depth
            queue.touched(chunk)
        prefix_hits += hits
        ref_hits += hits
        if capacity == 0:
            ref_hits += sum(1 for key in keys[hits:] if key in cached)
            continue
        # A LOOKUP remembers each key's depth (the last one, for a key twice in a request).
        depth_of = {key: depth for depth, key in enumerate(keys)}
        last = len(keys) - 1
        misses = keys[hits:]
        for start in range(0, len(misses), window):
            granted: list[bytes] = []
            for key in misses[start : start + window]:  # the ALLOCs
                if key in cached:
                    ref_hits += 1
                    continue
                if len(cached) + reserved >= capacity:
                    if not cached:
                        continue  # nothing to evict: refused
                    with contextlib.closing(queue.candidates()) as walk:
                        victim = next(walk)
                        del cached[victim.key]
                        queue.discard(victim.key)
                reserved += 1
                granted.append(key)
            for key in granted:  # the COMMITs
                reserved -= 1
                if key in cached:
                    continue  # the same key granted twice in a window: the first one stays
                depth = depth_of[key]
                chunk = _Chunk(key, seq, depth)
                cached[key] = chunk
                queue.add(chunk, tail=depth == last)
    return SimResult(refs, prefix_hits, ref_hits)


def next_uses(trace: Trace) -> list[int]:
    """For each reference (flattened in order), the index of the same block's next one."""
    flat = [b for blocks in trace for b in blocks]
    out = [NEVER] * len(flat)
    seen: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        b = flat[i]
        out[i] = seen.get(b, NEVER)
        seen[b] = i
    return out


def belady(trace: Trace, capacity: int) -> BeladyResult:
    """Belady's MIN (with bypass) holding at most `capacity` blocks.

    The cache maps block -> its next-use index; a max-heap of (-next use,
    block) finds the farthest one, with stale entries skipped lazily (an
    entry is live only while it matches the block's current next use).
    """
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    nxt = next_uses(trace)
    cached: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    refs = prefix_hits = ref_hits = 0
    i = 0
    for blocks in trace:
        leading = True
        for b in blocks:
            nu = nxt[i]
            i += 1
            refs += 1
            if b in cached:
                ref_hits += 1
                if leading:
                    prefix_hits += 1
                cached[b] = nu
                heapq.heappush(heap, (-nu, b))
                continue
            leading = False
            if capacity == 0 or nu == NEVER:
                continue  # never used again: caching it cannot help
            if len(cached) >= capacity:
                while True:  # the live entry with the farthest next use
                    neg, victim = heap[0]
                    if cached.get(victim) == -neg:
                        break
                    heapq.heappop(heap)
                if -neg <= nu:
                    continue  # bypass: every cached block is needed before this one
                heapq.heappop(heap)
                del cached[victim]
            cached[b] = nu
            heapq.heappush(heap, (-nu, b))
            if len(heap) > 4 * capacity + 64:  # drop stale entries, keep memory bounded
                heap = [(-v, k) for k, v in cached.items()]
                heapq.heapify(heap)
    return SimResult(refs, prefix_hits, ref_hits)


def capacity_blocks(distinct: int, fraction: float) -> int:
    """Blocks a cache holds at `fraction` of the trace's distinct blocks (as `kvpool demo`)."""
    return max(1, round(distinct * fraction))


@dataclass(frozen=True, slots=True)
class TieredResult:
    references: int
    prefix_hits: int
    """Leading blocks found in DRAM or NVMe."""
    nvme_hits: int
    """Of those, found in NVMe only (read up and promoted)."""
    nvme_writes: int
    """Blocks written to NVMe (demotions the NVMe tier admitted)."""

    @property
    def hit_ratio(self) -> float:
        return self.prefix_hits / self.references if self.references else 0.0


def tiered_sim(trace: Trace, dram: int, nvme: int, order: EvictionOrder,
               min_hits: int | None, *, min_seen: int = 1) -> TieredResult:
    """DRAM (the agent's queue for `order`) over an LRU NVMe tier, one block per chunk.

    A model of the store's default tier rules, for what NVMe admission costs
    and saves: a chunk evicted from DRAM is demoted to NVMe if NVMe admits
    it (every chunk when `min_hits` is None, as `admission: always`; else
    only one hit at least `min_hits` times, as `admission: minHits`), unless
    NVMe holds it already; with `min_seen` > 1, also only one whose block was
    referenced at least `min_seen` times so far, hit or not (a doorkeeper:
    a block seen once is not written, one that left DRAM unhit and came
    back is); a leading block found only in NVMe is a hit,
    promoted back into DRAM (counting as its first hit there). Everything
    else is as `queue_sim`.
    """
    if dram < 1 or nvme < 0:
        raise ValueError("dram must be >= 1 and nvme >= 0")
    queue = new_queue(order)
    cached: dict[bytes, _Chunk] = {}
    lower: OrderedDict[bytes, None] = OrderedDict()
    seen: Counter[bytes] = Counter()
    refs = prefix_hits = nvme_hits = writes = 0

    def insert(chunk: _Chunk, tail: bool) -> None:
        nonlocal writes
        if len(cached) >= dram:
            with contextlib.closing(queue.candidates()) as walk:
                victim = next(walk)
                del cached[victim.key]
                queue.discard(victim.key)
            admitted = ((min_hits is None or victim.hits >= min_hits)
                        and seen[victim.key] >= min_seen)
            if nvme and admitted and victim.key not in lower:
                lower[victim.key] = None
                writes += 1
                if len(lower) > nvme:
                    lower.popitem(last=False)
        cached[chunk.key] = chunk
        queue.add(chunk, tail=tail)

    for seq, blocks in enumerate(trace, start=1):
        leading = True
        last = len(blocks) - 1
        for depth, b in enumerate(blocks):
            refs += 1
            key = b.to_bytes(16, "little")
            seen[key] += 1
            chunk = cached.get(key)
            if chunk is not None:
                if leading:
                    prefix_hits += 1
                    chunk.hits += 1
                    chunk.last_seq, chunk.depth = seq, depth
                    queue.touched(chunk)
                continue
            if leading and key in lower:
                lower.move_to_end(key)
                prefix_hits += 1
                nvme_hits += 1
                insert(_Chunk(key, seq, depth, hits=1), tail=depth == last)
                continue
            leading = False
            insert(_Chunk(key, seq, depth), tail=depth == last)
    return TieredResult(refs, prefix_hits, nvme_hits, writes)
