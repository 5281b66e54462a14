"""The loop's side of KV events for one space: which tiers hold each chunk, and as what.

`TierEvents` is the store's observer (`store.observer.TierObserver`). It keeps,
per chunk any local tier holds, the tiers announced so far and the chunk's
identity (the engine blocks its storing client named, else kvpool's own key), so
every `BlockRemoved` names what its `BlockStored` named, and a topic that starts
gets an inventory of everything held. Announcing is idempotent per (tier, key): a
tier's index may briefly hold an entry the store never made visible (a demotion
overtaken by a delete), and its removal must not be published.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from ..config import TIER_ORDER, TierName
from .identity import Identity
from .publisher import Change, Publisher, TopicEnd, TopicStart

_BIT: dict[TierName, int] = {t: 1 << i for i, t in enumerate(TIER_ORDER)}


class _Held:
    __slots__ = ("identity", "tiers")

    def __init__(self, identity: Identity | None) -> None:
        self.tiers = 0
        self.identity = identity


class TierEvents:
    """Turns one space's tier changes into queued events (see the module's doc)."""

    def __init__(self, space: str, publisher: Publisher, *, node_topic: str | None) -> None:
        self.space = space
        self.publisher = publisher
        self.node_topic = node_topic
        """The topic of node mode; None: pod mode (topics come with connections)."""
        self.held: dict[bytes, _Held] = {}
        self.pods: dict[tuple[str, str], int] = {}
        """Connections of each (pod, model) that said HELLO with a pod name."""
        self._pending: dict[bytes, Identity] = {}
        """Identities of chunks being stored (a PUT may wait for room meanwhile)."""

    # -- what the store tells

    def stored(self, tier: TierName, key: bytes) -> None:
        h = self.held.get(key)
        if h is None:
            h = self.held[key] = _Held(self._pending.get(key))
        bit = _BIT[tier]
        if h.tiers & bit:
            return
        h.tiers |= bit
        self.publisher.offer(Change(self.space, True, tier, key, h.identity))

    def removed(self, tier: TierName, key: bytes) -> None:
        h = self.held.get(key)
        bit = _BIT[tier]
        if h is None or not h.tiers & bit:
            return
        h.tiers &= ~bit
        if not h.tiers:
            del self.held[key]
        self.publisher.offer(Change(self.space, False, tier, key, h.identity))

    @contextlib.contextmanager
    def storing(self, key: bytes, ident: Identity | None) -> Iterator[None]:
        """`key`, if stored inside the block, takes this identity (the storing client's);
        a chunk keeps the one it was first stored with while any tier holds it."""
        if ident is None:
            yield
            return
        self._pending[key] = ident
        try:
            yield
        finally:
            if self._pending.get(key) is ident:
                del self._pending[key]

    # -- topics

    def start(self, held: Iterable[tuple[TierName, bytes]]) -> None:
        """The store as it is at start (recovered DRAM, NVMe's index); in node mode the
        topic starts with it."""
        for tier, key in held:
            h = self.held.get(key)
            if h is None:
                h = self.held[key] = _Held(None)
            h.tiers |= _BIT[tier]
        if self.node_topic is not None:
            self.publisher.offer(TopicStart(self.space, self.node_topic, "",
                                            self._inventory()))

    def _inventory(self) -> list[tuple[TierName, bytes, Identity | None]]:
        out: list[tuple[TierName, bytes, Identity | None]] = []
        for tier in TIER_ORDER:
            bit = _BIT[tier]
            out += [(tier, k, h.identity) for k, h in self.held.items() if h.tiers & bit]
        return out

    def connected(self, pod: str, model: str) -> None:
        """A connection said HELLO for `pod` (pod mode: its first starts the topic)."""
        if self.node_topic is not None or not pod:
            return
        n = self.pods.get((pod, model), 0)
        self.pods[(pod, model)] = n + 1
        if not n:
            self.publisher.offer(TopicStart(self.space, pod_topic(pod, model), model,
                                            self._inventory()))

    def disconnected(self, pod: str, model: str) -> None:
        if self.node_topic is not None or not pod:
            return
        n = self.pods.get((pod, model), 0) - 1
        if n > 0:
            self.pods[(pod, model)] = n
            return
        self.pods.pop((pod, model), None)
        self.publisher.offer(TopicEnd(self.space, pod_topic(pod, model)))


def pod_topic(pod: str, model: str) -> str:
    """llm-d's topic of an engine pod."""
    return f"kv@{pod}@{model}"


def node_topic(node: str, pool: str, tenant: str) -> str:
    return f"kv@{node}@{pool}:{tenant}" if tenant else f"kv@{node}@{pool}"
