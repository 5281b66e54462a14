"""The agent's configuration: the contract between the operator and the agent.

The operator renders an `AgentConfig` into the pool's ConfigMap (`agent.yaml`)
and the `TierPolicy` of the pool's `KVTierPolicy` into `policy.yaml`; the agent
reads both. Field names are camelCase on the wire (YAML, CRDs), snake_case in
Python. Unknown fields are errors, and every error names its field.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from .constants import (
    DEFAULT_SOCKET,
    HUGE_PAGE_BYTES,
    NVME_IDENTITIES,
    NVME_STORES_RECORD,
    PAGE_BYTES,
    SOCKET_PATH_MAX,
    STATE_PEER_DELETES,
    STATE_STORES_RECORD,
)
from .constants import TIER_ORDER as TIER_ORDER
from .constants import TierName as TierName
from .units import ByteSize, Duration, human_size


class Model(BaseModel):
    """Base of every config model: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase, JSON-compatible form written to YAML and ConfigMaps."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --------------------------------------------------------------------------- policy


class EvictionOrder(StrEnum):
    """Which chunk a full tier gives up first."""

    LRU = "lru"
    """Least recently used."""
    LFU = "lfu"
    """Least frequently used, ties broken by recency."""
    PREFIX = "prefix"
    """Prefix-aware LRU: chunks deep in a prefix go before the chunks they extend."""
    S3FIFO = "s3fifo"
    """S3-FIFO: new chunks wait in a small probation queue; only those hit again stay long.
    Keeps a prompt's unique tail from pushing out the shared prefixes that are reused."""
    ADAPTIVE = "adaptive"
    """S3-FIFO whose probation size tunes itself from ghost hits (ARC-style): long on
    recency-driven workloads (chats), short on frequency-driven ones (shared prefixes)."""


class OnEvict(StrEnum):
    DEMOTE = "demote"
    """Move the evicted chunk to the next slower tier (if it admits it)."""
    DROP = "drop"
    """Forget the chunk in this tier."""


class AdmissionMode(StrEnum):
    ALWAYS = "always"
    """Admit every chunk offered to this tier."""
    MIN_HITS = "minHits"
    """Admit a chunk only after it was hit `minHits` times."""


class TierRules(Model):
    """How one tier fills, evicts and admits."""

    high_watermark: float = Field(
        0.98, gt=0, le=1, description="Fraction of capacity at which background eviction starts."
    )
    low_watermark: float = Field(
        0.95, ge=0, lt=1, description="Fraction of capacity background eviction frees down to."
    )
    eviction: EvictionOrder = Field(
        EvictionOrder.ADAPTIVE, description="Order in which chunks are evicted."
    )
    on_evict: OnEvict = Field(
        OnEvict.DEMOTE, description="What eviction does with a chunk: demote or drop."
    )
    ttl: Duration | None = Field(
        None, description="Chunks not read for this long expire (e.g. 1h, 7d); unset: never."
    )
    admission: AdmissionMode = Field(
        AdmissionMode.ALWAYS, description="Which chunks this tier accepts from the tier above."
    )
    min_hits: int = Field(
        2, ge=1, description="Hits a chunk needs before `admission: minHits` admits it."
    )
    write_through: bool = Field(
        False,
        description="Copy every committed chunk into this tier in the background, "
        "not only on demotion (the shared tier defaults to true).",
    )

    @model_validator(mode="after")
    def _low_below_high(self) -> Self:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"lowWatermark ({self.low_watermark}) must be below "
                f"highWatermark ({self.high_watermark})"
            )
        return self


def _shared_rules() -> TierRules:
    return TierRules(on_evict=OnEvict.DROP, write_through=True)


def _nvme_rules() -> TierRules:
    return TierRules()


class TierRulesByTier(Model):
    dram: TierRules = Field(default_factory=TierRules)
    nvme: TierRules = Field(default_factory=_nvme_rules)
    shared: TierRules = Field(default_factory=_shared_rules)

    def for_tier(self, tier: TierName) -> TierRules:
        rules: TierRules = getattr(self, tier)
        return rules


class Promotion(Model):
    enabled: bool = Field(True, description="Copy a chunk read from a slower tier into DRAM.")
    min_hits: int = Field(1, ge=1, description="Hits in the slower tier before it is promoted.")


