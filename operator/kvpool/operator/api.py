"""The kvpool API: `KVCachePool` and `KVTierPolicy` (group `kvpool.io`, version `v1alpha1`).

These pydantic models are the single source of truth: the CRDs (`kvpool crds`),
the CRD reference (`docs/crd-reference.md`), the operator's parsing of custom
resources and the rendering of agents all come from them. A `KVTierPolicy`'s
spec *is* the agent's `TierPolicy`, so the policy engine reads exactly what the
user wrote.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal, TypeVar

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kvpool.agent.config import (
    PEER_PORT,
    PEER_SECRET_GRACE,
    PEER_TIMEOUT,
    DramTier,
    Events,
    Model,
    TenantSpace,
    TierPolicy,
    explain,
    tenant_sizes,
)
from kvpool.agent.constants import HUGE_PAGE_BYTES, NODE_LABEL_PREFIX
from kvpool.agent.lookupindex import (
    MAX_PEERS,
    PEER_HEADER_BYTES,
    PEER_MAX_SLOTS,
    PEER_MIN_SLOTS,
    PEER_SLOT_BYTES,
    PEER_STATE_BYTES,
    dram_table_bytes,
)
from kvpool.agent.units import ByteSize, Duration, format_size, parse_size

GROUP = "kvpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

POOL_KIND = "KVCachePool"
POOL_PLURAL = "kvcachepools"
POLICY_KIND = "KVTierPolicy"
POLICY_PLURAL = "kvtierpolicies"

POOL_ANNOTATION = "kvpool.io/pool"
"""A pod annotated with a pool's name gets that pool's socket, env and node affinity."""
TENANT_ANNOTATION = "kvpool.io/tenant"
"""The tenant a pod's chunks belong to (part of the fingerprint); default: its namespace."""
AGENT_UID = 65532
"""The agent's default UID and GID: not root (the distroless "nonroot" user's number)."""

_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


STATE_HOST_PATH = "/var/lib/kvpool/state"
"""The default `spec.stateHostPath`."""


def pool_id(namespace: str, name: str) -> str:
    """The pool's cluster-wide id, `<namespace>.<name>`: the agent's `pool`."""
    return f"{namespace}.{name}"


def node_label(namespace: str, name: str) -> str:
    """The node label key the pool's agent sets to `ready` on its node."""
    return NODE_LABEL_PREFIX + pool_id(namespace, name)


def check_pool_id(namespace: str, name: str) -> None:
    """Raise `InvalidSpec` if `<namespace>.<name>` cannot be a node label name."""
    ident = pool_id(namespace, name)
    if len(ident) > 63 or not _LABEL_NAME.match(ident):
        raise InvalidSpec(
            f"metadata.name: '{ident}' (namespace.name) must be at most 63 characters "
            "to serve as the node label pool.kvpool.io/<namespace>.<name>"
        )


_LENIENT = ConfigDict(
    extra="ignore", alias_generator=to_camel, populate_by_name=True, validate_default=True
)
"""Like `Model`'s config, but ignoring fields the operator does not read (metadata, status)."""


class InvalidSpec(ValueError):
    """A custom resource's spec is invalid; the message names every bad field."""


class PortConflict(InvalidSpec):
    """Two ports of the agent container are the same (events, peer, metrics ports)."""


# --------------------------------------------------------------------------- pool spec


class ReclaimPolicy(StrEnum):
    RETAIN = "Retain"
    """Deleting the pool keeps what it stored (in the shared store, or on the nodes)."""
    DELETE = "Delete"
    """Deleting the pool removes it first: `kvpool gc --all` on its shared prefix, or its
    directories on every node (`spec.nodeReclaimPolicy`)."""


