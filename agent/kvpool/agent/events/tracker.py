"""The loop's side of KV events for one space: which tiers hold each chunk, and as what.

`TierEvents` is the store's observer (`store.observer.TierObserver`). It keeps,
per chunk any tier holds (as far as this agent knows), the tiers announced so far,
and the chunk's identity when its storing client gave one (the engine blocks it
named; without one, events name kvpool's own key), also on file for a restart
(`remembered`), so every `BlockRemoved` names
what its `BlockStored` named, and a topic that starts gets an inventory of
everything held. Announcing is idempotent per (tier, key): a tier's index may
briefly hold an entry the store never made visible (a demotion overtaken by a
delete), and its removal must not be published.

This runs once per chunk per tier change on the event loop, inside puts: it keeps
a bit mask per key (no object per chunk) and queues a plain tuple; everything
else (what the event says, encoding, topics) is the publisher thread's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from ..config import TIER_ORDER, TierName
from .identity import Identity
from .publisher import Publisher, TopicEnd, TopicStart
from .remembered import IdentityLog

_BIT: dict[TierName, int] = {t: 1 << i for i, t in enumerate(TIER_ORDER)}
_SHARED = _BIT["shared"]

SHARED_ANNOUNCED = 1 << 20
"""Most shared-tier chunks one space announces at once. The shared store has no size
the agent manages, so what the agent remembers of it is bounded here (about 150 bytes
a chunk): past it, the oldest announcement is withdrawn (`BlockRemoved`)."""

LEAVING = 4096
"""Identities kept after their chunk left every tier, for it to take again: a chunk being
demoted is in no tier until its file lands (a few hundred at most are: the store bounds
the demotions in flight), then NVMe holds it, as its engine named it. Past this many, the
oldest is forgotten, and forgotten on file too."""

_NO_IDENTITY: contextlib.nullcontext[None] = contextlib.nullcontext()


class _Storing:
    """While a PUT/COMMIT stores `key`: the identity its chunk takes (`storing`)."""

    __slots__ = ("events", "identity", "key")

    def __init__(self, events: TierEvents, key: bytes, identity: Identity) -> None:
        self.events, self.key, self.identity = events, key, identity

    def __enter__(self) -> None:
        self.events.pending[self.key] = self.identity

    def __exit__(self, *_: object) -> None:
        pending = self.events.pending
        if pending.get(self.key) is self.identity:
            del pending[self.key]


class TierEvents:
    """Turns one space's tier changes into queued events (see the module's doc)."""

    def __init__(self, space: str, publisher: Publisher, *, node_topic: str | None,
                 shared_announced: int = SHARED_ANNOUNCED,
                 remembered: IdentityLog | None = None) -> None:
        self.space = space
        self.publisher = publisher
        self._offer = publisher.offer
        self.node_topic = node_topic
        """The topic of node mode; None: pod mode (topics come with connections)."""
        self.held: dict[bytes, int] = {}
        """Tiers (bits of `_BIT`) announced to hold each key."""
        self.identities: dict[bytes, Identity] = {}
        """What the storing client said of a held chunk; absent: nothing (kvpool's key)."""
        self.shared: dict[bytes, None] = {}
        """Keys announced in the shared tier, oldest first (for `shared_announced`)."""
        self.shared_announced = shared_announced
        self._count = dict.fromkeys(_BIT.values(), 0)
        """Keys announced per tier (by bit)."""
        self.pods: dict[tuple[str, str], int] = {}
        """Connections of each (pod, model) that said HELLO with a pod name."""
        self.pending: dict[bytes, Identity] = {}
        """Identities of chunks being stored (a PUT may wait for room meanwhile)."""
        self.leaving: dict[bytes, Identity] = {}
        """Identities of chunks that just left every tier, oldest first (`LEAVING`)."""
        self.remembered = remembered
        """The identities on file, for a restart (`remembered`); None: kept in memory only."""
        if remembered is not None:
            # What a compaction keeps: the chunks held, and those on their way to a tier
            # (a demotion's chunk is in none until its file lands: `leaving`).
            remembered.live = lambda: [*self.identities.items(), *self.leaving.items()]
            remembered.live_count = lambda: len(self.identities) + len(self.leaving)

    # -- what the store tells

    def stored(self, tier: TierName, key: bytes) -> None:
        held = self.held
        bits = held.get(key, 0)
        bit = _BIT[tier]
        if bits & bit:
            return
        if not bits:
            ident = self.pending.get(key) if self.pending else None
            left = self.leaving.pop(key, None) if self.leaving else None
            if ident is not None:
                self.identities[key] = ident
                if self.remembered is not None:
                    self.remembered.keep(key, ident)
            elif left is not None:  # back from a demotion: the file still has it
                self.identities[key] = left
        held[key] = bits | bit
        self._count[bit] += 1
        self._offer((self.space, True, tier, key, self.identities.get(key)))
        if bit == _SHARED:
            self.shared[key] = None
            if len(self.shared) > self.shared_announced:
                self.removed("shared", next(iter(self.shared)))

    def removed(self, tier: TierName, key: bytes) -> None:
        held = self.held
        bits = held.get(key, 0)
        bit = _BIT[tier]
        if not bits & bit:
            return
        ident = self.identities.get(key)
        self._count[bit] -= 1
        bits &= ~bit
        if bits:
            held[key] = bits
        else:
            del held[key]
            if ident is not None:
                del self.identities[key]
                self.leaving[key] = ident
                if len(self.leaving) > LEAVING:
                    gone = next(iter(self.leaving))
                    del self.leaving[gone]
                    if self.remembered is not None:
                        self.remembered.forget(gone)
        if bit == _SHARED:
            del self.shared[key]
        self._offer((self.space, False, tier, key, ident))

    def storing(self, key: bytes, ident: Identity | None
                ) -> contextlib.AbstractContextManager[None]:
        """`key`, if stored inside the block, takes this identity (the storing client's);
        a chunk keeps the one it was first stored with while any tier holds it."""
        return _NO_IDENTITY if ident is None else _Storing(self, key, ident)

    # -- topics

    def start(self, held: Iterable[tuple[TierName, bytes]]) -> None:
        """The store as it is at start (recovered DRAM, NVMe's index), with the identities
        remembered for its chunks; in node mode the topic starts with it."""
        for tier, key in held:
            bits, bit = self.held.get(key, 0), _BIT[tier]
            if not bits & bit:
                self.held[key] = bits | bit
                self._count[bit] += 1
        if self.remembered is not None:
            self.identities.update(self.remembered.load(self.held.keys()))
        if self.node_topic is not None:
            self._offer(TopicStart(self.space, self.node_topic, "", self._inventory()))

    def _inventory(self) -> list[tuple[TierName, bytes, Identity | None]]:
        out: list[tuple[TierName, bytes, Identity | None]] = []
        ids = self.identities
        for tier in TIER_ORDER:
            bit = _BIT[tier]
            out += [(tier, k, ids.get(k)) for k, bits in self.held.items() if bits & bit]
        return out

    def connected(self, pod: str, model: str) -> None:
        """A connection said HELLO for `pod` (pod mode: its first starts the topic)."""
        if self.node_topic is not None or not pod:
            return
        n = self.pods.get((pod, model), 0)
        self.pods[(pod, model)] = n + 1
        if not n:
            self._offer(TopicStart(self.space, pod_topic(pod, model), model,
                                   self._inventory()))

    def disconnected(self, pod: str, model: str) -> None:
        if self.node_topic is not None or not pod:
            return
        n = self.pods.get((pod, model), 0) - 1
        if n > 0:
            self.pods[(pod, model)] = n
            return
        self.pods.pop((pod, model), None)
        self._offer(TopicEnd(self.space, pod_topic(pod, model)))

    def announced(self) -> dict[TierName, int]:
        """Chunks announced held per tier now (STATS `events.announced`): what a
        subscriber that applied every event of this space holds."""
        return {tier: self._count[_BIT[tier]] for tier in TIER_ORDER}


def pod_topic(pod: str, model: str) -> str:
    """llm-d's topic of an engine pod."""
    return f"kv@{pod}@{model}"


def node_topic(node: str, pool: str, tenant: str) -> str:
    return f"kv@{node}@{pool}:{tenant}" if tenant else f"kv@{node}@{pool}"