class Prefetch(Model):
    enabled: bool = Field(
        True, description="On a hit below DRAM, load the prefix's next chunks too."
    )
    lookahead_chunks: int = Field(
        4, ge=0, le=1024, description="How many following chunks a prefetch loads."
    )


class TierQuota(Model):
    dram: ByteSize | None = Field(None, description="Most DRAM bytes the tenant may hold.")
    nvme: ByteSize | None = Field(None, description="Most NVMe bytes the tenant may hold.")
    shared: ByteSize | None = Field(None, description="Most shared-tier bytes the tenant may hold.")

    def for_tier(self, tier: TierName) -> int | None:
        value: int | None = getattr(self, tier)
        return value


class TenantPolicy(Model):
    name: str = Field(
        min_length=1, max_length=63, description="Tenant name, as in the fingerprint."
    )
    priority: int = Field(
        0, ge=-100, le=100, description="Higher keeps its chunks longer under pressure."
    )
    quota: TierQuota = Field(default_factory=TierQuota, description="Per-tier byte quotas.")


KEY_HEX_LEN = 32


class TierPolicy(Model):
    """Everything the policy engine reads; the spec of a `KVTierPolicy`."""

    tiers: TierRulesByTier = Field(default_factory=TierRulesByTier)
    promotion: Promotion = Field(default_factory=Promotion)
    prefetch: Prefetch = Field(default_factory=Prefetch)
    pins: list[str] = Field(
        default_factory=list,
        description="Chunk keys (32 hex digits) that are never evicted.",
    )
    tenants: list[TenantPolicy] = Field(default_factory=list)

    @field_validator("pins")
    @classmethod
    def _pins_are_keys(cls, pins: list[str]) -> list[str]:
        for i, pin in enumerate(pins):
            try:
                ok = len(pin) == KEY_HEX_LEN and bytes.fromhex(pin) is not None
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"pins[{i}] {pin!r} is not a chunk key of 32 hex digits")
        return [p.lower() for p in pins]

    @field_validator("tenants")
    @classmethod
    def _tenant_names_unique(cls, tenants: list[TenantPolicy]) -> list[TenantPolicy]:
        seen: set[str] = set()
        for t in tenants:
            if t.name in seen:
                raise ValueError(f"tenant {t.name!r} is listed twice")
            seen.add(t.name)
        return tenants

    def tenant(self, name: str) -> TenantPolicy | None:
        for t in self.tenants:
            if t.name == name:
                return t
        return None


# --------------------------------------------------------------------------- tiers


class DramTier(Model):
    size: ByteSize = Field(1 << 30, description="Arena size (G2 capacity).")
    path: Path | None = Field(
        None,
        description="Arena file on a tmpfs or hugetlbfs; default under /dev/shm, "
        "stable for a given pool and socket so a restart finds it.",
    )
    huge_pages: bool = Field(False, description="The arena path is on hugetlbfs.")
    lock: bool = Field(True, description="mlock the arena (needs IPC_LOCK); failure is reported.")
    journal_dir: Path | None = Field(
        None,
        description="Directory on a tmpfs for the arena's commit journal, lock file and "
        "record of shared stores, which live as long as the arena. Default: beside the "
        "arena; for an arena on hugetlbfs (which refuses write(2)) /dev/shm.",
    )


class NvmeTier(Model):
    path: Path = Field(description="Directory for chunk files (G3).")
    size: ByteSize = Field(description="Most bytes of chunk files kept in the directory.")


