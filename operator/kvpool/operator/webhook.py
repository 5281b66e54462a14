"""Pod injection: what the mutating webhook adds to a pod annotated `kvpool.io/pool`.

`inject(pod, pool)` is pure: it edits a pod manifest in place (and is
idempotent), so the kopf handler in `handlers.py` only looks up the pool and
turns the edit into the admission response's JSON patch.

A pod of pool `<ns>/<name>` gets:

- the pool's socket directory (a hostPath) mounted at the same path in every
  container (native sidecars, init containers with `restartPolicy: Always`,
  included); in a pool with tenants, its tenant's socket directory
  (`<socketDir>/<ns>.<name>/tenants/<tenant>`) mounted there instead, so the
  pod reaches its own tenant's socket and no other (a tenant the pool does not
  list is rejected);
- env `KVPOOL_SOCKET` (the agent socket), `KVPOOL_POOL` (`<ns>.<name>`),
  `KVPOOL_TENANT` (annotation `kvpool.io/tenant`, default the namespace) and
  `KVPOOL_CHUNK_TOKENS` (the pool's chunk size, part of the fingerprint);
- a required node affinity on `pool.kvpool.io/<ns>.<name>=ready`, the label
  the pool's agent puts on its node once it serves;
- the agent's GID as a supplementary group (unless the agent runs as root): the
  agent's socket is owner-and-group only, and a client that is not root reaches it
  through that group.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvpool.agent.config import TENANT_NAME_PATTERN
from kvpool.agent.constants import (
    ENV_CHUNK_TOKENS,
    ENV_POOL,
    ENV_SOCKET,
    ENV_TENANT,
    NODE_LABEL_READY,
)

from . import api
from .operator_policy import Forbidden
from .operator_policy import check as check_operator_policy
from .render import Settings, render, socket_dir, socket_path, tenant_socket_dir

SOCKET_VOLUME = "kvpool-socket"
INJECTED_ANNOTATION = "kvpool.io/injected"
_TENANT = re.compile(TENANT_NAME_PATTERN)


class Rejected(ValueError):
    """The pod cannot join the pool it names; the message says why."""


def requested_pool(pod: Mapping[str, Any]) -> str | None:
    """The pool a pod asks for (annotation `kvpool.io/pool`), if any."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(api.POOL_ANNOTATION)
    return str(value) if value is not None else None


def tenant_of(pod: Mapping[str, Any], namespace: str) -> str:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    tenant = str(annotations.get(api.TENANT_ANNOTATION) or namespace)
    if len(tenant) > 63 or not _TENANT.match(tenant):
        raise Rejected(
            f"annotation {api.TENANT_ANNOTATION}: {tenant!r} is not a tenant name "
            "(at most 63 letters, digits, '-', '_' or '.')"
        )
    return tenant


def _upsert(items: list[dict[str, Any]], item: dict[str, Any], key: str = "name") -> None:
    for i, existing in enumerate(items):
        if existing.get(key) == item[key]:
            items[i] = item
            return
    items.append(item)


def env_for(pod: Mapping[str, Any], pool: api.KVCachePool) -> list[dict[str, Any]]:
    ns, name = pool.metadata.namespace, pool.metadata.name
    return [
        {"name": ENV_SOCKET, "value": socket_path(pool)},
        {"name": ENV_POOL, "value": api.pool_id(ns, name)},
        {"name": ENV_TENANT, "value": tenant_of(pod, ns)},
        {"name": ENV_CHUNK_TOKENS, "value": str(pool.spec.chunk_tokens)},
    ]


def host_socket_dir(pod: Mapping[str, Any], pool: api.KVCachePool) -> tuple[str, str]:
    """(node directory, type) the pod mounts at the pool's socket directory.

    In a pool with tenants that is the pod's tenant's directory, which the agent made
    (`Directory`: it must exist), so the pod can reach no other tenant's socket.
    """
    if not pool.spec.tenants:
        return socket_dir(pool), "DirectoryOrCreate"
    tenant = tenant_of(pod, pool.metadata.namespace)
    names = [t.name for t in pool.spec.tenants]
    if tenant not in names:
        raise Rejected(
            f"tenant {tenant!r} (annotation {api.TENANT_ANNOTATION}, default the namespace) "
            f"is not a tenant of KVCachePool {pool.metadata.name!r}; its tenants are "
            f"{', '.join(names)}"
        )
    return tenant_socket_dir(pool, tenant), "Directory"


def with_request_namespace(review: Mapping[str, Any]) -> None:
    """Give the admitted object the namespace of the admission request, in place.

    Most controllers create pods without `metadata.namespace` (the API server takes it
    from the URL); the request's `namespace` is where the pod goes.
    """
    request = review.get("request") or {}
    namespace = request.get("namespace")
    obj = request.get("object")
    if namespace and isinstance(obj, dict):
        meta = obj.setdefault("metadata", {})
        if isinstance(meta, dict) and not meta.get("namespace"):
            meta["namespace"] = namespace