class DramSpec(Model):
    """G2: a pinned shared-memory arena on every node of the pool."""

    size: ByteSize = Field(description="Arena size per node, a quantity such as 8Gi.")
    huge_pages: bool = Field(
        False,
        description="Back the arena with 2Mi huge pages (hugetlbfs at /dev/hugepages on the "
        "node); the agent then requests hugepages-2Mi instead of memory.",
    )
    locked: bool = Field(
        True,
        description="mlock the arena so it is never swapped (the agent gets IPC_LOCK); "
        "a failure to lock is reported, not fatal.",
    )

    @model_validator(mode="after")
    def _whole_huge_pages(self) -> DramSpec:
        if self.huge_pages and self.size % HUGE_PAGE_BYTES:
            raise ValueError("size must be a multiple of 2Mi when hugePages is true")
        return self


class NvmeSpec(Model):
    """G3: chunk files on a local disk of every node of the pool."""

    host_path: str = Field(
        description="Directory on the node (an NVMe mount); the pool uses "
        "<hostPath>/<namespace>.<name> below it.",
        pattern=r"^/.*",
    )
    size: ByteSize = Field(description="Most bytes of chunk files kept per node.")


class SharedSpec(Model):
    """G4: a store shared by all nodes (S3-compatible object store or shared POSIX mount)."""

    url: str = Field(
        description="s3://bucket/prefix, or file:///path for a shared mount present at the "
        "same path on every node.",
        pattern=r"^(s3://[^/]+.*|file:///.*)$",
        max_length=1024,
    )
    credentials_secret: str | None = Field(
        None,
        description="Secret in the pool's namespace with keys AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (s3:// only); unset: the node's AWS credential chain.",
        min_length=1,
        max_length=253,
    )
    endpoint_url: str | None = Field(
        None, description="S3 endpoint for S3-compatible stores (MinIO, Ceph RGW, ...)."
    )
    region: str | None = Field(None, description="S3 region.")
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        "auto", description="S3 bucket addressing: path-style for most self-hosted stores."
    )
    reclaim_policy: ReclaimPolicy = Field(
        ReclaimPolicy.RETAIN,
        description="What deleting the pool does to its chunks in the shared store.",
    )


class TiersSpec(Model):
    """The tiers of the pool; at least one. DRAM is the tier clients exchange data through."""

    dram: DramSpec | None = Field(
        None, description="G2 host DRAM; unset: the agent's default arena (1Gi)."
    )
    nvme: NvmeSpec | None = Field(None, description="G3 local NVMe; unset: no NVMe tier.")
    shared: SharedSpec | None = Field(None, description="G4 shared store; unset: no shared tier.")

    def enabled(self) -> list[str]:
        """The tiers the spec names."""
        return [t for t in ("dram", "nvme", "shared") if getattr(self, t) is not None]

    def effective_dram(self) -> DramSpec:
        """The DRAM tier the agents run: the spec's, or the agent's default arena."""
        return self.dram if self.dram is not None else DramSpec(size=DramTier().size)

    def served(self) -> list[str]:
        """The tiers the agents serve: DRAM always (clients exchange data through it)."""
        return ["dram", *(t for t in ("nvme", "shared") if getattr(self, t) is not None)]


class PolicyRef(Model):
    name: str = Field(
        description="Name of a KVTierPolicy in the pool's namespace.", min_length=1, max_length=253
    )


class Toleration(Model):
    """A Kubernetes toleration (core/v1 Toleration)."""

    key: str | None = Field(None, description="Taint key; empty with Exists: all taints.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; unset: all effects."
    )
    toleration_seconds: int | None = Field(
        None, description="How long a NoExecute taint is tolerated."
    )