class SharedTier(Model):
    url: str = Field(description="s3://bucket/prefix or file:///mount/path (G4).")
    endpoint_url: str | None = Field(
        None, description="S3 endpoint; default from AWS_ENDPOINT_URL or AWS."
    )
    region: str | None = Field(None, description="S3 region; default from the AWS environment.")
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    credentials_file: Path | None = Field(
        None,
        description="File holding AWS credentials (a mounted Secret); default: the AWS chain.",
    )
    write_queue_depth: int = Field(1024, ge=1, description="Pending write-behind uploads kept.")
    write_concurrency: int = Field(4, ge=1, le=64, description="Uploads in flight at once.")
    lookup_budget: Duration = Field(
        0.05, description="Longest a LOOKUP waits on the store before it counts as a miss."
    )
    negative_cache_ttl: Duration = Field(
        2.0, description="How long a key known absent is not asked for again."
    )
    request_timeout: Duration = Field(5.0, description="Per-request timeout for the store.")
    multipart_threshold: ByteSize = Field(
        8 << 20, description="Chunks at least this large upload in parts."
    )

    @field_validator("url")
    @classmethod
    def _scheme(cls, url: str) -> str:
        if not (url.startswith("s3://") or url.startswith("file://")):
            raise ValueError(f"{url!r}: the shared tier URL must start with s3:// or file://")
        if url.startswith("s3://") and not url[5:].split("/", 1)[0]:
            raise ValueError(f"{url!r}: an s3:// URL needs a bucket name")
        if url.startswith("file://") and not url[7:].startswith("/"):
            raise ValueError(f"{url!r}: a file:// URL needs an absolute path (file:///...)")
        return url


class Tiers(Model):
    dram: DramTier = Field(default_factory=DramTier)
    nvme: NvmeTier | None = None
    shared: SharedTier | None = None

    def enabled(self) -> list[TierName]:
        return [t for t in TIER_ORDER if getattr(self, t) is not None]


# --------------------------------------------------------------------------- tenants

TENANT_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
TENANTS_DIR = "tenants"
"""Per-tenant sockets, arenas, NVMe files and shared objects live under `tenants/<name>/`."""


class TenantSpace(Model):
    """A tenant of the pool with a space of its own: socket, arena, NVMe files, shared prefix.

    A client's tenant is then the socket it connected to, not what it claims, and its
    keys only ever reach its own space: another tenant's keys are misses, and its arena
    (the file a client maps) holds no other tenant's bytes.
    """

    name: str = Field(
        min_length=1, max_length=63, pattern=TENANT_NAME_PATTERN,
        description="Tenant name: the pod annotation kvpool.io/tenant (default: the namespace).",
    )
    dram: ByteSize | None = Field(
        None, description="The tenant's arena per node; unset: an equal share of the DRAM "
        "the sized tenants leave.",
    )
    nvme: ByteSize | None = Field(
        None, description="The tenant's NVMe bytes per node; unset: an equal share of what "
        "the sized tenants leave.",
    )


def tenant_shares(total: int, sizes: list[int | None], page: int, tier: str) -> list[int]:
    """Each tenant's bytes of a tier of `total`: its own size, or an equal share of the rest.

    Shares are whole pages. Raises ValueError naming the tier when sizes overrun it or
    leave an unsized tenant nothing.
    """
    fixed = sum(s for s in sizes if s is not None)
    if fixed > total:
        raise ValueError(f"tenants ask for {human_size(fixed)} of {tier}, "
                         f"more than its {human_size(total)}")
    unsized = sum(1 for s in sizes if s is None)
    share = (total - fixed) // unsized // page * page if unsized else 0
    if unsized and share == 0:
        raise ValueError(f"tenants without a {tier} size get no {tier}: "
                         f"{human_size(total - fixed)} is left for {unsized} of them")
    return [s if s is not None else share for s in sizes]


def socket_path_too_long(path: Path) -> str:
    """Why `path` cannot be a Unix socket's path ("" when it can): over the kernel's limit."""
    n = len(os.fsencode(path.absolute()))
    if n <= SOCKET_PATH_MAX:
        return ""
    return f"{n} bytes long: a Unix socket path is at most {SOCKET_PATH_MAX} bytes"


def tenant_socket_path(socket_path: Path, tenant: str) -> Path:
    """Where the agent serves `tenant`: `<socket dir>/tenants/<tenant>/<socket name>`."""
    return socket_path.parent / TENANTS_DIR / tenant / socket_path.name


def tenant_url(url: str, tenant: str) -> str:
    """The tenant's prefix of a shared tier: `<url>/tenants/<tenant>`."""
    return f"{url.rstrip('/')}/{TENANTS_DIR}/{tenant}"


