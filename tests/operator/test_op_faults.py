"""The operator under API faults: errors and dropped watches are retried and end right.

The emulator answers chosen requests of the operator with 409 Conflict or 500
InternalError, or ends watch streams after their first event; every test then checks
that the faults really hit and that the pools end in the state they would have reached
without them.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from op_cluster import NAMESPACE, Cluster, Emulator, Fault
from op_support import condition, policy_body, pool_body, secret_body

from kvpool.operator import api, metrics
from kvpool.operator.handlers import backoff

pytestmark = pytest.mark.kmock(cls=Emulator)

POOL = "llama-70b"
DS = "kvpool-llama-70b"


async def _create_all(cluster: Cluster) -> None:
    await cluster.create(secret_body())
    await cluster.create(policy_body())
    await cluster.create(pool_body(source="pool.yaml"))


async def _healthy(cluster: Cluster, name: str = POOL) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        pool = await cluster.pool(name)
        degraded = condition(pool, "Degraded")
        status = (pool or {}).get("status") or {}
        if degraded and degraded["status"] == "False" and status.get("policy") is not None:
            return pool
        return None

    result: dict[str, Any] = await cluster.eventually(probe, f"pool {name} healthy", timeout=60)
    return result


def _reasons_seen(cluster: Cluster, name: str = POOL) -> set[str]:
    """Every Degraded reason the pool's stored versions carried."""
    obj = cluster.emulator.objects[f"{api.GROUP}/{api.VERSION}/{api.POOL_PLURAL}", NAMESPACE, name]
    reasons = set()
    for version in obj.history:
        if version is None:
            continue
        cond = condition(dict(version), "Degraded")
        if cond and cond["status"] == "True":
            reasons.add(cond["reason"])
    return reasons


@pytest.mark.parametrize(
    ("retry", "delay"), [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (100, 5.0)]
)
def test_backoff_doubles_up_to_its_cap(retry: int, delay: float) -> None:
    assert backoff(retry, 0.5, 5.0) == delay


async def test_server_errors_on_apply_are_retried_with_backoff_until_healthy(
    cluster: Cluster,
) -> None:
    errors = metrics.RECONCILE_ERRORS.labels(kind=api.POOL_KIND, reason="ApplyFailed")
    before = errors._value.get()
    create_ds = Fault("create", "daemonsets", 500, times=3)
    cluster.emulator.faults.append(create_ds)
    # No policy: only the pool's own handler creates the DaemonSet, so its attempts are
    # the handler's retries and nothing else.
    await cluster.create(pool_body())
    await _healthy(cluster, "small")

    assert create_ds.hits == 3
    assert await cluster.get("apps/v1", "DaemonSet", "kvpool-small") is not None
    # Each failure was reported, not swallowed: the pool showed it, the metric counted it.
    assert "ApplyFailed" in _reasons_seen(cluster, "small")
    assert errors._value.get() - before >= 3
    # One attempt per failure and one that succeeded: retried, never given up. (The delays
    # kopf is asked for are `backoff()`'s, tested above; the emulator has no resourceVersion,
    # so kopf cannot hold an event back until its own progress patch is visible, and a
    # retry here may come early: timings on it would test the emulator.)
    creates = [
        c for c in cluster.emulator.calls if (c.verb, c.resource) == ("create", "daemonsets")
    ]
    assert len(creates) == 4


async def test_server_errors_while_resolving_policy_and_secret_are_retried(
    cluster: Cluster,
) -> None:
    get_policy = Fault("get", api.POLICY_PLURAL, 500, times=2)
    get_secret = Fault("get", "secrets", 500, times=2)
    cluster.emulator.faults.extend([get_policy, get_secret])
    await _create_all(cluster)
    await _healthy(cluster)
    assert (get_policy.hits, get_secret.hits) == (2, 2)
    assert "ApplyFailed" in _reasons_seen(cluster)
    assert await cluster.get("apps/v1", "DaemonSet", DS) is not None


