"""The pure rendering of a pool (and its policy) into Kubernetes manifests.

`render(pool, policy, settings)` is all the operator decides; the kopf handlers
only apply its output. It is deterministic (golden-tested) and every object it
returns is a valid Kubernetes object (tested with `kubernetes-validate`).

Layout on a node, for pool `<ns>/<name>`:

| what | on the node | in the agent container |
|---|---|---|
| socket | `<socketDir>/<ns>.<name>/agent.sock` | same path |
| DRAM arena | `/dev/shm/kvpool/<ns>.<name>/` (or `/dev/hugepages/...`) | `/var/lib/kvpool/dram/` |
| its journal, on huge pages | `/dev/shm/kvpool/<ns>.<name>/` | `/var/lib/kvpool/journal/` |
| NVMe chunks | `<nvme.hostPath>/<ns>.<name>/` | `/var/lib/kvpool/nvme/` |
| agent state | `<stateHostPath>/<ns>.<name>/` | `/var/lib/kvpool/state/` |
| config | ConfigMap `kvpool-<name>` | `/etc/kvpool/` |
| peer secret, TLS | Secrets `kvpool-<name>-peers`, `spec.peers.tls` | `/etc/kvpool-peers/` |

The arena lives on the host's tmpfs, so an agent restart or rolling upgrade
keeps the DRAM tier warm. The state directory is on the node's disk: what the
agent must remember across a reboot of the node (`stateDir`), which empties
the tmpfs. A deleted pool's state and NVMe directories are removed on every node
by its reclaim DaemonSet (`render_reclaim_daemon_set`, `spec.nodeReclaimPolicy`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpool.agent import __version__ as _agent_version
from kvpool.agent.config import (
    PEER_SECRET_GRACE,
    PEER_TIMEOUT,
    AgentConfig,
    DramTier,
    NvmeTier,
    Peers,
    PeerTls,
    SharedTier,
    TierPolicy,
    Tiers,
    tenant_socket_path,
)
from kvpool.agent.constants import AGENT_JOB, ENV_NODE_NAME, ENV_POD_NAMESPACE
from kvpool.agent.units import format_size

from . import api
from .operator_policy import OperatorPolicy
from .operator_policy import check as check_operator_policy

Manifest = dict[str, Any]

CONFIG_DIR = "/etc/kvpool"
AGENT_CONFIG_KEY = "agent.yaml"
POLICY_KEY = "policy.yaml"
DRAM_MOUNT = "/var/lib/kvpool/dram"
JOURNAL_MOUNT = "/var/lib/kvpool/journal"
"""Where an arena on huge pages keeps its journal, lock file and store record: hugetlbfs
takes no write(2), so they are on the host's tmpfs (`_journal_host_dir`)."""
NVME_MOUNT = "/var/lib/kvpool/nvme"
STATE_MOUNT = "/var/lib/kvpool/state"
RECLAIM_MOUNT = "/var/lib/kvpool/reclaim"
"""Where the reclaim DaemonSet mounts the parents of a deleted pool's directories."""
PEERS_MOUNT = "/etc/kvpool-peers"
"""The pool's peer secret (and TLS files) in the agent: beside the config, not below it, as
the ConfigMap's volume is read-only and a mount point cannot be made inside it."""
PEER_SECRET_KEY = "secret"
"""The key of the pool's peer Secret holding the shared secret (random, made by the
operator once: `handlers`), and its file name in `PEERS_MOUNT`."""
PEER_SECRET_BYTES = 32
"""Random bytes of a pool's peer secret, kept as hex digits (text: the agent strips
whitespace around the secret it reads, which raw bytes could end with)."""
PEER_TLS_KEYS = ("tls.crt", "tls.key", "ca.crt")
"""Keys the Secret named by `spec.peers.tls.secretName` must hold."""
POD_IP_ENV = "POD_IP"
"""The agent pod's address (downward API), which it advertises to its peers."""
CONFIG_CHECKSUM_ANNOTATION = "kvpool.io/config-checksum"
POOL_LABEL = "kvpool.io/pool"
POOL_NAMESPACE_LABEL = "kvpool.io/pool-namespace"
MANAGED_BY = "kvpool-operator"
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
SECRET_KEYS = (ACCESS_KEY_ENV, SECRET_KEY_ENV)
"""Keys the pool's credentialsSecret must hold."""


def package_version() -> str:
    try:
        return importlib.metadata.version("kvpool")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a tree
        return _agent_version


def default_agent_image() -> str:
    return f"ghcr.io/kvpool/kvpool:{package_version()}"