def containers_of(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The containers that run beside the app: `containers` and native sidecars (init
    containers with `restartPolicy: Always`, which run for the pod's whole life)."""
    sidecars = [
        c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"
    ]
    return [*(spec.get("containers") or []), *sidecars]


def readiness_warning(pool_name: str, body: Mapping[str, Any]) -> str | None:
    """An admission warning when the pool the pod joins does not serve yet."""
    for c in (body.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            if c.get("status") == "True":
                return None
            return (
                f"KVCachePool {pool_name!r} is not ready ({c.get('reason')}: "
                f"{c.get('message')}): the pod waits for a node whose agent serves the pool"
            )
    return (
        f"KVCachePool {pool_name!r} has no Ready condition yet: the pod waits for a node "
        "whose agent serves the pool"
    )


def inject(pod: dict[str, Any], pool: api.KVCachePool) -> None:
    """Add the pool's socket, env and node affinity to `pod` (in place, idempotent)."""
    ns, name = pool.metadata.namespace, pool.metadata.name
    env = env_for(pod, pool)
    directory = socket_dir(pool)
    host_dir, host_dir_type = host_socket_dir(pod, pool)
    spec = pod.setdefault("spec", {})

    volumes = spec.setdefault("volumes", [])
    _upsert(volumes, {"name": SOCKET_VOLUME, "hostPath": {"path": host_dir, "type": host_dir_type}})
    for container in containers_of(spec):
        mounts = container.setdefault("volumeMounts", [])
        mounts[:] = [m for m in mounts if m.get("name") != SOCKET_VOLUME]
        mounts.append({"name": SOCKET_VOLUME, "mountPath": directory})
        container_env = container.setdefault("env", [])
        for var in env:
            _upsert(container_env, dict(var))

    agent_gid = pool.spec.agent.run_as_user
    if agent_gid != 0:  # never hand a pod the root group
        groups = spec.setdefault("securityContext", {}).setdefault("supplementalGroups", [])
        if agent_gid not in groups:
            groups.append(agent_gid)

    requirement = {"key": api.node_label(ns, name), "operator": "In", "values": [NODE_LABEL_READY]}
    affinity = spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": []}
    )
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    # Terms are ORed, expressions within a term ANDed: the pool's node label goes in each.
    for term in terms:
        expressions = term.setdefault("matchExpressions", [])
        expressions[:] = [e for e in expressions if e.get("key") != requirement["key"]]
        expressions.append(dict(requirement))

    annotations = pod.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[INJECTED_ANNOTATION] = api.pool_id(ns, name)


def check_pool(pool_name: str, namespace: str, body: Mapping[str, Any] | None) -> api.KVCachePool:
    """The pool a pod may join, or `Rejected` saying why not."""
    if body is None:
        raise Rejected(
            f"annotation {api.POOL_ANNOTATION}: KVCachePool {pool_name!r} not found "
            f"in namespace {namespace!r}"
        )
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        raise Rejected(f"KVCachePool {pool_name!r} in namespace {namespace!r} is being deleted")
    try:
        return api.parse_pool(body)
    except api.InvalidSpec as e:
        raise Rejected(f"KVCachePool {pool_name!r} is invalid: {e}") from e


def check_allowed(pool: api.KVCachePool, settings: Settings) -> None:
    """`Rejected` if the operator policy forbids the pool: it runs no agents, and a pod
    must get none of its mounts (a forbidden host path, say)."""
    try:
        check_operator_policy(pool, settings.policy, settings.image())
    except Forbidden as e:
        raise Rejected(f"{e} (the pool runs no agents)") from e


def admit_pool(body: Mapping[str, Any], settings: Settings) -> api.KVCachePool:
    """The pool admission check: the same parsing and `render()` the reconcile runs (the
    pool's KVTierPolicy is checked on its own), so a pool `kubectl apply` accepts is one
    the operator can render; `api.InvalidSpec` (or `Forbidden`) says why not."""
    pool = api.parse_pool(body)
    render(pool, None, settings)
    return pool


def admit_policy(body: Mapping[str, Any]) -> api.KVTierPolicy:
    """The policy admission check: the parsing the reconcile runs."""
    return api.parse_policy(body)


def spec_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> bool:
    """Whether an update changes the spec. Updates that do not (finalizers, labels, the
    operator's own annotations) are never refused: an object whose spec a tightened
    operator policy no longer allows can still be labelled, and deleted."""
    if old is None or new is None:
        return True
    return (old.get("spec") or {}) != (new.get("spec") or {})
