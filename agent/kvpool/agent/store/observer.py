"""What the store tells about chunks entering and leaving its tiers (KV events listen).

The store calls `stored` when a chunk becomes visible in a tier and `removed` when
it stops being; both on the event loop, never blocking. The store does not care who
listens: the agent's KV-event tracker (`kvpool.agent.events`) does, when events are on.
"""

from __future__ import annotations

from typing import Protocol

from ..config import TierName


class TierObserver(Protocol):
    def stored(self, tier: TierName, key: bytes) -> None: ...

    def removed(self, tier: TierName, key: bytes) -> None: ...


class NoObserver:
    """Nobody listens (events off): the calls cost a no-op."""

    def stored(self, tier: TierName, key: bytes) -> None:
        pass

    def removed(self, tier: TierName, key: bytes) -> None:
        pass


NO_OBSERVER = NoObserver()


class Observers:
    """Several listeners (KV events and the peer tier), told in order."""

    def __init__(self, observers: list[TierObserver]) -> None:
        self.observers = observers

    def stored(self, tier: TierName, key: bytes) -> None:
        for o in self.observers:
            o.stored(tier, key)

    def removed(self, tier: TierName, key: bytes) -> None:
        for o in self.observers:
            o.removed(tier, key)