@dataclass(frozen=True)
class Settings:
    """What the operator adds to every render (from its flags)."""

    agent_image: str = ""
    """Agent image when a pool does not name one; empty: `default_agent_image()`."""
    version: str = ""
    """Value of the `app.kubernetes.io/version` label; empty: the package version."""
    pod_monitor: bool = False
    """Render a PodMonitor per pool (needs the Prometheus Operator CRDs)."""
    policy: OperatorPolicy = field(default_factory=OperatorPolicy)
    """What pools may ask of the nodes (images, root, host paths, tolerations)."""

    def image(self) -> str:
        return self.agent_image or default_agent_image()

    def app_version(self) -> str:
        return self.version or package_version()


# --------------------------------------------------------------------------- names


def dns_name(*parts: str, limit: int = 63) -> str:
    """`-`-joined parts, shortened with a hash suffix when longer than `limit`."""
    name = "-".join(p for p in parts if p)
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-.')}-{digest}"


def dns_label(*parts: str, limit: int = 63) -> str:
    """A DNS-1035 label (what a Service name must be: no dots) from `parts`.

    A pool name may be a DNS subdomain (`cache.v1`); its dots become `-`, and then a hash
    of the original name is appended, so `cache.v1` and `cache-v1` never share a name.
    """
    name = "-".join(p for p in parts if p)
    if "." not in name:
        return dns_name(name, limit=limit)
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name.replace('.', '-')[: limit - 9].rstrip('-')}-{digest}"


def pool_hash(namespace: str, pool: str) -> str:
    """A short hash of (namespace, pool): what makes a cluster-scoped name unique per pool."""
    return hashlib.sha256(f"{namespace}/{pool}".encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Names:
    """Names of everything rendered for one pool."""

    namespace: str
    pool: str

    @property
    def pool_id(self) -> str:
        return api.pool_id(self.namespace, self.pool)

    @property
    def agent(self) -> str:
        """ConfigMap, DaemonSet, ServiceAccount and PodMonitor."""
        return dns_name("kvpool", self.pool)

    @property
    def service(self) -> str:
        """The metrics Service: a DNS-1035 label (no dots, at most 63 characters)."""
        return dns_label("kvpool", self.pool, "metrics")

    @property
    def events_service(self) -> str:
        """The headless Service listing every agent's KV-events endpoints (DNS-1035)."""
        return dns_label("kvpool", self.pool, "events")

    @property
    def peers(self) -> str:
        """The peer Secret, headless Service and NetworkPolicy (one DNS-1035 name for all)."""
        return dns_label("kvpool", self.pool, "peers")

    @property
    def cluster_role(self) -> str:
        """ClusterRole and ClusterRoleBinding. Cluster-scoped: the namespace is in the name,
        and a hash of (namespace, pool), since `-` joins are ambiguous (pool `b-x` in
        namespace `team` and pool `x` in namespace `team-b`)."""
        return dns_name(
            "kvpool-agent", self.namespace, self.pool, pool_hash(self.namespace, self.pool),
            limit=253,
        )

    @property
    def reclaim(self) -> str:
        """The DaemonSet that removes a deleted pool's directories on its nodes."""
        return dns_name("kvpool", self.pool, "reclaim")

    def gc_job(self, uid: str | None) -> str:
        """The garbage-collection Job of one incarnation of the pool (uid: a re-created pool
        of the same name never mistakes an old Job for its own)."""
        return dns_name("kvpool", self.pool, "gc", (uid or "")[:8])


def socket_dir(pool: api.KVCachePool) -> str:
    """The pool's socket directory, on the node and in every container that mounts it."""
    m = pool.metadata
    return f"{pool.spec.socket_dir.rstrip('/')}/{api.pool_id(m.namespace, m.name)}"


def socket_path(pool: api.KVCachePool) -> str:
    return f"{socket_dir(pool)}/agent.sock"


def tenant_socket_dir(pool: api.KVCachePool, tenant: str) -> str:
    """The directory of a tenant's socket on the node; its pods mount it at `socket_dir`."""
    return str(tenant_socket_path(Path(socket_path(pool)), tenant).parent)


def checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- metadata


def selector_labels(pool: api.KVCachePool) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvpool",
        "app.kubernetes.io/instance": pool.metadata.name,
        "app.kubernetes.io/component": "agent",
    }


def pod_labels(pool: api.KVCachePool) -> dict[str, str]:
    """Labels of the agent pods: no operator version, so that upgrading the operator alone
    changes no pod template and restarts no agent."""
    return {
        **selector_labels(pool),
        "app.kubernetes.io/part-of": "kvpool",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        POOL_LABEL: pool.metadata.name,
    }


def labels(pool: api.KVCachePool, settings: Settings) -> dict[str, str]:
    """Labels of the objects themselves: the pod labels and the operator's version."""
    return {**pod_labels(pool), "app.kubernetes.io/version": settings.app_version()}