def tenant_sizes(tenants: list[TenantSpace], dram: int, nvme: int | None,
                 huge_pages: bool = False) -> list[tuple[int, int]]:
    """Each tenant's (DRAM, NVMe) bytes of tiers of `dram` and `nvme` bytes (NVMe 0 when
    there is no NVMe tier). Raises ValueError if names repeat or the sizes do not fit."""
    seen: set[str] = set()
    for t in tenants:
        if t.name in seen:
            raise ValueError(f"tenant {t.name!r} is listed twice")
        seen.add(t.name)
    page = HUGE_PAGE_BYTES if huge_pages else PAGE_BYTES
    dram_sizes = tenant_shares(dram, [t.dram for t in tenants], page, "dram")
    if nvme is None:
        if any(t.nvme is not None for t in tenants):
            raise ValueError("a tenant has an nvme size but the pool has no NVMe tier")
        return [(d, 0) for d in dram_sizes]
    nvme_sizes = tenant_shares(nvme, [t.nvme for t in tenants], 1, "nvme")
    return list(zip(dram_sizes, nvme_sizes, strict=True))


# --------------------------------------------------------------------------- agent


# --------------------------------------------------------------------------- KV events


class EventsPayload(StrEnum):
    """How each event is encoded inside a KVEventBatch (vLLM's format)."""

    MAP = "map"      # {"type": "BlockStored", ...}: vLLM >= #42892, llm-d, Dynamo
    ARRAY = "array"  # ["BlockStored", ...]: older vLLM, AIBrix, kthena


class EventsTopic(StrEnum):
    """Whose topic an event is published under; routers credit a pod, not a node."""

    POD = "pod"    # kv@<engine pod>@<model>, one copy per registered engine pod (fan-out)
    NODE = "node"  # kv@<node>@<pool>, once


class EventsMedium(Model):
    """The `medium` each tier is published as (router families name tiers differently)."""

    dram: str = Field("CPU_PINNED", min_length=1, description="Medium of G2 (host DRAM).")
    nvme: str = Field("DISK", min_length=1, description="Medium of G3 (local NVMe).")
    shared: str = Field("SHARED", min_length=1, description="Medium of G4 (shared store).")


class Events(Model):
    """KV events for KV-aware routers: ZMQ PUB in vLLM's format (see docs/events.md)."""

    enabled: bool = Field(False, description="Publish BlockStored/BlockRemoved events.")
    port: int = Field(5557, ge=1024, le=65535, description="TCP port of the ZMQ PUB socket.")
    replay_port: int | None = Field(
        5558, ge=1024, le=65535,
        description="TCP port of the ZMQ ROUTER replay socket; unset: no replay.",
    )
    replay_depth: int = Field(
        10000, ge=0, le=1_000_000, description="Batches kept for replay to late subscribers."
    )
    queue_depth: int = Field(
        65536, ge=1, le=1_000_000,
        description="Events queued for publishing; beyond it events are dropped (and counted), "
        "never waited for.",
    )
    address: str = Field(
        "*", min_length=1,
        description="Interface the PUB and replay sockets bind: `*` every one, or an address.",
    )
    payload: EventsPayload = Field(EventsPayload.MAP, description="Encoding of each event.")
    topic: EventsTopic = Field(EventsTopic.POD, description="Topic mode.")
    medium: EventsMedium = Field(default_factory=EventsMedium)

    @model_validator(mode="after")
    def _distinct_ports(self) -> Self:
        if self.replay_port is not None and self.replay_port == self.port:
            raise ValueError(f"replayPort {self.replay_port} is the same as port")
        return self



# --------------------------------------------------------------------------- peers

PEER_PORT = 9410
"""The TCP port agents serve chunks to each other on, unless the config says another."""
PEER_TIMEOUT = 0.25
"""Seconds a read from a peer may take, unless the config (a pool's spec) says otherwise."""
PEER_SECRET_GRACE = 300.0
"""`peers.secretGrace`'s default: a few times the minute or two the kubelets of a cluster take
to update a Secret's files on every node."""


