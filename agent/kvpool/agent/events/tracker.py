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
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..config import TIER_ORDER, TierName
from ..protocol import ErrorCode
from ..store.errors import OpError
from .publisher import Block, Change, Publisher, TopicEnd, TopicStart

_BIT: dict[TierName, int] = {t: 1 << i for i, t in enumerate(TIER_ORDER)}


@dataclass(frozen=True, slots=True)
class Identity:
    """What a client said of a chunk it stored, packed (about 4 bytes per token)."""

    hashes: array[int]
    parent: int | None
    tokens: array[int]
    block_size: int
    model: str


class _Held:
    __slots__ = ("identity", "tiers")

    def __init__(self, identity: Identity | None) -> None:
        self.tiers = 0
        self.identity = identity


def own_hash(key: bytes) -> int:
    """kvpool's stand-in for an engine block hash: the key's first 8 bytes, unsigned."""
    return int.from_bytes(key[:8], "big")


def identity(hashes: list[int], tokens: list[int], parent: int | None, block_size: int,
             model: str) -> Identity | None:
    """A chunk's identity from a PUT/COMMIT and its client's HELLO; None when neither
    says anything. Raises `OpError` (BAD_ARGUMENT) for values no event can carry."""
    if not (hashes or block_size or model):
        return None
    try:
        packed = array("Q", hashes) if min(hashes, default=0) >= 0 else array("q", hashes)
        toks = array("L", tokens)
    except OverflowError as e:
        raise OpError(ErrorCode.BAD_ARGUMENT,
                      f"block hashes must fit 64 bits and token ids 32 bits: {e}") from None
    if parent is not None and not -(1 << 63) <= parent < 1 << 64:
        raise OpError(ErrorCode.BAD_ARGUMENT, "parent_block_hash must fit 64 bits")
    return Identity(packed, parent, toks, block_size, model)


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
        self.publisher.offer(Change(self.space, True, tier, self._block(key, h), self._model(h)))

    def removed(self, tier: TierName, key: bytes) -> None:
        h = self.held.get(key)
        bit = _BIT[tier]
        if h is None or not h.tiers & bit:
            return
        h.tiers &= ~bit
        if not h.tiers:
            del self.held[key]
        self.publisher.offer(Change(self.space, False, tier, self._block(key, h),
                                    self._model(h)))

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

    @staticmethod
    def _block(key: bytes, h: _Held) -> Block:
        ident = h.identity
        if ident is None:
            return Block([own_hash(key)], None, [], 0)
        if not ident.hashes:  # kvpool's own key: one block for the whole chunk
            return Block([own_hash(key)], None, [], ident.block_size)
        return Block(ident.hashes.tolist(), ident.parent, ident.tokens.tolist(),
                     ident.block_size)

    @staticmethod
    def _model(h: _Held) -> str:
        return h.identity.model if h.identity is not None else ""

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

    def _inventory(self) -> list[tuple[TierName, Block, str]]:
        out: list[tuple[TierName, Block, str]] = []
        for tier in TIER_ORDER:
            bit = _BIT[tier]
            out += [(tier, self._block(k, h), self._model(h))
                    for k, h in self.held.items() if h.tiers & bit]
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