def cluster_labels(pool: api.KVCachePool, settings: Settings) -> dict[str, str]:
    """Labels of cluster-scoped objects, which cannot have an owner in a namespace."""
    return {**labels(pool, settings), POOL_NAMESPACE_LABEL: pool.metadata.namespace}


def cluster_selector(namespace: str, pool: str) -> dict[str, str]:
    """The labels that select exactly one pool's cluster-scoped objects."""
    return {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        POOL_NAMESPACE_LABEL: namespace,
        POOL_LABEL: pool,
    }


def owner_references(pool: api.KVCachePool) -> list[Manifest]:
    if not pool.metadata.uid:
        return []
    return [
        {
            "apiVersion": api.API_VERSION,
            "kind": api.POOL_KIND,
            "name": pool.metadata.name,
            "uid": pool.metadata.uid,
            "controller": True,
        }
    ]


def _meta(pool: api.KVCachePool, settings: Settings, name: str) -> Manifest:
    meta: Manifest = {
        "name": name,
        "namespace": pool.metadata.namespace,
        "labels": labels(pool, settings),
    }
    owners = owner_references(pool)
    if owners:
        meta["ownerReferences"] = owners
    return meta


# --------------------------------------------------------------------------- config


def _dram(pool: api.KVCachePool) -> api.DramSpec:
    return pool.spec.tiers.effective_dram()


def _tmpfs_host_dir(pool: api.KVCachePool) -> str:
    """The pool's directory on the host's tmpfs."""
    return f"/dev/shm/kvpool/{api.pool_id(pool.metadata.namespace, pool.metadata.name)}"


def _dram_host_dir(pool: api.KVCachePool) -> str:
    if _dram(pool).huge_pages:
        return f"/dev/hugepages/kvpool/{api.pool_id(pool.metadata.namespace, pool.metadata.name)}"
    return _tmpfs_host_dir(pool)


def _journal_host_dir(pool: api.KVCachePool) -> str | None:
    """The host's tmpfs directory for the journal of an arena on huge pages (None: the
    journal is beside the arena, on the same tmpfs). The same lifetime as the arena."""
    return _tmpfs_host_dir(pool) if _dram(pool).huge_pages else None


def _shared_file_path(shared: api.SharedSpec | None) -> str | None:
    if shared is not None and shared.url.startswith("file://"):
        return shared.url[len("file://") :].rstrip("/") or "/"
    return None


def peers_config(pool: api.KVCachePool) -> Peers:
    """The agents' `peers` section: their port, the pod address they advertise (expanded
    from the pod's env by the agent), the pool's secret and TLS files as mounted, and the
    headless Service whose DNS name lists every agent of the pool."""
    spec = pool.spec.peers
    names = Names(pool.metadata.namespace, pool.metadata.name)
    mount = Path(PEERS_MOUNT)
    return Peers(
        enabled=True,
        port=spec.port,
        advertise=f"$({POD_IP_ENV})",
        secret_file=mount / PEER_SECRET_KEY,
        discovery=f"{names.peers}.{names.namespace}.svc",
        max_entries=spec.remote_chunks,  # what the agent's memory is sized for
        # Only a timeout the pool changes: the agents' default is the pool's, and a config
        # that names it anyway would roll every pool's agents at the operator's upgrade.
        **({"timeout": spec.timeout} if spec.timeout != PEER_TIMEOUT else {}),
        **({"secret_grace": spec.secret_grace}
           if spec.secret_grace != PEER_SECRET_GRACE else {}),
        **(
            {"tls": PeerTls(cert_file=mount / "tls.crt", key_file=mount / "tls.key",
                            ca_file=mount / "ca.crt")}
            if spec.tls is not None
            else {}
        ),
    )


