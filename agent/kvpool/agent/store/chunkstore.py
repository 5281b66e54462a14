"""The chunk store: what every socket op does, across the agent's tiers.

The server decodes frames and calls these methods; they raise `OpError` with
a protocol error code for anything a client did wrong. Nothing here touches
the socket. Decisions (what to evict, whether to demote, promote, prefetch)
come from `policy`; the store carries them out with collaborators that own
their state:

- `Demotion` (demotion.py): the NVMe side — in-flight copies of demoted
  chunks, NVMe's eviction order, the write and removal pipelines.
- `Loads` (loads.py): reads below DRAM a client waits for, one per key, with
  NVMe read-ahead (readahead.py).
- `SharedLink` (sharedlink.py): G4 presence checks, uploads, deletes, probes.
- `PeerReads` (peerreads.py): reads from the pool's other agents under way, in batches
  read ahead along a LOOKUP, landed into DRAM; WAIT's answer; hand-offs received.
- `StoreSnapshot` (snapshot.py): one moment's per-tier state and counts, for
  STATS and the metrics collector alike.

What the operations themselves keep: DRAM's eviction order, the recent
LOOKUPs (a chunk written next knows its depth), and this store's hit counts.

- LOOKUP walks DRAM then the NVMe index, in memory, never waiting on a disk;
  where the local prefix ends it asks the shared tier (G4) about the next
  keys, waiting at most the tier's lookup budget.
- ACQUIRE/GET of a chunk below DRAM reads it (NVMe, else G4), verifies it, and
  copies it into the arena (a promotion) so it can be leased. DRAM and NVMe are
  exclusive (a promoted chunk leaves NVMe); G4 is shared by every node and keeps
  its copy.
- Chunks a client commits are offered to G4's write-behind queue when its
  rules say `writeThrough` (the default), else on eviction from the lowest
  local tier. The queue never blocks a client.
- Each tier keeps its chunks in eviction order (`eviction.EvictionQueue`);
  `policy.choose_victims` decides, walking that order only as far as needed.
- Every visible DRAM chunk is journaled, so a restarted agent finds it again; so is
  every chunk on its way to NVMe, whose pages stay taken until its file has landed
  (`_demoted`): an ALLOC, PUT or promotion needing them waits (`_room`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import checksums, probekernel
from .. import policy as pol
from ..config import AgentConfig, TierName, TierPolicy
from ..constants import KEY_BYTES, PEER_TIER, PEER_TIER_CODE
from ..constants import TIER_CODES as TIER_CODE
from ..eviction import new_queue
from ..journal import Handoff, Journal, JournalEntry, pending_handoffs, replay
from ..keytable import homes
from ..metrics import AgentMetrics
from ..peers import wire
from ..peers.server import ChunkSource
from ..protocol import MAX_LOOKUP_KEYS, ErrorCode, Extents, checksum
from ..tiers import base
from ..tiers.base import ChunkRecord, IntegrityError
from ..tiers.dram import DramChunk, DramTier, WriteLease
from ..tiers.nvme import NvmeTier
from ..tiers.peer import PeerTier
from ..tiers.shared import SharedChunkTier
from .deletes import Deletes
from .demotion import IO_THREADS, Demotion
from .errors import OpError, check_key
from .loads import Loaded, Loads
from .observer import NO_OBSERVER, Observers, TierObserver
from .peerreads import PeerRead, PeerReads
from .recent import RecentLookups
from .sharedlink import SharedLink
from .snapshot import LookupCounts, StoreSnapshot, TierSnapshot

log = logging.getLogger(__name__)

MAX_LEASES_PER_CLIENT = 4096
UNCOMMITTED_SHARE = 2
"""A connection's uncommitted writes take at most 1/this of the arena: ALLOCs never
committed must not flush the arena (they cannot be evicted)."""
SPARE_SHARE = 8
"""A spare write lease (put-ahead) takes at most 1/this of the arena."""
DEMOTION_WAIT = 30.0
"""Seconds an ALLOC or PUT waits for chunks on their way to NVMe to free its room before
it answers NO_SPACE (only a stalled NVMe takes that long)."""
RECENT_LOOKUPS = 1 << 16
"""Keys remembered from recent LOOKUPs, so a chunk written next knows its depth (at least
half as many, the last ones told: `RecentLookups`)."""
COMPILE_FROM = 16
"""A LOOKUP of this many keys has LOOKUP's compiled loops made (`probekernel`, once per
process, on a thread): below it a LOOKUP costs little key by key."""
DRAM_CODES = bytes([2]) * MAX_LOOKUP_KEYS
"""A LOOKUP's tier codes where every key is in DRAM (the prefix of it that is)."""
FIND_TRIES = 4
"""Reads of a chunk that keeps moving between DRAM and NVMe under one GET or ACQUIRE
before it is a miss (each try is one NVMe read; a chunk moves only that often when DRAM
is far too small for the prompts it serves)."""


class Wait(enum.Enum):
    """`ChunkStore.alloc_now`'s answer where the ALLOC must wait for room."""

    WAIT = "wait"


WAIT = Wait.WAIT

Storing = Callable[[int, bytes], contextlib.AbstractContextManager[None]]
"""The context a batch's i-th chunk is made visible in, given its key (`commit_many`)."""


@dataclass(slots=True)
class CommitRequest:
    """What one COMMIT asks (`ChunkStore.commit_many`)."""

    lease: int
    checksum: int
    kind: int = checksums.XXH3
    key: bytes = b""
    """A spare lease's key (and `meta` its metadata), named at its COMMIT."""
    meta: bytes = b""
    to: str = ""
    """The node the chunk is handed off to (`ChunkStore.hand_off`)."""


@dataclass(slots=True)
class Granted:
    lease: int
    extents: Extents
    size: int = 0
    checksum: int = 0
    meta: bytes = b""
    tier: int = 2
    checksum_kind: int = checksums.XXH3