def parse_host_port(text: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` as (host, port); ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port)


_ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_env(text: str, env: Mapping[str, str]) -> str:
    """`$(NAME)` replaced by `env[NAME]`, as Kubernetes expands a container's args; a name
    `env` lacks stays as written. (The operator writes `advertise: $(POD_IP)` into a
    ConfigMap every agent of the pool shares: each agent expands it from its own pod.)"""
    return _ENV_REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), text)


class PeerTls(Model):
    """TLS between the agents of a pool (off unless set): each side shows a certificate
    signed by the pool's CA and checks the other's."""

    cert_file: Path = Field(description="This agent's certificate (PEM).")
    key_file: Path = Field(description="Its private key (PEM).")
    ca_file: Path = Field(description="The CA that signs every agent of the pool (PEM).")


class Peers(Model):
    """The peer tier: agents of a pool read each other's chunks over TCP (docs/cross-node.md)."""

    enabled: bool = Field(False, description="Serve this agent's chunks to the pool's other "
                          "agents and read theirs.")
    port: int = Field(PEER_PORT, ge=1024, le=65535,
                      description="TCP port this agent serves chunks on.")
    address: str = Field("*", min_length=1,
                         description="Interface to bind: `*` every one, or an address.")
    advertise: str | None = Field(
        None, min_length=1,
        description="Address the other agents reach this one at (the pod IP); `$(NAME)` is "
        "expanded from the agent's environment (the operator writes `$(POD_IP)`). Unset: "
        "the agent finds itself by its id when a peer address is its own.",
    )
    secret_file: Path | None = Field(
        None, description="File holding the pool's shared secret, which both sides of a peer "
        "connection prove before any chunk moves (required when enabled).",
    )
    secret_grace: Duration = Field(
        PEER_SECRET_GRACE, description="After the secret file changes (a rotated pool secret), "
        "how long the previous secret is still accepted from the agents this one connects "
        "to (the kubelets of different nodes update the file up to minutes apart); then "
        "connections proven with it end.",
    )
    discovery: str | None = Field(
        None, min_length=1,
        description="DNS name resolving to every agent of the pool (a headless Service), "
        "re-resolved periodically.",
    )
    addresses: list[str] = Field(
        default_factory=list, description="Static peers as host:port (tests, bare metal)."
    )
    timeout: Duration = Field(
        PEER_TIMEOUT, description="Longest a peer read may take before the read falls back to the "
        "shared tier (then a miss).",
    )
    connections: int = Field(4, ge=1, le=64, description="Connections kept per peer.")
    tls: PeerTls | None = Field(None, description="TLS between agents; unset: plain TCP.")
    handoff_ttl: Duration = Field(
        60.0, gt=0, description="How long a chunk pushed here (a put hinted with this node) "
        "stays pinned unread; then it is an ordinary chunk, evictable.",
    )
    handoff_share: float = Field(
        0.25, gt=0, le=1, description="Most of each space's arena that chunks pushed here and "
        "not read yet may pin; a push past it is refused (the sender's put is not).",
    )
    delete_holdoff: Duration = Field(
        10.0, ge=0, description="After a DELETE, how long other nodes' announcements of the "
        "key are held off (one may be of a copy its holder has not deleted yet); one not "
        "withdrawn meanwhile is listed when it ends. The deleting node's own are not held off.",
    )
    max_entries: int | None = Field(
        None, ge=0, description="Most remote chunks each tenant space's peer directory lists "
        "(its memory: ~41-64 bytes of heap each); a key announced past it is not listed "
        "(a LOOKUP of it goes on to the shared tier), and counted. Unset: no limit. The "
        "operator sets it to the pool's spec.peers.remoteChunks, which the agent's memory "
        "limit is sized for.",
    )

    @field_validator("addresses")
    @classmethod
    def _addresses_are_host_port(cls, addresses: list[str]) -> list[str]:
        for i, a in enumerate(addresses):
            try:
                parse_host_port(a)
            except ValueError as e:
                raise ValueError(f"addresses[{i}]: {e}") from None
        return addresses

    @model_validator(mode="after")
    def _secret_when_enabled(self) -> Self:
        if self.enabled and self.secret_file is None:
            raise ValueError("secretFile is required when peers are enabled: a peer "
                             "connection is only ever made between holders of the pool's secret")
        return self


class AgentConfig(Model):
    """One agent process: one pool on one node."""

    pool: str = Field(
        "default", min_length=1, max_length=253, description="Pool name (namespace.name)."
    )
    socket_path: Path = Field(
        Path(DEFAULT_SOCKET), description="Unix socket clients connect to."
    )
    metrics_addr: str = Field(
        "127.0.0.1:9400", description="host:port for /metrics, /healthz and /readyz."
    )
    max_chunk_bytes: ByteSize = Field(64 << 20, description="Largest chunk a client may store.")
    max_meta_bytes: int = Field(
        4096, ge=0, le=65536, description="Largest per-chunk metadata blob (shapes, dtypes)."
    )
    write_lease_timeout: Duration = Field(
        30.0, description="An ALLOC not committed for this long is aborted."
    )
    frame_timeout: Duration = Field(
        10.0, description="A client that sends nothing for this long inside a frame it has "
        "started (a stalled or half-dead writer) is disconnected, its leases ended.",
    )
    send_timeout: Duration = Field(
        10.0, description="A client that reads none of its replies for this long (its socket "
        "full) is disconnected, its leases ended.",
    )
    tiers: Tiers = Field(default_factory=Tiers)
    policy: TierPolicy = Field(default_factory=TierPolicy)
    policy_file: Path | None = Field(
        None, description="YAML TierPolicy watched and reloaded in place; overrides `policy`."
    )
    state_dir: Path | None = Field(
        None,
        description="Directory, on disk, for what the agent must remember across a reboot "
        "of the node (the arena's tmpfs forgets) or a restart: a copy of the record of the "
        "`file://` shared stores it has used, and the peer DELETEs waiting for their peers. "
        "Made if missing; one agent's own. Unset: none (those DELETEs wait in memory only).",
    )
    node_name: str | None = Field(None, description="Kubernetes node (for labels and logs).")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tenants: list[TenantSpace] = Field(
        default_factory=list,
        description="Tenants with a space of their own; unset: one space for the whole pool, "
        "where the tenant a client names is used for quotas and priorities only.",
    )
    events: Events = Field(default_factory=Events, description="KV events for routers.")
    peers: Peers = Field(default_factory=Peers,
                         description="The peer tier: chunks read from the pool's other agents.")

    @model_validator(mode="after")
    def _tenants_fit(self) -> Self:
        self.tenant_sizes()
        return self

    def socket_problem(self) -> str:
        """Why a socket of this agent (the pool's, or a tenant's, which is longer) cannot be
        made: "" when every one can. Checked by `kvpool agent` and `kvpool cleanup` before
        they touch anything, and by the operator before it admits a pool."""
        if too_long := socket_path_too_long(self.socket_path):
            return too_long
        for tenant in self.tenants:
            path = tenant_socket_path(self.socket_path, tenant.name)
            if too_long := socket_path_too_long(path):
                return f"tenant {tenant.name}'s socket {path} is {too_long}"
        return ""

    def tenant_sizes(self) -> list[tuple[int, int]]:
        """Each tenant's (DRAM, NVMe) bytes on this node; see `tenant_sizes`."""
        nvme = self.tiers.nvme.size if self.tiers.nvme is not None else None
        return tenant_sizes(self.tenants, self.tiers.dram.size, nvme, self.tiers.dram.huge_pages)

    @field_validator("metrics_addr")
    @classmethod
    def _host_port(cls, addr: str) -> str:
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"{addr!r} is not host:port")
        return addr

    def arena_path(self) -> Path:
        """The arena file: explicit, or stable for this pool and socket under /dev/shm."""
        if self.tiers.dram.path is not None:
            return self.tiers.dram.path
        digest = hashlib.sha256(str(self.socket_path.absolute()).encode()).hexdigest()[:12]
        safe_pool = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.pool)
        return Path("/dev/shm") / f"kvpool-{safe_pool}-{digest}.arena"

    def _with_arena(self, suffix: str) -> Path:
        """A file that lives as long as the arena: beside it on its tmpfs, or in
        `journalDir`. hugetlbfs takes no write(2), so beside an arena there the files go to
        /dev/shm (the same lifetime: the node's), named after the arena's path."""
        arena = self.arena_path()
        dram = self.tiers.dram
        if dram.journal_dir is not None:
            return dram.journal_dir / arena.with_suffix(suffix).name
        if dram.huge_pages:
            digest = hashlib.sha256(str(arena.absolute()).encode()).hexdigest()[:12]
            return Path("/dev/shm") / f"kvpool-{arena.stem}-{digest}{suffix}"
        return arena.with_suffix(suffix)

    def journal_path(self) -> Path:
        """The DRAM commit journal (`_with_arena`)."""
        return self._with_arena(".journal")

    def lock_path(self) -> Path:
        """The lock file of the arena and its journal (`claim`; `_with_arena`)."""
        return self._with_arena(".lock")

    def stores_path(self) -> Path:
        """The record of the `file://` shared stores this agent has used (`seenstores`),
        with the journal (`_with_arena`)."""
        return self._with_arena(".stores")

    def identities_path(self) -> Path:
        """The identities the engines gave the chunks, for KV events after a restart
        (`events.remembered`): in the NVMe directory, where chunk files outlive a reboot of
        the node; without NVMe with the journal (`_with_arena`), as long-lived as DRAM's."""
        if self.tiers.nvme is not None:
            return self.tiers.nvme.path / NVME_IDENTITIES
        return self._with_arena(".identities")

    def stores_paths(self) -> list[Path]:
        """`stores_path`, and a copy of the record in the NVMe directory and in the state
        directory, where the agent has them: on disk, they outlive a reboot of the node,
        which empties the arena's tmpfs."""
        paths = [self.stores_path()]
        if self.tiers.nvme is not None:
            paths.append(self.tiers.nvme.path / NVME_STORES_RECORD)
        if self.state_dir is not None:
            paths.append(self.state_dir / STATE_STORES_RECORD)
        return paths

    def peer_deletes_path(self) -> Path | None:
        """The peer DELETEs waiting for their peers (`peers.deletelog`), in the state
        directory, on disk; None without one: they wait in the agent's memory only."""
        return None if self.state_dir is None else self.state_dir / STATE_PEER_DELETES

    def spaces(self) -> list[tuple[str, AgentConfig]]:
        """(tenant, config) of every space the agent serves: one per tenant, or the pool's.

        A tenant's config is the pool's with its own socket, arena, journal directory, NVMe
        directory, shared prefix and state directory (each under `tenants/<name>/`) and its
        share of the local tiers.
        """
        if not self.tenants:
            return [("", self)]
        dram = self.tiers.dram
        out = []
        for tenant, (dram_size, nvme_size) in zip(self.tenants, self.tenant_sizes(),
                                                  strict=True):
            name = tenant.name
            cfg = self.model_copy(deep=True)
            cfg.tenants = []
            cfg.socket_path = tenant_socket_path(self.socket_path, name)
            cfg.tiers.dram.size = dram_size
            if dram.path is not None:
                cfg.tiers.dram.path = dram.path.parent / TENANTS_DIR / name / dram.path.name
            # else: the default arena is named after the socket path, the tenant's own
            if dram.journal_dir is not None:
                cfg.tiers.dram.journal_dir = dram.journal_dir / TENANTS_DIR / name
            if cfg.tiers.nvme is not None:
                cfg.tiers.nvme.path = cfg.tiers.nvme.path / TENANTS_DIR / name
                cfg.tiers.nvme.size = nvme_size
            if cfg.tiers.shared is not None:
                cfg.tiers.shared.url = tenant_url(cfg.tiers.shared.url, name)
            if self.state_dir is not None:
                cfg.state_dir = self.state_dir / TENANTS_DIR / name
            out.append((name, cfg))
        return out