def agent_config(pool: api.KVCachePool) -> AgentConfig:
    """The `AgentConfig` every agent of the pool runs with (`agent.yaml`)."""
    spec = pool.spec
    dram = _dram(pool)
    nvme = spec.tiers.nvme
    shared = spec.tiers.shared
    tiers: dict[str, Any] = {
        "dram": DramTier(
            size=dram.size,
            path=Path(DRAM_MOUNT) / "arena",
            huge_pages=dram.huge_pages,
            lock=dram.locked,
            **({"journal_dir": Path(JOURNAL_MOUNT)} if dram.huge_pages else {}),
        )
    }
    if nvme is not None:
        tiers["nvme"] = NvmeTier(path=Path(NVME_MOUNT), size=nvme.size)
    if shared is not None:
        options: dict[str, Any] = {"addressing_style": shared.addressing_style}
        if shared.endpoint_url:
            options["endpoint_url"] = shared.endpoint_url
        if shared.region:
            options["region"] = shared.region
        tiers["shared"] = SharedTier(url=shared.url, **options)
    cfg = AgentConfig(
        pool=api.pool_id(pool.metadata.namespace, pool.metadata.name),
        socket_path=Path(socket_path(pool)),
        metrics_addr=f"0.0.0.0:{spec.agent.metrics_port}",
        tiers=Tiers(**tiers),
        policy_file=Path(CONFIG_DIR) / POLICY_KEY,
        state_dir=Path(STATE_MOUNT),
        log_level=spec.agent.log_level.value,
        tenants=spec.tenants,
        # Only when enabled: a disabled section means nothing to the agent, and every
        # other pool's agent.yaml (and its config checksum, so its pods) stays as it was.
        **({"events": spec.events} if spec.events.enabled else {}),
        **({"peers": peers_config(pool)} if spec.peers.enabled else {}),
    )
    # The agent would refuse to start on every node (a socket path past `sun_path`): say so
    # at admission, naming the fields that make the path, not in a crash-looping DaemonSet.
    if problem := cfg.socket_problem():
        raise api.InvalidSpec(
            f"KVCachePool {pool.metadata.name}: spec.socketDir, the pool's name and its tenants' "
            f"names make a socket path too long: {problem}"
        )
    return cfg


EVENTS_PORT_NAME = "kv-events"
"""Container and Service port name of the agent's ZMQ PUB socket."""
REPLAY_PORT_NAME = "kv-replay"
"""Container and Service port name of the agent's ZMQ ROUTER replay socket."""


PEERS_PORT_NAME = "kv-peers"
"""Container and Service port name of the agent's peer port."""


def events_ports(pool: api.KVCachePool) -> list[tuple[str, int]]:
    """(name, port) of the KV-events sockets the pool's agents listen on; none when off."""
    events = pool.spec.events
    if not events.enabled:
        return []
    ports = [(EVENTS_PORT_NAME, events.port)]
    if events.replay_port is not None:
        ports.append((REPLAY_PORT_NAME, events.replay_port))
    return ports


def _yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=100)


def agent_yaml(pool: api.KVCachePool) -> str:
    cfg = agent_config(pool)
    return _yaml(cfg.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_unset=True))


def policy_yaml(policy: TierPolicy) -> str:
    return _yaml(policy.to_wire())


# --------------------------------------------------------------------------- objects


def _config_map(pool: api.KVCachePool, policy: TierPolicy, settings: Settings) -> Manifest:
    names = Names(pool.metadata.namespace, pool.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(pool, settings, names.agent),
        "data": {AGENT_CONFIG_KEY: agent_yaml(pool), POLICY_KEY: policy_yaml(policy)},
    }


def credential_env(pool: api.KVCachePool) -> list[Manifest]:
    """S3 credentials from the pool's Secret, as env (never in the ConfigMap)."""
    shared = pool.spec.tiers.shared
    if shared is None or not shared.credentials_secret:
        return []
    return [
        {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": shared.credentials_secret, "key": key}},
        }
        for key in SECRET_KEYS
    ]


def _resources(pool: api.KVCachePool) -> Manifest:
    res = pool.spec.agent.resources
    if res is not None:
        out: Manifest = {}
        if res.requests:
            out["requests"] = dict(res.requests)
        if res.limits:
            out["limits"] = dict(res.limits)
        return out
    dram = _dram(pool)
    extra = api.agent_overhead(pool.spec)  # with peers on, their directories too
    if dram.huge_pages:
        overhead = format_size(extra)
        huge = format_size(dram.size)
        return {
            "requests": {"cpu": "100m", "memory": overhead, "hugepages-2Mi": huge},
            "limits": {"memory": overhead, "hugepages-2Mi": huge},
        }
    memory = format_size(dram.size + extra)
    return {"requests": {"cpu": "100m", "memory": memory}, "limits": {"memory": memory}}


def _security(pool: api.KVCachePool) -> tuple[Manifest, Manifest]:
    """(pod securityContext, container securityContext) of the agent.

    Not root (unless `spec.agent.runAsUser` is 0), no privilege escalation, a read-only
    root filesystem, every capability dropped but `IPC_LOCK` for a locked arena. For a
    non-root UID the runtime keeps `IPC_LOCK` in the bounding set only (Kubernetes has no
    ambient capabilities): mlock then works up to the node's memlock limit, and the agent
    reports an arena it could not lock (docs/operator.md, "Security").
    """
    uid = pool.spec.agent.run_as_user
    pod: Manifest = {
        "runAsUser": uid,
        "runAsGroup": uid,
        "runAsNonRoot": uid != 0,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    caps: Manifest = {"drop": ["ALL"]}
    if _dram(pool).locked:
        caps["add"] = ["IPC_LOCK"]
    container: Manifest = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": caps,
    }
    return pod, container