class Resources(Model):
    """Compute resources of the agent container (core/v1 ResourceRequirements)."""

    requests: dict[str, str] | None = Field(
        None, description="Requested resources (cpu, memory, hugepages-2Mi)."
    )
    limits: dict[str, str] | None = Field(None, description="Resource limits.")


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class AgentSpec(Model):
    """How the agent DaemonSet runs."""

    image: str | None = Field(
        None,
        description="Agent image; unset: the operator's default (same kvpool version). "
        "It must be one the operator policy allows (default: the operator's own repository).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Image pull policy."
    )
    resources: Resources | None = Field(
        None,
        description="Agent container resources; unset: memory sized to the DRAM arena "
        "plus the agent's overhead: 256Mi, each tenant space's lookup table (64 B per 4 KiB "
        "of its arena share, at most 64Mi a space) and, with spec.peers enabled, the peer "
        "directory of each tenant space (spec.peers.remoteChunks) (or hugepages-2Mi with "
        "hugePages), "
        "cpu request 100m. A memory limit below the arena plus that overhead (the arena is "
        "shared memory, charged to the pod), or a hugepages-2Mi limit below a huge-page "
        "arena, is refused.",
    )
    metrics_port: int = Field(
        9400, ge=1024, le=65535, description="Port of /metrics, /healthz and /readyz."
    )
    log_level: LogLevel = Field(LogLevel.INFO, description="Agent log level.")
    run_as_user: int = Field(
        AGENT_UID,
        ge=0,
        description="UID and GID the agent runs as (not root by default); an init container "
        "gives the pool's host directories to it. 0 runs the agent as root (where the "
        "operator policy allows it), the only way the IPC_LOCK capability takes effect "
        "without a raised memlock limit on the node.",
    )
    priority_class_name: str | None = Field(
        None, description="PriorityClass of the agent pods (e.g. system-node-critical)."
    )


class PeerTlsSpec(Model):
    """TLS between the agents of the pool, with a certificate Secret the admin provides;
    unset: plain TCP (the pool's secret still authenticates every connection, but chunks
    cross the network unencrypted)."""

    secret_name: str = Field(
        description="A Secret in the pool's namespace (type kubernetes.io/tls) with keys "
        "tls.crt, tls.key and ca.crt: the certificate every agent of the pool shows, its key, "
        "and the CA each agent checks the others' certificate against.",
        min_length=1,
        max_length=253,
    )


REMOTE_CHUNKS = 1_000_000
"""`spec.peers.remoteChunks`' default: issue 29's scale, a pool of a few nodes."""


class PeersSpec(Model):
    """The peer tier: the agents of the pool read each other's chunks over TCP."""

    enabled: bool = Field(
        False,
        description="Every agent serves its DRAM and NVMe chunks to the pool's other agents and "
        "reads theirs before the shared tier. The operator creates the pool's secret (Secret "
        "kvpool-<name>-peers, which both sides of a connection prove), the headless Service "
        "kvpool-<name>-peers the agents find each other through, and a NetworkPolicy "
        "admitting only the pool's agents on the port (docs/cross-node.md).",
    )
    port: int = Field(
        PEER_PORT, ge=1024, le=65535,
        description="TCP port the agents serve chunks on (container port kv-peers).",
    )
    tls: PeerTlsSpec | None = Field(None, description="TLS between the agents; unset: plain TCP.")
    timeout: Duration = Field(
        PEER_TIMEOUT,
        description="Longest a read from another agent may take before it falls back to the "
        "shared tier, then to a miss (the agents' peers.timeout). A read past it while the "
        "peer answered nothing marks that peer slow for 5s. Batches of reads are sized to "
        "land in half of it at the link's measured speed, 8 to 32Mi: a link slower than "
        "34 MB/s needs more than 250ms (docs/cross-node.md, \"Slow links\").",
    )
    secret_grace: Duration = Field(
        PEER_SECRET_GRACE,
        description="After the pool's secret is rotated (a new value written into the "
        "Secret kvpool-<name>-peers), how long each agent still accepts the previous one "
        "from the agents it connects to, those whose node has not updated its copy yet "
        "(the agents' peers.secretGrace); then the connections proven with it end. After a "
        "leak, set it to the minute or two the kubelets take (docs/cross-node.md, "
        "\"Rotating the secret and renewing certificates\").",
    )
    remote_chunks: int = Field(
        REMOTE_CHUNKS,
        ge=0,
        le=1 << 32,
        description="Remote chunks (held by the pool's other agents) each tenant space's "
        "peer directory is sized for: unless spec.agent.resources is set, the agent's memory "
        "grows by 64 bytes per remote chunk per tenant space (the directory's heap) plus, "
        "without an NVMe tier, the peer table clients read LOOKUPs from (24 bytes a slot, "
        "the smallest power of two at least twice the chunks, at most 2^22 slots: 96Mi), "
        "rounded up to a MiB; 10^6: 62Mi, 110Mi without NVMe. An agent sees at most the "
        "chunks the other nodes' DRAM and NVMe hold: set it from the pool's size (e.g. 8 "
        "other nodes of 64Gi DRAM and 1Ti NVMe, chunks of 4Mi: 2.2 million). It caps the "
        "directory too (the agents' peers.maxEntries): a remote chunk past it is not listed, "
        "so a LOOKUP of it goes on to the shared tier (counted: "
        "kvpool_peer_directory_full_total; docs/cross-node.md, \"Directory size\").",
    )
    network_policy: bool = Field(
        True,
        description="Render the NetworkPolicy kvpool-<name>-peers, which admits only the "
        "pool's agents on the peer port and, as it isolates the agent pods, their metrics "
        "and events ports from anywhere. false: no policy from the operator, for clusters "
        "whose own NetworkPolicies govern the agent pods (they must then admit the pool's "
        "agents on the peer port).",
    )


