"""The kopf handlers: thin shells around `render()`, `status` and `webhook.inject()`.

- A pool's create/update/resume (and a periodic resync) applies its render and
  writes its status; a missing policy or Secret gives `Degraded` with a reason
  and a retry, an invalid spec gives `Degraded/InvalidSpec` and waits for an edit.
- A policy's create/update/resume/delete re-reconciles every pool that references it.
- A change of an agent DaemonSet's status updates its pool's conditions.
- A pool's deletion runs its finalizer: with `reclaimPolicy: Delete` a Job runs
  `kvpool gc --shared <url> --all` first; with `nodeReclaimPolicy: Delete` (the default)
  the agents are stopped and a DaemonSet removes the pool's state and NVMe directories on
  every node; the cluster-scoped RBAC goes last.
- The mutating webhook `kvpool-inject` injects socket, env and affinity into pods at
  their creation (a pool the operator policy forbids gets none); the validating webhooks
  check pools and policies as the reconcile would.

Handlers are synchronous (they run in kopf's thread pool) and idempotent:
every event, including a replayed one, converges to the same objects.
"""

from __future__ import annotations

import base64
import copy
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from kvpool.agent.config import TierPolicy

from . import api, metrics
from .kube import Kube, KubeError
from .operator_policy import Forbidden
from .operator_policy import check as check_operator_policy
from .render import (
    MANAGED_BY,
    PEER_SECRET_BYTES,
    PEER_SECRET_KEY,
    PEER_TLS_KEYS,
    POOL_LABEL,
    SECRET_KEYS,
    Names,
    Settings,
    checksum,
    cluster_selector,
    policy_yaml,
    render,
    render_gc_job,
    render_reclaim_daemon_set,
    socket_path,
    unrendered,
)
from .status import (
    DEGRADED,
    INVALID_EDITS,
    Problem,
    Reason,
    applied_pool,
    changed,
    keep_transition_times,
    pool_status,
    problem_of,
    running_pool,
)
from .webhook import (
    Rejected,
    admit_policy,
    admit_pool,
    check_allowed,
    check_pool,
    inject,
    readiness_warning,
    requested_pool,
    spec_changed,
)

Logger = logging.Logger | logging.LoggerAdapter[Any]

POOL = (api.GROUP, api.VERSION, api.POOL_PLURAL)
POLICY = (api.GROUP, api.VERSION, api.POLICY_PLURAL)
FINALIZER = "kvpool.io/finalizer"
RBAC = "rbac.authorization.k8s.io/v1"
WEBHOOK_ID = "kvpool-inject"
VALIDATE_POOL_ID = "kvpool-validate-pool"
VALIDATE_POLICY_ID = "kvpool-validate-policy"


@dataclass
class Context:
    """What every handler needs; carried in kopf's memo as `memo.kvpool`."""

    kube: Kube
    settings: Settings
    retry_delay: float = 30.0
    """Seconds before a pool with a problem (missing policy/Secret, API error) is first
    retried; each further retry waits twice as long, up to `retry_max`."""
    retry_max: float = 300.0
    gc_poll: float = 10.0
    """Seconds between checks of a running garbage-collection Job."""
    connection: kopf.ConnectionInfo | None = None
    """Where kopf connects; None: the in-cluster or kubeconfig login."""


def backoff(retry: int, base: float, cap: float) -> float:
    """Seconds before the next attempt after `retry` failed retries: doubling from `base`,
    at most `cap`. An API server that is down or overloaded is not hammered, and a
    problem fixed in minutes is still noticed in minutes."""
    return float(min(cap, base * 2 ** min(retry, 30)))


def context(memo: Any) -> Context:
    ctx = memo["kvpool"]
    assert isinstance(ctx, Context)
    return ctx


# --------------------------------------------------------------------------- reconcile


