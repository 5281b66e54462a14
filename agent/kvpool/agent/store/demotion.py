"""The NVMe side of the store: demotions into it, evictions and file removals out of it.

A DRAM chunk evicted with `onEvict: demote` is copied out and verified and written to
NVMe in a worker thread; until that write lands the chunk is served from the in-flight
copy, and its arena pages and commit-journal entry stay: they are given back (`settled`)
only once the file is in place, so an agent killed meanwhile finds the chunk in DRAM
again. NVMe room is made before a write, never after, and the demotions in flight are
bounded (`DEMOTIONS_IN_FLIGHT`, `DEMOTION_BYTES_SHARE`): past the bound, writers wait
for them to land.

Chunks leave NVMe's index on the loop at once (so one watermark crossing cannot start a
second eviction round while the files are still there); their files go (or move to G4
first) in a worker thread. A demotion whose room in the index is made but still held on
disk by such files waits (`parked`, still in flight) until they are gone, so the files on
disk never take more than NVMe's size either.
`Demotion` owns what that takes: the in-flight copies, NVMe's eviction order, and
the two batch pipelines.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor

from .. import policy as pol
from ..batches import Batches
from ..config import TierPolicy
from ..eviction import EvictionQueue
from ..metrics import EVICTION_REASONS, AgentMetrics
from ..tiers.base import ChunkRecord
from ..tiers.dram import DramChunk
from ..tiers.nvme import NvmeTier, file_bytes
from ..tiers.nvmeindex import NvmeChunk
from .observer import NO_OBSERVER, TierObserver
from .sharedlink import SharedLink
from .tierreads import read_nvme

log = logging.getLogger(__name__)

IO_THREADS = 4
"""Threads of the store's background pool (NVMe writes and removals, shared-tier deletes
and probes): file and object-store calls release the GIL, so they overlap."""

WriteResult = list[tuple[str, OSError] | None]

DEMOTIONS_IN_FLIGHT = 256
"""Most chunks on their way from DRAM to NVMe at once (each holds its arena pages and a
heap copy): past it, an allocation that would demote more waits for some to land."""
DEMOTION_BYTES_SHARE = 2
"""Chunks on their way to NVMe take at most 1/this of the arena (same rule)."""


class Demotion:
    def __init__(self, nvme: NvmeTier, io: Executor, metrics: AgentMetrics, policy: TierPolicy,
                 *, in_dram: Callable[[bytes], bool], pinned: Callable[[bytes], bool],
                 shared: SharedLink | None,
                 settled: Callable[[DramChunk, bool], None] = lambda c, j: None) -> None:
        self.nvme = nvme
        self.io = io
        self.m = metrics
        self.policy = policy
        self._in_dram = in_dram
        self._pinned = pinned
        self._shared = shared
        self._settled = settled
        """Called once per demotion when its write is done (landed, failed or superseded):
        the DRAM chunk's pages can go, and its journal entry too when True."""
        self.observer: TierObserver = NO_OBSERVER
        """Told when a demotion lands on NVMe and when a chunk leaves it."""
        self.queue: EvictionQueue = nvme.new_queue(policy.tiers.nvme.eviction,
                                                         "last_access")
        """NVMe's chunks in eviction order (files found at start: the oldest go first)."""
        self.inflight: dict[bytes, tuple[ChunkRecord, DramChunk]] = {}
        """Chunks on their way from DRAM to NVMe (the newest demotion of each key): still
        served from here."""
        self.pending = 0
        """Demotions whose write is not done yet (a key demoted twice counts twice)."""
        self.pending_bytes = 0
        """Their chunk bytes (each is held twice: in the arena and in its heap copy)."""
        self.peak = 0
        self.peak_bytes = 0
        """The most of `pending` and of `pending_bytes` since the agent started: what the
        backlog's bound has held (STATS; a sample of `pending` may miss a burst)."""
        self.reserved = 0
        """NVMe bytes (header and chunk) of the files being written: room made for them."""
        self.removing = 0
        """Chunks out of the NVMe index whose files a worker has yet to remove (or upload)."""
        self.removing_bytes = 0
        """Their files' bytes: still on disk, so no new file takes their room yet."""
        self.writing = 0
        """File bytes of the demotions handed to a worker to write (on disk soon)."""
        self.parked: deque[tuple[ChunkRecord, DramChunk]] = deque()
        """Demotions whose room is made in NVMe's index but still held on disk by files
        being removed: written once those are gone (`_unpark`), so the files on disk never
        take more than NVMe's size."""
        self.writes: Batches[tuple[ChunkRecord, DramChunk], WriteResult] = Batches(
            io, self._write_files, self._written, weight=lambda d: d[0].size,
            key=lambda d: d[0].key, concurrency=IO_THREADS)
        """DRAM victims waiting to be written to NVMe, a batch per executor call. Batches
        run side by side, but two demotions of one key (demoted, promoted from the in-flight
        copy or deleted and written again, demoted again) land in the order they were
        made, so the file holds the newest bytes."""
        self.removals: Batches[tuple[bytes, bool, int, int], None] = Batches(
            io, self._remove_files, self._removed)
        """Files of chunks out of the NVMe index, removed a batch per executor call."""

    def set_policy(self, policy: TierPolicy) -> None:
        """A changed eviction order rebuilds the queue from what NVMe holds."""
        if policy.tiers.nvme.eviction is not self.policy.tiers.nvme.eviction:
            self.queue = self.nvme.new_queue(policy.tiers.nvme.eviction, "last_seq")
        self.policy = policy

    # -- what NVMe holds

    def entry(self, key: bytes) -> NvmeChunk | None:
        return self.nvme.entry(key)

    def holds(self, key: bytes) -> bool:
        """In NVMe or on its way there."""
        return key in self.inflight or self.nvme.contains(key)

    def hit(self, key: bytes, seq: int, depth: int, now: float) -> bool:
        """`holds`, and a chunk NVMe holds was hit by request `seq` at `depth` at time
        `now`: its facts and its place in the order are updated by slot (LOOKUP's path:
        no view of the chunk is made)."""
        slot = self.nvme.hit(key, seq, depth, now)
        if slot < 0:
            return key in self.inflight
        self.queue.touched_slot(slot, depth)
        return True

    def copy_of(self, key: bytes) -> ChunkRecord | None:
        """The in-flight copy of a chunk being demoted."""
        got = self.inflight.get(key)
        return None if got is None else got[0]

    # -- into NVMe

    def admits(self, chunks: int, nbytes: int, arena: int) -> bool:
        """Whether `chunks` more demotions of `nbytes` stay within the bound."""
        return (self.pending + chunks <= DEMOTIONS_IN_FLIGHT
                and self.pending_bytes + nbytes <= arena // DEMOTION_BYTES_SHARE)

    def reserve(self, rec: ChunkRecord) -> bool:
        """Make room in NVMe for a chunk's file before it is written (evicting by policy);
        False when that cannot be done (the rest is pinned or on its way in)."""
        nvme = self.nvme
        need = file_bytes(rec)
        free = nvme.capacity_bytes - nvme.used_bytes - self.reserved
        if free < need:
            with contextlib.closing(self.queue.candidates()) as walk:
                victims = pol.choose_victims(
                    walk, tier="nvme", policy=self.policy, used=nvme.used_bytes,
                    target=nvme.capacity_bytes - self.reserved - need, reason="capacity",
                    protected=self._pinned)
            self.drop(victims)
            if nvme.capacity_bytes - nvme.used_bytes - self.reserved < need:
                return False
        self.reserved += need
        return True

    def demote(self, rec: ChunkRecord, chunk: DramChunk) -> None:
        """Write a verified copy of an evicted DRAM chunk to NVMe (room `reserve`d first);
        served from here meanwhile. `chunk` keeps its arena pages until `settled`."""
        self.inflight[rec.key] = (rec, chunk)
        self.pending += 1
        self.pending_bytes += rec.size
        self.peak = max(self.peak, self.pending)
        self.peak_bytes = max(self.peak_bytes, self.pending_bytes)
        self.parked.append((rec, chunk))
        self._unpark()

    def _unpark(self) -> None:
        """Hand parked demotions to the writers, in order, while the disk has their room
        (or when nothing is being removed or written that could make more: the capacity
        shrank under them, by quarantined files, and waiting would not help)."""
        nvme = self.nvme
        while self.parked:
            rec, chunk = self.parked[0]
            need = file_bytes(rec)
            on_disk = nvme.used_bytes + self.removing_bytes + self.writing
            if on_disk + need > nvme.capacity_bytes and (self.removing_bytes or self.writing):
                return
            self.parked.popleft()
            self.writing += need
            self.writes.offer((rec, chunk))

    def forget(self, key: bytes) -> bool:
        """A deleted key: its in-flight copy goes and its file with it. Whether any was held.

        A write of its in-flight copy may be landing in a worker thread right now: taken
        out of `inflight` while NVMe holds off publishing, that write has either indexed
        its file already (dropped here) or never will (`_wanted`). Before, the file was
        indexed as it landed and stayed so until its batch was done: a read meanwhile
        served the deleted chunk and promoted it back into DRAM."""
        with self.nvme.publishing():
            in_flight = self.inflight.pop(key, None) is not None
        existed = in_flight
        if self.nvme.contains(key):
            self.drop([pol.Victim(key, "deleted")])
            existed = True
        elif in_flight:  # held only in flight: its leaving is told here (peers drop it)
            self.observer.removed("nvme", key)
        # Its file goes now, not when the background pool gets to it: an agent killed
        # meanwhile would find the deleted chunk again at its next start. (So does the
        # file of an eviction of the key still waiting for its removal.) One unlink, on a
        # DELETE only.
        try:
            self.nvme.remove_file(key)
        except OSError as e:  # a removal queued for it (by `drop`) tries again
            log.warning("removing the nvme file of deleted %s failed: %s", key.hex(), e)
        return existed

    def _write_files(self, batch: list[tuple[ChunkRecord, DramChunk]]) -> WriteResult:
        """Write demoted chunks to NVMe (a worker thread): per chunk, None once it is
        written, else (error kind, error)."""
        out: WriteResult = []
        for rec, _ in batch:
            if not self._wanted(rec):  # deleted or demoted again since: nothing to write
                out.append(None)
                continue
            try:
                self.nvme.write(rec, functools.partial(self._wanted, rec))
            except OSError as e:
                out.append(("full" if not self.nvme.healthy()[0] else "write", e))
            except Exception as e:  # a bug must not leave the chunk in flight for ever
                log.exception("demotion of %s to nvme failed", rec.key.hex())
                out.append(("write", OSError(str(e))))
            else:
                out.append(None)
        return out

    def _wanted(self, rec: ChunkRecord) -> bool:
        """Whether a demotion's file is still the one to land: its key neither deleted
        nor demoted again since (that later demotion's file takes its place)."""
        got = self.inflight.get(rec.key)
        return got is not None and got[0] is rec

    def _written(self, batch: list[tuple[ChunkRecord, DramChunk]], results: WriteResult) -> None:
        """A batch of demotions has been written (or failed): the chunks leave `inflight`
        and join NVMe's eviction order, then NVMe makes room down to its watermark."""
        landed = False
        for (rec, chunk), failed in zip(batch, results, strict=True):
            got = self.inflight.get(rec.key)
            current = None if got is None else got[0]
            self.pending -= 1
            self.pending_bytes -= rec.size
            self.reserved -= file_bytes(rec)
            self.writing -= file_bytes(rec)
            # The DRAM copy goes only now that the file is in place (or the write failed).
            # Its journal entry goes with it unless a newer one speaks for the key: a
            # newer demotion's, or DRAM's after a promotion or a rewrite (and a delete
            # has dropped it already).
            self._settled(chunk, current is rec and not self._in_dram(rec.key))
            if failed is not None:
                kind, e = failed
                log.warning("demotion of %s to nvme failed (%s): dropped", rec.key.hex(), e)
                self.m.tier_errors[("nvme", kind)].inc()
                if current is rec:
                    del self.inflight[rec.key]
                    # A file an earlier demotion of the key left (it deferred to this one)
                    # is tracked by nobody: it goes too.
                    self.drop([pol.Victim(rec.key, "superseded")])
                    # Announced while in flight: peers hear it is gone (unless DRAM holds
                    # it again, which they are then told is no change).
                    self.observer.removed("nvme", rec.key)
                    if self._shared is not None and self._shared.demotes(chunk.hits):
                        self._shared.upload(rec)
                continue
            if current is None:
                # Deleted while it was being written: the file must not bring it back.
                self.drop([pol.Victim(rec.key, "deleted")])
                continue
            if current is not rec:
                # Demoted again meanwhile (promoted from the in-flight copy, or deleted and
                # written again): the file and the index entry are that demotion's to take.
                continue
            del self.inflight[rec.key]
            if self._in_dram(rec.key):
                # Promoted again from the in-flight copy: DRAM holds it, NVMe need not.
                self.drop([pol.Victim(rec.key, "promoted")])
                continue
            entry = self.nvme.entry(rec.key)
            if entry is None:
                continue
            entry.hits = chunk.hits
            entry.last_seq, entry.depth = chunk.last_seq, chunk.depth
            entry.last_access = time.time()
            self.queue.add(entry)
            self.observer.stored("nvme", rec.key)
            self.m.demotions["dram"].inc()
            self.m.written_bytes["nvme"].inc(rec.size)
            landed = True
        if landed:
            self.evict_to_watermark()
        self._unpark()  # a failed write gave its room back

    # -- out of NVMe

    def evict_to_watermark(self) -> None:
        rules = self.policy.tiers.nvme
        nvme = self.nvme
        target = pol.watermark_target(rules, nvme.capacity_bytes, nvme.used_bytes)
        if target is None:
            return
        with contextlib.closing(self.queue.candidates()) as walk:
            self.drop(pol.choose_victims(
                walk, tier="nvme", policy=self.policy, used=nvme.used_bytes, target=target,
                reason="watermark", protected=self._pinned))

    def expire(self, wall: float) -> None:
        """Chunks whose files vanished with their directories, and chunks past NVMe's TTL,
        go."""
        vanished = self.nvme.vanished_keys()
        if vanished:
            log.warning("%d nvme chunks vanished with their directories: forgotten",
                        len(vanished))
            self.drop([pol.Victim(k, "vanished") for k in vanished])
        victims = pol.expired(self.nvme.entries(), self.policy.tiers.nvme.ttl, wall,
                              self._pinned)
        if victims:
            self.drop(victims)

    def drop(self, victims: Iterable[pol.Victim]) -> None:
        """Take chunks out of NVMe now; their files go (or move to G4) in a worker thread."""
        gone: list[tuple[bytes, bool, int, int]] = []
        mark = self._shared.deletes.mark() if self._shared is not None else 0
        for v in victims:
            entry = self.nvme.entry(v.key)
            hits, size = (entry.hits, entry.size) if entry is not None else (0, 0)
            if entry is None or not self.nvme.forget(v.key):
                # Taken out of the index by a worker (a bad file): out of the order too.
                self.queue.discard(v.key)
                self.nvme.reap(v.key)
                continue
            self.queue.discard(v.key)
            self.nvme.reap(v.key)  # its slot, when the queue did not hold it
            self.observer.removed("nvme", v.key)
            if v.reason in EVICTION_REASONS:
                self.m.evictions[("nvme", v.reason)].inc()
                to_shared = self._shared is not None and self._shared.demotes(hits)
                gone.append((v.key, to_shared, size, mark))
            else:
                gone.append((v.key, False, size, mark))
        self.removing += len(gone)
        self.removing_bytes += sum(size for _, _, size, _ in gone)
        for item in gone:
            self.removals.offer(item)

    def _removed(self, gone: list[tuple[bytes, bool, int, int]], _: None) -> None:
        self.removing -= len(gone)
        self.removing_bytes -= sum(size for _, _, size, _ in gone)
        self._unpark()

    def _remove_files(self, gone: list[tuple[bytes, bool, int, int]]) -> None:
        """Remove forgotten chunks' files (a worker thread), passing some on to G4 first,
        unless their key is deleted after it left NVMe (`mark`: the deletes then)."""
        for key, to_shared, _, mark in gone:
            try:
                if to_shared and self._shared is not None:
                    rec = read_nvme(self.nvme, key, self.m, indexed=False)
                    if rec is not None:
                        self._shared.upload(rec, since=mark)
                        self.m.demotions["nvme"].inc()
                self.nvme.remove_file(key)
            except Exception:  # one file must not keep the others of its batch
                log.exception("removing the nvme file of %s failed", key.hex())

    def close(self) -> None:
        """Finish the writes and removals that wait, in this thread (call it once the
        background pool is shut down, so no batch is running). A chunk whose file has
        landed by now gives its DRAM journal entry back, as a landed demotion does while
        the agent runs: the next start finds it in NVMe, not in DRAM as well."""
        self.removals.close()  # first: the parked demotions' room is on disk once they ran
        self.writes.waiting.extend(self.parked)
        self.parked.clear()
        self.writes.close()
        for key, (_, chunk) in list(self.inflight.items()):
            if self.nvme.contains(key) and not self._in_dram(key):
                self._settled(chunk, True)
        self.inflight.clear()
