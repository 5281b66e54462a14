"""The chunk store: what every socket op does, across the agent's tiers.

The server decodes frames and calls these methods; they raise `OpError` with
a protocol error code for anything a client did wrong. Nothing here touches
the socket. Decisions (what to evict, whether to demote, promote, prefetch)
come from `policy`; this module carries them out:

- LOOKUP walks DRAM then the NVMe index, in memory, never waiting on a disk;
  where the local prefix ends it asks the shared tier (G4) about the next
  keys, waiting at most the tier's lookup budget.
- ACQUIRE/GET of a chunk below DRAM reads it in a worker thread (NVMe, else
  G4), verifies it, and copies it into the arena (a promotion) so it can be
  leased. An NVMe read also takes the chunks after it in its LOOKUP that NVMe
  holds (read-ahead: one thread hand-off for a prompt, not one per chunk).
  DRAM and NVMe are exclusive (a promoted chunk leaves NVMe); G4 is shared
  by every node and keeps its copy.
- A DRAM chunk evicted with `onEvict: demote` is copied out and verified,
  its arena space freed at once, and written to NVMe in a worker thread;
  until that write lands the chunk is served from the in-flight copy.
- Chunks a client commits are offered to G4's write-behind queue when its
  rules say `writeThrough` (the default), else on eviction from the lowest
  local tier. The queue never blocks a client.
- Each tier keeps its chunks in eviction order (`eviction.EvictionQueue`);
  `policy.choose_victims` decides, walking that order only as far as needed.
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
from .batches import Batches
from .config import AgentConfig, TierName, TierPolicy
from .constants import KEY_BYTES
from .constants import TIER_CODES as TIER_CODE
from .eviction import EvictionQueue, new_queue
from .journal import Journal, JournalEntry, replay
from .metrics import EVICTION_REASONS, AgentMetrics
from .protocol import MAX_LOOKUP_KEYS, ErrorCode, Extents, checksum
from .tiers.base import ChunkRecord, IntegrityError
from .tiers.dram import DramChunk, DramTier
from .tiers.nvme import NvmeEntry, NvmeTier
from .tiers.shared import SharedChunkTier
from .writebehind import WriteBehindQueue

log = logging.getLogger(__name__)

MAX_LEASES_PER_CLIENT = 4096
RECENT_LOOKUPS = 1 << 16
"""Keys remembered from recent LOOKUPs, so a chunk written next knows its depth."""
IO_THREADS = 4
READ_THREADS = 4
PRESENCE_WAIT_THREADS = 8
"""Worker threads of the store's three pools (background writes, client reads, shared-tier
presence checks): file and object-store calls release the GIL, so they overlap."""
SHARED_PROBE_KEYS = 256
"""Most keys past the local prefix one LOOKUP asks the shared tier about."""
SHARED_PROBE_INTERVAL = 1.0
"""Seconds between health probes of an unhealthy shared tier."""
READAHEAD_CHUNKS = 32
"""Most chunks one NVMe read of a client takes: the one asked for and those after it."""
READAHEAD_BYTES = 32 << 20
"""Most bytes one such read takes, and (twice that) read-ahead chunks kept waiting."""
RECENT_PROMPTS = 256
"""Recent LOOKUPs that reached NVMe whose keys are kept, to know what follows a key."""


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


Loaded = tuple[ChunkRecord, TierName, int]
"""A chunk read from below DRAM, the tier it came from, and its hits there."""


def check_key(key: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise OpError(ErrorCode.BAD_KEY, f"a key is {KEY_BYTES} bytes, got {len(key)}")


class ChunkStore:
    def __init__(self, config: AgentConfig, dram: DramTier, nvme: NvmeTier | None,
                 metrics: AgentMetrics, policy: TierPolicy, journal: Journal | None = None,
                 shared: SharedChunkTier | None = None) -> None:
        self.config = config
        self.dram = dram
        self.nvme = nvme
        self.shared = shared
        self.m = metrics
        self.policy = policy
        self.journal = journal
        if journal is not None:
            journal.live_entries = self.dram.journal_entries  # what its compaction keeps
        self.dram.pins.update(bytes.fromhex(k) for k in policy.pins)
        self.seq = 0
        self.recent: OrderedDict[bytes, tuple[int, int, bool]] = OrderedDict()
        """key -> (request seq, depth, last of its prompt) from recent LOOKUPs."""
        self.dram_queue = new_queue(policy.tiers.dram.eviction)
        self.nvme_queue = new_queue(policy.tiers.nvme.eviction)
        if nvme is not None:
            # Files found at start: the oldest go first.
            for entry in sorted(nvme.index.values(), key=lambda e: e.last_access):
                self.nvme_queue.add(entry)
        self.uploads: WriteBehindQueue | None = None
        if shared is not None and config.tiers.shared is not None:
            self.uploads = WriteBehindQueue(shared, config.tiers.shared.write_queue_depth,
                                            config.tiers.shared.write_concurrency, metrics)
        self._next_probe = 0.0
        self.nvme_removals = 0
        """Chunks out of the NVMe index whose files a worker has yet to remove (or upload)."""
        self.inflight: dict[bytes, ChunkRecord] = {}
        """Chunks on their way from DRAM to NVMe: still served from here."""
        self.loading: dict[bytes, asyncio.Future[Loaded | None]] = {}
        self.prompts: OrderedDict[int, list[bytes]] = OrderedDict()
        """Keys of recent LOOKUPs that found chunks in NVMe, by request seq."""
        self.readahead: OrderedDict[bytes, tuple[ChunkRecord, NvmeEntry]] = OrderedDict()
        """Verified chunks read from NVMe with an earlier chunk of their prompt, waiting for
        their own read; each is good while the index holds the entry it was read under."""
        self.readahead_bytes = 0
        self.io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvpool-io")
        """Background writes and deletes: demotions, uploads' bookkeeping, file removals."""
        self.demotions: Batches[tuple[ChunkRecord, DramChunk], list[tuple[str, OSError] | None]]
        self.demotions = Batches(self.io, self._write_nvme_files, self._demoted,
                                 weight=lambda d: d[0].size, key=lambda d: d[0].key,
                                 concurrency=IO_THREADS)
        """DRAM victims waiting to be written to NVMe, a batch per executor call. Batches
        run side by side, but two demotions of one key (demoted, promoted from the in-flight
        copy or deleted and written again, demoted again) land in the order they were
        made, so the file holds the newest bytes."""
        self.removals: Batches[tuple[bytes, bool], None] = Batches(
            self.io, self._remove_nvme_files, self._removed)
        """Files of chunks out of the NVMe index, removed a batch per executor call."""
        self.reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvpool-read")
        """Reads a client waits for (ACQUIRE/GET below DRAM, prefetch): never queued behind
        a burst of background writes."""
        self.lookup_io = ThreadPoolExecutor(PRESENCE_WAIT_THREADS,
                                            thread_name_prefix="kvpool-lookup")
        """Threads that wait out shared-tier presence checks, so a slow store cannot hold
        up the reads and writes of the local tiers."""
        self._background: set[asyncio.Task[None]] = set()

    # -- policy

    def set_policy(self, policy: TierPolicy) -> None:
        """Apply a new policy in place: nothing is flushed, pins are re-derived, and a
        tier whose eviction order changed has its queue rebuilt from what it holds."""
        old = {bytes.fromhex(k) for k in self.policy.pins}
        new = {bytes.fromhex(k) for k in policy.pins}
        self.dram.pins -= old - new
        self.dram.pins |= new
        if policy.tiers.dram.eviction is not self.policy.tiers.dram.eviction:
            self.dram_queue = new_queue(policy.tiers.dram.eviction)
            for chunk in sorted(self.dram.chunks.values(), key=lambda c: c.last_seq):
                self.dram_queue.add(chunk)
        if policy.tiers.nvme.eviction is not self.policy.tiers.nvme.eviction:
            self.nvme_queue = new_queue(policy.tiers.nvme.eviction)
            if self.nvme is not None:
                for entry in sorted(self.nvme.index.values(), key=lambda e: e.last_seq):
                    self.nvme_queue.add(entry)
        self.policy = policy

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    @staticmethod
    def _touch(entry: pol.Entry, queue: EvictionQueue, seq: int, depth: int) -> None:
        entry.hits += 1
        entry.last_seq = seq
        entry.depth = depth
        entry.last_access = time.time()
        queue.touched(entry)

    def _touch_read(self, chunk: DramChunk) -> None:
        """A read keeps the request grouping its LOOKUP gave it (prefix order needs it);
        a read without a LOOKUP before it counts as a hit of its own."""
        seq, depth, _ = self.recent.get(chunk.key) or (self._next_seq(), chunk.depth, False)
        chunk.last_access = time.time()
        if seq > chunk.last_seq:
            chunk.last_seq, chunk.depth = seq, depth
            self.dram_queue.touched(chunk)

    # -- lookups

    async def lookup(self, keys: list[bytes]) -> tuple[int, bytes]:
        """How many leading keys are stored, and the tier code of each (2, 3, 4)."""
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
        nvme_index = self.nvme.index if self.nvme is not None else {}
        for depth, k in enumerate(keys):
            chunk = self.dram.get(k)
            if chunk is not None:
                self._touch(chunk, self.dram_queue, seq, depth)
                tiers.append(2)
                continue
            entry = nvme_index.get(k)
            if entry is not None or k in self.inflight:
                if entry is not None:
                    self._touch(entry, self.nvme_queue, seq, depth)
                tiers.append(3)
                continue
            break
        last = len(keys) - 1
        for depth, k in enumerate(keys):
            self.recent[k] = (seq, depth, depth == last)
            self.recent.move_to_end(k)
        while len(self.recent) > RECENT_LOOKUPS:
            self.recent.popitem(last=False)
        local = len(tiers)
        if 3 in tiers:  # its NVMe chunks are about to be read: one read can take several
            self.prompts[seq] = keys[:local]
            if len(self.prompts) > RECENT_PROMPTS:
                self.prompts.popitem(last=False)
        if local < len(keys) and self.shared is not None:
            # Past the local prefix the shared tier decides how far the prefix goes, but a
            # key of it that is local after all is reported (and counted) in its local tier.
            for depth in range(local, local + await self._shared_prefix(keys[local:])):
                k = keys[depth]
                chunk = self.dram.get(k)
                if chunk is not None:
                    self._touch(chunk, self.dram_queue, seq, depth)
                    tiers.append(2)
                elif k in nvme_index or k in self.inflight:
                    tiers.append(3)
                else:
                    tiers.append(4)
        count = len(tiers)
        in_dram = tiers.count(2)
        in_nvme = tiers.count(3)
        m.hits["dram"].inc(in_dram)
        m.misses["dram"].inc(len(keys) - in_dram)
        if self.nvme is not None:
            m.hits["nvme"].inc(in_nvme)
            m.misses["nvme"].inc(len(keys) - in_dram - in_nvme)
        if self.shared is not None:
            m.hits["shared"].inc(count - in_dram - in_nvme)
            m.misses["shared"].inc(len(keys) - count)
        for k in pol.prefetch_keys(self.policy, keys, count, bytes(tiers)):
            self._spawn(self._prefetch(k))
        return count, bytes(tiers)

    async def _shared_prefix(self, keys: list[bytes]) -> int:
        """Leading keys the shared tier holds, answered within its lookup budget."""
        shared = self.shared
        assert shared is not None
        if not shared.healthy()[0]:
            return 0
        keys = keys[:SHARED_PROBE_KEYS]
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(self.lookup_io, shared.contains_many, keys)
        n = 0
        for k in keys:
            if not found.get(k):
                break
            n += 1
        return n

    def contains(self, key: bytes) -> bool:
        return self.dram.get(key) is not None or self._below(key)

    def _below(self, key: bytes) -> bool:
        """Held by a local tier below DRAM (the shared tier is not asked: it may be slow)."""
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
        chunk = self._insert(lease.key, lease.extents, lease.size, checksum_ & (2**64 - 1),
                             lease.meta, lease.tenant)
        self._write_through(chunk)

    def abort(self, lease_id: int, owner: int) -> None:
        lease = self.dram.close_write(lease_id, owner)
        if lease is None:
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"write lease {lease_id} is not open on this connection")
        self.dram.alloc.free(lease.extents)

    def _insert(self, key: bytes, extents: Extents, size: int, checksum_: int, meta: bytes,
                tenant: str, hits: int = 0, evict: bool = True) -> DramChunk:
        """Make a chunk visible; `evict=False` leaves the watermark check to the caller.

        Journaled first: a chunk the journal cannot record is refused and its extents
        freed, so no client is told "failed" for a chunk that is stored."""
        if self.journal is not None:
            try:
                self.journal.commit(JournalEntry(key, extents, size, checksum_, meta, tenant))
            except OSError as e:
                self.dram.alloc.free(extents)
                raise OpError(ErrorCode.NO_SPACE,
                              f"chunk not stored: the commit journal cannot record it ({e})"
                              ) from e
        chunk = self.dram.insert(key, extents, size, checksum_, meta, tenant)
        seq, depth, last = self.recent.get(key) or (self._next_seq(), 0, False)
        chunk.last_seq, chunk.depth, chunk.last_access = seq, depth, time.time()
        chunk.hits = hits
        self.dram_queue.add(chunk, tail=last)
        self.m.written_bytes["dram"].inc(size)
        if evict:
            self._check_watermark()
        return chunk

    # -- reads

    async def acquire(self, key: bytes, owner: int) -> Granted:
        check_key(key)
        self._check_lease_budget(owner)
        chunk = self.dram.get(key)
        tier, transient = 2, False
        if chunk is None:
            loaded = await self._load(key)
            if loaded is None:
                raise OpError(ErrorCode.NOT_FOUND, f"{key.hex()} is not stored")
            rec, source, hits = loaded
            # Leases are on arena bytes, so the chunk comes up into DRAM either way;
            # with promotion off it stays only for this lease.
            chunk = self.dram.get(key) or self._promote(rec, "promotion", source, hits,
                                                        evict=False)
            tier, transient = TIER_CODE[source], not pol.should_promote(self.policy, hits or 1)
        self._touch_read(chunk)
        lease = self.dram.open_read(chunk, owner)
        # Only now that the lease protects it: a promoted chunk may well be the watermark's
        # first victim (LRU by an old LOOKUP's seq, a prompt's tail), and evicted before
        # its lease it would be read from freed arena pages that another chunk reuses.
        self._check_watermark()
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
            data = self.dram.read_verified(chunk)
            if data is None:  # its arena bytes were overwritten: a miss, never wrong bytes
                self.m.integrity_failures["dram"].inc()
                self._drop_dram(key)
                raise OpError(ErrorCode.NOT_FOUND, f"{key.hex()} failed its checksum")
            self._touch_read(chunk)
            self.m.read_bytes["dram"].inc(chunk.size)
            return data, chunk.checksum, chunk.meta, 2
        loaded = await self._load(key)
        if loaded is None:
            raise OpError(ErrorCode.NOT_FOUND, f"{key.hex()} is not stored")
        rec, source, hits = loaded
        if pol.should_promote(self.policy, hits or 1) and self.dram.get(key) is None:
            with contextlib.suppress(OpError):  # DRAM all leased: serve without promoting
                self._promote(rec, "promotion", source, hits)
        return bytes(rec.data), rec.checksum, rec.meta, TIER_CODE[source]

    async def _load(self, key: bytes) -> Loaded | None:
        """A verified chunk from below DRAM, the tier it came from and its hits there
        (one read per key however many ask).

        An NVMe read also takes the chunks that follow the key in the LOOKUP that found
        it, when they are in NVMe too (at most `READAHEAD_CHUNKS` and `READAHEAD_BYTES`):
        a client reads a prompt's chunks one after the other, and one worker-thread read
        of all of them costs one thread hand-off instead of one per chunk. The others wait
        in `readahead`, verified, until their own read takes them; one is used only while
        the NVMe index still holds the entry it was read under (so never after a delete,
        a rewrite or an eviction)."""
        rec = self.inflight.get(key)
        if rec is not None:
            return rec, "nvme", 1
        pending = self.loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        ahead = self._take_readahead(key)
        if ahead is not None:
            return ahead
        if self.nvme is not None and key in self.nvme.index:
            return await self._load_nvme([key, *self._following_in_nvme(key)])
        if self.shared is None or not self.shared.healthy()[0]:
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Loaded | None] = loop.create_future()
        self.loading[key] = fut
        try:
            got = await loop.run_in_executor(self.reads, self._read_shared, key)
            result: Loaded | None = None
            if got is not None:
                result = (got, "shared", 1)
            fut.set_result(result)
            return result
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiting readers get it, nobody else must
            raise
        finally:
            del self.loading[key]

    async def _load_nvme(self, keys: list[bytes]) -> Loaded | None:
        """Read `keys` from NVMe in one worker-thread call; the first one's result, the
        others kept in `readahead` (and given to whoever waits for them meanwhile)."""
        nvme = self.nvme
        assert nvme is not None
        loop = asyncio.get_running_loop()
        entries = [nvme.index.get(k) for k in keys]
        futs: list[asyncio.Future[Loaded | None]] = []
        for k in keys:
            fut: asyncio.Future[Loaded | None] = loop.create_future()
            self.loading[k] = fut
            futs.append(fut)
        try:
            got = await loop.run_in_executor(self.reads, self._read_nvme_many, keys)
            first: Loaded | None = None
            for i, (k, rec, read_under, fut) in enumerate(
                    zip(keys, got, entries, futs, strict=True)):
                result: Loaded | None = None
                if rec is not None:
                    entry = nvme.index.get(k)
                    result = (rec, "nvme", entry.hits if entry is not None else 1)
                    if i and read_under is not None and entry is read_under:
                        self._keep_readahead(k, rec, read_under)
                else:
                    self.nvme_queue.discard(k)  # quarantined or gone: out of the order too
                fut.set_result(result)
                if i == 0:
                    first = result
            return first
        except BaseException as e:
            for fut in futs:
                if not fut.done():
                    fut.set_exception(e)
                    fut.exception()  # retrieved: waiting readers get it, nobody else must
            raise
        finally:
            for k, fut in zip(keys, futs, strict=True):
                if self.loading.get(k) is fut:
                    del self.loading[k]

    def _following_in_nvme(self, key: bytes) -> list[bytes]:
        """The keys after `key` in its LOOKUP that NVMe holds and nobody is reading yet."""
        nvme = self.nvme
        assert nvme is not None
        seq, depth, _ = self.recent.get(key) or (0, 0, False)
        prompt = self.prompts.get(seq)
        if prompt is None or depth >= len(prompt) or prompt[depth] != key:
            return []
        out: list[bytes] = []
        total = nvme.index[key].size
        for k in prompt[depth + 1 :]:
            if len(out) + 1 >= READAHEAD_CHUNKS:
                break
            entry = nvme.index.get(k)
            if (entry is None or k in self.loading or k in self.readahead
                    or k in self.inflight or self.dram.get(k) is not None):
                continue
            total += entry.size
            if total > READAHEAD_BYTES:
                break
            out.append(k)
        return out

    def _read_nvme_many(self, keys: list[bytes]) -> list[ChunkRecord | None]:
        return [self._read_nvme(k) for k in keys]

    def _keep_readahead(self, key: bytes, rec: ChunkRecord, entry: NvmeEntry) -> None:
        self._drop_readahead(key)
        self.readahead[key] = (rec, entry)
        self.readahead_bytes += rec.size
        while self.readahead_bytes > 2 * READAHEAD_BYTES:
            _, (old, _) = self.readahead.popitem(last=False)
            self.readahead_bytes -= old.size

    def _drop_readahead(self, key: bytes) -> None:
        kept = self.readahead.pop(key, None)
        if kept is not None:
            self.readahead_bytes -= kept[0].size

    def _take_readahead(self, key: bytes) -> Loaded | None:
        kept = self.readahead.pop(key, None)
        if kept is None:
            return None
        rec, entry = kept
        self.readahead_bytes -= rec.size
        if self.nvme is None or self.nvme.index.get(key) is not entry:
            return None  # deleted, rewritten or evicted since: read again (or miss)
        return rec, "nvme", entry.hits

    def _read_nvme(self, key: bytes, *, indexed: bool = True) -> ChunkRecord | None:
        """A verified chunk from its NVMe file; a failure is counted and is a miss.
        `indexed=False` reads a chunk already taken out of the index (on its way to G4)."""
        assert self.nvme is not None
        try:
            rec = self.nvme.read(key) if indexed else self.nvme.read_file(key)
        except IntegrityError as e:
            log.error("integrity failure in nvme: %s; chunk quarantined, not served or moved", e)
            self.m.integrity_failures["nvme"].inc()
            return None
        except OSError as e:
            log.error("nvme read of %s failed: %s", key.hex(), e)
            self.m.tier_errors[("nvme", "read")].inc()
            return None
        if rec is not None:
            self.m.read_bytes["nvme"].inc(rec.size)
        return rec

    def _read_shared(self, key: bytes) -> ChunkRecord | None:
        """A verified chunk from G4; a failure is a miss (the tier counts and logs it)."""
        assert self.shared is not None
        try:
            rec = self.shared.read(key)
        except IntegrityError:
            return None  # counted, logged and deleted by the tier
        except OSError as e:
            log.warning("shared read of %s failed: %s", key.hex(), e)
            return None
        if rec is not None:
            self.m.read_bytes["shared"].inc(rec.size)
        return rec

    def _promote(self, rec: ChunkRecord, why: str, source: TierName, hits: int,
                 evict: bool = True) -> DramChunk:
        """Copy a verified lower-tier chunk into DRAM (`promotion` or `prefetch`)."""
        self._drop_readahead(rec.key)
        extents = self._allocate(rec.size)
        self.dram.arena.write(extents, rec.data)
        chunk = self._insert(rec.key, extents, rec.size, rec.checksum, rec.meta, rec.tenant,
                             hits, evict)
        (self.m.prefetches if why == "prefetch" else self.m.promotions)[source].inc()
        # DRAM and NVMe are exclusive: the NVMe copy goes, so they hold as many
        # distinct chunks as their capacities add up to. Eviction demotes it back.
        if self.nvme is not None and rec.key in self.nvme.index:
            self._drop_nvme([pol.Victim(rec.key, "promoted")])
        return chunk

    async def _prefetch(self, key: bytes) -> None:
        if self.dram.get(key) is not None:
            return
        loaded = await self._load(key)
        if loaded is not None and self.dram.get(key) is None:
            rec, source, hits = loaded
            with contextlib.suppress(OpError):  # no room can be made: prefetch is best effort
                self._promote(rec, "prefetch", source, hits)

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
        chunk = self._insert(key, extents, len(data), checksum_, meta, tenant)
        self._write_through(chunk, data)
        return True

    # -- management

    def delete(self, key: bytes) -> bool:
        check_key(key)
        self.dram.pins.discard(key)
        self._drop_readahead(key)
        existed = self._drop_dram(key)
        if self.inflight.pop(key, None) is not None:
            existed = True
        if self.nvme is not None and key in self.nvme.index:
            self._drop_nvme([pol.Victim(key, "deleted")])
            existed = True
        if self.shared is not None:
            # Other nodes share the object: it goes too, in the background (best effort;
            # an upload already in flight may still land, with the same, correct bytes).
            if self.uploads is not None:
                self.uploads.discard(key)
            self._spawn(asyncio.get_running_loop().run_in_executor(
                self.io, self._delete_shared, key))
        return existed

    def _delete_shared(self, key: bytes) -> None:
        assert self.shared is not None
        try:
            self.shared.delete(key)
        except OSError as e:
            log.warning("shared delete of %s failed: %s", key.hex(), e)

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
        self.dram_queue.discard(key)
        if self.journal is not None:
            self.journal.drop(key)
        return True

    def _footprint(self, chunk: pol.Entry) -> int:
        """Arena bytes a DRAM chunk frees: whole pages."""
        return self.dram.alloc.pages_for(chunk.size) * self.dram.alloc.page

    def _evict_dram_to(self, target: int, reason: str) -> None:
        with contextlib.closing(self.dram_queue.candidates()) as walk:
            self._evict_dram(pol.choose_victims(
                walk, tier="dram", policy=self.policy, used=self.dram.used_bytes,
                target=target, reason=reason, protected=self.dram.protected,
                footprint=self._footprint))

    def _evict_dram(self, victims: Iterable[pol.Victim]) -> None:
        rules = self.policy.tiers.dram
        for v in victims:
            chunk = self.dram.get(v.key)
            if chunk is None or self.dram.protected(v.key):
                continue
            below: TierName | None = None
            if pol.demotes(rules):
                if self.nvme is not None:
                    below = "nvme" if pol.admits(self.policy.tiers.nvme, chunk.hits) else None
                elif self._demotes_to_shared(chunk.hits):
                    below = "shared"
            rec = None
            if below is not None:
                rec = ChunkRecord(chunk.key, self.dram.arena.read(chunk.extents), chunk.checksum,
                                  chunk.meta, chunk.tenant)
                if not rec.verify():
                    log.error("integrity failure in dram for %s: dropped", chunk.key.hex())
                    self.m.integrity_failures["dram"].inc()
                    rec = None
            self._drop_dram(v.key)
            self.m.evictions[("dram", v.reason)].inc()
            if rec is None:
                continue
            if below == "nvme":
                self.inflight[rec.key] = rec
                self.demotions.offer((rec, chunk))
            else:
                self._upload(rec)
                self.m.demotions["dram"].inc()

    def _demotes_to_shared(self, hits: int) -> bool:
        """Whether a chunk leaving the lowest local tier goes to G4 (when it is not there
        already by write-through)."""
        rules = self.policy.tiers.shared
        return (self.uploads is not None and not rules.write_through
                and pol.admits(rules, hits))

    def _write_through(self, chunk: DramChunk, data: bytes | None = None) -> None:
        """Offer a freshly committed chunk to G4 when its rules say write-through."""
        if self.uploads is None or not self.policy.tiers.shared.write_through:
            return
        payload = data if data is not None else self.dram.arena.read(chunk.extents)
        self._upload(ChunkRecord(chunk.key, payload, chunk.checksum, chunk.meta, chunk.tenant))

    def _upload(self, rec: ChunkRecord) -> None:
        assert self.uploads is not None
        self.uploads.offer(rec)
        self.m.written_bytes["shared"].inc(rec.size)

    def _write_nvme_files(self, batch: list[tuple[ChunkRecord, DramChunk]]
                          ) -> list[tuple[str, OSError] | None]:
        """Write demoted chunks to NVMe (a worker thread): per chunk, None once it is
        written, else (error kind, error)."""
        nvme = self.nvme
        assert nvme is not None
        out: list[tuple[str, OSError] | None] = []
        for rec, _ in batch:
            try:
                nvme.write(rec)
            except OSError as e:
                out.append(("full" if not nvme.healthy()[0] else "write", e))
            except Exception as e:  # a bug must not leave the chunk in flight for ever
                log.exception("demotion of %s to nvme failed", rec.key.hex())
                out.append(("write", OSError(str(e))))
            else:
                out.append(None)
        return out

    def _demoted(self, batch: list[tuple[ChunkRecord, DramChunk]],
                 results: list[tuple[str, OSError] | None]) -> None:
        """A batch of demotions has been written (or failed): the chunks leave `inflight`
        and join NVMe's eviction order, then NVMe makes room down to its watermark."""
        nvme = self.nvme
        assert nvme is not None
        landed = False
        for (rec, chunk), failed in zip(batch, results, strict=True):
            current = self.inflight.get(rec.key)
            if failed is not None:
                kind, e = failed
                log.warning("demotion of %s to nvme failed (%s): dropped", rec.key.hex(), e)
                self.m.tier_errors[("nvme", kind)].inc()
                if current is rec:
                    del self.inflight[rec.key]
                    # A file an earlier demotion of the key left (it deferred to this one)
                    # is tracked by nobody: it goes too.
                    self._drop_nvme([pol.Victim(rec.key, "superseded")])
                    if self._demotes_to_shared(chunk.hits):
                        self._upload(rec)
                continue
            if current is None:
                # Deleted while it was being written: the file must not bring it back.
                self._drop_nvme([pol.Victim(rec.key, "deleted")])
                continue
            if current is not rec:
                # Demoted again meanwhile (promoted from the in-flight copy, or deleted and
                # written again): the file and the index entry are that demotion's to take.
                continue
            del self.inflight[rec.key]
            if self.dram.get(rec.key) is not None:
                # Promoted again from the in-flight copy: DRAM holds it, NVMe need not.
                self._drop_nvme([pol.Victim(rec.key, "promoted")])
                continue
            entry = nvme.index.get(rec.key)
            if entry is None:
                continue
            entry.hits = chunk.hits
            entry.last_seq, entry.depth = chunk.last_seq, chunk.depth
            entry.last_access = time.time()
            self.nvme_queue.add(entry)
            self.m.demotions["dram"].inc()
            self.m.written_bytes["nvme"].inc(rec.size)
            landed = True
        if landed:
            self._evict_nvme_to_watermark()

    def _evict_nvme_to_watermark(self) -> None:
        nvme = self.nvme
        if nvme is None:
            return
        rules = self.policy.tiers.nvme
        target = pol.watermark_target(rules, nvme.capacity_bytes, nvme.used_bytes)
        if target is None:
            return
        with contextlib.closing(self.nvme_queue.candidates()) as walk:
            victims = pol.choose_victims(
                walk, tier="nvme", policy=self.policy, used=nvme.used_bytes, target=target,
                reason="watermark", protected=lambda k: k in self.dram.pins)
            self._drop_nvme(victims)

    def _drop_nvme(self, victims: list[pol.Victim]) -> None:
        """Take chunks out of NVMe now; their files go (or move to G4) in a worker thread.

        Forgetting them at once, on the loop, is what keeps one watermark crossing
        from starting a second eviction round while the files are still there.
        """
        nvme = self.nvme
        assert nvme is not None
        gone: list[tuple[bytes, bool]] = []
        for v in victims:
            entry = nvme.index.get(v.key)
            if entry is None or not nvme.forget(v.key):
                continue
            self.nvme_queue.discard(v.key)
            if v.reason in EVICTION_REASONS:
                self.m.evictions[("nvme", v.reason)].inc()
                gone.append((v.key, self._demotes_to_shared(entry.hits)))
            else:
                gone.append((v.key, False))
        self.nvme_removals += len(gone)
        for item in gone:
            self.removals.offer(item)

    def _removed(self, gone: list[tuple[bytes, bool]], _: None) -> None:
        self.nvme_removals -= len(gone)

    def _remove_nvme_files(self, gone: list[tuple[bytes, bool]]) -> None:
        """Remove forgotten chunks' files (a worker thread), passing some on to G4 first."""
        assert self.nvme is not None
        for key, to_shared in gone:
            try:
                if to_shared:
                    rec = self._read_nvme(key, indexed=False)
                    if rec is not None:
                        self._upload(rec)
                        self.m.demotions["nvme"].inc()
                self.nvme.remove_file(key)
            except Exception:  # one file must not keep the others of its batch
                log.exception("removing the nvme file of %s failed", key.hex())

    def _check_watermark(self) -> None:
        rules = self.policy.tiers.dram
        target = pol.watermark_target(rules, self.dram.capacity_bytes, self.dram.used_bytes)
        if target is not None:
            self._evict_dram_to(target, "watermark")

    def _allocate(self, size: int) -> Extents:
        """Extents for a new chunk, evicting by policy as needed."""
        extents = self.dram.alloc.alloc(size)
        if extents is not None:
            return extents
        need = self.dram.used_bytes + self.dram.alloc.pages_for(size) * self.dram.alloc.page \
            - self.dram.capacity_bytes
        self._evict_dram_to(self.dram.used_bytes - max(need, 0), "capacity")
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
            vanished = self.nvme.vanished_keys()
            if vanished:
                log.warning("%d nvme chunks vanished with their directories: forgotten",
                            len(vanished))
                self._drop_nvme([pol.Victim(k, "vanished") for k in vanished])
            victims = pol.expired(self.nvme.index.values(), self.policy.tiers.nvme.ttl, wall,
                                  lambda k: k in self.dram.pins)
            if victims:
                self._drop_nvme(victims)

    async def probe_shared(self) -> None:
        """Ask an unhealthy shared tier, about once a second, whether it answers again."""
        shared = self.shared
        if shared is None or shared.healthy()[0] or time.monotonic() < self._next_probe:
            return
        self._next_probe = time.monotonic() + SHARED_PROBE_INTERVAL
        await asyncio.get_running_loop().run_in_executor(self.io, shared.probe)

    def close(self) -> None:
        """Stop background work: finish the NVMe writes and removals that wait, upload what
        is queued for a moment, then stop the threads."""
        self.io.shutdown(wait=True)  # batches already handed over finish first
        self.demotions.close()
        self.removals.close()
        if self.uploads is not None:
            self.uploads.close()
        if self.shared is not None:
            self.shared.close()
        self.lookup_io.shutdown(wait=False, cancel_futures=True)
        self.reads.shutdown(wait=True)

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
            self.dram_queue.add(chunk)
            live.append(e)
            kept += 1
        if self.journal is not None:
            self.journal.rewrite(live)
        return kept, dropped

    def _spawn(self, work: Coroutine[object, object, None] | asyncio.Future[None]) -> None:
        task = asyncio.ensure_future(work)
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
                "removing": self.nvme_removals,
            }
        if self.shared is not None:
            ok, reason = self.shared.healthy()
            queue = self.uploads.stats() if self.uploads is not None else None
            tiers["shared"] = {
                "url": self.shared.url,
                "capacity_bytes": self.shared.capacity_bytes,
                "used_bytes": self.shared.used_bytes,
                "chunks": self.shared.chunks,
                "hits": int(self.m.hits["shared"]._value.get()),
                "misses": int(self.m.misses["shared"]._value.get()),
                "healthy": ok,
                "reason": reason,
                "queue": {"pending": queue.pending, "in_flight": queue.in_flight,
                          "written": queue.written, "dropped": queue.dropped} if queue else {},
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
        if self.shared is not None:
            rows.append(("shared", self.shared.capacity_bytes, self.shared.used_bytes,
                         self.shared.chunks, self.shared.healthy()[0]))
            depth = self.uploads.queue_depth if self.uploads is not None else 0
            yield ("kvpool_shared_queue_depth", "Write-behind uploads waiting", {}, depth)
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
        if self.dram.held.get(owner, 0) >= MAX_LEASES_PER_CLIENT:
            raise OpError(ErrorCode.TOO_MANY_LEASES,
                          f"this connection holds {MAX_LEASES_PER_CLIENT} leases; release some")


def open_journal(config: AgentConfig) -> tuple[Journal, list[JournalEntry]]:
    path = config.journal_path()
    entries = list(replay(path))
    return Journal(path), entries