HOST_DIRS_CAPABILITIES = ["CHOWN", "DAC_READ_SEARCH"]
"""What the init container that hands the host directories to the agent needs: change
owners, and walk directories another UID left behind. Nothing else."""


def _host_dirs_container(
    pool: api.KVCachePool, image: str, mounts: list[Manifest]
) -> Manifest | None:
    """The init container giving the agent's writable host directories to its UID.

    kubelet creates hostPath directories owned by root and `fsGroup` does not apply to
    them; a root agent needs no such step.
    """
    uid = pool.spec.agent.run_as_user
    if uid == 0:
        return None
    return {
        "name": "host-dirs",
        "image": image,
        "imagePullPolicy": pool.spec.agent.image_pull_policy,
        "command": [
            "python3",
            "-m",
            "kvpool.operator.hostdirs",
            f"--owner={uid}:{uid}",
            *(m["mountPath"] for m in mounts),
        ],
        "env": [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": {
            "runAsUser": 0,
            "runAsGroup": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": list(HOST_DIRS_CAPABILITIES)},
        },
        "volumeMounts": mounts,
    }


def _host_dir(name: str, path: str, kind: str = "DirectoryOrCreate") -> Manifest:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


def _scheduling(pool: api.KVCachePool) -> Manifest:
    out: Manifest = {}
    if pool.spec.node_selector:
        out["nodeSelector"] = dict(pool.spec.node_selector)
    if pool.spec.tolerations:
        out["tolerations"] = [t.to_wire() for t in pool.spec.tolerations]
    return out


