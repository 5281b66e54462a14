"""The contract constants: names and numbers that the client, the agent, the operator,
the chart and the files on disk must agree on.

Each is defined here once and imported everywhere else (the operator imports this
module, never the agent's server modules), so two copies can never drift apart.
Only the standard library is imported: the light client imports this module too.
"""

from __future__ import annotations

from typing import Final, Literal

# -- chunks and keys

KEY_BYTES: Final = 16
"""Length of a chunk key (XXH3-128); the agent refuses any other length (BAD_KEY)."""

CHUNK_SUFFIX: Final = ".kvc"
"""File-name suffix of a chunk on the NVMe tier and of an object in the shared tier."""

NVME_STORES_RECORD: Final = ".kvpool-stores"
"""In the NVMe directory: the agent's record of the `file://` shared stores it has used (a
file, so the NVMe tier's scan of its fan-out directories never takes it for chunks)."""

NVME_IDENTITIES: Final = ".kvpool-identities"
"""In the NVMe directory: the identities engines gave the chunks, for KV events after a
restart (`events.remembered`; a file, like `NVME_STORES_RECORD`)."""

STATE_STORES_RECORD: Final = "shared-stores.json"
"""In the agent's state directory (`stateDir`): its copy of the same record."""

STATE_PEER_DELETES: Final = "peer-deletes"
"""In the agent's state directory: the peer DELETEs waiting for their peers
(`peers.deletelog`), sent by the agent after a restart."""

# -- tiers

TierName = Literal["dram", "nvme", "shared"]
TIER_ORDER: Final[tuple[TierName, ...]] = ("dram", "nvme", "shared")
"""Fastest first: G2 host DRAM, G3 local NVMe, G4 shared store."""
TIER_CODES: Final[dict[TierName, int]] = {"dram": 2, "nvme": 3, "shared": 4}
"""A tier's code in LOOKUP replies (one byte per hit; docs/protocol.md)."""
PEER_TIER: Final = "peer"
"""Chunks another agent of the pool holds (the peer tier, between NVMe and the shared
tier; docs/cross-node.md). Not a tier of the config's `tiers`: `peers` turns it on."""
PEER_TIER_CODE: Final = 5
"""The peer tier's code in LOOKUP replies."""
LOOKUP_TIERS: Final[tuple[str, ...]] = ("dram", "nvme", PEER_TIER, "shared")
"""Every tier a LOOKUP can report a key in, in the order it asks them."""
TIER_NAMES: Final[dict[int, str]] = {
    **{code: name for name, code in TIER_CODES.items()}, PEER_TIER_CODE: PEER_TIER}

# -- the DRAM arena's pages (the operator checks pool sizes against them)

PAGE_BYTES: Final = 4096
HUGE_PAGE_BYTES: Final = 2 << 20
"""The page of an arena on hugetlbfs (2Mi huge pages): its size is a multiple of it."""

# -- environment variables (KVPOOL_*)

ENV_SOCKET: Final = "KVPOOL_SOCKET"
"""The agent's socket, injected into inference pods; the client's default."""
SOCKET_PATH_MAX: Final = 107
"""Longest Unix socket path, in bytes (Linux's `sun_path` holds 108, its NUL included)."""
DEFAULT_SOCKET: Final = "/run/kvpool/agent.sock"
"""The socket an agent serves when none is given, and so where a client (and `kvpool stats`,
`kvpool events`) looks when neither a path nor `KVPOOL_SOCKET` names one."""
ENV_TENANT: Final = "KVPOOL_TENANT"
"""The pod's tenant, injected into inference pods; the client's default."""
ENV_LOCAL_LOOKUP: Final = "KVPOOL_LOCAL_LOOKUP"
"""`1`: clients answer LOOKUP from the agent's shared-memory index by default (set by hand)."""
ENV_LEASE_FREE: Final = "KVPOOL_LEASE_FREE"
"""`0`/`1`: clients read DRAM chunks without a lease where the lookup index allows (docs/
protocol.md, "Reads without a lease"); unset, as `KVPOOL_LOCAL_LOOKUP` says (the vLLM
connector: on)."""
ENV_PUT_AHEAD: Final = "KVPOOL_PUT_AHEAD"
"""`1`: clients' puts ask for the next put's lease with each COMMIT by default (by hand)."""
ENV_POOL: Final = "KVPOOL_POOL"
"""The pool id `<namespace>.<name>`, injected into inference pods."""
ENV_CHUNK_TOKENS: Final = "KVPOOL_CHUNK_TOKENS"
"""The pool's tokens per chunk, injected into inference pods."""
ENV_NODE_NAME: Final = "KVPOOL_NODE_NAME"
"""The agent's node (downward API), for its node label."""
ENV_POD_NAMESPACE: Final = "KVPOOL_POD_NAMESPACE"
"""The agent pod's namespace (downward API)."""
ENV_AGENT_IMAGE: Final = "KVPOOL_AGENT_IMAGE"
ENV_NAMESPACES: Final = "KVPOOL_NAMESPACES"
ENV_ALL_NAMESPACES: Final = "KVPOOL_ALL_NAMESPACES"
ENV_METRICS_PORT: Final = "KVPOOL_METRICS_PORT"
ENV_LIVENESS_PORT: Final = "KVPOOL_LIVENESS_PORT"
ENV_WEBHOOK_PORT: Final = "KVPOOL_WEBHOOK_PORT"
ENV_WEBHOOK_CERT_DIR: Final = "KVPOOL_WEBHOOK_CERT_DIR"
ENV_POD_MONITOR: Final = "KVPOOL_POD_MONITOR"
ENV_RESYNC_SECONDS: Final = "KVPOOL_RESYNC_SECONDS"
ENV_ALLOWED_IMAGES: Final = "KVPOOL_ALLOWED_IMAGES"
ENV_ALLOW_ROOT: Final = "KVPOOL_ALLOW_ROOT"
ENV_HOST_PATH_ROOTS: Final = "KVPOOL_HOST_PATH_ROOTS"
ENV_ALLOW_TOLERATE_ALL_TAINTS: Final = "KVPOOL_ALLOW_TOLERATE_ALL_TAINTS"
ENV_ALLOW_EVENTS: Final = "KVPOOL_ALLOW_EVENTS"
ENV_ALLOW_PEERS: Final = "KVPOOL_ALLOW_PEERS"
"""The operator's settings (`kvpool operator run` options)."""

# -- Kubernetes names shared by the agent, the operator and the chart

NODE_LABEL_PREFIX: Final = "pool.kvpool.io/"
"""The agent labels its node `pool.kvpool.io/<namespace>.<pool>=ready` while it serves;
the webhook gives inference pods a node affinity on that label."""
NODE_LABEL_READY: Final = "ready"
AGENT_JOB: Final = "kvpool-agent"
"""The `job` label of the agents' metrics (the chart's PodMonitor sets it; the alerts
and the dashboard select on it)."""