def _resolve_policy(
    kube: Kube, pool: api.KVCachePool
) -> tuple[api.KVTierPolicy | None, api.ResolvedPolicy]:
    ref = pool.spec.policy_ref
    if ref is None:
        return None, api.ResolvedPolicy(name="", checksum=checksum(policy_yaml(TierPolicy())))
    ns = pool.metadata.namespace
    body = kube.get(api.API_VERSION, api.POLICY_KIND, ns, ref.name)
    if body is None:
        raise Problem(
            Reason.POLICY_NOT_FOUND,
            f"KVTierPolicy {ref.name!r} (spec.policyRef) not found in namespace {ns!r}",
        )
    try:
        policy = api.parse_policy(body)
    except api.InvalidSpec as e:
        raise Problem(Reason.INVALID_POLICY, str(e)) from e
    return policy, api.ResolvedPolicy(
        name=ref.name,
        generation=policy.metadata.generation,
        checksum=checksum(policy_yaml(policy.spec)),
    )


def _check_secrets(kube: Kube, pool: api.KVCachePool) -> None:
    """The Secrets the pool names exist and hold the keys its agents read."""
    shared = pool.spec.tiers.shared
    if shared is not None and shared.credentials_secret:
        _check_secret(kube, pool.metadata.namespace, shared.credentials_secret, SECRET_KEYS,
                      "spec.tiers.shared.credentialsSecret", "the shared tier")
    tls = pool.spec.peers.tls if pool.spec.peers.enabled else None
    if tls is not None:
        _check_secret(kube, pool.metadata.namespace, tls.secret_name, PEER_TLS_KEYS,
                      "spec.peers.tls.secretName", "TLS between the agents")


def _check_secret(
    kube: Kube, ns: str, name: str, keys: tuple[str, ...], field: str, user: str
) -> None:
    found = kube.secret_keys(ns, name)
    if found is None:
        raise Problem(
            Reason.SECRET_NOT_FOUND, f"Secret {name!r} ({field}) not found in namespace {ns!r}"
        )
    missing = [k for k in keys if k not in found]
    if missing:
        raise Problem(
            Reason.SECRET_KEY_MISSING,
            f"Secret {name!r} has no key {', '.join(missing)} (needed by {user})",
        )