def _daemon_set(pool: api.KVCachePool, settings: Settings, config_sum: str) -> Manifest:
    names = Names(pool.metadata.namespace, pool.metadata.name)
    spec = pool.spec
    agent = spec.agent
    volumes: list[Manifest] = [
        {"name": "config", "configMap": {"name": names.agent}},
        _host_dir("socket", socket_dir(pool)),
        _host_dir("dram", _dram_host_dir(pool)),
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
    mounts: list[Manifest] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "socket", "mountPath": socket_dir(pool)},
        {"name": "dram", "mountPath": DRAM_MOUNT},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    journal_host = _journal_host_dir(pool)
    if journal_host is not None:
        volumes.append(_host_dir("journal", journal_host))
        mounts.append({"name": "journal", "mountPath": JOURNAL_MOUNT})
    if spec.tiers.nvme is not None:
        host = f"{spec.tiers.nvme.host_path.rstrip('/')}/{names.pool_id}"
        volumes.append(_host_dir("nvme", host))
        mounts.append({"name": "nvme", "mountPath": NVME_MOUNT})
    volumes.append(_host_dir("state", f"{spec.state_host_path}/{names.pool_id}"))
    mounts.append({"name": "state", "mountPath": STATE_MOUNT})
    # The per-pool host directories the agent writes (the shared file:// mount is the
    # user's to prepare: it spans nodes and often squashes root).
    writable_host = [
        dict(m) for m in mounts if m["name"] in ("socket", "dram", "journal", "nvme", "state")
    ]
    shared_path = _shared_file_path(spec.tiers.shared)
    if shared_path is not None:
        volumes.append(_host_dir("shared", shared_path, "Directory"))
        mounts.append({"name": "shared", "mountPath": shared_path})
    if spec.peers.enabled:
        volumes.append(_peers_volume(pool))
        mounts.append({"name": "peers", "mountPath": PEERS_MOUNT, "readOnly": True})
    env: list[Manifest] = [
        {"name": ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {
            "name": ENV_POD_NAMESPACE,
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
        *credential_env(pool),
        *(
            [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
            if spec.peers.enabled
            else []
        ),
    ]
    pod_security, container_security = _security(pool)

    def probe(path: str, period: int, failures: int) -> Manifest:
        return {
            "httpGet": {"path": path, "port": "metrics"},
            "periodSeconds": period,
            "timeoutSeconds": 2,
            "failureThreshold": failures,
        }

    container: Manifest = {
        "name": "agent",
        "image": agent.image or settings.image(),
        "imagePullPolicy": agent.image_pull_policy,
        "command": ["kvpool", "agent", "--config", f"{CONFIG_DIR}/{AGENT_CONFIG_KEY}"],
        "env": env,
        "ports": [
            {"name": "metrics", "containerPort": agent.metrics_port, "protocol": "TCP"},
            *(
                {"name": name, "containerPort": port, "protocol": "TCP"}
                for name, port in (*events_ports(pool), *peers_ports(pool))
            ),
        ],
        "startupProbe": probe("/healthz", 5, 60),
        "livenessProbe": probe("/healthz", 10, 3),
        "readinessProbe": probe("/readyz", 5, 2),
        "resources": _resources(pool),
        "securityContext": container_security,
        "volumeMounts": mounts,
    }
    init = _host_dirs_container(pool, container["image"], writable_host)
    pod_spec: Manifest = {
        "serviceAccountName": names.agent,
        **_scheduling(pool),
        "securityContext": pod_security,
        "terminationGracePeriodSeconds": 30,
        **({"initContainers": [init]} if init is not None else {}),
        "containers": [container],
        "volumes": volumes,
    }
    if agent.priority_class_name:
        pod_spec["priorityClassName"] = agent.priority_class_name
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(pool, settings, names.agent),
        "spec": {
            "selector": {"matchLabels": selector_labels(pool)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": pod_labels(pool),
                    "annotations": {
                        CONFIG_CHECKSUM_ANNOTATION: config_sum,
                        "kubectl.kubernetes.io/default-container": "agent",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def peers_ports(pool: api.KVCachePool) -> list[tuple[str, int]]:
    """(name, port) of the agents' peer port; none when peers are off."""
    return [(PEERS_PORT_NAME, pool.spec.peers.port)] if pool.spec.peers.enabled else []


def _peers_volume(pool: api.KVCachePool) -> Manifest:
    """One read-only volume with the pool's peer secret and, with TLS, the certificate files
    (their Secrets projected side by side, so a rotated certificate reaches the pod)."""
    names = Names(pool.metadata.namespace, pool.metadata.name)
    sources: list[Manifest] = [
        {
            "secret": {
                "name": names.peers,
                "items": [{"key": PEER_SECRET_KEY, "path": PEER_SECRET_KEY}],
            }
        }
    ]
    tls = pool.spec.peers.tls
    if tls is not None:
        sources.append(
            {
                "secret": {
                    "name": tls.secret_name,
                    "items": [{"key": key, "path": key} for key in PEER_TLS_KEYS],
                }
            }
        )
    return {"name": "peers", "projected": {"sources": sources}}


def _peer_secret(pool: api.KVCachePool, settings: Settings) -> Manifest:
    """The pool's peer Secret without its value: render is pure, so the random secret is
    made by the operator when it creates the Secret, and no later apply replaces it
    (`handlers`). Owned by the pool, so it goes with it."""
    names = Names(pool.metadata.namespace, pool.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(pool, settings, names.peers),
        "type": "Opaque",
    }


def _peers_service(pool: api.KVCachePool, settings: Settings) -> Manifest:
    """The headless Service the agents find each other through (DNS: every agent pod's
    address). Not-ready agents are listed too: an agent that is starting is a peer the
    others may already reach, and its readiness does not depend on theirs."""
    names = Names(pool.metadata.namespace, pool.metadata.name)
    service = _headless_service(pool, settings, names.peers, peers_ports(pool))
    service["spec"]["publishNotReadyAddresses"] = True
    return service


def _peers_network_policy(pool: api.KVCachePool, settings: Settings) -> Manifest:
    """Only the pool's own agents reach the peer port.

    A NetworkPolicy that selects a pod isolates it for all ingress but what some policy
    admits, so this one also admits the agent's other ports (metrics, KV events) from
    anywhere, as without it: it restricts the peer port and nothing else. Egress is not
    touched. (Traffic from the node itself, the kubelet's probes, is always allowed.)
    """
    names = Names(pool.metadata.namespace, pool.metadata.name)
    others = [("metrics", pool.spec.agent.metrics_port), *events_ports(pool)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(pool, settings, names.peers),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(pool)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(pool)}}],
                    "ports": [{"protocol": "TCP", "port": pool.spec.peers.port}],
                },
                {"ports": [{"protocol": "TCP", "port": port} for _, port in others]},
            ],
        },
    }


def _rbac(pool: api.KVCachePool, settings: Settings) -> list[Manifest]:
    names = Names(pool.metadata.namespace, pool.metadata.name)
    cluster_meta = {"name": names.cluster_role, "labels": cluster_labels(pool, settings)}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(pool, settings, names.agent),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": dict(cluster_meta),
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": dict(cluster_meta),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": names.cluster_role,
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": names.agent,
                    "namespace": pool.metadata.namespace,
                }
            ],
        },
    ]


def _service(pool: api.KVCachePool, settings: Settings) -> Manifest:
    """The headless Service of the agents' metrics port (what Prometheus discovers)."""
    names = Names(pool.metadata.namespace, pool.metadata.name)
    return _headless_service(pool, settings, names.service,
                             [("metrics", pool.spec.agent.metrics_port)])