class KVCachePoolSpec(Model):
    """A tiered KV-cache pool: one agent per selected node, sharing a G4 store."""

    tiers: TiersSpec = Field(description="Tiers of the pool (at least one).")
    policy_ref: PolicyRef | None = Field(
        None, description="The KVTierPolicy the agents follow; unset: the built-in defaults."
    )
    chunk_tokens: int = Field(
        256,
        ge=1,
        le=65536,
        description="Tokens per chunk; part of the layout fingerprint, given to clients "
        "as KVPOOL_CHUNK_TOKENS.",
    )
    node_selector: dict[str, str] | None = Field(
        None, description="Nodes that run an agent (and so can serve pods of the pool)."
    )
    tolerations: list[Toleration] | None = Field(None, description="Tolerations of the agent pods.")
    agent: AgentSpec = Field(default_factory=AgentSpec, description="The agent DaemonSet.")
    tenants: list[TenantSpace] = Field(
        default_factory=list,
        description="Tenants with a space of their own on every node: a socket only their "
        "pods mount, their own arena, NVMe directory and shared prefix, so no tenant can "
        "read another's chunks. A pod's tenant (annotation kvpool.io/tenant, default its "
        "namespace) must be listed. Unset: one space for the pool.",
    )
    events: Events = Field(
        default_factory=Events,
        description="KV events for KV-aware routers (llm-d, Dynamo): every agent publishes "
        "the chunks entering and leaving its tiers on a ZMQ PUB socket in vLLM's KV-event "
        "format, with a replay socket for late subscribers. Enabled: the ports are named "
        "container ports of the agent (kv-events, kv-replay) and the headless Service "
        "kvpool-<name>-events lists every agent's pod address (docs/events.md).",
    )
    peers: PeersSpec = Field(
        default_factory=PeersSpec,
        description="The peer tier: agents read chunks other nodes' agents hold, verified, "
        "before the shared tier (docs/cross-node.md).",
    )
    socket_dir: str = Field(
        "/run/kvpool",
        description="Host directory for agent sockets; the pool's socket is "
        "<socketDir>/<namespace>.<name>/agent.sock on the node and in pods.",
        pattern=r"^/.*",
    )

    state_host_path: str = Field(
        STATE_HOST_PATH,
        description="Host directory, on the node's disk, for what agents must remember "
        "across a reboot of the node (the tmpfs forgets it); the pool uses "
        "<stateHostPath>/<namespace>.<name> below it. It must lie below one of the "
        "operator policy's hostPathRoots.",
        pattern=r"^/.*",
    )
    node_reclaim_policy: ReclaimPolicy = Field(
        ReclaimPolicy.DELETE,
        description="What deleting the pool does to its directories on the nodes (the "
        "state directory and the NVMe directory, <namespace>.<name> below stateHostPath "
        "and tiers.nvme.hostPath): Delete removes them on every node of the pool once its "
        "agents are gone; Retain keeps them.",
    )

    @field_validator("socket_dir", "state_host_path")
    @classmethod
    def _no_trailing_slash(cls, v: str) -> str:
        return v.rstrip("/") or "/"


