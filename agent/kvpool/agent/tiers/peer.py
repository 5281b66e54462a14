"""The peer tier (between NVMe and the shared tier): chunks the pool's other agents hold.

One per space: the directory of its tenant and the reads from peers, which the store
uses like any other tier: LOOKUP asks `holds` (memory only, never the network); a GET or
ACQUIRE of a key only a peer holds reserves arena extents for it and for the peer keys
that follow it in its LOOKUP, and `fetch_many`es the bytes straight into them in one
pipelined batch, verified, within `peers.timeout` (docs/cross-node.md). A peer tier
serves no writes: a chunk lands on a peer by that peer's own clients, or by a hand-off
one of this agent's clients named it for (`PeerNetwork.push`), which that peer then reads
from this agent.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence

from ..constants import PEER_TIER_CODE
from ..peers.links import FAILED, ArenaTarget, Fetched, PeerLink
from ..peers.network import PeerNetwork

_Soon = list[tuple[bytes, ArenaTarget, "asyncio.Future[Fetched | str]"]]


class PeerTier:
    name = "peer"

    def __init__(self, network: PeerNetwork, tenant: str) -> None:
        self.network = network
        self.tenant = tenant
        self.directory = network.directories[tenant]
        self._soon: dict[tuple[PeerLink, float], _Soon] = {}
        """Reads asked for in this turn of the event loop (`fetch_soon`), by peer."""

    def holds(self, key: bytes) -> bool:
        """A readable peer holds `key`, says the directory (which may be stale)."""
        return self.network.holder(self.tenant, key) is not None

    def codes(self, keys: Sequence[bytes], want: bytes, hashes: bytes, local: bytes) -> bytes:
        """LOOKUP's view of many keys at once, a byte each: 2 where `local` says DRAM has
        it, else the peer tier's code where a readable peer holds it (as `holds`), else 0
        (`PeerDirectory.codes`)."""
        return self.directory.codes(keys, want, hashes, self.network.readable(), local,
                                    PEER_TIER_CODE)

    @property
    def timeout(self) -> float:
        """`peers.timeout`: how long a read from a peer may take."""
        return self.network.cfg.timeout

    def holder(self, key: bytes) -> tuple[PeerLink, int] | None:
        """The peer to read `key` from and the bytes to reserve for it."""
        return self.network.holder(self.tenant, key)

    async def fetch(self, link: PeerLink, key: bytes, target: ArenaTarget) -> Fetched | str:
        """The chunk received into `target`'s arena extents and verified, or why not."""
        return await self.network.fetch(link, self.tenant, key, target)

    def fetch_many(self, link: PeerLink, reads: list[tuple[bytes, ArenaTarget]],
                   timeout: float | None = None,
                   then: list[Callable[[Fetched | str], None]] | None = None,
                   alone: bool = False) -> list[asyncio.Future[Fetched | str]]:
        """Reads of (key, target) from one peer, sent together (a pipelined batch): a
        future per read, settled as its chunk is in and verified, or with why not, within
        `timeout` (by default `peers.timeout`); with `then`, a callback per read instead,
        which the event loop calls with that (no futures made). `alone`: a batch of their
        own, not joined by reads queued after them (`PeerLink.fetch_many`)."""
        return self.network.fetch_many(link, [(self.tenant, k, t) for k, t in reads],
                                       timeout, then, alone)

    def fetch_soon(self, link: PeerLink, key: bytes, target: ArenaTarget,
                   timeout: float) -> asyncio.Future[Fetched | str]:
        """A read of `key` from `link` into `target` within `timeout`, sent with the other
        reads from that peer asked for in this turn of the event loop, as one pipelined
        batch: a batch of push offers is taken offer by offer, each asking for its own
        chunk, and its chunks still travel together."""
        loop = asyncio.get_running_loop()
        if not self._soon:
            loop.call_soon(self._send_soon)
        fut: asyncio.Future[Fetched | str] = loop.create_future()
        self._soon.setdefault((link, timeout), []).append((key, target, fut))
        return fut

    def _send_soon(self) -> None:
        soon, self._soon = self._soon, {}
        for (link, timeout), reads in soon.items():
            works = self.fetch_many(link, [(k, t) for k, t, _ in reads], timeout)
            for (_, _, fut), work in zip(reads, works, strict=True):
                work.add_done_callback(functools.partial(_pass_on, fut))

    def push(self, key: bytes, size: int, to: str) -> None:
        """Queue a hand-off: offer `key` to the node `to` (never waits)."""
        self.network.push(self.tenant, key, size, to)

    def delete(self, key: bytes, here: bool, sender: bytes | None = None) -> None:
        """A DELETE of `key` in this space (`PeerNetwork.delete`): made on this node
        (`here`: it goes to every peer) or received from the agent whose id is `sender`."""
        self.network.delete(self.tenant, key, here, sender)

    def links(self) -> list[dict[str, object]]:
        """STATS' `peers`: each other agent of the pool as this tenant space sees it: its
        address and node, its state (`PeerLink.state`, with `for_seconds` where it ends by
        itself), the chunks the directory lists as its (in this space), what its link's
        batches delivered (`bytes_per_second`, None before the first) and the lag of its
        stream."""
        now = time.monotonic()
        out: list[dict[str, object]] = []
        for link in self.network.links.values():
            if link.is_self or link.closed:
                continue
            state, left = link.state(now)
            out.append({"peer": link.name, "node": link.node, "state": state,
                        "for_seconds": round(left, 3), "chunks": self.directory.count(link.index),
                        "bytes_per_second": link.rate.bytes_per_second,
                        "lag_seconds": round(link.lag, 6)})
        return out

    def link_of(self, sender: bytes) -> PeerLink | None:
        """The link to the agent that offers a push, if it is a peer this one follows."""
        return self.network.link_of(sender)

    def handoff_ended(self, end: str) -> None:
        """Count the end of a pushed chunk's pin (read, expired, deleted)."""
        self.network.m.handoff_ended(end)

    @property
    def chunks(self) -> int:
        return len(self.directory)


def _pass_on(fut: asyncio.Future[Fetched | str], work: asyncio.Future[Fetched | str]) -> None:
    if not fut.done():
        fut.set_result(FAILED if work.cancelled() else work.result())
