"""Peers no longer listed whose node is known: the DELETEs that wait for them by node name,
until that node's agent is linked again, at whatever address (docs/cross-node.md#delete).

A link is made to an address (`host:port`): discovery lists a pool's agents by the
addresses its headless Service gives, and an agent's pod made again (an upgrade, a
reschedule, its container's crash) comes back at another one. On the same node, its agent
keeps what its NVMe and arena held (a warm restart), deleted chunks among them unless a
DELETE reaches it: one that waited for its old address, or one made while it was away.
A link's node is what its peer's inventory stream says (`PeerLink.node`). When a link
whose node is known goes (its address no longer listed), that node is *away*: what waited
for the link waits for the node, and so does every DELETE made meanwhile, until a link
whose stream names the node takes them (`take`), or `NODE_KEEP` passes (dropped, counted:
a node out of the pool for good). The file (`deletelog`) keeps them under the old link's
name, whose PEER record names the node: a restart parks them again.

Pure bookkeeping, event loop only: `PeerNetwork` writes the file and counts the drops.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from .deletelog import Item, Waiting

NODE_KEEP = 3600.0
"""Seconds an away node's DELETEs wait for it (from when it went), kept in memory and on
file: a pod made again is back in seconds, a node that reboots in minutes."""


@dataclass
class Away:
    until: float
    """The wall-clock time the node's DELETEs are dropped at (`NODE_KEEP` after it went)."""
    waiting: dict[str, Waiting] = field(default_factory=dict)
    """Its DELETEs by the name of the link they waited for (its last one last: a DELETE
    made while it is away is on file under that one), each with its own `until` (a
    refused one's; else 0)."""


class AwayNodes:
    def __init__(self, bound: int) -> None:
        self.bound = bound
        """DELETEs kept per node at most (the oldest dropped past it, as a link's queue)."""
        self.nodes: dict[str, Away] = {}
        self.items: Counter[Item] = Counter()
        """Every away node's DELETEs: a new link's first inventory lists none of them until
        its node is known (`PeerLink`: it may be the node they wait for)."""

    def park(self, node: str, name: str, waiting: Waiting, now: float
             ) -> list[tuple[str, Item]]:
        """`waiting` (what the link `name` to `node` had queued) waits for `node` now;
        the node is away until `now` + `NODE_KEEP` (from its latest going). What the bound
        dropped, (name, DELETE), oldest first."""
        away = self.nodes.get(node)
        if away is None:
            away = self.nodes[node] = Away(now + NODE_KEEP)
        away.until = now + NODE_KEEP
        mine = away.waiting.pop(name, None) or OrderedDict()
        away.waiting[name] = mine  # (the latest name last)
        for item, until in waiting.items():
            if item not in mine:
                self.items[item] += 1
            mine[item] = until
        return self._bound(away)

    def add(self, item: Item) -> tuple[list[str], list[tuple[str, Item]]]:
        """A DELETE made now waits for every away node: the names it is on file under (one
        per node, its latest), and what the bound dropped, (name, DELETE)."""
        names: list[str] = []
        dropped: list[tuple[str, Item]] = []
        for away in self.nodes.values():
            name, mine = next(reversed(away.waiting.items()))
            if item not in mine:
                self.items[item] += 1
            mine[item] = 0.0
            mine.move_to_end(item)
            names.append(name)
            dropped += self._bound(away)
        return names, dropped

    def take(self, node: str) -> dict[str, Waiting]:
        """`node`'s DELETEs, by the name they are on file under, for its new link (none
        where it is not away); it is away no more."""
        away = self.nodes.pop(node, None)
        if away is None:
            return {}
        for mine in away.waiting.values():
            for item in mine:
                self._release(item)
        return {name: mine for name, mine in away.waiting.items() if mine}

    def expire(self, now: float) -> dict[str, dict[str, Waiting]]:
        """The nodes away for `NODE_KEEP` leave with their DELETEs: these, by node, then by
        the name they are on file under."""
        gone = [node for node, away in self.nodes.items() if away.until <= now]
        return {node: self.take(node) for node in gone}

    def entries(self) -> Iterator[tuple[str, Item, float]]:
        """(name, DELETE, until) of each away node's DELETE, for the file's rewrite."""
        for away in self.nodes.values():
            for name, mine in away.waiting.items():
                for item, until in mine.items():
                    yield name, item, until

    def _bound(self, away: Away) -> list[tuple[str, Item]]:
        """Drop `away`'s oldest DELETEs past the bound (oldest name first): (name, item)."""
        dropped: list[tuple[str, Item]] = []
        left = sum(len(mine) for mine in away.waiting.values()) - self.bound
        for name, mine in away.waiting.items():
            while left > 0 and mine:
                item, _ = mine.popitem(last=False)
                self._release(item)
                dropped.append((name, item))
                left -= 1
        return dropped

    def _release(self, item: Item) -> None:
        """One away node waits for `item` no more (`items` counts those that still do)."""
        self.items[item] -= 1
        if self.items[item] <= 0:
            del self.items[item]
