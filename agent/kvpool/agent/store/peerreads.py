"""Chunks read from the pool's other agents into this node's DRAM: the peer tier's read
path, the part of the chunk store (`ChunkStore`) that owns the reads under way.

- A client's read of a peer chunk (`read`: an ACQUIRE's or a GET's, or a prefetch's)
  reads it in one batch with the peer chunks after it in the LOOKUP that found it
  (`_peer_following`), at most `MAX_BATCH` reads and what the peer's link lands in part of
  `peers.timeout` (`LinkRate`); as the batch lands, the batch after it goes out
  (`_read_ahead`, `BatchChain`), so a run of peer chunks has at most two batches in
  flight.
- Each read settles on the event loop as its worker hands it over; the reads a drain
  brings land together (`_land`): checked, journaled in one write, inserted into DRAM as
  a promotion would be (announced by this node from then on), then whoever waits for
  each is answered (`PeerRead`: a task's wait, or a connection's held request).
- WAIT's answer (`landed`): which of a lease-free client's keys are in DRAM, up to the
  first a read brings, starting the reads not under way.
- A hand-off pushed here (`receive_push`): read from its sender like any peer read, then
  pinned by the store until its first read.

A stale entry, a failed, slow or lying peer: the read settles None, its extents are freed
once its worker is done with them, and the caller falls back to the shared tier, then to
a miss (docs/cross-node.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..constants import PEER_TIER_CODE
from ..constants import TIER_CODES as TIER_CODE
from ..journal import JournalEntry
from ..peers.links import MAX_BATCH, MAX_BATCH_BYTES, PUSH_READ_TIMEOUT, Fetched, PeerLink
from ..peers.settle import after_drain
from ..protocol import MAX_LOOKUP_KEYS, ErrorCode, Extents
from ..tiers.dram import DramChunk
from .errors import OpError, check_key

if TYPE_CHECKING:
    from .chunkstore import ChunkStore

log = logging.getLogger(__name__)

RECENT_PEER_PROMPTS = 256
"""Recent LOOKUPs that counted peer chunks whose keys are kept, to know what follows a key."""
AHEAD_LEAD = 4 << 20
"""Bytes of a batch of peer reads still to land when the batch after it is sent
(`BatchChain`): enough for its FETCHes to reach the holder and its first reply
to start while these land, so the link carries the next batch's bytes right after."""
FAILED_READS = 4096
FAILED_READ_SECONDS = 1.0
"""A WAIT does not start a read of a key whose peer read failed this recently (the last
`FAILED_READS` such keys are kept): a WAIT waiting on a read that failed answers its key
as not coming and goes on, and a read that fails at once is not made again and again."""
STRIPE_MIN = 4
"""Reads of one peer in a batch from which they go on two connections, every second one
on the second (where two are spare)."""


