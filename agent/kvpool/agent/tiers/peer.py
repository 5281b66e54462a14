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

from ..peers.links import ArenaTarget, Fetched, PeerLink
from ..peers.network import PeerNetwork


class PeerTier:
    name = "peer"

    def __init__(self, network: PeerNetwork, tenant: str) -> None:
        self.network = network
        self.tenant = tenant
        self.directory = network.directories[tenant]

    def holds(self, key: bytes) -> bool:
        """A readable peer holds `key`, says the directory (which may be stale)."""
        return self.network.holder(self.tenant, key) is not None

    def holder(self, key: bytes) -> tuple[PeerLink, int] | None:
        """The peer to read `key` from and the bytes to reserve for it."""
        return self.network.holder(self.tenant, key)

    async def fetch(self, link: PeerLink, key: bytes, target: ArenaTarget) -> Fetched | str:
        """The chunk received into `target`'s arena extents and verified, or why not."""
        return await self.network.fetch(link, self.tenant, key, target)

    def fetch_many(self, link: PeerLink, reads: list[tuple[bytes, ArenaTarget]],
                   timeout: float | None = None) -> list[asyncio.Future[Fetched | str]]:
        """Reads of (key, target) from one peer, sent together (a pipelined batch): a
        future per read, settled as its chunk is in and verified, or with why not, within
        `timeout` (by default `peers.timeout`)."""
        return self.network.fetch_many(link, [(self.tenant, k, t) for k, t in reads],
                                       timeout)

    def push(self, key: bytes, size: int, to: str) -> None:
        """Queue a hand-off: offer `key` to the node `to` (never waits)."""
        self.network.push(self.tenant, key, size, to)

    def link_of(self, sender: bytes) -> PeerLink | None:
        """The link to the agent that offers a push, if it is a peer this one follows."""
        return self.network.link_of(sender)

    def handoff_ended(self, end: str) -> None:
        """Count the end of a pushed chunk's pin (read, expired, deleted)."""
        self.network.m.handoff_ended(end)

    @property
    def chunks(self) -> int:
        return len(self.directory)