def _events_service(pool: api.KVCachePool, settings: Settings) -> Manifest:
    """The headless Service routers discover the agents' KV-events endpoints through.

    Its EndpointSlices list every agent with the named ports, so a router or relay
    subscribes to each agent, never to one picked by a load balancer (a SUB socket
    connected to one agent would see only that node's chunks).
    """
    names = Names(pool.metadata.namespace, pool.metadata.name)
    return _headless_service(pool, settings, names.events_service, events_ports(pool))


def _headless_service(pool: api.KVCachePool, settings: Settings, name: str,
                      ports: list[tuple[str, int]]) -> Manifest:
    """A Service without a cluster IP over the pool's agents: its DNS name resolves to every
    ready agent pod (one per node), each port aimed at the agent container's port of the
    same name."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, settings, name),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(pool),
            "ports": [
                {"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}
                for port_name, port in ports
            ],
        },
    }


def _pod_monitor(pool: api.KVCachePool, settings: Settings) -> Manifest:
    names = Names(pool.metadata.namespace, pool.metadata.name)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _meta(pool, settings, names.agent),
        "spec": {
            "selector": {"matchLabels": selector_labels(pool)},
            "podMetricsEndpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    # As the chart's PodMonitor: the dashboard and the alerts select agent
                    # series by job="kvpool-agent" and group them by node.
                    "relabelings": [
                        {
                            "sourceLabels": ["__meta_kubernetes_pod_node_name"],
                            "targetLabel": "node",
                            "action": "replace",
                        },
                        {"targetLabel": "job", "replacement": AGENT_JOB, "action": "replace"},
                    ],
                }
            ],
        },
    }


def render(
    pool: api.KVCachePool,
    policy: api.KVTierPolicy | None,
    settings: Settings | None = None,
) -> list[Manifest]:
    """Every object of a pool, in apply order; pure and deterministic.

    `policy` is the pool's resolved `KVTierPolicy` (None: the built-in defaults).
    Raises `api.InvalidSpec` if the pool cannot be rendered, `operator_policy.Forbidden`
    (a kind of it) if the operator policy does not allow what it asks for.
    """
    settings = settings or Settings()
    api.check_pool_id(pool.metadata.namespace, pool.metadata.name)
    check_operator_policy(pool, settings.policy, settings.image())
    tier_policy = policy.spec if policy is not None else TierPolicy()
    config_map = _config_map(pool, tier_policy, settings)
    data = config_map["data"]
    peers = pool.spec.peers.enabled
    objects = [
        *_rbac(pool, settings),
        config_map,
        # Before the agents: their volume needs the Secret, and the policy guards the port
        # before it opens.
        *([_peer_secret(pool, settings)] if peers else []),
        *([_peers_network_policy(pool, settings)] if peers and pool.spec.peers.network_policy
          else []),
        _daemon_set(pool, settings, checksum(data[AGENT_CONFIG_KEY])),
        _service(pool, settings),
    ]
    if pool.spec.events.enabled:
        objects.append(_events_service(pool, settings))
    if peers:
        objects.append(_peers_service(pool, settings))
    if settings.pod_monitor:
        objects.append(_pod_monitor(pool, settings))
    return objects


def unrendered(pool: api.KVCachePool) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the pool's optional objects its spec does not render now:
    what the reconcile deletes when a pool turns a feature off (a three-way merge prunes
    fields of an object, never the object)."""
    names = Names(pool.metadata.namespace, pool.metadata.name)
    off: list[tuple[str, str, str]] = []
    if not pool.spec.events.enabled:
        off.append(("v1", "Service", names.events_service))
    peers = pool.spec.peers
    if not peers.enabled:
        off.append(("v1", "Service", names.peers))
    if not (peers.enabled and peers.network_policy):
        off.append(("networking.k8s.io/v1", "NetworkPolicy", names.peers))
    if not peers.enabled:
        off.append(("v1", "Secret", names.peers))
    return off