class PeerReads:
    """The store's reads from peers under way, and what lands them (see the module)."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        # The store's parts that never change (its policy and peers do: read from it).
        self.dram, self.recent, self.deletes = store.dram, store.recent, store.deletes
        self.journal = store.journal
        self.fetching: dict[bytes, PeerRead] = {}
        """Reads from peers under way, one per key however many ask."""
        self._failed: OrderedDict[bytes, float] = OrderedDict()
        """Keys whose peer read failed, and when (monotonic), oldest first: WAIT does not
        start them again for `FAILED_READ_SECONDS`."""
        self._landing: list[tuple[bytes, Extents, PeerRead, int, Fetched | str]] = []
        """Peer reads settled in the drain of results under way, landed once it is done
        (`_land`)."""
        self._due: list[BatchChain] = []
        """Batches whose batch after is due (`BatchChain.due`), found as reads settle
        (`_read_over`), sent once the landing or the task that settled them is done
        (`_send_due`)."""
        self._prompts: OrderedDict[int, list[bytes]] = OrderedDict()
        """Keys of recent LOOKUPs that counted chunks in the peer tier, by request seq: a
        read of one is batched with the peer chunks after it."""

    def remember(self, seq: int, keys: list[bytes]) -> None:
        """The keys of LOOKUP `seq`, which counted chunks in the peer tier, up to where it
        reached: what `_peer_following` follows."""
        self._prompts[seq] = keys
        if len(self._prompts) > RECENT_PEER_PROMPTS:
            self._prompts.popitem(last=False)

    async def read(self, key: bytes, ahead: bool = True) -> DramChunk | None:
        """The chunk read from the peer the directory names, one read per key however many
        ask; None: the shared tier, then a miss, decide. With `ahead` (a client's read),
        the keys that follow it in the LOOKUP that found it in the peer tier
        (`_peer_following`) are read in the same batch (`_fetch_peer`): the client reads
        them next. A prefetch reads its key only (its LOOKUP's `lookaheadChunks` bound
        what it loads)."""
        pending = self.fetching.get(key)
        if pending is None:
            keys = [key, *(self._peer_following(key) if ahead else ())]
            pending = self._start_peer_batch(keys, chained=ahead)[0]
        return self._landed_chunk(key, await pending.wait())

    def _landed_chunk(self, key: bytes, landed: DramChunk | None) -> DramChunk | None:
        """The chunk DRAM holds for `key` now that a read waiting on its landing resumes,
        not the `landed` view: a `DramChunk` is a view of a slot, and a turn of the loop
        after the landing an eviction (the watermark's at an insert, another read's room)
        may have taken the chunk and given its slot to another; a lease on the old view
        gave the client that other chunk, whole, with that chunk's checksum, which the
        client's check cannot catch (tests/peers/test_peer_batches.py, a window larger
        than DRAM). None when it went: the caller looks below, else it is a miss."""
        return None if landed is None else self.dram.get(key)

    def _start_peer_batch(self, keys: list[bytes], chained: bool, ahead: bool = False,
                          before: BatchChain | None = None) -> list[PeerRead]:
        """Reads of `keys` (one batch per peer, `_fetch_peer`) registered as under way.
        `chained`: the batch after it goes out as it lands (`BatchChain`, `_read_ahead`);
        `before`, the batch of the run before it, which has to have settled first.
        `ahead`: a batch no client asked for yet (read into free room only)."""
        reads = [PeerRead() for _ in keys]
        chain = None
        if chained:
            chain = BatchChain(keys[-1], len(keys), before)
            if before is not None:
                before.after = chain
        for k, read in zip(keys, reads, strict=True):
            self.fetching[k] = read
            read.chain = chain
        self.store._spawn(self._fetch_peer(keys, reads, ahead, lead=chained and not ahead))
        return reads

    def _read_ahead(self, chain: BatchChain) -> None:
        """A batch of a run of peer chunks has its last `AHEAD_LEAD` bytes left to land,
        and the batch before it has settled (`BatchChain.due`): the next batch of that run
        (the keys after the batch's last in the LOOKUP that found them,
        `_peer_following`) is read now, before the client reaches it, so that the
        connections do not idle while the client takes this batch's chunks (without it
        a run's next FETCHes went out only when the client asked for their first chunk:
        a gap of a round trip and a chunk's transfer at every batch, docs/benchmarks.md,
        "Peer reads pipelined across batches"). Once per batch, so at most two batches of
        a run are in flight, each within `MAX_BATCH` and `MAX_BATCH_BYTES`; and only into
        free room below DRAM's high watermark (`_fetch_peer`): nothing is evicted for
        chunks no client asked for yet, and where room runs out the chain stops, until a
        client's read of a chunk not in yet starts it again. (On the landings, not on a
        client's ask: a client reads a landed chunk lease-free, without the agent hearing
        of it. Near the batch's end, not at its first chunk: sent at the first chunk, a
        batch of 32 MiB shared the link with the batch after it from the start, each
        at half its speed, and the later batch's chunks, all in at the end, were
        copied by the client after the round's last landing, docs/benchmarks.md, "A 1
        MiB window's batches in order".)"""
        chain.sent = True
        following = self._peer_following(chain.last, whole=True)
        if following:
            self._start_peer_batch(following, chained=True, ahead=True,
                                   before=chain if chain.left else None)

    def _send_due(self) -> None:
        """The batches after those found due as their reads settled (`_read_over`), sent
        after the landing (or the task) that settled them, not in its midst: the reads
        it lands are in DRAM by then, and none is read again."""
        due, self._due = self._due, []
        for chain in due:
            if chain.due():  # (and not sent meanwhile: found due twice in one landing)
                self._read_ahead(chain)

    def _peer_following(self, key: bytes, whole: bool = False,
                        after: Sequence[bytes] = ()) -> list[bytes]:
        """The keys after `key` in the recent LOOKUP that found it in the peer tier (where
        that gives none, those of `after`: the keys a client named after it), that a peer
        holds and nobody is reading yet, within one batch's caps (`whole`: the batch is
        these keys alone; otherwise `key` is read with them)."""
        seq, depth, _ = self.recent.get(key) or (0, 0, False)
        prompt = self._prompts.get(seq)
        lead = None if whole else key
        found = [] if prompt is None or depth >= len(prompt) or prompt[depth] != key \
            else self._peer_unread(prompt[depth + 1 :], lead)
        return found or self._peer_unread(after, lead)

    def _peer_unread(self, keys: Sequence[bytes], lead: bytes | None) -> list[bytes]:
        """The first of `keys` that a peer holds and nobody is reading yet, within one
        batch's caps, where the batch is these keys after `lead` (None: these keys alone,
        and then at least one): at most `MAX_BATCH` reads, and per peer the bytes its link
        lands in part of `peers.timeout` (`LinkRate.batch_bytes`: `MAX_BATCH_BYTES` on a
        fast link, 8 MiB on one not measured yet), `lead`'s bytes counted (they were not:
        on a slow link a client's batch asked for a chunk more than lands in time)."""
        peer = self.store.peer
        assert peer is not None
        out: list[bytes] = []
        totals: dict[PeerLink, int] = {}
        caps: dict[PeerLink, int] = {}

        def cap_of(link: PeerLink) -> int:
            cap = caps.get(link)
            if cap is None:
                cap = caps[link] = link.rate.batch_bytes(peer.timeout, MAX_BATCH_BYTES)
            return cap

        if lead is not None and (got := peer.holder(lead)) is not None:
            totals[got[0]] = got[1]
        room = MAX_BATCH if lead is None else MAX_BATCH - 1
        for k in keys:
            if len(out) >= room:
                break
            got = peer.holder(k)
            if got is None or k in self.fetching or self.store.contains(k):
                continue
            link, size = got
            total = totals.get(link, 0) + size
            if total > cap_of(link) and (out or lead is not None):
                break
            totals[link] = total
            out.append(k)
        return out

    async def _fetch_peer(self, keys: list[bytes], reads: list[PeerRead],
                          ahead: bool = False, lead: bool = False) -> None:
        """Reserve arena extents for chunks peers hold and have them received into them
        (one batch per peer, `PeerNetwork.fetch_many`); as each read settles, a callback
        makes its chunk a DRAM chunk like a promotion (announced as this node's from then
        on) and answers who waits for it (`_landed`, which the loop calls as it takes the
        results from the worker: no future per read, no turn of the loop more per chunk).
        A stale entry, a failed, slow or lying peer: None, and the extents are free again,
        only once the worker that writes into them is done. (This task ends once the reads
        are queued: a task step and a `shield` per chunk, awaiting each read in turn, were
        a fifth of the reading loop's Python at 1 MiB chunks.) `ahead` (`_read_ahead`):
        only into free room below DRAM's high watermark, nothing evicted for it; the reads
        past that room are not made (a client's ask reads them), nor the batch after (the
        chain stops).

        `lead` (a client's read, the client waiting for the first key): the first key's
        FETCH goes out at once, a batch of its own, before the extents of the others are
        reserved, where the peer has a connection spare for them besides (the rest go
        together on it as soon as they are reserved): the client's first chunk is on its
        way while the agent reserves the batch and the holder takes the batch's sources,
        instead of after both (docs/benchmarks.md, "A 1 MiB window's start").

        A peer's reads of a batch, `STRIPE_MIN` or more, go every second one on a second
        connection where the peer has two spare: the two connections' chunks land in the
        batch's order (not the first half before the second), each connection received
        on a thread of its own."""
        assert self.store.peer is not None
        peer = self.store.peer
        mark = self.deletes.mark()
        started = [False] * len(keys)
        by_link: dict[PeerLink, list[tuple[int, Extents]]] = {}
        d = self.dram
        limit = int(self.store.policy.tiers.dram.high_watermark * d.capacity_bytes)

        def send(link: PeerLink, items: list[tuple[int, Extents]], alone: bool) -> None:
            targets = self.dram.fetch_targets([extents for _, extents in items])
            peer.fetch_many(link, [(keys[i], target)
                                   for (i, _), target in zip(items, targets, strict=True)],
                            then=[functools.partial(self._landed, keys[i], extents,
                                                    reads[i], mark)
                                  for i, extents in items], alone=alone)
            for i, _ in items:
                started[i] = True

        chain = reads[0].chain
        if chain is not None:
            # The batch after this one goes out once this batch's last AHEAD_LEAD bytes
            # are what is left to land, not at its first chunk: its bytes then follow
            # this batch's on the link instead of sharing it from the start.
            chain.to_land = sum(got[1] for k in keys if (got := peer.holder(k))) - AHEAD_LEAD
        try:
            for i, key in enumerate(keys):
                got = peer.holder(key)
                if got is None:
                    continue
                if ahead and d.used_bytes + got[1] > limit:
                    break  # (the reads not made stop the chain, `_read_over`)
                try:
                    extents = await self.store._room(got[1])  # NVMe holders announce file sizes
                except OpError:
                    continue  # no room now: the shared tier, or a miss
                items = by_link.setdefault(got[0], [])
                items.append((i, extents))
                if lead and i == 0 and len(keys) > 1 and _two_at_once(got[0], peer.timeout):
                    send(got[0], items, alone=True)
                    items.clear()
            for link, items in by_link.items():
                if len(items) >= STRIPE_MIN and _two_at_once(link, peer.timeout):
                    # Every second read on a second connection: both connections' chunks
                    # land in the batch's order, each connection's on its own thread.
                    send(link, items[0::2], alone=True)
                    send(link, items[1::2], alone=False)
                elif items:
                    send(link, items, alone=False)
        finally:
            for i, key in enumerate(keys):
                if not started[i]:
                    self._read_over(key, reads[i], None)
            for items in by_link.values():  # reserved, never asked for (cancelled)
                for i, extents in items:
                    if not started[i]:
                        self.dram.free(extents)
            self._send_due()

    def _landed(self, key: bytes, extents: Extents, read: PeerRead, mark: int,
                result: Fetched | str) -> None:
        """A peer read of `_fetch_peer` settled (the event loop calls this as it takes the
        read's result from the worker, `Settler`): queued to land with the others the same
        drain brings (`_land`, once the drain has taken them all)."""
        self._landing.append((key, extents, read, mark, result))
        if len(self._landing) == 1:
            after_drain(self._land)

    def _land(self) -> None:
        """The peer reads a drain brought, landed together: each checked as `_fetched`
        checks one (a failed read, or a key deleted or stored meanwhile, frees its
        extents), the chunks kept journaled in one write (or, refused by the journal, none
        of them stored), inserted, the watermark checked once, then whoever waits for each
        answered. A chunk is still inserted only once its worker verified it and the
        journal holds it."""
        landing, self._landing = self._landing, []
        chunks: list[DramChunk | None] = [None] * len(landing)
        kept: list[tuple[int, Extents, Fetched]] = []
        try:
            seen: set[bytes] = set()
            for i, (key, extents, _, mark, result) in enumerate(landing):
                if not isinstance(result, Fetched):
                    self.dram.free(extents)
                    continue
                extents = self._trim(extents, result.size)
                if key in seen or self.deletes.since(key, mark) or self.store.contains(key):
                    self.dram.free(extents)
                    chunks[i] = self.dram.get(key)
                    continue
                seen.add(key)
                kept.append((i, extents, result))
            if self.journal is not None and kept:
                try:
                    self.journal.commit_many([
                        JournalEntry(landing[i][0], extents, r.size, r.checksum, r.meta,
                                     r.tenant, r.kind) for i, extents, r in kept])
                except OSError as e:
                    for _, extents, _ in kept:
                        self.dram.free(extents)
                    log.warning("%d chunks read from peers not stored: the commit journal "
                                "cannot record them (%s)", len(kept), e)
                    kept = []
            for i, extents, r in kept:
                chunks[i] = self.store._insert(landing[i][0], extents, r.size, r.checksum, r.meta,
                                         r.tenant, hits=1, evict=False, kind=r.kind,
                                         journaled=True)
            if kept:
                self.store._check_watermark()
        finally:
            for (key, _, read, _, _), chunk in zip(landing, chunks, strict=True):
                self._read_over(key, read, chunk)
        self._send_due()

    def _read_over(self, key: bytes, read: PeerRead, chunk: DramChunk | None) -> None:
        """A read settled (`chunk` None: it brought none): its askers answered, its batch's
        chain counted (what is due is sent by the caller, `_send_due`)."""
        read.settle(chunk)
        if self.fetching.get(key) is read:
            del self.fetching[key]
        chain, read.chain = read.chain, None
        if chain is not None:
            after = chain.settled(None if chunk is None else chunk.size)
            if chain.due():
                self._due.append(chain)
            if after is not None and after.due():
                self._due.append(after)
        if chunk is None:  # (failed, or the key went meanwhile)
            failed = self._failed
            failed.pop(key, None)
            failed[key] = time.monotonic()
            if len(failed) > FAILED_READS:
                failed.popitem(last=False)

    def _failed_lately(self, key: bytes) -> bool:
        at = self._failed.get(key)
        return at is not None and time.monotonic() - at < FAILED_READ_SECONDS

    async def receive_push(self, key: bytes, link: PeerLink, size: int) -> DramChunk | None:
        """A pushed chunk read from its sender into fresh arena extents (one read per key:
        a read of it under way is waited for instead), verified, inserted and pinned
        before anything may evict it (`_fetched`); None when that fails."""
        assert self.store.peer is not None
        pending = self.fetching.get(key)
        if pending is not None:
            return self._landed_chunk(key, await pending.wait())
        read = self.fetching[key] = PeerRead()
        chunk = None
        try:
            mark = self.deletes.mark()
            try:
                extents = await self.store._room(size)
            except OpError:
                return None
            # With the other offers of its batch (taken in the same turn of the loop):
            # one pipelined batch of reads from the sender.
            work = self.store.peer.fetch_soon(link, key, self.dram.fetch_target(extents),
                                        PUSH_READ_TIMEOUT)
            try:
                result = await asyncio.shield(work)
            except asyncio.CancelledError:
                work.add_done_callback(self._free_when_settled(extents))
                raise
            chunk = self._fetched(key, extents, result, mark, handoff=True)
            return chunk
        finally:
            self._read_over(key, read, chunk)

    def _free_when_settled(self, extents: Extents
                           ) -> Callable[[asyncio.Future[Fetched | str]], None]:
        return lambda _: self.dram.free(extents)

    def _fetched(self, key: bytes, extents: Extents, result: Fetched | str,
                 mark: int, handoff: bool = False) -> DramChunk | None:
        """A peer read's end: the chunk inserted into DRAM, or its extents freed. A
        `handoff` (a push) is pinned before the watermark may take it (the newest chunk,
        unread)."""
        if not isinstance(result, Fetched):
            self.dram.free(extents)
            return None
        extents = self._trim(extents, result.size)
        if self.deletes.since(key, mark) or self.store.contains(key):
            self.dram.free(extents)
            return self.dram.get(key)
        if not handoff:
            return self.store._insert(key, extents, result.size, result.checksum, result.meta,
                                result.tenant, hits=1, kind=result.kind)
        chunk = self.store._insert(key, extents, result.size, result.checksum, result.meta,
                             result.tenant, evict=False, kind=result.kind)
        self.store._pin_handoff(chunk)
        self.store._check_watermark()
        return chunk

    def _trim(self, extents: Extents, size: int) -> Extents:
        """The first `size` bytes of `extents`; the whole pages past them freed (a peer
        that holds a chunk in NVMe announces its file's size, header included)."""
        page = self.dram.page_bytes
        kept: Extents = []
        freed: Extents = []
        left = size
        for offset, n in extents:
            take = min(n, left)
            if take:
                kept.append((offset, take))
                left -= take
            used, have = -(-take // page) * page, -(-n // page) * page
            if have > used:
                freed.append((offset + used, have - used))
        if freed:
            self.dram.free(freed)
        return kept

    def landing(self, key: bytes) -> PeerRead | None:
        """The peer read of `key` under way, if one is (a read leaves `fetching` as it
        settles, `_read_over`): a connection holds an ACQUIRE of the key until it settles
        (`Connection._hold`) instead of waiting in a task."""
        return self.fetching.get(key)

    def landed(self, keys: list[bytes]) -> tuple[bytes, PeerRead | None]:
        """WAIT's answer for `keys`, in their order up to the first a peer read brings: a
        code per key (2 in DRAM, 0 not coming: read it through ACQUIRE), then 5 for that
        key, whose read under way is returned (None: no key is coming, and every key has
        its code). A key a peer holds whose read has not started is read now, with those
        after it in its LOOKUP in one batch, as an ACQUIRE of it would (`read`), or
        with those after it in the WAIT where that LOOKUP names none after it (read one by
        one, each WAIT's answer waiting for the chunk before, they would cost a round trip
        each); the batches after it follow as its chunks land (`_read_ahead`). Asked
        again, nothing new starts: the reads are under way. A key whose peer read failed
        in the last `FAILED_READ_SECONDS` is not read again here: not coming (a slow peer
        costs a WAIT one `peers.timeout`, and a read that fails at once is not made again
        and again while the WAIT is held). (Up to the first key coming: peer chunks land
        about in order, so a window's WAIT looks at the keys landed since the last, not at
        every key still to come.)"""
        if len(keys) > MAX_LOOKUP_KEYS:
            raise OpError(ErrorCode.BAD_ARGUMENT,
                          f"WAIT takes at most {MAX_LOOKUP_KEYS} keys, got {len(keys)}")
        for key in keys:
            check_key(key)
        codes = bytearray()
        dram, fetching, peer, in_dram = self.dram, self.fetching, self.store.peer, TIER_CODE["dram"]
        for i, key in enumerate(keys):
            if key in dram:
                codes.append(in_dram)
                continue
            read = fetching.get(key)
            if read is None and peer is not None and peer.holder(key) is not None \
                    and not self.store._below(key) and not self._failed_lately(key):
                following = self._peer_following(key, after=keys[i + 1 :])
                read = self._start_peer_batch([key, *following], chained=True)[0]
            if read is not None:
                codes.append(PEER_TIER_CODE)
                return bytes(codes), read
            codes.append(0)  # (not coming)
        return bytes(codes), None


def _two_at_once(link: PeerLink, timeout: float) -> bool:
    """Whether a batch's reads from `link` may go on two of its connections at once (its
    lead alone, the rest striped): where it has two spare and its measured speed does not
    cut its batches (`LinkRate.cut`). On a slow link the link, not a receiving thread, is
    what limits the reads, and a batch on one connection measures the whole link: on two,
    each measured half of it, and batches sized to that (at the 8 MiB floor, two at once)
    overran `peers.timeout` on a link that moves 16 MiB in it."""
    return link.spare() >= 2 and not link.rate.cut(timeout, MAX_BATCH_BYTES)


class BatchChain:
    """A batch of a run of peer chunks, as far as the batch after it goes
    (`PeerReads._read_ahead`): that batch is due once no more than this one's last
    `AHEAD_LEAD` bytes are left to land, counted in whatever order its chunks land, and
    the batch before it has settled whole; never where a read of it brought no chunk (a
    timeout, a stale entry, no room for a read ahead: a client's read starts the run
    again). Counted, not the landing of the batch's chunk with `AHEAD_LEAD` after it: a
    batch striped over two connections lands its halves at their own pace, and a later
    batch whose connection the link favoured reached that chunk while the batch before
    it still had its tail to land; on a slow link four batches of a run shared it, and
    the oldest's tail timed out (tests/peers/test_peer_batch_order.py)."""

    __slots__ = ("after", "before", "last", "left", "sent", "stopped", "to_land")

    def __init__(self, last: bytes, reads: int, before: BatchChain | None) -> None:
        self.last = last
        """The batch's last key: the batch after starts after it in its LOOKUP."""
        self.left = reads
        """The batch's reads not settled yet."""
        self.to_land = 0
        """Bytes to land before the batch after is due (set as the batch goes out,
        `PeerReads._fetch_peer`: its chunks' bytes less `AHEAD_LEAD`)."""
        self.before = before
        """The run's batch before, until it has settled whole."""
        self.after: BatchChain | None = None
        """The run's batch after, once sent, until this one has settled whole."""
        self.sent = False
        self.stopped = False

    def settled(self, landed: int | None) -> BatchChain | None:
        """One of the batch's reads settled, having landed `landed` bytes (None: no
        chunk); the batch after it, where this was the batch's last read (it may be due
        now)."""
        self.left -= 1
        if landed is None:
            self.stopped = True
        else:
            self.to_land -= landed
        after = self.after
        if self.left or after is None:
            return None
        self.after = after.before = None
        return after

    def due(self) -> bool:
        return not (self.sent or self.stopped or self.before is not None) and self.to_land <= 0


class PeerRead:
    """A key's read from a peer under way. Each asker waits on a future of its own: one
    that goes away (a client's disconnect cancels its wait) leaves the others theirs, with
    no `shield` (two more hand-offs through the loop) around a shared one."""

    __slots__ = ("calls", "chain", "waiters")

    def __init__(self) -> None:
        self.waiters: list[asyncio.Future[DramChunk | None]] = []
        self.calls: list[Callable[[], None]] = []
        """Called (each in a turn of the loop of its own) once the read settles: a
        connection's ACQUIRE held for the chunk (`Connection._hold`, which finds the read
        by `ChunkStore.landing`: never one settled already)."""
        self.chain: BatchChain | None = None
        """Its batch's, where the batch after it goes out as it lands, until the read
        settles (`PeerReads._read_over`)."""

    def wait(self) -> asyncio.Future[DramChunk | None]:
        fut: asyncio.Future[DramChunk | None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        return fut

    def call_when_settled(self, call: Callable[[], None]) -> None:
        self.calls.append(call)

    def settle(self, chunk: DramChunk | None) -> None:
        waiters, self.waiters = self.waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(chunk)
        if self.calls:
            # Not called here: a landing settles its reads in turn, and what a call does
            # (a connection's replies, the requests after them) waits for the landing's end.
            calls, self.calls = self.calls, []
            loop = asyncio.get_running_loop()
            for call in calls:
                loop.call_soon(call)
