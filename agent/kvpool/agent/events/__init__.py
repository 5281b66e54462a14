"""KV events for routers: chunks entering and leaving tiers, published in vLLM's format.

`wire` holds the payload structs and encoding, `publisher` the ZMQ PUB and replay
sockets fed from a bounded queue, `tracker` the loop's side of one space (the
store's observer), `remembered` its chunks' identities on file for a restart. See docs/events.md.
"""

from __future__ import annotations

from .identity import Identity, identity, own_hash
from .publisher import Publisher
from .remembered import IdentityLog
from .tracker import TierEvents, node_topic, pod_topic

__all__ = ["Identity", "IdentityLog", "Publisher", "TierEvents", "identity", "node_topic",
           "own_hash", "pod_topic"]
