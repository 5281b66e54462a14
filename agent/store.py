"""The chunk store: what every socket op does, across the agent's tiers.

The server decodes frames and calls these methods; they raise `OpError` with
a protocol error code for anything a client did wrong. Nothing here touches
the socket. Decisions (what to evict, whether to demote, promote, prefetch)
come from `policy`; this module carries them out:

- LOOKUP walks DRAM then the NVMe index, in memory, never waiting on a disk.
- ACQUIRE/GET of a chunk below DRAM reads it in a worker thread, verifies
  it, and copies it into the arena (a promotion) so it can be leased.
- A DRAM chunk evicted with `onEvict: demote` is copied out and verified,
  its arena space freed at once, and written to NVMe in a worker thread;
  until that write lands the chunk is served from the in-flight copy.
- Every visible DRAM chunk is journaled, so a restarted agent finds it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import policy as pol
from .config import AgentConfig, TierPolicy
from .journal import Journal, JournalEntry, replay
from .keys import KEY_BYTES
from .metrics import AgentMetrics
from .protocol import MAX_LOOKUP_KEYS, ErrorCode, Extents, checksum
from .tiers.base import ChunkRecord, IntegrityError
from .tiers.dram import DramChunk, DramTier
from .tiers.nvme import NvmeTier

log = logging.getLogger(__name__)

MAX_LEASES_PER_CLIENT = 4096
RECENT_LOOKUPS = 1 << 16
"""Keys remembered from recent LOOKUPs, so a chunk written next knows its depth."""


class OpError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class Granted:
    lease: int
    extents: Extents
    size: int = 0
    checksum: int = 0
    meta: bytes = b""
    tier: int = 2


def check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise OpError(ErrorCode.BAD_KEY, f"a key is {KEY_BYTES} bytes, got {len(key)}")


class ChunkStore:
    def __init__(self, config: AgentConfig, dram: DramTier, nvme: NvmeTier | None,
                 metrics: AgentMetrics, policy: TierPolicy, journal: Journal | None = None
                 ) -> None:
        self.config = config
        self.dram = dram
        self.nvme = nvme
        self.m = metrics
        self.policy = policy
        self.journal = journal
        self.dram.pins.update(bytes.fromhex(k) for k in policy.pins)
        self.seq = 0
        self.recent: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.inflight: dict[bytes, ChunkRecord] = {}
        """Chunks on their way from DRAM to NVMe: still served from here."""
        self.loading: dict[bytes, asyncio.Future[ChunkRecord | None]] = {}
        self.io = ThreadPoolExecutor(4, thread_name_prefix="kvpool-io")
        self._background: set[asyncio.Task[None]] = set()

    # -- policy

    def set_policy(self, policy: TierPolicy) -> None:
        """Apply a new policy in place: nothing is flushed, pins are re-derived."""
        old = {bytes.fromhex(k) for k in self.policy.pins}
        new = {bytes.fromhex(k) for k in policy.pins}
        self.dram.pins -= old - new
        self.dram.pins |= new
        self.policy = policy

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    @staticmethod
    def _touch(entry: DramChunk | pol.Entry, seq: int, depth: int) -> None:
        entry.hits += 1
        entry.last_seq = seq
        entry.depth = depth
        entry.last_access = time.time()

    def _touch_read(self, chunk: DramChunk) -> None:
        """A read keeps the request grouping its LOOKUP gave it (prefix order needs it)."""
        seq, depth = self.recent.get(chunk.key) or (self._next_seq(), chunk.depth)
        if seq >= chunk.last_seq:
            chunk.last_seq, chunk.depth = seq, depth
        chunk.last_access = time.time()

    # -- lookups

    def lookup(self, keys: list[bytes]) -> tuple[int, bytes]:
        if len(keys) > MAX_LOOKUP_KEYS:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"LOOKUP takes at most {MAX_LOOKUP_KEYS} keys, got {len(keys)}")
        for k in keys:
            check_key(k)
        m = self.m
        m.lookups.inc()
        m.lookup_keys.inc(len(keys))
        seq = self._next_seq()
        tiers = bytearray()
        for depth, k in enumerate(keys):
            chunk = self.dram.get(k)
            if chunk is not None:
                self._touch(chunk, seq, depth)
                tiers.append(2)
                continue
            entry = self.nvme.index.get(k) if self.nvme is not None else None
            if entry is not None or k in self.inflight:
                if entry is not None:
                    self._touch(entry, seq, depth)
                tiers.append(3)
                continue
            break
        for depth, k in enumerate(keys):
            self.recent[k] = (seq, depth)
            self.recent.move_to_end(k)
        while len(self.recent) > RECENT_LOOKUPS:
            self.recent.popitem(last=False)
        count = len(tiers)
        in_dram = tiers.count(2)
        m.hits["dram"].inc(in_dram)
        m.misses["dram"].inc(len(keys) - in_dram)
        if self.nvme is not None:
            in_nvme = count - in_dram
            m.hits["nvme"].inc(in_nvme)
            m.misses["nvme"].inc(len(keys) - count)
        for k in pol.prefetch_keys(self.policy, keys, count, bytes(tiers)):
            self._spawn(self._prefetch(k))
        return count, bytes(tiers)

    def contains(self, key: bytes) -> bool:
        return self.dram.get(key) is not None or self._below(key)

    def _below(self, key: bytes) -> bool:
        return key in self.inflight or (self.nvme is not None and key in self.nvme.index)

    # -- zero-copy writes

    def alloc(self, key: bytes, size: int, meta: bytes, tenant: str, owner: int) -> Granted | None:
        """A write lease on fresh extents, or None when the key is already stored."""
        check_key(key)
        self._check_size(size, meta)
        if self.contains(key):
            return None
        self._check_lease_budget(owner)
        extents = self._allocate(size)
        lease = self.dram.open_write(key, extents, size, meta, tenant, owner,
                                     self.config.write_lease_timeout)
        return Granted(lease.id, extents, size)

    def commit(self, lease_id: int, checksum_: int, owner: int) -> None:
        lease = self.dram.close_write(lease_id, owner)
        if lease is None:
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"write lease {lease_id} is not open on this connection")
        if self.contains(lease.key):
            # Another client stored the same key first: keep theirs.
            self.dram.alloc.free(lease.extents)
            return
        self._insert(lease.key, lease.extents, lease.size, checksum_ & (2**64 - 1), lease.meta,
                     lease.tenant)

    def abort(self, lease_id: int, owner: int) -> None:
        lease = self.dram.close_write(lease_id, owner)
        if lease is None:
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"write lease {lease_id} is not open on this connection")
        self.dram.alloc.free(lease.extents)

    def _insert(self, key: bytes, extents: Extents, size: int, checksum_: int, meta: bytes,
                tenant: str) -> DramChunk:
        chunk = self.dram.insert(key, extents, size, checksum_, meta, tenant)
        seq, depth = self.recent.get(key) or (self._next_seq(), 0)
        chunk.last_seq, chunk.depth, chunk.last_access = seq, depth, time.time()
        if self.journal is not None:
            self.journal.commit(JournalEntry(key, extents, size, checksum_, meta, tenant))
        self.m.written_bytes["dram"].inc(size)
        self._check_watermark()
        return chunk

    # -- reads

    async def acquire(self, key: bytes, owner: int) -> Granted:
        check_key(key)
        self._check_lease_budget(owner)
        chunk = self.dram.get(key)
        tier, transient = 2, False
        if chunk is None:
            rec = await self._load(key)
            if rec is None:
                raise OpError(ErrorCode.NOT_FOUND, f"{key.hex()} is not stored")
            # Leases are on arena bytes, so the chunk comes up into DRAM either way;
            # with promotion off it stays only for this lease.
            chunk = self.dram.get(key) or self._promote(rec, "promotion")
            tier, transient = 3, not pol.should_promote(self.policy, 1)
        self._touch_read(chunk)
        lease = self.dram.open_read(chunk, owner)
        if transient:
            self._drop_dram(key)  # hidden now, freed at RELEASE
        self.m.read_bytes["dram"].inc(chunk.size)
        return Granted(lease.id, chunk.extents, chunk.size, chunk.checksum, chunk.meta, tier)

    def release(self, lease_id: int, owner: int) -> None:
        if not self.dram.close_read(lease_id, owner):
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"read lease {lease_id} is not open on this connection")

    async def get(self, key: bytes) -> tuple[bytes, int, bytes, int]:
        """(bytes, checksum, meta, tier) of a stored chunk."""
        check_key(key)
        chunk = self.dram.get(key)
        if chunk is not None:
            self._touch_read(chunk)
            self.m.read_bytes["dram"].inc(chunk.size)
            return self.dram.arena.read(chunk.extents), chunk.checksum, chunk.meta, 2
        rec = await self._load(key)
        if rec is None:
            raise OpError(ErrorCode.NOT_FOUND, f"{key.hex()} is not stored")
        if pol.should_promote(self.policy, 1) and self.dram.get(key) is None:
            with contextlib.suppress(OpError):  # DRAM all leased: serve without promoting
                self._promote(rec, "promotion")
        return bytes(rec.data), rec.checksum, rec.meta, 3

    async def _load(self, key: bytes) -> ChunkRecord | None:
        """A verified chunk from below DRAM (one read per key however many ask)."""
        rec = self.inflight.get(key)
        if rec is not None:
            return rec
        if self.nvme is None or key not in self.nvme.index:
            return None
        pending = self.loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ChunkRecord | None] = loop.create_future()
        self.loading[key] = fut
        try:
            rec = await loop.run_in_executor(self.io, self._read_nvme, key)
            fut.set_result(rec)
            return rec
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiting readers get it, nobody else must
            raise
        finally:
            del self.loading[key]

    def _read_nvme(self, key: bytes) -> ChunkRecord | None:
        assert self.nvme is not None
        try:
            rec = self.nvme.read(key)
        except IntegrityError as e:
            log.error("integrity failure in nvme: %s; chunk quarantined, served as a miss", e)
            self.m.integrity_failures["nvme"].inc()
            return None
        except OSError as e:
            log.error("nvme read of %s failed: %s", key.hex(), e)
            self.m.tier_errors[("nvme", "read")].inc()
            return None
        if rec is not None:
            self.m.read_bytes["nvme"].inc(rec.size)
        return rec

    def _promote(self, rec: ChunkRecord, why: str) -> DramChunk:
        """Copy a verified lower-tier chunk into DRAM (`promotion` or `prefetch`)."""
        extents = self._allocate(rec.size)
        self.dram.arena.write(extents, rec.data)
        chunk = self._insert(rec.key, extents, rec.size, rec.checksum, rec.meta, rec.tenant)
        (self.m.prefetches if why == "prefetch" else self.m.promotions)["nvme"].inc()
        # Tiers are exclusive: the NVMe copy goes, so DRAM + NVMe hold as many
        # distinct chunks as their capacities add up to. Eviction demotes it back.
        if self.nvme is not None and rec.key in self.nvme.index:
            self._spawn(self._drop_nvme([pol.Victim(rec.key, "promoted")]))
        return chunk

    async def _prefetch(self, key: bytes) -> None:
        if self.dram.get(key) is not None:
            return
        rec = await self._load(key)
        if rec is not None and self.dram.get(key) is None:
            with contextlib.suppress(OpError):  # no room can be made: prefetch is best effort
                self._promote(rec, "prefetch")

    # -- inline writes

    def put(self, key: bytes, data: bytes, checksum_: int, meta: bytes, tenant: str) -> bool:
        check_key(key)
        self._check_size(len(data), meta)
        if checksum(data, meta) != checksum_:
            raise OpError(ErrorCode.CHECKSUM_MISMATCH,
                          "the PUT bytes do not match their checksum; nothing stored")
        if self.contains(key):
            return False
        extents = self._allocate(len(data))
        self.dram.arena.write(extents, data)
        self._insert(key, extents, len(data), checksum_, meta, tenant)
        return True

    # -- management

    def delete(self, key: bytes) -> bool:
        check_key(key)
        self.dram.pins.discard(key)
        existed = self._drop_dram(key)
        if self.inflight.pop(key, None) is not None:
            existed = True
        if self.nvme is not None and key in self.nvme.index:
            self.nvme.delete(key)
            existed = True
        return existed

    def pin(self, key: bytes) -> None:
        check_key(key)
        if not self.contains(key):
            raise OpError(ErrorCode.NOT_FOUND, f"cannot pin {key.hex()}: not stored")
        self.dram.pins.add(key)

    def unpin(self, key: bytes) -> None:
        check_key(key)
        self.dram.pins.discard(key)

    def disconnect(self, owner: int) -> None:
        """A connection closed: abort its writes and end its reads."""
        writes, reads = self.dram.leases_of(owner)
        for lease_id in writes:
            self.abort(lease_id, owner)
        for lease_id in reads:
            self.dram.close_read(lease_id, owner)

    # -- eviction and demotion

    def _drop_dram(self, key: bytes) -> bool:
        if self.dram.remove(key) is None:
            return False
        if self.journal is not None:
            self.journal.drop(key)
        return True

    def _evict_dram(self, victims: Iterable[pol.Victim]) -> None:
        rules = self.policy.tiers.dram
        nvme_rules = self.policy.tiers.nvme
        for v in victims:
            chunk = self.dram.get(v.key)
            if chunk is None or self.dram.protected(v.key):
                continue
            demote = (self.nvme is not None and pol.demotes(rules)
                      and pol.admits(nvme_rules, chunk.hits))
            rec = None
            if demote:
                rec = ChunkRecord(chunk.key, self.dram.arena.read(chunk.extents), chunk.checksum,
                                  chunk.meta, chunk.tenant)
                if not rec.verify():
                    log.error("integrity failure in dram for %s: dropped", chunk.key.hex())
                    self.m.integrity_failures["dram"].inc()
                    rec = None
            self._drop_dram(v.key)
            self.m.evictions[("dram", v.reason)].inc()
            if rec is not None:
                self.inflight[rec.key] = rec
                self._spawn(self._demote(rec, chunk.hits))

    async def _demote(self, rec: ChunkRecord, hits: int) -> None:
        loop = asyncio.get_running_loop()
        assert self.nvme is not None
        try:
            await loop.run_in_executor(self.io, self.nvme.write, rec)
        except OSError as e:
            kind = "full" if not self.nvme.healthy()[0] else "write"
            log.warning("demotion of %s to nvme failed (%s): dropped", rec.key.hex(), e)
            self.m.tier_errors[("nvme", kind)].inc()
            return
        finally:
            if self.inflight.get(rec.key) is rec:
                del self.inflight[rec.key]
        if rec.key not in self.nvme.index:
            return
        entry = self.nvme.index[rec.key]
        entry.hits = hits
        seq, depth = self.recent.get(rec.key) or (self.seq, 0)
        entry.last_seq, entry.depth, entry.last_access = seq, depth, time.time()
        self.m.demotions["dram"].inc()
        self.m.written_bytes["nvme"].inc(rec.size)
        await self._evict_nvme_to_watermark()

    async def _evict_nvme_to_watermark(self) -> None:
        nvme = self.nvme
        if nvme is None:
            return
        rules = self.policy.tiers.nvme
        target = pol.watermark_target(rules, nvme.capacity_bytes, nvme.used_bytes)
        if target is None:
            return
        victims = pol.choose_victims(
            list(nvme.index.values()), tier="nvme", policy=self.policy, used=nvme.used_bytes,
            target=target, reason="watermark", protected=lambda k: k in self.dram.pins)
        await self._drop_nvme(victims)

    async def _drop_nvme(self, victims: list[pol.Victim]) -> None:
        assert self.nvme is not None
        loop = asyncio.get_running_loop()
        for v in victims:
            if await loop.run_in_executor(self.io, self.nvme.delete, v.key) \
                    and v.reason != "promoted":
                self.m.evictions[("nvme", v.reason)].inc()

    def _check_watermark(self) -> None:
        rules = self.policy.tiers.dram
        target = pol.watermark_target(rules, self.dram.capacity_bytes, self.dram.used_bytes)
        if target is not None:
            self._evict_dram(pol.choose_victims(
                list(self.dram.chunks.values()), tier="dram", policy=self.policy,
                used=self.dram.used_bytes, target=target, reason="watermark",
                protected=self.dram.protected))

    def _allocate(self, size: int) -> Extents:
        """Extents for a new chunk, evicting by policy as needed."""
        extents = self.dram.alloc.alloc(size)
        if extents is not None:
            return extents
        need = self.dram.used_bytes + self.dram.alloc.pages_for(size) * self.dram.alloc.page \
            - self.dram.capacity_bytes
        victims = pol.choose_victims(
            list(self.dram.chunks.values()), tier="dram", policy=self.policy,
            used=self.dram.used_bytes, target=self.dram.used_bytes - max(need, 0),
            reason="capacity", protected=self.dram.protected)
        self._evict_dram(victims)
        extents = self.dram.alloc.alloc(size)
        if extents is not None:
            return extents
        raise OpError(ErrorCode.NO_SPACE,
                      f"no room for {size} bytes: the arena's chunks are all leased or pinned")

    # -- housekeeping

    def expire(self, now: float | None = None) -> None:
        """Writes idle past their lease timeout, and chunks past their tier's TTL."""
        mono = time.monotonic()
        for lease in self.dram.expired_writes(mono):
            self.abort(lease.id, lease.owner)
        wall = time.time() if now is None else now
        self._evict_dram(pol.expired(self.dram.chunks.values(), self.policy.tiers.dram.ttl, wall,
                                     self.dram.protected))
        if self.nvme is not None:
            victims = pol.expired(self.nvme.index.values(), self.policy.tiers.nvme.ttl, wall,
                                  lambda k: k in self.dram.pins)
            if victims:
                self._spawn(self._drop_nvme(victims))

    def recover(self, entries: Iterable[JournalEntry]) -> tuple[int, int]:
        """Re-admit journaled chunks whose arena bytes still verify; (kept, dropped)."""
        kept = dropped = 0
        live: list[JournalEntry] = []
        arena = self.dram.arena
        for e in entries:
            if (len(e.key) != KEY_BYTES or self.dram.get(e.key) is not None
                    or not self.dram.alloc.reserve(e.extents)):
                dropped += 1
                continue
            if arena.checksum(e.extents, e.meta) != e.checksum:
                self.dram.alloc.free(e.extents)
                self.m.integrity_failures["dram"].inc()
                dropped += 1
                continue
            chunk = self.dram.insert(e.key, e.extents, e.size, e.checksum, e.meta, e.tenant)
            chunk.last_seq = self._next_seq()
            chunk.last_access = time.time()
            live.append(e)
            kept += 1
        if self.journal is not None:
            self.journal.rewrite(live)
        return kept, dropped

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- reporting

    def stats(self) -> dict[str, object]:
        d = self.dram
        tiers: dict[str, object] = {
            "dram": {
                "capacity_bytes": d.capacity_bytes,
                "used_bytes": d.used_bytes,
                "chunks": len(d.chunks),
                "hits": int(self.m.hits["dram"]._value.get()),
                "misses": int(self.m.misses["dram"]._value.get()),
                "healthy": True,
                "locked_bytes": d.arena.locked_bytes,
                "lock_error": d.arena.lock_error or "",
            },
        }
        if self.nvme is not None:
            ok, reason = self.nvme.healthy()
            tiers["nvme"] = {
                "capacity_bytes": self.nvme.capacity_bytes,
                "used_bytes": self.nvme.used_bytes,
                "chunks": self.nvme.chunks,
                "hits": int(self.m.hits["nvme"]._value.get()),
                "misses": int(self.m.misses["nvme"]._value.get()),
                "healthy": ok,
                "reason": reason,
                "inflight": len(self.inflight),
            }
        return {
            "pool": self.config.pool,
            "tiers": tiers,
            "leases": {"read": len(d.reads), "write": len(d.writes)},
            "pins": len(d.pins),
        }

    def state_samples(self) -> Iterable[tuple[str, str, dict[str, str], float]]:
        d = self.dram
        rows: list[tuple[str, int, int, int, bool]] = [
            ("dram", d.capacity_bytes, d.used_bytes, len(d.chunks), True)]
        if self.nvme is not None:
            rows.append(("nvme", self.nvme.capacity_bytes, self.nvme.used_bytes,
                         self.nvme.chunks, self.nvme.healthy()[0]))
        for tier, cap, used, chunks, healthy in rows:
            labels = {"tier": tier}
            yield ("kvpool_tier_capacity_bytes", "Tier capacity", labels, cap)
            yield ("kvpool_tier_used_bytes", "Bytes held in the tier", labels, used)
            yield ("kvpool_tier_chunks", "Chunks held in the tier", labels, chunks)
            yield ("kvpool_tier_healthy", "1 when the tier serves", labels, 1 if healthy else 0)
        yield ("kvpool_leases", "Open leases", {"kind": "read"}, len(d.reads))
        yield ("kvpool_leases", "Open leases", {"kind": "write"}, len(d.writes))
        yield ("kvpool_dram_locked_bytes", "Arena bytes locked in RAM", {},
               d.arena.locked_bytes)

    # -- checks

    def _check_size(self, size: int, meta: bytes) -> None:
        if not 0 < size <= self.config.max_chunk_bytes:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"chunk size {size} is outside 1..{self.config.max_chunk_bytes}")
        if len(meta) > self.config.max_meta_bytes:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"metadata of {len(meta)} bytes exceeds {self.config.max_meta_bytes}")

    def _check_lease_budget(self, owner: int) -> None:
        writes, reads = self.dram.leases_of(owner)
        if len(writes) + len(reads) >= MAX_LEASES_PER_CLIENT:
            raise OpError(ErrorCode.TOO_MANY_LEASES,
                          f"this connection holds {MAX_LEASES_PER_CLIENT} leases; release some")


def open_journal(config: AgentConfig) -> tuple[Journal, list[JournalEntry]]:
    path = config.journal_path()
    entries = list(replay(path))
    return Journal(path), entries