class ChunkStore:
    def __init__(self, config: AgentConfig, dram: DramTier, nvme: NvmeTier | None,
                 metrics: AgentMetrics, policy: TierPolicy, journal: Journal | None = None,
                 shared: SharedChunkTier | None = None) -> None:
        self.config = config
        self.dram = dram
        self.m = metrics
        self.policy = policy
        self.journal = journal
        if journal is not None:
            journal.live_entries = self._journal_live  # what its compaction keeps
            journal.live_handoffs = self._journal_handoffs
        self.dram.repin((), (bytes.fromhex(k) for k in policy.pins))
        self.seq = 0
        self.recent = RecentLookups(RECENT_LOOKUPS)
        """key -> (request seq, depth, last of its prompt) from recent LOOKUPs."""
        self.counts = LookupCounts()
        self.deletes = Deletes()
        """The DELETEs so far: work that waits notes a mark first, to learn of one meanwhile."""
        self.demoting = 0
        """Arena bytes (whole pages) of chunks on their way to NVMe: still held, soon free."""
        self._room_waiters: list[asyncio.Future[None]] = []
        """Allocations waiting for demotions to land (their pages to be freed)."""
        self.uncommitted: dict[int, int] = {}
        """Arena bytes (whole pages) under each connection's open write leases."""
        self.dma_owners: set[int] = set()
        """Connections that took a lease with `dma`: their leases drain when they close."""
        self.dram_queue = new_queue(policy.tiers.dram.eviction, dram)
        self.io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvpool-io")
        """Background writes and deletes: demotions, file removals, shared deletes and probes."""
        self.shared: SharedLink | None = None
        if shared is not None:
            self.shared = SharedLink(shared, config.tiers.shared, metrics, self.io,
                                     lambda: self.policy, journal, self.deletes)
        self.nvme: Demotion | None = None
        if nvme is not None:
            self.nvme = Demotion(nvme, self.io, metrics, policy,
                                 in_dram=lambda k: k in self.dram,
                                 pinned=self.dram.pinned, shared=self.shared,
                                 settled=self._demoted)
        self.loads = Loads(self.nvme, self.shared, metrics, position=self._position,
                           in_dram=lambda k: k in self.dram)
        self._background: set[asyncio.Task[None]] = set()
        self.observer: TierObserver = NO_OBSERVER
        """Told of every chunk entering and leaving a tier (`observe`)."""
        self.peer: PeerTier | None = None
        """The chunks the pool's other agents hold (`attach_peer`); None: peers are off."""
        self.handoffs: dict[bytes, tuple[float, int]] = {}
        """Chunks pushed here by peers (hand-offs) and not read yet: pinned until their
        first read or this monotonic time; with their arena bytes (whole pages). Journaled
        (with the wall-clock time they end): a warm restart pins them again."""
        self._handoff_bytes = 0
        """Arena bytes of `handoffs` and of the pushes being received (their quota)."""
        self.peer_reads = PeerReads(self)
        """Reads from peers under way, and their landings (`peerreads`)."""

    def attach_peer(self, peer: PeerTier) -> None:
        """Count and read the chunks the pool's other agents hold, from now on."""
        self.peer = peer

    def observe(self, observer: TierObserver) -> None:
        """Tell `observer` of chunks entering and leaving every tier from now on (as well
        as those told already)."""
        if self.observer is not NO_OBSERVER:
            observer = Observers([self.observer, observer])
        self.observer = observer
        if self.nvme is not None:
            self.nvme.observer = observer
        if self.shared is not None:
            self.shared.observe(observer)

    def held(self) -> Iterable[tuple[TierName, bytes]]:
        """Every (tier, key) the local tiers hold now (what an observer starts from)."""
        for key in self.dram:
            yield "dram", key
        if self.nvme is not None:
            held = self.nvme.nvme.keys()
            for key in held:
                yield "nvme", key

    # -- policy

    def set_policy(self, policy: TierPolicy) -> None:
        """Apply a new policy in place: nothing is flushed, pins are re-derived, and a
        tier whose eviction order changed has its queue rebuilt from what it holds."""
        old = {bytes.fromhex(k) for k in self.policy.pins}
        new = {bytes.fromhex(k) for k in policy.pins}
        self.dram.repin(old - new, new)
        if policy.tiers.dram.eviction is not self.policy.tiers.dram.eviction:
            self.dram_queue = new_queue(policy.tiers.dram.eviction, self.dram)
            for chunk in sorted(self.dram.entries(), key=lambda c: c.last_seq):
                self.dram_queue.add(chunk)
        if self.nvme is not None:
            self.nvme.set_policy(policy)
        self.policy = policy

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _position(self, key: bytes) -> tuple[int, int]:
        seq, depth, _ = self.recent.get(key) or (0, 0, False)
        return seq, depth

    def _hit_dram(self, slot: int, seq: int, depth: int, now: float) -> None:
        """A DRAM chunk hit by LOOKUP `seq` at `depth`, by its slot: LOOKUP's hot path, no
        view made (`Demotion.hit` for NVMe's)."""
        self.dram.hit(slot, seq, depth, now)
        self.dram_queue.touched_slot(slot, depth)

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
        keys = keys if type(keys) is list else list(keys)
        n = len(keys)
        if n > MAX_LOOKUP_KEYS:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"LOOKUP takes at most {MAX_LOOKUP_KEYS} keys, got {n}")
        # The keys joined and hashed (in one compiled call once it is there), what the
        # probes of every key at once start from (`KeyTable.find_many`).
        kernels = probekernel.ready()
        if kernels is None and n >= COMPILE_FROM:
            probekernel.compile_soon()  # (an agent that never sees one pays no compile)
        prepared = None if kernels is None else kernels.prepare(keys)
        if prepared is None:
            for k in keys:
                check_key(k)
            want, hashes = b"".join(keys), homes(keys)
        else:
            want, hashes = prepared
        seq = self._next_seq()
        now = time.time()
        slots, in_dram = self.dram.find_many(keys, want, hashes)
        hit = self._hit_dram
        nvme = self.nvme
        run = in_dram.find(0)
        run = n if run < 0 else run
        # (`_hit_dram` of each: their facts in one call, then their places in the order)
        self.dram.hit_run(slots, run, seq, now)
        touched = self.dram_queue.touched_slot
        for depth in range(run):
            touched(slots[depth], depth)
        tiers = bytearray(DRAM_CODES[:run])
        if nvme is not None:
            for depth in range(run, n):
                slot = slots[depth]
                if slot >= 0:
                    hit(slot, seq, depth, now)
                    tiers.append(2)
                    continue
                if nvme.hit(keys[depth], seq, depth, now):
                    tiers.append(3)
                    continue
                break
        self.recent.told(seq, keys)
        local = len(tiers)
        if 3 in tiers:  # its NVMe chunks are about to be read: one read can take several
            self.loads.ahead.remember_prompt(seq, keys[:local])
        peer = self.peer
        if peer is not None and local < n:
            # Past the local prefix, the directory of what peers hold (memory only: no
            # network on LOOKUP's path); a key that is local after all is reported local.
            codes = peer.codes(keys, want, hashes, in_dram)
            if nvme is None:
                end = codes.find(0, local)
                end = n if end < 0 else end
                if codes.count(2, local, end):
                    for depth in range(local, end):
                        if codes[depth] == 2:
                            hit(slots[depth], seq, depth, now)
                tiers += codes[local:end]
            else:
                for depth in range(local, n):
                    code = codes[depth]
                    if code == 2:
                        hit(slots[depth], seq, depth, now)
                    elif self._below(keys[depth]):
                        code = 3
                    elif not code:
                        break
                    tiers.append(code)
        reached = len(tiers)
        if peer is not None and reached > local and PEER_TIER_CODE in tiers:
            self.peer_reads.remember(seq, keys[:reached])
        if reached < n and self.shared is not None:
            # Past the local prefix the shared tier decides how far the prefix goes, but a
            # key of it that is local after all is reported (and counted) in its local tier.
            find = self.dram.finder()  # (after the wait: DRAM may have changed meanwhile)
            for depth in range(reached, reached + await self.shared.prefix(keys[reached:])):
                tiers.append(self._local_after_all(find, keys[depth], seq, depth, now) or 4)
        count = len(tiers)
        in_dram_count = tiers.count(2)
        in_nvme = tiers.count(3)
        in_peer = tiers.count(PEER_TIER_CODE)
        # Counted with the tiers' hits, not when the LOOKUP arrives: a scrape taken while
        # one waits on the shared tier saw its keys asked for but not their hits, and the
        # dashboard's hit ratio (hits over keys, two rates) read above 1.
        self.m.lookups.inc()
        self.m.lookup_keys.inc(n)
        self.counts.add("dram", in_dram_count, n - in_dram_count)
        if self.nvme is not None:
            self.counts.add("nvme", in_nvme, n - in_dram_count - in_nvme)
        if peer is not None:
            self.counts.add(PEER_TIER, in_peer, n - in_dram_count - in_nvme - in_peer)
        if self.shared is not None:
            self.counts.add("shared", count - in_dram_count - in_nvme - in_peer, n - count)
        for k in pol.prefetch_keys(self.policy, keys, count, bytes(tiers)):
            self._spawn(self._prefetch(k))
        return count, bytes(tiers)

    def _local_after_all(self, find: Callable[[bytes], int], key: bytes, seq: int,
                         depth: int, now: float) -> int:
        """The tier code of a key past LOOKUP's local prefix that a local tier holds after
        all (2, its DRAM hit counted, or 3; 0: neither does): where a lower tier carries
        the prefix on, a key of it that is local is reported, and counted, as local."""
        slot = find(key)
        if slot >= 0:
            self._hit_dram(slot, seq, depth, now)
            return 2
        return 3 if self._below(key) else 0

    async def _load(self, key: bytes) -> Loaded | None:
        """A chunk from below DRAM (`Loads.load`), unless its key was deleted while the
        read was under way: a DELETE is final, whatever reads were in flight."""
        mark = self.deletes.mark()
        loaded = await self.loads.load(key)
        if loaded is not None and self.deletes.since(key, mark):
            return None
        return loaded

    async def _find(self, key: bytes) -> DramChunk | Loaded | None:
        """The chunk in DRAM, or read from below. A read from NVMe can miss because the
        chunk moved meanwhile: a prefetch or another reader promoted it and its file went
        before this read opened it, and the watermark may have sent it straight back down
        (a new file, or a demotion in flight). So while a local tier still holds the key
        it is looked for again: a stored chunk is never a miss for being on the move."""
        for _ in range(FIND_TRIES):
            chunk = self.dram.get(key)
            if chunk is not None:
                return chunk
            if self.peer is not None and not self._below(key):
                fetched = await self.peer_reads.read(key)
                if fetched is not None:
                    return fetched
            loaded = await self._load(key)
            if loaded is not None:
                return loaded
            if not self._below(key):
                return self.dram.get(key)
        log.warning("%s moved between DRAM and NVMe during %d reads of it: a miss",
                    key.hex(), FIND_TRIES)
        return None

    # -- what this store offers its peers (`peers.server.Holdings`)

    async def peer_source(self, key: bytes, owner: int) -> ChunkSource | None:
        """Where a peer's read of `key` takes the bytes from: the arena (under a read lease
        until sent), the in-flight copy of a chunk on its way to NVMe (as a local read
        takes it: `Loads.load`), or the chunk's NVMe file (open: a rewrite or removal
        meanwhile leaves this read its own inode); None when none holds it. Before, a chunk
        mid-demotion was out of DRAM's index and not yet in NVMe's: announced still
        (`peer_size`), yet answered ABSENT. A deleted chunk is in none of them."""
        chunk = self.dram.get(key)
        if chunk is not None:
            lease = self.dram.open_read(chunk, owner)
            self.m.read_bytes["dram"].inc(chunk.size)

            def release() -> None:
                self.dram.close_read(lease.id, owner)
            return ChunkSource(chunk.size, chunk.checksum, chunk.checksum_kind, chunk.meta,
                               chunk.tenant, self.dram.dup_fd(), list(chunk.extents),
                               release, address=self.dram.address)
        copy = self.nvme.copy_of(key) if self.nvme is not None else None
        if copy is not None:
            self.m.read_bytes["nvme"].inc(copy.size)
            return ChunkSource(copy.size, copy.checksum, copy.checksum_kind, copy.meta,
                               copy.tenant, -1, [(0, copy.size)], data=copy.data)
        if self.nvme is not None and self.nvme.entry(key) is not None:
            loop = asyncio.get_running_loop()
            source = await loop.run_in_executor(self.loads.pool, open_nvme_source,
                                                str(self.nvme.nvme.path_of(key)), key)
            if source is not None:
                self.m.read_bytes["nvme"].inc(source.size)
            return source
        return None

    def peer_size(self, key: bytes) -> int:
        chunk = self.dram.get(key)
        if chunk is not None:
            return chunk.size
        if self.nvme is not None:
            entry = self.nvme.entry(key)
            if entry is not None:
                return entry.size
            copy = self.nvme.copy_of(key)
            if copy is not None:
                return copy.size
        return 0

    def peer_inventory(self) -> Iterator[tuple[bytes, int]]:
        """What `peer_size` counts: DRAM's chunks, those on their way to NVMe (served from
        their in-flight copy) and NVMe's."""
        for chunk in self.dram.entries():
            yield chunk.key, chunk.size
        if self.nvme is not None:
            # A copy (the stream waits between batches: the dict may change meanwhile).
            for key, (rec, _) in list(self.nvme.inflight.items()):
                if key not in self.dram and not self.nvme.nvme.contains(key):
                    yield key, rec.size
            for entry in self.nvme.nvme.entries():
                yield entry.key, entry.size

    # -- hand-offs (docs/cross-node.md#hand-off)

    def hand_off(self, key: bytes, to: str) -> None:
        """A client put `key` with a hint naming the node `to` that will read it: queue its
        push there (never waits; a push that fails leaves the chunk here, readable by key
        from every node)."""
        if self.peer is None or not to:
            return  # every put without a hint (nearly all) stops here, before a tier lookup
        if size := self.peer_size(key):
            self.peer.push(key, size, to)

    async def take_push(self, key: bytes, size: int, sender: bytes) -> tuple[int, str]:
        """A peer's offer of a chunk a client put for a reader on this node: read it from
        that peer (verified, as any peer read) and pin it until its first read or
        `peers.handoffTtl`. Refused, before any byte moves, past the pin quota (a
        producer must not pin a consumer's whole arena), for a size out of range, or from
        an agent this one does not follow (a peer it reads from)."""
        if self.contains(key):
            return wire.PUSH_HELD, ""
        if self.peer is None:
            return wire.PUSH_REFUSED, "peers are off on this agent"
        if not 0 < size <= self.config.max_chunk_bytes:
            return wire.PUSH_REFUSED, (f"chunk size {size} is outside "
                                       f"1..{self.config.max_chunk_bytes}")
        link = self.peer.link_of(sender)
        if link is None:
            return wire.PUSH_REFUSED, "the sender is not a peer this agent follows"
        pages = self._pages(size)
        quota = int(self.dram.capacity_bytes * self.config.peers.handoff_share)
        if self._handoff_bytes + pages > quota:
            return wire.PUSH_REFUSED, (
                f"pin quota: {self._handoff_bytes} of {quota} arena bytes are pinned by "
                f"unread pushes (peers.handoffShare), a chunk of {size} bytes does not fit; "
                "the reader can still read it by key")
        self._handoff_bytes += pages  # reserved while it is received
        try:
            chunk = await self.peer_reads.receive_push(key, link, size)
        except OpError as e:  # its insert refused (the journal cannot record it)
            return wire.PUSH_FAILED, e.message
        finally:
            self._handoff_bytes -= pages
        if chunk is None:
            return wire.PUSH_FAILED, "the read of the chunk from the sender failed"
        if chunk.key not in self.handoffs:
            self._pin_handoff(chunk)  # read by a concurrent read of this node's
        return wire.PUSH_STORED, ""

    def _pin_handoff(self, chunk: DramChunk, until: float | None = None) -> None:
        """Pin a pushed chunk until its first read or `until` (wall clock; by default
        `peers.handoffTtl` from now), and journal the pin (a restart keeps it)."""
        if self.dram.pinned(chunk.key):
            return  # pinned already (a policy's or a client's pin): that pin outlives it
        pages = self._pages(chunk.size)
        now = time.time()
        if until is None:
            until = now + self.config.peers.handoff_ttl
        self.handoffs[chunk.key] = (time.monotonic() + until - now, pages)
        self._handoff_bytes += pages
        self.dram.pin(chunk.key)
        if self.journal is not None:
            self.journal.handoff(chunk.key, until)

    def _journal_handoffs(self) -> Iterator[Handoff]:
        """The hand-off pins now, with the wall-clock time each ends (what a journal
        compaction keeps)."""
        mono, wall = time.monotonic(), time.time()
        for key, (until, _) in self.handoffs.items():
            yield Handoff(key, wall + until - mono)

    def _end_handoff(self, key: bytes, end: str | None, unpin: bool = True) -> None:
        """The pin of a pushed chunk ends (`end`: read, expired, deleted; None: not
        counted, the chunk left otherwise or a client pinned it)."""
        got = self.handoffs.pop(key, None)
        if got is None:
            return
        self._handoff_bytes -= got[1]
        if self.journal is not None:
            self.journal.handoff_ended(key)
        if unpin:
            self.dram.unpin(key)
        if end is not None and self.peer is not None:
            self.peer.handoff_ended(end)

    @property
    def handoff_bytes(self) -> int:
        return self._handoff_bytes

    def _expire_handoffs(self, now: float) -> None:
        for key in [k for k, (until, _) in self.handoffs.items() if until <= now]:
            self._end_handoff(key, "expired")

    def contains(self, key: bytes) -> bool:
        return key in self.dram or self._below(key)

    def waits(self, key: bytes) -> bool:
        """Whether an ACQUIRE of `key` would wait for a read from below DRAM (a peer's, under
        way or to start, or NVMe's) rather than be answered in this turn of the loop (a
        chunk in DRAM, or a miss): the connection sends the replies it holds before it."""
        if key in self.dram:
            return False
        return key in self.peer_reads.fetching or self._below(key) or (
            self.peer is not None and self.peer.holder(key) is not None)

    def landing(self, key: bytes) -> PeerRead | None:
        """The peer read of `key` under way, if one is (`PeerReads.landing`)."""
        return self.peer_reads.landing(key)

    def landed(self, keys: list[bytes]) -> tuple[bytes, PeerRead | None]:
        """WAIT's answer for `keys` (`PeerReads.landed`)."""
        return self.peer_reads.landed(keys)

    def _below(self, key: bytes) -> bool:
        """Held by a local tier below DRAM (the shared tier is not asked: it may be slow)."""
        return self.nvme is not None and self.nvme.holds(key)

    # -- zero-copy writes

    async def alloc(self, key: bytes, size: int, meta: bytes, tenant: str,
                    owner: int, dma: bool = False, to: str = "") -> Granted | None:
        """A write lease on fresh extents, or None when the key is already stored (then
        handed off `to` a node, if named: the COMMIT that would have done it never comes).
        `dma`: the owner copies by DMA (its leases drain when it disconnects)."""
        now = self.alloc_now(key, size, meta, tenant, owner, dma, to)
        if now is not WAIT:
            return now
        extents = await self._room(size)  # (room held by chunks on their way to NVMe)
        if self.contains(key):  # stored by another client while this one waited
            self.dram.free(extents)
            self.hand_off(key, to)
            return None
        return self._open_write(key, extents, size, meta, tenant, owner)

    def alloc_now(self, key: bytes, size: int, meta: bytes, tenant: str, owner: int,
                  dma: bool = False, to: str = "") -> Granted | Wait | None:
        """`alloc` where it needs no wait (a connection answers it as its frame arrives,
        without waking its task); `WAIT` where its room is held by chunks on their way to
        NVMe (`alloc` waits for them; what was evicted meanwhile is gone either way)."""
        check_key(key)
        if dma:
            self.dma_owners.add(owner)
        self._check_size(size, meta)
        if self.contains(key):
            self.hand_off(key, to)
            return None
        self._check_lease_budget(owner)
        pages = self._pages(size)
        self._check_fits(size)
        held = self.uncommitted.get(owner, 0)
        if held + pages > self.dram.capacity_bytes // UNCOMMITTED_SHARE:
            raise OpError(ErrorCode.NO_SPACE,
                          f"this connection's uncommitted writes hold {held} bytes of the "
                          f"arena; at most {self.dram.capacity_bytes // UNCOMMITTED_SHARE} "
                          "(half of it): commit or abort some first")
        extents = self._allocate(size)
        if extents is None:
            return WAIT
        return self._open_write(key, extents, size, meta, tenant, owner)

    def _open_write(self, key: bytes, extents: Extents, size: int, meta: bytes, tenant: str,
                    owner: int) -> Granted:
        lease = self.dram.open_write(key, extents, size, meta, tenant, owner,
                                     self.config.write_lease_timeout)
        self.uncommitted[owner] = self.uncommitted.get(owner, 0) + self._pages(size)
        return Granted(lease.id, extents, size)

    def _pages(self, size: int) -> int:
        """Arena bytes a chunk of `size` takes: whole pages."""
        return self.dram.footprint(size)

    def _write_closed(self, owner: int, size: int) -> None:
        left = self.uncommitted.get(owner, 0) - self._pages(size)
        if left > 0:
            self.uncommitted[owner] = left
        else:
            self.uncommitted.pop(owner, None)

    def commit(self, lease_id: int, checksum_: int, owner: int,
               kind: int = checksums.XXH3, key: bytes = b"", meta: bytes = b"",
               to: str = "") -> bool:
        """Make a write lease's chunk visible; False when its key was stored meanwhile
        (theirs is kept). A spare lease (`spare`) takes its `key` and `meta` here. `to`:
        the node that will read it, where it is pushed (`hand_off`), stored now or not."""
        key, meta, lease = self._close_write(lease_id, kind, key, meta, owner)
        if self.contains(key):
            self._keep_theirs(key, lease, to)
            return False
        chunk = self._insert(key, lease.extents, lease.size, checksum_ & (2**64 - 1), meta,
                             lease.tenant, kind=kind)
        self._write_through(chunk)
        self.hand_off(key, to)
        return True

    def commit_many(self, commits: Sequence[CommitRequest], owner: int,
                    storing: Storing | None = None) -> list[bool | Exception]:
        """`commit` of each (a window's COMMITs that came together), one result each: True
        (stored), False (its key was stored first, theirs is kept), or what refused it (an
        `OpError`: that commit alone fails, its lease open where `commit` leaves it open).

        The chunks are journaled in one write, then made visible in order, then the DRAM
        watermark is checked once: each is in the journal before it is visible, as with one
        commit at a time, and nothing is answered before all of it is done. Where the
        journal refuses the write, each is journaled alone, and refused alone if that fails
        too. `storing(i, key)`: the context `commits[i]`'s chunk is made visible in (what
        KV events say of it)."""
        results: list[bool | Exception] = [False] * len(commits)
        ready: list[tuple[int, bytes, bytes, WriteLease]] = []
        again: list[tuple[int, bytes, bytes, WriteLease]] = []
        """Keys an earlier commit of the batch stores: done after those, as one commit at a
        time would (False, unless that earlier commit was refused)."""
        keys: set[bytes] = set()
        for i, c in enumerate(commits):
            try:
                key, meta, lease = self._close_write(c.lease, c.kind, c.key, c.meta, owner)
            except Exception as e:  # that commit's reply says it
                results[i] = e
                continue
            if key in keys:
                again.append((i, key, meta, lease))
            elif self.contains(key):
                self._keep_theirs(key, lease, c.to)
            else:
                keys.add(key)
                ready.append((i, key, meta, lease))
        journaled = False
        if self.journal is not None and len(ready) > 1:
            try:
                self.journal.commit_many([
                    JournalEntry(key, lease.extents, lease.size,
                                 commits[i].checksum & (2**64 - 1), meta, lease.tenant,
                                 commits[i].kind)
                    for i, key, meta, lease in ready])
                journaled = True
            except OSError:
                pass  # one at a time, then: refused alone where it cannot be recorded
        for i, key, meta, lease in ready:
            self._commit_visible(commits[i], key, meta, lease, journaled, storing, i, results)
        for i, key, meta, lease in again:
            if self.contains(key):
                self._keep_theirs(key, lease, commits[i].to)
            else:
                self._commit_visible(commits[i], key, meta, lease, False, storing, i, results)
        if any(r is True for r in results):
            self._check_watermark()
        return results

    def _keep_theirs(self, key: bytes, lease: WriteLease, to: str) -> None:
        """A closed write whose key another client stored first: theirs is kept (this
        one's pages freed), and handed off `to` a node as this COMMIT asked."""
        self.dram.free(lease.extents)
        self.hand_off(key, to)

    def _close_write(self, lease_id: int, kind: int, key: bytes, meta: bytes,
                     owner: int) -> tuple[bytes, bytes, WriteLease]:
        """A commit's checks, then its write lease closed: the chunk's key, metadata and
        the lease. Raises, the lease left open, for an unknown checksum kind, a spare's bad
        key or metadata, or a key other than the lease's; UNKNOWN_LEASE for a lease not
        open on this connection."""
        if kind not in checksums.KINDS:  # checked first: the lease stays open to retry
            raise OpError(ErrorCode.BAD_ARGUMENT, f"unknown checksum kind {kind}")
        open_ = self.dram.write_lease(lease_id)
        if open_ is not None and open_.owner == owner:
            if not open_.key:  # a spare: the chunk is named now, checked before it closes
                check_key(key)
                self._check_size(open_.size, meta)
            elif key and key != open_.key:
                raise OpError(ErrorCode.BAD_ARGUMENT,
                              f"write lease {lease_id} is for another key")
        lease = self.dram.close_write(lease_id, owner)
        if lease is None:
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"write lease {lease_id} is not open on this connection")
        self._write_closed(owner, lease.size)
        return (lease.key, lease.meta, lease) if lease.key else (key, meta, lease)

    def _commit_visible(self, c: CommitRequest, key: bytes, meta: bytes, lease: WriteLease,
                        journaled: bool, storing: Storing | None, i: int,
                        results: list[bool | Exception]) -> None:
        """A closed write's chunk made visible (journaled first unless `journaled`), offered
        to the shared tier and handed off; results[i] says how it went."""
        try:
            with storing(i, key) if storing is not None else contextlib.nullcontext():
                chunk = self._insert(key, lease.extents, lease.size, c.checksum & (2**64 - 1),
                                     meta, lease.tenant, evict=False, kind=c.kind,
                                     journaled=journaled)
        except Exception as e:  # the journal cannot record it (pages freed), or a bug
            results[i] = e
            return
        self._write_through(chunk)
        self.hand_off(key, c.to)
        results[i] = True

    def spare(self, size: int, tenant: str, owner: int) -> Granted | None:
        """A keyless write lease for the connection's next put of `size` bytes (put-ahead,
        docs/protocol.md): its key and metadata come with its COMMIT. None when it does not
        fit now without waiting, or would take more than 1/SPARE_SHARE of the arena or
        the connection's budget: that put ALLOCs instead."""
        self._check_size(size, b"")
        pages = self._pages(size)
        held = self.uncommitted.get(owner, 0)
        if self.dram.leases_held(owner) >= MAX_LEASES_PER_CLIENT \
                or pages > self.dram.capacity_bytes // SPARE_SHARE \
                or held + pages > self.dram.capacity_bytes // UNCOMMITTED_SHARE:
            return None
        try:
            extents = self._allocate(size)
        except OpError:
            return None
        if extents is None:  # room only once demotions land: not worth a wait
            return None
        lease = self.dram.open_write(b"", extents, size, b"", tenant, owner,
                                     self.config.write_lease_timeout)
        self.uncommitted[owner] = held + pages
        return Granted(lease.id, extents, size)

    def abort(self, lease_id: int, owner: int) -> None:
        lease = self.dram.close_write(lease_id, owner)
        if lease is None:
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"write lease {lease_id} is not open on this connection")
        self._write_closed(owner, lease.size)
        self.dram.free(lease.extents)

    def _insert(self, key: bytes, extents: Extents, size: int, checksum_: int, meta: bytes,
                tenant: str, hits: int = 0, evict: bool = True,
                kind: int = checksums.XXH3, journaled: bool = False) -> DramChunk:
        """Make a chunk visible; `evict=False` leaves the watermark check to the caller.

        Journaled first: a chunk the journal cannot record is refused and its extents
        freed, so no client is told "failed" for a chunk that is stored. (`journaled`: the
        caller has journaled it already, with others in one write: `_land`.)"""
        if self.journal is not None and not journaled:
            try:
                self.journal.commit(JournalEntry(key, extents, size, checksum_, meta, tenant,
                                                 kind))
            except OSError as e:
                self.dram.free(extents)
                raise OpError(ErrorCode.NO_SPACE,
                              f"chunk not stored: the commit journal cannot record it ({e})"
                              ) from e
        seq, depth, last = self.recent.get(key) or (self._next_seq(), 0, False)
        chunk = self.dram.insert(key, extents, size, checksum_, meta, tenant, kind, hits=hits,
                                 seq=seq, depth=depth, now=time.time())
        self.dram_queue.add(chunk, tail=last)
        self.m.written_bytes["dram"].inc(size)
        self.observer.stored("dram", key)
        if evict:
            self._check_watermark()
        return chunk

    # -- reads

    def acquire_now(self, key: bytes, owner: int, dma: bool = False) -> Granted | None:
        """`acquire` of a chunk DRAM holds now, answered without a wait (a connection
        answers it as its frame arrives, without waking its task); None where DRAM does
        not hold it, nothing done then but the checks `acquire` makes first (the caller
        then `acquire`s it: a read from below, or a miss)."""
        check_key(key)
        if dma:
            self.dma_owners.add(owner)
        self._check_lease_budget(owner)
        chunk = self.dram.get(key)
        return None if chunk is None else self._lease(key, chunk, owner)

    async def acquire(self, key: bytes, owner: int, dma: bool = False) -> Granted:
        check_key(key)
        if dma:
            self.dma_owners.add(owner)
        self._check_lease_budget(owner)
        chunk = self.dram.get(key)  # (nearly every read: no wait, `_find` not entered)
        if chunk is not None:
            return self._lease(key, chunk, owner)
        found = await self._find(key)
        tier, transient = 2, False
        if found is None:
            raise OpError(ErrorCode.NOT_FOUND, f"{key.hex()} is not stored")
        if isinstance(found, DramChunk):
            chunk = found
        else:
            rec, source, hits = found
            # Leases are on arena bytes, so the chunk comes up into DRAM either way;
            # with promotion off it stays only for this lease.
            chunk = self.dram.get(key) or await self._promote(rec, "promotion", source, hits,
                                                              evict=False)
            tier, transient = TIER_CODE[source], not pol.should_promote(self.policy, hits or 1)
        return self._lease(key, chunk, owner, tier, transient)

    def _lease(self, key: bytes, chunk: DramChunk, owner: int, tier: int = 2,
               transient: bool = False) -> Granted:
        """A read lease on `key`'s DRAM chunk for `owner` (`acquire`'s end): `tier` is
        where the chunk was found, `transient` that it is dropped from DRAM at once
        (hidden, freed at RELEASE: promotion is off)."""
        self._touch_read(chunk)
        lease = self.dram.open_read(chunk, owner)
        if key in self.handoffs:  # the hand-off's read: the lease keeps it till RELEASE
            self._end_handoff(key, "read")
        # Only now that the lease protects it: a promoted chunk may well be the watermark's
        # first victim (LRU by an old LOOKUP's seq, a prompt's tail), and evicted before
        # its lease it would be read from freed arena pages that another chunk reuses.
        self._check_watermark()
        if transient:
            self._drop_dram(key)  # hidden now, freed at RELEASE
        self.m.read_bytes["dram"].inc(chunk.size)
        return Granted(lease.id, chunk.extents, chunk.size, chunk.checksum, chunk.meta, tier,
                       chunk.checksum_kind)

    def read_told(self, keys: list[bytes]) -> None:
        """Chunks a client read from DRAM without a lease, told after the fact (READ): each
        still here counts as a read, as an ACQUIRE's does (its place in the eviction order,
        the tier's read bytes, a hand-off's first read). A key not held is skipped: it was
        evicted or deleted since, and the client's copy was checked against its slot."""
        if len(keys) > MAX_LOOKUP_KEYS:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"READ takes at most {MAX_LOOKUP_KEYS} keys, got {len(keys)}")
        for key in keys:
            check_key(key)
        for key in keys:
            chunk = self.dram.get(key)
            if chunk is None:
                continue
            self._touch_read(chunk)
            self.m.read_bytes["dram"].inc(chunk.size)
            if key in self.handoffs:
                self._end_handoff(key, "read")

    def release(self, lease_id: int, owner: int) -> None:
        if not self.dram.close_read(lease_id, owner):
            raise OpError(ErrorCode.UNKNOWN_LEASE,
                          f"read lease {lease_id} is not open on this connection")

    async def get(self, key: bytes) -> tuple[bytes, int, bytes, int, int]:
        """(bytes, checksum, meta, tier, checksum kind) of a stored chunk."""
        check_key(key)
        found = await self._find(key)
        if isinstance(found, DramChunk):
            chunk = found
            data = self.dram.read_verified(chunk)
            if data is None:  # its arena bytes were overwritten: a miss, never wrong bytes
                self.m.integrity_failures["dram"].inc()
                self._drop_dram(key)
                raise OpError(ErrorCode.NOT_FOUND, f"{key.hex()} failed its checksum")
            self._touch_read(chunk)
            self.m.read_bytes["dram"].inc(chunk.size)
            if key in self.handoffs:
                self._end_handoff(key, "read")
            return data, chunk.checksum, chunk.meta, 2, chunk.checksum_kind
        if found is None:
            raise OpError(ErrorCode.NOT_FOUND, f"{key.hex()} is not stored")
        rec, source, hits = found
        if pol.should_promote(self.policy, hits or 1) and self.dram.get(key) is None:
            try:
                await self._promote(rec, "promotion", source, hits)
            except OpError as e:  # DRAM all leased: serve without promoting
                if e.code == ErrorCode.NOT_FOUND:
                    raise  # deleted while the promotion waited for room
        return bytes(rec.data), rec.checksum, rec.meta, TIER_CODE[source], rec.checksum_kind

    async def _promote(self, rec: ChunkRecord, why: str, source: TierName, hits: int,
                       evict: bool = True) -> DramChunk:
        """Copy a verified lower-tier chunk into DRAM (`promotion` or `prefetch`), waiting
        for room like a write (`_room`)."""
        self.loads.ahead.drop(rec.key)
        mark = self.deletes.mark()
        extents = await self._room(rec.size)
        if self.deletes.since(rec.key, mark):  # a DELETE is final, whatever waited
            self.dram.free(extents)
            raise OpError(ErrorCode.NOT_FOUND, f"{rec.key.hex()} was deleted")
        if self.dram.get(rec.key) is not None:  # promoted by another read while this waited
            self.dram.free(extents)
            chunk = self.dram.get(rec.key)
            assert chunk is not None
            return chunk
        self.dram.write_extents(extents, rec.data)
        chunk = self._insert(rec.key, extents, rec.size, rec.checksum, rec.meta, rec.tenant,
                             hits, evict, rec.checksum_kind)
        (self.m.prefetches if why == "prefetch" else self.m.promotions)[source].inc()
        # DRAM and NVMe are exclusive: the NVMe copy goes, so they hold as many
        # distinct chunks as their capacities add up to. Eviction demotes it back.
        if self.nvme is not None and self.nvme.entry(rec.key) is not None:
            self.nvme.drop([pol.Victim(rec.key, "promoted")])
        return chunk

    async def _prefetch(self, key: bytes) -> None:
        if self.dram.get(key) is not None:
            return
        # A key a peer holds comes from it, as a read of it would (the peer tier is above
        # the shared one); where that fails, from below as any other.
        if self.peer is not None and not self._below(key) \
                and await self.peer_reads.read(key, ahead=False) is not None:
            return
        loaded = await self._load(key)
        if loaded is not None and self.dram.get(key) is None:
            rec, source, hits = loaded
            with contextlib.suppress(OpError):  # no room can be made: prefetch is best effort
                await self._promote(rec, "prefetch", source, hits)

    # -- inline writes

    async def put(self, key: bytes, data: bytes, checksum_: int, meta: bytes,
                  tenant: str, to: str = "") -> bool:
        check_key(key)
        self._check_size(len(data), meta)
        if checksum(data, meta) != checksum_:
            raise OpError(ErrorCode.CHECKSUM_MISMATCH,
                          "the PUT bytes do not match their checksum; nothing stored")
        if self.contains(key):
            self.hand_off(key, to)
            return False
        extents = await self._room(len(data))
        if self.contains(key):  # stored by another client while this one waited
            self.dram.free(extents)
            self.hand_off(key, to)
            return False
        self.dram.write_extents(extents, data)
        chunk = self._insert(key, extents, len(data), checksum_, meta, tenant)
        self._write_through(chunk, data)
        self.hand_off(key, to)
        return True

    # -- management

    def delete(self, key: bytes, local: bool = False) -> bool:
        """A client's DELETE: final on this node, in the shared tier (in the background)
        and, with peers on, on every other node of the pool (docs/cross-node.md#delete);
        `local`: on this node only. Whether this node held it."""
        check_key(key)
        existed = self._delete_here(key)
        if local:
            return existed
        if self.shared is not None:
            self._spawn(self.shared.delete(key))
        if self.peer is not None:
            self.peer.delete(key, here=True)
        return existed

    def peer_delete(self, key: bytes, sender: bytes) -> tuple[int, str]:
        """A DELETE made on the node of the agent whose id is `sender` (a peer this one
        follows): this node's copy goes, and no peer is read from for it any more."""
        if self.peer is None:
            return wire.DELETE_REFUSED, "peers are off on this agent"
        if self.peer.link_of(sender) is None:
            return wire.DELETE_REFUSED, "the sender is not a peer this agent follows"
        self.peer.delete(key, here=False, sender=sender)
        return (wire.DELETED if self._delete_here(key) else wire.NOT_HELD), ""

    def _delete_here(self, key: bytes) -> bool:
        """The key's copy on this node goes: DRAM, in flight, NVMe; whether one was held."""
        self.deletes.record(key)
        self._end_handoff(key, "deleted")
        self.dram.unpin(key)
        self.loads.forget(key)
        demoting = self.nvme is not None and key in self.nvme.inflight
        existed = self._drop_dram(key)
        if demoting and not existed and self.journal is not None:
            self.journal.drop(key)  # journaled till its demotion lands: a delete is final
        if self.nvme is not None and self.nvme.forget(key):
            existed = True
        return existed

    def pin(self, key: bytes) -> None:
        check_key(key)
        if not self.contains(key):
            raise OpError(ErrorCode.NOT_FOUND, f"cannot pin {key.hex()}: not stored")
        self._end_handoff(key, None, unpin=False)  # the client's pin, from now on
        self.dram.pin(key)

    def unpin(self, key: bytes) -> None:
        check_key(key)
        self.dram.unpin(key)

    def disconnect(self, owner: int) -> None:
        """A connection closed: abort its writes and end its reads. One that copied by DMA
        (an ALLOC or ACQUIRE with `dma`) drains instead: a device may still be copying
        into its write leases' pages or out of its read leases' chunks (its process died
        mid-copy, or is alive and finishing the window its connection lost), so the pages
        stay from reuse and the reads open for `writeLeaseTimeout`, the time the agent
        gives any writer to copy a chunk; its writes are never committed."""
        self.uncommitted.pop(owner, None)
        if owner in self.dma_owners:
            self.dma_owners.discard(owner)
            writes_ = self.dram.writes_of(owner)
            self.dram.drain(owner, writes_,
                            time.monotonic() + self.config.write_lease_timeout)
            return
        writes, reads = self.dram.leases_of(owner)
        for lease_id in writes:
            self.abort(lease_id, owner)
        for lease_id in reads:
            self.dram.close_read(lease_id, owner)
        self.dram.unfence(owner)

    # -- eviction and demotion

    def _drop_dram(self, key: bytes) -> bool:
        self.dram_queue.discard(key)  # first: the queue finds the chunk by the tier's index
        if self.dram.remove(key) is None:
            return False
        self._end_handoff(key, None)
        if self.journal is not None:
            self.journal.drop(key)
        self.observer.removed("dram", key)
        return True

    def _footprint(self, chunk: pol.Entry) -> int:
        """Arena bytes a DRAM chunk frees: whole pages."""
        return self._pages(chunk.size)

    def _evict_dram_to(self, target: int, reason: str) -> None:
        """Evict down to `target` (pages being demoted count as free already), as far as
        the demotions in flight stay within their bound: a watermark is a soft target,
        the next insert goes on."""
        with contextlib.closing(self.dram_queue.candidates()) as walk:
            victims = pol.choose_victims(
                walk, tier="dram", policy=self.policy, used=self.dram.used_bytes - self.demoting,
                target=target, reason=reason, protected=self.dram.protected,
                footprint=self._footprint)
        self._evict_dram(self._admissible(victims))

    def _admissible(self, victims: list[pol.Victim]) -> list[pol.Victim]:
        """The victims, in order, that can be demoted within the bound on demotions in
        flight (the first one always, with none in flight: a chunk larger than the bound
        must still get through)."""
        if self.nvme is None:
            return victims
        n = size = 0
        for i, v in enumerate(victims):
            chunk = self.dram.get(v.key)
            n, size = n + 1, size + (chunk.size if chunk is not None else 0)
            if not self.nvme.admits(n, size, self.dram.capacity_bytes):
                return victims[: max(i, 1 if self.nvme.pending == 0 else 0)]
        return victims

    def _demoted(self, chunk: DramChunk, drop_journal: bool) -> None:
        """A demotion's write is done: its DRAM pages are free now (and its journal entry
        gone, unless a newer one speaks for the key), and waiting allocations retry."""
        if drop_journal and self.journal is not None:
            self.journal.drop(chunk.key)  # first: the pages are reused only once it is gone
        self.demoting -= self._pages(chunk.size)
        self.dram.release(chunk)
        waiters, self._room_waiters = self._room_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _journal_live(self) -> Iterable[JournalEntry]:
        """What a journal compaction keeps: the visible DRAM chunks, and chunks on their
        way to NVMe (still in the arena until their file lands)."""
        yield from self.dram.journal_entries()
        if self.nvme is not None:
            for key, (_, c) in self.nvme.inflight.items():
                if self.dram.get(key) is None:
                    yield JournalEntry(c.key, c.extents, c.size, c.checksum, c.meta, c.tenant,
                                       c.checksum_kind)

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
                elif self.shared is not None and self.shared.demotes(chunk.hits):
                    below = "shared"
            rec = None
            if below is not None and chunk.readers == 0:
                rec = ChunkRecord(chunk.key, self.dram.read_extents(chunk.extents), chunk.checksum,
                                  chunk.meta, chunk.tenant, checksum_kind=chunk.checksum_kind)
                if not rec.verify():
                    log.error("integrity failure in dram for %s: dropped", chunk.key.hex())
                    self.m.integrity_failures["dram"].inc()
                    rec = None
            if below == "nvme" and rec is not None:
                assert self.nvme is not None
                if self.nvme.reserve(rec):
                    # Out of the index, but its pages and journal entry stay until its
                    # file has landed: a SIGKILL meanwhile finds it in DRAM again.
                    self.dram_queue.discard(v.key)  # first, as in `_drop_dram`
                    self.dram.detach(v.key)
                    self.demoting += self._pages(chunk.size)
                    self.m.evictions[("dram", v.reason)].inc()
                    # In flight before DRAM tells it is gone: the peer tier hears no
                    # change (it serves the in-flight copy). Told the other way round,
                    # peers dropped the chunk until its file landed, and a read of it
                    # already on its way was answered ABSENT.
                    self.nvme.demote(rec, chunk)
                    self.observer.removed("dram", v.key)
                    continue
                rec = None  # no room can be made in NVMe: dropped, as if not admitted
            self._drop_dram(v.key)
            self.m.evictions[("dram", v.reason)].inc()
            if rec is None:
                continue
            assert self.shared is not None and below == "shared"
            self.shared.upload(rec)
            self.m.demotions["dram"].inc()

    def _write_through(self, chunk: DramChunk, data: bytes | None = None) -> None:
        """Offer a freshly committed chunk to G4 when its rules say write-through."""
        if self.shared is None or not self.shared.writes_through():
            return
        payload = data if data is not None else self.dram.read_extents(chunk.extents)
        self.shared.upload(ChunkRecord(chunk.key, payload, chunk.checksum, chunk.meta,
                                       chunk.tenant, checksum_kind=chunk.checksum_kind))

    def _check_watermark(self) -> None:
        rules = self.policy.tiers.dram
        target = pol.watermark_target(rules, self.dram.capacity_bytes, self.dram.used_bytes)
        if target is not None:
            self._evict_dram_to(target, "watermark")

    async def _room(self, size: int) -> Extents:
        """Extents for a new chunk (`_allocate`), waiting while the room is held by chunks
        on their way to NVMe: the writers are held back, never the heap grown. NO_SPACE
        after `DEMOTION_WAIT` seconds without room (NVMe stalled)."""
        deadline = time.monotonic() + DEMOTION_WAIT
        while (extents := self._allocate(size)) is None:
            if self.nvme is None or self.nvme.pending == 0:
                continue  # what it evicted was dropped, not demoted: evict on
            left = deadline - time.monotonic()
            if left <= 0:
                raise OpError(ErrorCode.NO_SPACE,
                              f"no room for {size} bytes: the arena is held by chunks being "
                              f"demoted to nvme, and none landed for {DEMOTION_WAIT:g} s")
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._room_waiters.append(fut)
            await asyncio.wait([fut], timeout=left)
        return extents

    def _allocate(self, size: int) -> Extents | None:
        """Extents for a new chunk, evicting by policy as needed; None when room will be
        there once demotions in flight land (the caller waits, `_room`).

        Nothing is evicted for a chunk that cannot fit even then (larger than the arena,
        or more than its free, evictable and being-demoted bytes together), nor while
        that would take the demotions in flight past their bound. Where the free bytes
        would do but are split into too many runs, more chunks go, in eviction order,
        until their pages join into room enough."""
        d = self.dram
        extents = d.allocate(size)
        if extents is not None:
            return extents
        need = self._pages(size)
        self._check_fits(size)
        free = d.capacity_bytes - d.used_bytes
        with contextlib.closing(self.dram_queue.candidates()) as walk:
            victims = pol.choose_victims(
                walk, tier="dram", policy=self.policy, used=d.used_bytes - self.demoting,
                target=d.capacity_bytes - need, reason="capacity", protected=d.protected,
                footprint=self._footprint)
        evictable = sum(self._footprint(c) for v in victims if (c := d.get(v.key)) is not None)
        if free + self.demoting + evictable < need:
            raise OpError(ErrorCode.NO_SPACE,
                          f"no room for {size} bytes: {free} free, {evictable} evictable and "
                          f"{self.demoting} being demoted; the rest is leased or pinned, or "
                          "being written")
        admitted = self._admissible(victims)
        self._evict_dram(admitted)
        if len(admitted) < len(victims):
            return None  # the rest once some of those in flight have landed
        while (extents := d.allocate(size)) is None:
            if self.demoting:
                return None  # pages on their way to NVMe free up soon: wait for them
            # The free pages are there, in too many runs: evict on to join them.
            with contextlib.closing(self.dram_queue.candidates()) as walk:
                more = pol.choose_victims(
                    walk, tier="dram", policy=self.policy, used=d.used_bytes,
                    target=d.used_bytes - need, reason="capacity", protected=d.protected,
                    footprint=self._footprint)
            if not more:
                raise OpError(ErrorCode.NO_SPACE,
                              f"no room for {size} bytes: {d.capacity_bytes - d.used_bytes} "
                              "free, but in runs too small and too many for one chunk, and "
                              "nothing left to evict")
            self._evict_dram(self._admissible(more))
        return extents

    # -- housekeeping

    def expire(self, now: float | None = None) -> None:
        """Writes idle past their lease timeout, and chunks past their tier's TTL."""
        mono = time.monotonic()
        self.dram.expire_writes(mono)  # their pages stay fenced until the writer disconnects
        self.dram.end_drains(mono)
        wall = time.time() if now is None else now
        self._expire_handoffs(mono)
        # Within the bound on demotions in flight: the rest go at a later sweep.
        self._evict_dram(self._admissible(pol.expired(
            self.dram.entries(), self.policy.tiers.dram.ttl, wall, self.dram.protected)))
        if self.nvme is not None:
            self.nvme.expire(wall)

    async def probe_shared(self) -> None:
        """Ask an unhealthy shared tier, about once a second, whether it answers again."""
        if self.shared is not None:
            await self.shared.probe()

    def close(self) -> None:
        """Stop background work: finish the NVMe writes and removals that wait, upload what
        is queued for a moment, then stop the threads."""
        self.io.shutdown(wait=True)  # batches already handed over finish first
        if self.nvme is not None:
            self.nvme.close()
        if self.shared is not None:
            self.shared.close()
        self.loads.close()

    def recover(self, entries: Iterable[JournalEntry]) -> tuple[int, int]:
        """Re-admit journaled chunks whose arena bytes still verify; (kept, dropped).

        Extents are reserved in arena order, so each reservation cuts the free run at the
        end of what is reserved so far (a warm restart of a fragmented arena stays linear);
        chunks are then admitted in journal order, which is their eviction order."""
        kept = dropped = 0
        live: list[JournalEntry] = []
        journaled = list(entries)
        seen: set[bytes] = set()
        reserved: set[int] = set()
        for i in sorted(range(len(journaled)), key=lambda i: journaled[i].extents[:1]):
            e = journaled[i]
            if len(e.key) == KEY_BYTES and e.key not in seen and self.dram.reserve(e.extents):
                seen.add(e.key)
                reserved.add(i)
        for i, e in enumerate(journaled):
            if i not in reserved:
                dropped += 1
                continue
            if (e.checksum_kind not in checksums.KINDS
                    or self.dram.checksum_of(e.extents, e.meta, e.checksum_kind) != e.checksum):
                self.dram.free(e.extents)
                self.m.integrity_failures["dram"].inc()
                dropped += 1
                continue
            chunk = self.dram.insert(e.key, e.extents, e.size, e.checksum, e.meta, e.tenant,
                                     e.checksum_kind, seq=self._next_seq(), now=time.time())
            self.dram_queue.add(chunk)
            live.append(e)
            kept += 1
        if self.journal is not None:
            # Pushed chunks not read yet are pinned again until their pin's end: the
            # reader they were pushed for may not have read them yet.
            now = time.time()
            for pin in pending_handoffs(self.journal.path):
                pushed = self.dram.get(pin.key)
                if pushed is not None and pin.until > now:
                    self._pin_handoff(pushed, pin.until)
            # The shared-tier deletes still pending stay recorded (read at start-up).
            self.journal.rewrite(live, list(self.journal.live_deletes()),
                                 list(self._journal_handoffs()))
        return kept, dropped

    def _spawn(self, work: Coroutine[object, object, None] | asyncio.Future[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- reporting

    def snapshot(self) -> StoreSnapshot:
        """What this store holds and has counted, now (STATS and the metrics read it)."""
        d, c = self.dram, self.counts
        tiers = [TierSnapshot("dram", d.capacity_bytes, d.used_bytes, len(d),
                              c.hits["dram"], c.misses["dram"], True)]
        demoting = demoting_bytes = removing = peak = peak_bytes = 0
        if self.nvme is not None:
            nvme = self.nvme.nvme
            ok, reason = nvme.healthy()
            tiers.append(TierSnapshot("nvme", nvme.capacity_bytes, nvme.used_bytes, nvme.chunks,
                                      c.hits["nvme"], c.misses["nvme"], ok, reason))
            demoting, demoting_bytes = self.nvme.pending, self.nvme.pending_bytes
            peak, peak_bytes = self.nvme.peak, self.nvme.peak_bytes
            removing = self.nvme.removing
        url = ""
        queue = None
        if self.shared is not None:
            shared = self.shared.tier
            ok, reason = shared.healthy()
            tiers.append(TierSnapshot("shared", shared.capacity_bytes, shared.used_bytes,
                                      shared.chunks, c.hits["shared"], c.misses["shared"], ok,
                                      reason))
            url, queue = shared.url, self.shared.queue_stats()
        return StoreSnapshot(tiers, LookupCounts(dict(c.hits), dict(c.misses)), d.read_leases,
                             d.write_leases, d.pin_count, d.locked_bytes, d.lock_error,
                             demoting, demoting_bytes, removing, url, queue, d.draining_reads,
                             d.draining_bytes,
                             None if self.peer is None else self.peer.chunks,
                             len(self.handoffs), self._handoff_bytes,
                             demoting_peak=peak, demoting_peak_bytes=peak_bytes)

    # -- checks

    def _check_size(self, size: int, meta: bytes) -> None:
        if not 0 < size <= self.config.max_chunk_bytes:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"chunk size {size} is outside 1..{self.config.max_chunk_bytes}")
        if len(meta) > self.config.max_meta_bytes:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"metadata of {len(meta)} bytes exceeds {self.config.max_meta_bytes}")

    def _check_fits(self, size: int) -> None:
        if self._pages(size) > self.dram.capacity_bytes:
            raise OpError(ErrorCode.NO_SPACE,
                          f"a chunk of {size} bytes can never fit: the arena holds "
                          f"{self.dram.capacity_bytes}")

    def _check_lease_budget(self, owner: int) -> None:
        if self.dram.leases_held(owner) >= MAX_LEASES_PER_CLIENT:
            raise OpError(ErrorCode.TOO_MANY_LEASES,
                          f"this connection holds {MAX_LEASES_PER_CLIENT} leases; release some")


def open_nvme_source(path: str, key: bytes) -> ChunkSource | None:
    """The chunk bytes of an NVMe chunk file, for a peer (a worker thread): its header read
    and checked against the key and the file's size; the bytes are not (the reader
    verifies them). None when the file is gone or damaged."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        head = os.pread(fd, base.HEADER_BYTES, 0)
        head += os.pread(fd, max(0, base.header_length(head) - len(head)), len(head))
        h = base.decode_header(head)
        if h.key != key or os.fstat(fd).st_size != h.data_offset + h.size:
            raise IntegrityError("size or key does not match the header")
    except (OSError, IntegrityError):
        os.close(fd)
        return None
    return ChunkSource(h.size, h.checksum, h.checksum_kind, h.meta, h.tenant, fd,
                       [(h.data_offset, h.size)])


def open_journal(config: AgentConfig) -> tuple[Journal, list[JournalEntry]]:
    path = config.journal_path()
    entries = list(replay(path))
    return Journal(path), entries