async def test_conflicts_on_patches_are_retried_and_the_policy_change_lands(
    cluster: Cluster,
) -> None:
    await _create_all(cluster)
    await _healthy(cluster)
    patch_cm = Fault("patch", "configmaps", 409, times=2)
    patch_status = Fault("patch", f"{api.POOL_PLURAL}/status", 409, times=2)
    cluster.emulator.faults.extend([patch_cm, patch_status])

    await cluster.edit_policy("llama-70b", {"prefetch": {"lookaheadChunks": 3}})

    async def landed() -> dict[str, Any] | None:
        pool = await cluster.pool(POOL)
        policy = ((pool or {}).get("status") or {}).get("policy") or {}
        cm = await cluster.get("v1", "ConfigMap", DS)
        data = yaml.safe_load(((cm or {}).get("data") or {}).get("policy.yaml", "{}"))
        if policy.get("generation") == 2 and data["prefetch"]["lookaheadChunks"] == 3:
            return pool
        return None

    pool = await cluster.eventually(landed, "the new policy in ConfigMap and status", timeout=60)
    assert (patch_cm.hits, patch_status.hits) == (2, 2)
    assert condition(pool, "Degraded")["status"] == "False"


async def test_a_create_race_is_resolved_by_patching(cluster: Cluster) -> None:
    """409 AlreadyExists on create (someone else was first): apply reads and patches."""
    created = Fault("create", "configmaps", 409, times=1, reason="AlreadyExists")
    cluster.emulator.faults.append(created)
    await _create_all(cluster)
    await _healthy(cluster)
    assert created.hits == 1
    assert await cluster.get("v1", "ConfigMap", DS) is not None


async def test_server_errors_on_kopfs_own_calls_are_retried(cluster: Cluster) -> None:
    """kopf adds its finalizer and keeps its progress with patches of the pool: those fail
    too, and kopf retries them itself."""
    patch_pool = Fault("patch", api.POOL_PLURAL, 500, times=2)
    cluster.emulator.faults.append(patch_pool)
    await _create_all(cluster)
    await _healthy(cluster)

    async def finalizer() -> dict[str, Any] | None:
        pool = await cluster.pool(POOL)
        return (
            pool
            if "kvpool.io/finalizer" in (pool or {})["metadata"].get("finalizers", [])
            else None
        )

    await cluster.eventually(finalizer, "kopf's finalizer on the pool", timeout=60)
    assert patch_pool.hits == 2


async def test_dropped_watches_are_resumed_and_every_change_is_seen(cluster: Cluster) -> None:
    """Watch streams that end after one event: kopf watches again (and gets every object
    replayed), and the handlers converge, idempotently."""
    cluster.emulator.watch_cuts = 30
    await _create_all(cluster)
    await _healthy(cluster)
    await cluster.edit_policy("llama-70b", {"prefetch": {"lookaheadChunks": 5}})
    await cluster.report_agents(DS, desired=2, ready=2, updated=2, available=2)

    async def converged() -> dict[str, Any] | None:
        pool = await cluster.pool(POOL)
        ready = condition(pool, "Ready")
        policy = ((pool or {}).get("status") or {}).get("policy") or {}
        if ready and ready["status"] == "True" and policy.get("generation") == 2:
            return pool
        return None

    await cluster.eventually(converged, "Ready with the new policy", timeout=60)
    assert cluster.emulator.watches_cut > 3
    watches = [c for c in cluster.emulator.calls if c.verb == "watch"]
    assert len(watches) > cluster.emulator.watches_cut  # every cut stream was watched again


async def test_a_hundred_pools_reconcile_without_error(cluster: Cluster) -> None:
    ok = metrics.RECONCILES.labels(kind=api.POOL_KIND, result="success")
    failed = metrics.RECONCILES.labels(kind=api.POOL_KIND, result="error")
    ok_before, failed_before = ok._value.get(), failed._value.get()
    names = [f"pool-{i:03d}" for i in range(100)]
    for name in names:
        await cluster.create(pool_body(name))

    async def all_reconciled() -> bool:
        pools = await cluster.call(cluster.kube.list, api.API_VERSION, api.POOL_KIND, NAMESPACE)
        done = {
            p["metadata"]["name"]
            for p in pools
            if condition(p, "Degraded").get("status") == "False"
            and (p.get("status") or {}).get("policy") is not None
        }
        return done == set(names)

    await cluster.eventually(all_reconciled, "100 pools reconciled", timeout=240, interval=1.0)
    for name in names:
        key = ("apps/v1/daemonsets", NAMESPACE, f"kvpool-{name}")
        assert not cluster.emulator.objects[key].deleted
    assert failed._value.get() == failed_before
    assert ok._value.get() - ok_before >= 100
    assert not [c for c in cluster.emulator.calls if c.verb in ("update", "delete")]