def render_gc_job(pool: api.KVCachePool, settings: Settings | None = None) -> Manifest:
    """The Job that deletes every chunk of the pool's shared prefix (`reclaimPolicy: Delete`)."""
    settings = settings or Settings()
    check_operator_policy(pool, settings.policy, settings.image())
    shared = pool.spec.tiers.shared
    if shared is None:
        raise api.InvalidSpec(f"KVCachePool {pool.metadata.name} has no shared tier to collect")
    names = Names(pool.metadata.namespace, pool.metadata.name)
    env = credential_env(pool)
    if shared.endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL", "value": shared.endpoint_url})
    if shared.region:
        env.append({"name": "AWS_REGION", "value": shared.region})
        env.append({"name": "AWS_DEFAULT_REGION", "value": shared.region})
    pod_security, container_security = _security(pool)
    container_security["capabilities"] = {"drop": ["ALL"]}
    container: Manifest = {
        "name": "gc",
        "image": pool.spec.agent.image or settings.image(),
        "imagePullPolicy": pool.spec.agent.image_pull_policy,
        "command": ["kvpool", "gc", "--shared", shared.url, "--all",
                    *(arg for t in pool.spec.tenants for arg in ("--tenant", t.name))],
        "env": env,
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": container_security,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    volumes: list[Manifest] = [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    shared_path = _shared_file_path(shared)
    if shared_path is not None:
        volumes.append(_host_dir("shared", shared_path, "Directory"))
        container["volumeMounts"].append({"name": "shared", "mountPath": shared_path})
    # No owner reference: a foreground deletion of the pool would delete its dependents,
    # this Job included, before the pool; the Job cleans itself up after it finished.
    meta: Manifest = {
        "name": names.gc_job(pool.metadata.uid),
        "namespace": pool.metadata.namespace,
        "labels": {**labels(pool, settings), "app.kubernetes.io/component": "gc"},
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 3,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": meta["labels"]},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    **_scheduling(pool),
                    "securityContext": pod_security,
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def _node_dir_parents(pool: api.KVCachePool) -> list[tuple[str, str]]:
    """(name, host directory) of the parents of the pool's directories on a node that
    `spec.nodeReclaimPolicy: Delete` removes: the state directory's, the NVMe directory's,
    the DRAM arena's (a tmpfs or hugetlbfs file left there holds the host's memory for
    good), the journal's (an arena on huge pages) and the socket directory's."""
    out = [("state", pool.spec.state_host_path)]
    if pool.spec.tiers.nvme is not None:
        out.append(("nvme", pool.spec.tiers.nvme.host_path.rstrip("/") or "/"))
    out.append(("dram", str(Path(_dram_host_dir(pool)).parent)))
    if (journal := _journal_host_dir(pool)) is not None:
        out.append(("journal", str(Path(journal).parent)))
    out.append(("sockets", pool.spec.socket_dir.rstrip("/") or "/"))
    return out


def render_reclaim_daemon_set(pool: api.KVCachePool,
                              settings: Settings | None = None) -> Manifest:
    """The DaemonSet that removes a deleted pool's directories on every node its agents ran
    on (state, NVMe, DRAM arena, socket: `_node_dir_parents`) with
    `spec.nodeReclaimPolicy: Delete`, started once they are gone.

    Its init container (`hostdirs --remove`) deletes `<parent>/<ns>.<name>` below each
    parent, mounted whole so the directory itself goes too; a pod is ready once its node is
    clean, and the finalizer waits for every one. Root with the host-dirs init container's
    two capabilities (`hostdirs`); the main container only waits to be deleted."""
    settings = settings or Settings()
    check_operator_policy(pool, settings.policy, settings.image())
    names = Names(pool.metadata.namespace, pool.metadata.name)
    image = pool.spec.agent.image or settings.image()
    parents = _node_dir_parents(pool)
    volumes = [_host_dir(name, host) for name, host in parents]
    mounts = [{"name": name, "mountPath": f"{RECLAIM_MOUNT}/{name}"} for name, _ in parents]
    root: Manifest = {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
    }
    resources = {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}}
    meta = {
        "name": names.reclaim,
        "namespace": pool.metadata.namespace,
        "labels": {**labels(pool, settings), "app.kubernetes.io/component": "reclaim"},
    }
    selector = {**selector_labels(pool), "app.kubernetes.io/component": "reclaim"}
    # No owner reference (as the gc Job): the finalizer deletes it once every node is clean.
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector},
                "spec": {
                    "automountServiceAccountToken": False,
                    **_scheduling(pool),
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "terminationGracePeriodSeconds": 1,
                    "initContainers": [{
                        "name": "reclaim",
                        "image": image,
                        "imagePullPolicy": pool.spec.agent.image_pull_policy,
                        "command": ["python3", "-m", "kvpool.operator.hostdirs", "--remove",
                                    *(f"{m['mountPath']}/{names.pool_id}" for m in mounts)],
                        "env": [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
                        "resources": resources,
                        "securityContext": {**root, "capabilities": {
                            "drop": ["ALL"], "add": list(HOST_DIRS_CAPABILITIES)}},
                        "volumeMounts": mounts,
                    }],
                    "containers": [{
                        "name": "done",
                        "image": image,
                        "imagePullPolicy": pool.spec.agent.image_pull_policy,
                        "command": ["python3", "-c", "import signal; signal.pause()"],
                        "resources": resources,
                        "securityContext": {**root, "runAsUser": 65534, "runAsGroup": 65534,
                                            "runAsNonRoot": True,
                                            "capabilities": {"drop": ["ALL"]}},
                    }],
                    "volumes": volumes,
                },
            },
        },
    }