# --------------------------------------------------------------------------- status


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(Model):
    """A Kubernetes-style condition."""

    type: str = Field(description="Ready, Progressing or Degraded.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason (see docs/operator.md).")
    message: str = Field("", description="Human-readable detail.")
    observed_generation: int | None = Field(
        None, description="metadata.generation the condition was computed from."
    )
    last_transition_time: str | None = Field(
        None, description="When status last changed (RFC 3339)."
    )


class NodeCounts(Model):
    desired: int = Field(0, description="Nodes that should run an agent.")
    ready: int = Field(0, description="Nodes whose agent is ready.")
    updated: int = Field(0, description="Nodes running the current agent template.")
    available: int = Field(0, description="Nodes whose agent is available.")


class TierCapacity(Model):
    per_node: str = Field(description="Capacity on each node (quantity).")
    total: str | None = Field(None, description="perNode times desired nodes (local tiers).")


class ResolvedPolicy(Model):
    name: str = Field(description="The KVTierPolicy in use; empty: built-in defaults.")
    generation: int | None = Field(None, description="Its metadata.generation when rendered.")
    checksum: str = Field(description="sha256 (first 16 hex) of the policy as rendered.")


class KVCachePoolStatus(Model):
    observed_generation: int | None = Field(
        None, description="metadata.generation of the last reconciled spec."
    )
    applied_generation: int | None = Field(
        None,
        description="metadata.generation of the spec the agents run (tiers, capacity and "
        "socket below describe it): behind observedGeneration while an invalid or "
        "disallowed edit is refused.",
    )
    applied_spec: dict[str, Any] | None = Field(
        None,
        description="The spec the agents run (of appliedGeneration), as it was stored: while "
        "an invalid edit is refused, the pod webhook admits pods for it and capacity is "
        "computed from it, also after an operator restart. Absent while no agents run "
        "(Forbidden).",
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing, Degraded."
    )
    nodes: NodeCounts | None = Field(None, description="Agent rollout over the nodes.")
    tiers: str | None = Field(None, description="Enabled tiers, e.g. dram+nvme+shared.")
    capacity: dict[str, TierCapacity] | None = Field(None, description="Capacity per tier.")
    policy: ResolvedPolicy | None = Field(None, description="The policy the agents follow.")
    socket: str | None = Field(None, description="The agent socket path on nodes and in pods.")


class KVTierPolicyStatus(Model):
    observed_generation: int | None = Field(
        None, description="metadata.generation last propagated to pools."
    )
    pools: list[str] = Field(default_factory=list, description="Pools that reference this policy.")
    checksum: str | None = Field(None, description="sha256 (first 16 hex) of the spec.")


# --------------------------------------------------------------------------- resources


class ObjectMeta(Model):
    """The part of metadata the operator reads."""

    model_config = _LENIENT

    name: str
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class KVCachePool(Model):
    model_config = _LENIENT

    api_version: Literal["kvpool.io/v1alpha1"] = "kvpool.io/v1alpha1"
    kind: Literal["KVCachePool"] = "KVCachePool"
    metadata: ObjectMeta
    spec: KVCachePoolSpec


class KVTierPolicy(Model):
    model_config = _LENIENT

    api_version: Literal["kvpool.io/v1alpha1"] = "kvpool.io/v1alpha1"
    kind: Literal["KVTierPolicy"] = "KVTierPolicy"
    metadata: ObjectMeta
    spec: TierPolicy = Field(default_factory=TierPolicy)


_M = TypeVar("_M", bound=Model)