class ConfigError(ValueError):
    """A config or policy file is invalid; the message names every bad field."""


def explain(err: ValidationError, source: str) -> str:
    """One line per problem, each naming the field by its wire (camelCase) path."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{source}: {where}: {msg}")
    return "\n".join(lines)


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    except UnicodeDecodeError as e:  # binary garbage: callers (the policy reload) catch ConfigError
        raise ConfigError(f"{path}: not valid UTF-8 text: {e.reason} at byte {e.start}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e


def load_agent_config(path: Path) -> AgentConfig:
    try:
        cfg = AgentConfig.model_validate(_load_yaml(path))
    except ValidationError as e:
        raise ConfigError(explain(e, str(path))) from e
    if cfg.policy_file is not None and not cfg.policy_file.is_absolute():
        # Absolute without following symlinks: in a mounted ConfigMap the file is a symlink
        # through `..data`, which an update re-points; resolving would pin the agent to the
        # old timestamped directory, and it would never see a change.
        cfg.policy_file = Path(os.path.abspath(path.parent / cfg.policy_file))
    return cfg


def load_policy(path: Path) -> TierPolicy:
    try:
        return TierPolicy.model_validate(_load_yaml(path))
    except ValidationError as e:
        raise ConfigError(explain(e, str(path))) from e