def generated(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """Fields the operator makes once for a rendered object, where render (pure) cannot:
    the pool's random peer secret (the only Secret rendered). `Kube.apply` gives them to
    the object it creates, or to one that lost them, and never replaces them, so a
    re-render keeps the secret every agent of the pool holds."""
    if obj["kind"] != "Secret":
        return None
    value = secrets.token_hex(PEER_SECRET_BYTES).encode()
    return {"data": {PEER_SECRET_KEY: base64.b64encode(value).decode()}}


def _write_status(kube: Kube, body: Mapping[str, Any], status: dict[str, Any]) -> None:
    """Merge `status` into the live pool's, if it changes anything.

    Reconciles of one pool can overlap (its own handler, its policy's handler, its
    DaemonSet's events), each computed from the body it was given; transition times
    are taken from the live object, so a condition that did not change keeps its time.
    """
    meta = body["metadata"]
    live = kube.get(api.API_VERSION, api.POOL_KIND, meta["namespace"], meta["name"])
    if live is None:
        return
    current = live.get("status") or {}
    if "conditions" in status:
        status["conditions"] = keep_transition_times(
            status["conditions"], current.get("conditions") or []
        )
    if changed(current, status):
        kube.patch(
            api.API_VERSION,
            api.POOL_KIND,
            meta["namespace"],
            meta["name"],
            {"status": status},
            subresource="status",
        )


def _daemon_set(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return kube.get("apps/v1", "DaemonSet", namespace, Names(namespace, name).agent)
    except KubeError:
        return None


def _remove_agents(kube: Kube, namespace: str, name: str, logger: Logger) -> None:
    """Delete the pool's agent DaemonSet, if there is one."""
    try:
        if kube.delete("apps/v1", "DaemonSet", namespace, Names(namespace, name).agent):
            logger.warning("deleted the agents of a pool the operator policy does not allow")
    except KubeError as e:
        raise Problem(Reason.APPLY_FAILED, f"cannot delete the agents: {e}") from e


def _prune(kube: Kube, pool: api.KVCachePool, logger: Logger) -> None:
    """Delete the pool's optional objects its spec no longer renders (events or peers turned
    off): only those the operator made for this pool, by their labels."""
    ns, name = pool.metadata.namespace, pool.metadata.name
    for api_version, kind, obj_name in unrendered(pool):
        live = kube.get(api_version, kind, ns, obj_name)
        labels = ((live or {}).get("metadata") or {}).get("labels") or {}
        if labels.get("app.kubernetes.io/managed-by") == MANAGED_BY and (
            labels.get(POOL_LABEL) == name
        ):
            kube.delete(api_version, kind, ns, obj_name)
            logger.info("%s %s deleted", kind, obj_name)


def reconcile_pool(ctx: Context, body: Mapping[str, Any], logger: Logger, retry: int = 0) -> None:
    """Apply the pool's render and write its status; raise kopf errors on problems.

    `retry` is how many times kopf has retried this handler: the delay kopf is asked to
    wait before the next attempt grows with it.
    """
    delay = backoff(retry, ctx.retry_delay, ctx.retry_max)
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    generation = meta.get("generation")
    previous = (body.get("status") or {}).get("conditions") or []
    pool: api.KVCachePool | None = None
    with metrics.timed(api.POOL_KIND):
        try:
            try:
                pool = api.parse_pool(body)
            except api.PortConflict as e:
                raise Problem(Reason.PORT_CONFLICT, str(e)) from e
            except api.InvalidSpec as e:
                raise Problem(Reason.INVALID_SPEC, str(e)) from e
            try:
                policy, resolved = _resolve_policy(ctx.kube, pool)
                _check_secrets(ctx.kube, pool)
            except KubeError as e:
                raise Problem(Reason.APPLY_FAILED, str(e)) from e
            try:
                objects = render(pool, policy, ctx.settings)
            except Forbidden as e:
                # Stored past the admission webhook (down, or the policy was tightened
                # since): no agent runs what the policy does not allow.
                _remove_agents(ctx.kube, ns, name, logger)
                raise Problem(Reason.FORBIDDEN, str(e)) from e
            except api.InvalidSpec as e:
                raise Problem(Reason.INVALID_SPEC, str(e)) from e
            for obj in objects:
                try:
                    result = ctx.kube.apply(obj, generated(obj))
                except KubeError as e:
                    raise Problem(
                        Reason.APPLY_FAILED, f"{obj['kind']} {obj['metadata']['name']}: {e}"
                    ) from e
                if result != "unchanged":
                    logger.info("%s %s %s", obj["kind"], obj["metadata"]["name"], result)
            try:
                _prune(ctx.kube, pool, logger)
            except KubeError as e:
                raise Problem(Reason.APPLY_FAILED, f"cannot delete what is off: {e}") from e
        except Problem as problem:
            _sync_policies(ctx, body, logger)
            metrics.failed(api.POOL_KIND, problem.reason)
            status = pool_status(
                # While an invalid edit is refused, the status describes what runs.
                pool=running_pool(body, problem),
                generation=generation,
                daemon_set=_daemon_set(ctx.kube, ns, name),
                problem=problem,
                previous=previous,
            )
            try:
                _write_status(ctx.kube, body, status)
            except KubeError as e:
                logger.warning("cannot write the status: %s", e)
            if problem.reason in (*INVALID_EDITS, Reason.FORBIDDEN):
                # Nothing to retry until the spec is edited (which triggers an update).
                raise kopf.PermanentError(str(problem)) from problem
            raise kopf.TemporaryError(str(problem), delay=delay) from problem
        status = pool_status(
            pool=pool,
            generation=generation,
            daemon_set=_daemon_set(ctx.kube, ns, name),
            problem=None,
            previous=previous,
            policy=resolved,
            socket=socket_path(pool),
            # Kept in the pool, where the pod webhook and a restarted operator find it.
            applied_spec=copy.deepcopy(dict(body.get("spec") or {})),
        )
        try:
            _write_status(ctx.kube, body, status)
        except KubeError as e:
            metrics.failed(api.POOL_KIND, Reason.APPLY_FAILED)
            raise kopf.TemporaryError(f"cannot write the status: {e}", delay=delay) from e
        _sync_policies(ctx, body, logger)
    metrics.succeeded(api.POOL_KIND)


def _sync_policies(
    ctx: Context, body: Mapping[str, Any], logger: Logger, gone: bool = False
) -> None:
    meta = body["metadata"]
    ref = ((body.get("spec") or {}).get("policyRef") or {}).get("name")
    try:
        sync_policy_pools(ctx, meta["namespace"], meta["name"], ref, gone)
    except KubeError as e:
        # The next reconcile of any pool or policy of the namespace fixes it.
        logger.warning("cannot update the policies' status.pools: %s", e)


def refresh_pool_status(
    ctx: Context, body: Mapping[str, Any], daemon_set: Mapping[str, Any]
) -> None:
    """Update a pool's rollout fields and conditions from its DaemonSet; keep any problem."""
    current = body.get("status") or {}
    previous = current.get("conditions") or []
    if not previous:
        # The reconcile that created the DaemonSet has not written its status yet; it
        # writes the first conditions, with the generation it observed.
        return
    problem = problem_of(previous)
    status = pool_status(
        pool=running_pool(body, problem),
        generation=current.get("observedGeneration"),
        daemon_set=daemon_set,
        problem=problem,
        previous=previous,
    )
    _write_status(ctx.kube, body, status)


def _pools_using(ctx: Context, namespace: str, policy: str) -> list[dict[str, Any]]:
    pools = ctx.kube.list(api.API_VERSION, api.POOL_KIND, namespace)
    return [
        p
        for p in pools
        if ((p.get("spec") or {}).get("policyRef") or {}).get("name") == policy
        and not (p.get("metadata") or {}).get("deletionTimestamp")
    ]


def policy_pools(pools: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Policy name -> the sorted names of the live pools that reference it."""
    out: dict[str, list[str]] = {}
    for pool in pools:
        meta = pool.get("metadata") or {}
        ref = ((pool.get("spec") or {}).get("policyRef") or {}).get("name")
        if ref and not meta.get("deletionTimestamp"):
            out.setdefault(str(ref), []).append(str(meta.get("name")))
    return {name: sorted(names) for name, names in out.items()}


def sync_policy_pools(
    ctx: Context, namespace: str, pool: str, ref: str | None, gone: bool = False
) -> None:
    """Make every KVTierPolicy of `namespace` list exactly the pools that reference it now,
    if `pool` (referencing policy `ref`; `gone`: being deleted) is listed wrongly anywhere.
    Run by every pool reconcile and deletion, so `status.pools` follows pools created,
    deleted and re-pointed within one reconcile; a pool listed rightly costs one list of
    the namespace's policies."""
    policies = ctx.kube.list(api.API_VERSION, api.POLICY_KIND, namespace)
    if all(
        (pool in ((p.get("status") or {}).get("pools") or []))
        == (not gone and (p.get("metadata") or {}).get("name") == ref)
        for p in policies
    ):
        return
    pools = [
        p
        for p in ctx.kube.list(api.API_VERSION, api.POOL_KIND, namespace)
        if not (gone and (p.get("metadata") or {}).get("name") == pool)
    ]
    using = policy_pools(pools)
    for policy in policies:
        name = str((policy.get("metadata") or {}).get("name"))
        want = using.get(name, [])
        if ((policy.get("status") or {}).get("pools") or []) != want:
            ctx.kube.patch(
                api.API_VERSION,
                api.POLICY_KIND,
                namespace,
                name,
                {"status": {"pools": want}},
                "status",
            )


def propagate_policy(
    ctx: Context,
    namespace: str,
    name: str,
    body: Mapping[str, Any] | None,
    logger: Logger,
    retry: int = 0,
) -> None:
    """Re-reconcile every pool of `namespace` that references policy `name`."""
    delay = backoff(retry, ctx.retry_delay, ctx.retry_max)
    with metrics.timed(api.POLICY_KIND):
        try:
            pools = _pools_using(ctx, namespace, name)
        except KubeError as e:
            metrics.failed(api.POLICY_KIND, Reason.APPLY_FAILED)
            raise kopf.TemporaryError(f"cannot list pools: {e}", delay=delay) from e
        for pool in pools:
            try:
                reconcile_pool(ctx, pool, logger)
            except (kopf.TemporaryError, kopf.PermanentError) as e:
                # The pool's own status and retries carry it from here.
                logger.warning("pool %s: %s", pool["metadata"]["name"], e)
        if body is None:
            metrics.succeeded(api.POLICY_KIND)
            return
        status: dict[str, Any] = {"pools": sorted(p["metadata"]["name"] for p in pools)}
        try:
            policy = api.parse_policy(body)
        except api.InvalidSpec as e:
            metrics.failed(api.POLICY_KIND, Reason.INVALID_POLICY)
            raise kopf.PermanentError(str(e)) from e
        status["checksum"] = checksum(policy_yaml(policy.spec))
        if policy.metadata.generation is not None:
            status["observedGeneration"] = policy.metadata.generation
        if changed(body.get("status"), status):
            try:
                ctx.kube.patch(
                    api.API_VERSION, api.POLICY_KIND, namespace, name, {"status": status}, "status"
                )
            except KubeError as e:
                metrics.failed(api.POLICY_KIND, Reason.APPLY_FAILED)
                raise kopf.TemporaryError(str(e), delay=delay) from e
    metrics.succeeded(api.POLICY_KIND)


# --------------------------------------------------------------------------- deletion


def _job_failed(job: Mapping[str, Any]) -> str | None:
    st = job.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            return str(c.get("message") or c.get("reason") or "failed")
    backoff = (job.get("spec") or {}).get("backoffLimit", 6)
    if int(st.get("failed") or 0) > int(backoff):
        return f"{st.get('failed')} failed attempts"
    return None


def _job_succeeded(job: Mapping[str, Any]) -> bool:
    st = job.get("status") or {}
    if int(st.get("succeeded") or 0) >= 1:
        return True
    return any(
        c.get("type") == "Complete" and c.get("status") == "True"
        for c in st.get("conditions") or []
    )


def _write_deleting(ctx: Context, pool: api.KVCachePool, body: Mapping[str, Any],
                    problem: Problem | None = None) -> None:
    """Progressing=True/Deleting: the finalizer has started removing what the pool stored;
    with `problem`, what keeps it from finishing (the DaemonSet is not looked up then)."""
    _write_status(
        ctx.kube,
        body,
        pool_status(
            pool=pool,
            generation=(body.get("status") or {}).get("observedGeneration"),
            daemon_set=None if problem else _daemon_set(
                ctx.kube, pool.metadata.namespace, pool.metadata.name),
            problem=problem,
            previous=(body.get("status") or {}).get("conditions") or [],
            deleting=True,
        ),
    )


def collect_garbage(
    ctx: Context, pool: api.KVCachePool, body: Mapping[str, Any], logger: Logger
) -> None:
    """Run the gc Job to completion; raise kopf.TemporaryError until it succeeded."""
    shared = pool.spec.tiers.shared
    assert shared is not None
    ns = pool.metadata.namespace
    job_name = Names(ns, pool.metadata.name).gc_job(pool.metadata.uid)
    job = ctx.kube.get("batch/v1", "Job", ns, job_name)
    if job is None:
        try:
            ctx.kube.create(render_gc_job(pool, ctx.settings))
        except KubeError as e:
            if e.status == 403 and "being terminated" in str(e):
                # The whole namespace goes: no pod can start in it any more, and blocking
                # would keep the namespace terminating forever. The chunks stay.
                logger.warning("namespace %s is terminating: %s is kept", ns, shared.url)
                return
            raise
        _write_deleting(ctx, pool, body)
        raise kopf.TemporaryError(f"deleting {shared.url} (Job {job_name})", delay=ctx.gc_poll)
    if _job_succeeded(job):
        return
    failure = _job_failed(job)
    if failure is None:
        raise kopf.TemporaryError(f"waiting for Job {job_name}", delay=ctx.gc_poll)
    problem = Problem(
        Reason.GC_FAILED,
        f"Job {job_name} could not delete {shared.url}: {failure}. Fix the cause "
        f"(credentials, endpoint) and delete the Job to retry, or set "
        f"spec.tiers.shared.reclaimPolicy to Retain to keep the chunks.",
    )
    metrics.failed(api.POOL_KIND, problem.reason)
    _write_deleting(ctx, pool, body, problem)
    raise kopf.TemporaryError(str(problem), delay=ctx.retry_delay)


def _rolled_out(ds: Mapping[str, Any]) -> bool:
    """Every pod the DaemonSet's controller wants is ready (as last reported)."""
    st = ds.get("status") or {}
    if "desiredNumberScheduled" not in st:
        return False  # not reported yet
    generation = (ds.get("metadata") or {}).get("generation")
    if generation is not None and int(st.get("observedGeneration") or 0) < int(generation):
        return False
    return int(st.get("numberReady") or 0) >= int(st["desiredNumberScheduled"])


def reclaim_node_dirs(ctx: Context, pool: api.KVCachePool, body: Mapping[str, Any],
                      logger: Logger) -> None:
    """Remove the deleted pool's state and NVMe directories on every node
    (`spec.nodeReclaimPolicy: Delete`): stop the agents (their DaemonSet deleted in the
    foreground, so it stays until their pods are gone), then run the reclaim DaemonSet
    until it is ready on every node, then delete it. Raises `kopf.TemporaryError` while
    waiting."""
    ns, name = pool.metadata.namespace, pool.metadata.name
    names = Names(ns, name)
    if ctx.kube.get("apps/v1", "DaemonSet", ns, names.agent) is not None:
        _write_deleting(ctx, pool, body)
        ctx.kube.delete("apps/v1", "DaemonSet", ns, names.agent, propagation="Foreground")
        raise kopf.TemporaryError(f"waiting for the agents of {name} to stop before "
                                  "removing its node directories", delay=ctx.gc_poll)
    reclaim = ctx.kube.get("apps/v1", "DaemonSet", ns, names.reclaim)
    if reclaim is None:
        try:
            ctx.kube.create(render_reclaim_daemon_set(pool, ctx.settings))
        except KubeError as e:
            if e.status == 403 and "being terminated" in str(e):
                # No pod starts in a namespace being deleted (as for the gc Job).
                logger.warning("namespace %s is terminating: the node directories of %s "
                               "are kept", ns, name)
                return
            raise
        raise kopf.TemporaryError(f"removing the node directories of {name} (DaemonSet "
                                  f"{names.reclaim})", delay=ctx.gc_poll)
    if not _rolled_out(reclaim):
        raise kopf.TemporaryError(f"waiting for DaemonSet {names.reclaim} on every node",
                                  delay=ctx.gc_poll)
    ctx.kube.delete("apps/v1", "DaemonSet", ns, names.reclaim)
    logger.info("removed the node directories of %s", name)


def finalize_pool(ctx: Context, body: Mapping[str, Any], logger: Logger, retry: int = 0) -> None:
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    try:
        pool: api.KVCachePool | None = api.parse_pool(body)
    except api.InvalidSpec:
        pool = None  # nothing was rendered for it beyond what the names say
    try:
        shared = pool.spec.tiers.shared if pool is not None else None
        if pool is not None and shared is not None and shared.reclaim_policy == "Delete":
            try:
                check_operator_policy(pool, ctx.settings.policy, ctx.settings.image())
            except Forbidden as e:
                # The gc Job would run what the policy does not allow: the chunks stay.
                logger.warning("%s is kept: %s", shared.url, e)
            else:
                collect_garbage(ctx, pool, body, logger)
                logger.info("deleted the pool's chunks in %s", shared.url)
        if pool is not None and pool.spec.node_reclaim_policy == "Delete":
            try:
                check_operator_policy(pool, ctx.settings.policy, ctx.settings.image())
            except Forbidden as e:
                # Its pods would mount what the policy does not allow: the directories stay.
                logger.warning("the node directories of %s are kept: %s", name, e)
            else:
                reclaim_node_dirs(ctx, pool, body, logger)
        # Cluster-scoped objects cannot be owned by the pool: delete them here, found by
        # the pool's labels (namespace and name), never by a name another pool might share.
        for kind in ("ClusterRoleBinding", "ClusterRole"):
            for obj in ctx.kube.list(RBAC, kind, None, cluster_selector(ns, name)):
                ctx.kube.delete(RBAC, kind, None, obj["metadata"]["name"])
        _sync_policies(ctx, body, logger, gone=True)
    except KubeError as e:
        raise kopf.TemporaryError(
            str(e), delay=backoff(retry, ctx.retry_delay, ctx.retry_max)
        ) from e


# --------------------------------------------------------------------------- registry


def build_registry(
    *, resync_seconds: float | None = 300.0, webhook: bool = True
) -> kopf.OperatorRegistry:
    """A registry with every kvpool handler (one per operator run, or shared by tests)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(*, memo: Any, **kwargs: Any) -> kopf.ConnectionInfo | None:
        ctx = context(memo)
        if ctx.connection is not None:
            return ctx.connection
        return kopf.login_via_client(**kwargs)

    @kopf.on.resume(*POOL, registry=registry)
    @kopf.on.create(*POOL, registry=registry)
    @kopf.on.update(*POOL, registry=registry)
    def pool_changed(*, body: kopf.Body, memo: Any, logger: Logger, retry: int, **_: Any) -> None:
        reconcile_pool(context(memo), body, logger, retry)

    if resync_seconds:

        @kopf.timer(*POOL, interval=resync_seconds, initial_delay=resync_seconds, registry=registry)
        def pool_resync(*, body: kopf.Body, memo: Any, logger: Logger, **kwargs: Any) -> None:
            if not body.metadata.get("deletionTimestamp"):
                reconcile_pool(context(memo), body, logger, int(kwargs.get("retry") or 0))

    @kopf.on.delete(*POOL, registry=registry)
    def pool_deleted(*, body: kopf.Body, memo: Any, logger: Logger, retry: int, **_: Any) -> None:
        finalize_pool(context(memo), body, logger, retry)

    @kopf.on.event(
        "apps",
        "v1",
        "daemonsets",
        labels={"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/component": "agent"},
        registry=registry,
    )
    def daemon_set_changed(
        *, event: kopf.RawEvent, body: kopf.Body, memo: Any, logger: Logger, **_: Any
    ) -> None:
        ctx = context(memo)
        ns = body.metadata.namespace
        name = body.metadata.labels.get(POOL_LABEL)
        if not ns or not name:
            return
        try:
            pool = ctx.kube.get(api.API_VERSION, api.POOL_KIND, ns, name)
            if pool is None or pool["metadata"].get("deletionTimestamp"):
                return
            if event.get("type") == "DELETED":
                reconcile_pool(ctx, pool, logger)  # someone deleted it: put it back
            else:
                refresh_pool_status(ctx, pool, body)
        except (KubeError, kopf.TemporaryError, kopf.PermanentError) as e:
            logger.warning("pool %s: %s", name, e)

    @kopf.on.resume(*POLICY, registry=registry)
    @kopf.on.create(*POLICY, registry=registry)
    @kopf.on.update(*POLICY, registry=registry)
    def policy_changed(*, body: kopf.Body, memo: Any, logger: Logger, retry: int, **_: Any) -> None:
        propagate_policy(
            context(memo),
            body.metadata.namespace or "",
            body.metadata.name or "",
            body,
            logger,
            retry,
        )

    @kopf.on.event(*POLICY, registry=registry)
    def policy_event(
        *, event: kopf.RawEvent, body: kopf.Body, memo: Any, logger: Logger, **_: Any
    ) -> None:
        if event.get("type") != "DELETED":
            return
        try:
            propagate_policy(
                context(memo), body.metadata.namespace or "", body.metadata.name or "", None, logger
            )
        except (kopf.TemporaryError, kopf.PermanentError) as e:
            logger.warning("%s", e)

    if webhook:

        @kopf.index(*POOL, id="pools_by_name", registry=registry)
        def pools_by_name(*, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
            return {(body.metadata.namespace or "", body.metadata.name or ""): dict(body)}

        @kopf.on.mutate(
            "v1",
            "pods",
            id=WEBHOOK_ID,
            operations=["CREATE"],
            annotations={api.POOL_ANNOTATION: kopf.PRESENT},
            registry=registry,
        )
        def inject_pod(
            *, body: kopf.Body, patch: kopf.Patch, warnings: list[str], **kwargs: Any
        ) -> None:
            if kwargs.get("operation") != "CREATE":
                # kopf serves whatever the webhook registration sends: a pod's pool is
                # injected at its creation only, and a pod updated later (its pool since
                # deleted or edited) passes untouched.
                return
            # kopf passes the index under its id.
            ctx = context(kwargs["memo"])
            mutate_pod(body, patch, kwargs["pools_by_name"], ctx.settings, warnings)

        @kopf.on.validate(
            *POOL, id=VALIDATE_POOL_ID, operations=["CREATE", "UPDATE"], registry=registry
        )
        def validate_pool(
            *, body: kopf.Body, memo: Any, warnings: list[str], **kwargs: Any
        ) -> None:
            if not _checks_spec(kwargs):
                return
            ctx = context(memo)
            try:
                pool = admit_pool(body, ctx.settings)
            except api.InvalidSpec as e:
                raise kopf.AdmissionError(str(e), code=422) from e
            warning = policy_ref_warning(ctx.kube, pool)
            if warning is not None:
                warnings.append(warning)

        @kopf.on.validate(
            *POLICY, id=VALIDATE_POLICY_ID, operations=["CREATE", "UPDATE"], registry=registry
        )
        def validate_policy(*, body: kopf.Body, **kwargs: Any) -> None:
            if not _checks_spec(kwargs):
                return
            try:
                admit_policy(body)
            except api.InvalidSpec as e:
                raise kopf.AdmissionError(str(e), code=422) from e

    return registry


def _checks_spec(request: Mapping[str, Any]) -> bool:
    """Whether a validating webhook's request is a create or an update that changes the
    spec: only those are checked, whatever operations the registration sends (a DELETE of
    a pool a tightened operator policy no longer allows must go through)."""
    return request.get("operation") in ("CREATE", "UPDATE") and spec_changed(
        request.get("old"), request.get("new")
    )


def policy_ref_warning(kube: Kube, pool: api.KVCachePool) -> str | None:
    """An admission warning when the pool's `spec.policyRef` names no usable KVTierPolicy:
    the pool is admitted (the policy may be created next), but is not applied until then."""
    try:
        _resolve_policy(kube, pool)
    except Problem as problem:
        when = "exists" if problem.reason == Reason.POLICY_NOT_FOUND else "is fixed"
        return (
            f"{problem.message}: the operator applies the pool once the policy {when} "
            f"(until then the pool is Degraded with reason {problem.reason})"
        )
    except KubeError:
        return None  # cannot tell now; the reconcile reports it in the pool's status
    return None


def mutate_pod(
    body: Mapping[str, Any],
    patch: kopf.Patch,
    pools: Mapping[tuple[str, str], Any],
    settings: Settings,
    warnings: list[str] | None = None,
) -> None:
    """The webhook's work: find the pool the pod names, and inject it (or reject the pod).

    The pod's namespace is the admission request's (`NamespacedWebhookServer` puts it in
    the body). `warnings` get what the user should know: the pool does not serve yet, or
    why the pod is refused (also shown by `kubectl` on a refusal). The pool is checked
    against the operator policy as its render is: a pool stored past the validating
    webhook with a spec the policy forbids runs no agents, and its pods get nothing of it.
    """
    warnings = warnings if warnings is not None else []
    pool_name = requested_pool(body)
    if pool_name is None:
        return
    namespace = str((body.get("metadata") or {}).get("namespace") or "")
    found = pools.get((namespace, pool_name))
    pool_body = next(iter(found), None) if found is not None else None
    try:
        try:
            pool = check_pool(pool_name, namespace, pool_body)
        except Rejected as e:
            # An invalid edit stored past the validating webhook changes nothing that runs:
            # pods join the pool as its agents run it.
            deleting = (pool_body or {}).get("metadata", {}).get("deletionTimestamp")
            last = applied_pool(pool_body) if pool_body is not None else None
            if deleting or last is None:
                raise
            pool = last
            warnings.append(f"{e}; the pod joins the pool as its agents run it")
        check_allowed(pool, settings)
        inject(copy.deepcopy(dict(body)), pool)  # validates the tenant before the patch is built
    except Rejected as e:
        warnings.append(str(e))
        raise kopf.AdmissionError(str(e), code=400) from e
    assert pool_body is not None
    warning = readiness_warning(pool_name, pool_body)
    if warning is not None:
        warnings.append(warning)
    patch.fns.append(lambda raw: inject(raw, pool))  # type: ignore[arg-type]


__all__ = [
    "DEGRADED",
    "FINALIZER",
    "VALIDATE_POLICY_ID",
    "VALIDATE_POOL_ID",
    "WEBHOOK_ID",
    "Context",
    "backoff",
    "build_registry",
    "context",
    "finalize_pool",
    "mutate_pod",
    "propagate_policy",
    "reconcile_pool",
    "refresh_pool_status",
    "sync_policy_pools",
]