AGENT_OVERHEAD = 256 << 20
"""Memory the agent needs beside its arena and its lookup tables (Python, buffers, the
NVMe index), peers off."""
PEER_HEAP_PER_CHUNK = 64
"""The peer directory's heap per remote chunk: issue 29's bound (~41-46 B measured at
10^6, `tests/peers/test_directory.py` checks < 64), so a figure that holds."""
MIB = 1 << 20


def peer_table_bytes(remote_chunks: int) -> int:
    """The peer table's shared memory in a tenant space with `remote_chunks` entries: the
    agent's `lookupindex.PeerIndex` rebuilds it at the smallest power of two of slots at
    least twice its entries (within its minimum and maximum); pages past them are never
    touched, and those touched stay when entries go."""
    slots = PEER_MIN_SLOTS
    while slots < 2 * remote_chunks and slots < PEER_MAX_SLOTS:
        slots <<= 1
    return PEER_HEADER_BYTES + MAX_PEERS * PEER_STATE_BYTES + slots * PEER_SLOT_BYTES


def peer_overhead(spec: KVCachePoolSpec) -> int:
    """The agent's memory for the peer tier beside `AGENT_OVERHEAD` (0 with peers off): per
    tenant space, the directory's heap and, without an NVMe tier (where the agent mirrors
    the directory for clients' local LOOKUPs), the peer table; rounded up to a MiB."""
    if not spec.peers.enabled:
        return 0
    n = spec.peers.remote_chunks
    space = n * PEER_HEAP_PER_CHUNK
    if spec.tiers.nvme is None:
        space += peer_table_bytes(n)
    total = max(1, len(spec.tenants)) * space
    return -(-total // MIB) * MIB


def lookup_table_overhead(spec: KVCachePoolSpec) -> int:
    """The DRAM lookup tables' shared memory (charged to the agent's pod, as the arena
    is): each tenant space publishes its own, sized for its share of the arena (64 B a
    slot, up to 64 MiB a space); rounded up to a MiB."""
    dram = spec.tiers.effective_dram()
    nvme = spec.tiers.nvme.size if spec.tiers.nvme is not None else None
    spaces = [size for size, _ in tenant_sizes(spec.tenants, dram.size, nvme, dram.huge_pages)]
    total = sum(dram_table_bytes(size) for size in spaces or [dram.size])  # none: one space
    return -(-total // MIB) * MIB


def agent_overhead(spec: KVCachePoolSpec) -> int:
    """The memory the agent needs beside its arena: what the operator sizes it with."""
    return AGENT_OVERHEAD + lookup_table_overhead(spec) + peer_overhead(spec)


def memory_limit_problem(spec: KVCachePoolSpec) -> str | None:
    """Why the agent's memory limits cannot hold its arena, or None.

    The arena is shared memory (tmpfs), which counts against the pod's memory cgroup: a
    limit below arena + overhead gets the agent OOM-killed once the arena fills. With huge
    pages the arena counts against the hugepages-2Mi limit instead.
    """
    limits = (spec.agent.resources.limits if spec.agent.resources else None) or {}
    dram = spec.tiers.effective_dram()
    overhead = agent_overhead(spec)
    need = {"memory": overhead if dram.huge_pages else dram.size + overhead}
    if dram.huge_pages:
        need["hugepages-2Mi"] = dram.size
    for resource, minimum in need.items():
        value = limits.get(resource)
        if value is None:
            continue
        try:
            limit = parse_size(value)
        except ValueError as e:
            return f"spec.agent.resources.limits.{resource}: {e}"
        if limit < minimum:
            tables = f"the lookup tables' {format_size(lookup_table_overhead(spec))}"
            why = (
                f"{format_size(overhead)}: 256Mi, {tables} and the peer directory of "
                f"spec.peers.remoteChunks ({spec.peers.remote_chunks})"
                if spec.peers.enabled
                else f"{format_size(overhead)}: 256Mi and {tables}"
            )
            what = (
                f"the agent's overhead ({why})"
                if resource == "memory" and dram.huge_pages
                else "the DRAM arena (huge pages)"
                if resource != "memory"
                else f"the DRAM arena ({format_size(dram.size)}) plus the agent's overhead "
                f"({why}; the arena is shared memory, charged to the pod)"
            )
            return (
                f"spec.agent.resources.limits.{resource}: {value} is below {what}: "
                f"at least {format_size(minimum)} is needed"
            )
    return None


ALL_INTERFACES = ("*", "0.0.0.0", "::", "[::]")
"""Bind addresses that reach every interface of the agent pod, so its Service reaches it."""


def port_conflict(spec: KVCachePoolSpec) -> str | None:
    """Why the agent container's ports collide or are out of reach, or None: with events
    enabled, the PUB and replay ports must differ from the metrics port, and bind every
    interface of the agent pod; with peers enabled, the peer port must differ from the
    metrics port and from the events ports."""
    problem = _events_port_conflict(spec)
    if problem is not None or not spec.peers.enabled:
        return problem
    port = spec.peers.port
    taken = [("spec.agent.metricsPort", spec.agent.metrics_port)]
    if spec.events.enabled:
        taken.append(("spec.events.port", spec.events.port))
        if spec.events.replay_port is not None:
            taken.append(("spec.events.replayPort", spec.events.replay_port))
    for field, other in taken:
        if port == other:
            return f"spec.peers.port: {port} is also {field}; choose another port"
    return None


def _events_port_conflict(spec: KVCachePoolSpec) -> str | None:
    events = spec.events
    if not events.enabled:
        return None
    if events.address not in ALL_INTERFACES:
        return (
            f"spec.events.address: {events.address!r} would leave the events ports out of "
            "reach: routers connect to the agent pod's address, which is not known before the "
            "pod starts; use '*' (every interface of the agent pod)"
        )
    metrics = spec.agent.metrics_port
    for name, port in (("port", events.port), ("replayPort", events.replay_port)):
        if port == metrics:
            return (
                f"spec.events.{name}: {port} is the agent's metrics port "
                "(spec.agent.metricsPort); choose another port"
            )
    return None


def parse_pool(body: Any) -> KVCachePool:
    """A `KVCachePool` from its manifest; `InvalidSpec` names every bad field."""
    return _parse(KVCachePool, body)


def parse_policy(body: Any) -> KVTierPolicy:
    """A `KVTierPolicy` from its manifest; `InvalidSpec` names every bad field."""
    return _parse(KVTierPolicy, body)


def _parse(cls: type[_M], body: Any) -> _M:
    data = dict(body) if body is not None else {}
    data.pop("status", None)
    name = (data.get("metadata") or {}).get("name", "?")
    try:
        obj = cls.model_validate(data)
    except ValidationError as e:
        raise InvalidSpec(explain(e, f"{cls.__name__} {name}")) from e
    if isinstance(obj, KVCachePool):
        check_pool_id(obj.metadata.namespace, obj.metadata.name)
        if obj.spec.tiers.enabled() == []:
            raise InvalidSpec(f"KVCachePool {name}: spec.tiers: at least one tier is required")
        tiers = obj.spec.tiers
        dram = tiers.effective_dram()
        try:
            tenant_sizes(obj.spec.tenants, dram.size,
                         tiers.nvme.size if tiers.nvme is not None else None, dram.huge_pages)
        except ValueError as e:
            raise InvalidSpec(f"KVCachePool {name}: spec.tenants: {e}") from e
        problem = memory_limit_problem(obj.spec)
        if problem is not None:
            raise InvalidSpec(f"KVCachePool {name}: {problem}")
        problem = port_conflict(obj.spec)
        if problem is not None:
            raise PortConflict(f"KVCachePool {name}: {problem}")
        shared = obj.spec.tiers.shared
        if shared is not None and shared.credentials_secret and not shared.url.startswith("s3://"):
            raise InvalidSpec(
                f"KVCachePool {name}: spec.tiers.shared.credentialsSecret: "
                "only s3:// URLs take credentials"
            )
    return obj
