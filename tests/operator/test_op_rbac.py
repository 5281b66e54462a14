"""Least privilege of the operator, shown by the requests it really makes.

The operator runs against the emulator through a pool's whole life (create, drift
repair, a policy change, rollout status, a deleted DaemonSet, KV events and peers turned
off, deletion with a gc Job), with a namespace pattern and `--pod-monitor`, so every kind
of call it can make is made. The emulator records each request of the operator (kopf's and
its own client's) as an RBAC verb on a resource; the chart's ClusterRole must grant exactly
those, plus what the operator only holds to grant the agents. The same run checks that the
pool's S3 credentials and its peer secret never leave their Secrets: not into another
object, not into a log line.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import helm_python
import kmock as kmock_module
import pytest
import yaml
from op_cluster import NAMESPACE, Call, Cluster, Emulator, cluster_on
from op_support import ROOT, condition, example

from kvpool.operator import api
from kvpool.operator.render import Names

pytestmark = pytest.mark.kmock(cls=Emulator)

CHART = ROOT / "charts" / "kvpool"
POOL = "llama-70b"
CHILD = "kvpool-llama-70b"
ROLE = Names(NAMESPACE, POOL).cluster_role
PEERS = Names(NAMESPACE, POOL).peers
ACCESS_KEY = "AKIAKVPOOLLEAKCHECK7Q"
SECRET_KEY = "kvpool-leak-check/s3cr3t+9f8e7d6c5b4a"
RBAC = "rbac.authorization.k8s.io/v1"

Grant = tuple[str, str, str]
"""(API group, resource, verb), as in an RBAC rule."""


def _grants(rules: list[dict[str, Any]]) -> set[Grant]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _chart_role(values: dict[str, Any]) -> set[Grant]:
    with helm_python.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="kvpool", namespace="kvpool", is_install=True)
    docs = yaml.safe_load_all(next(t for p, t in files.items() if p.endswith("clusterrole.yaml")))
    (role,) = [d for d in docs if d and d["kind"] == "ClusterRole"]
    return _grants(role["rules"])


def _used(calls: list[Call]) -> set[Grant]:
    return {(c.group, c.resource, c.verb) for c in calls}


@pytest.fixture
async def patterned(kmock: Any) -> AsyncIterator[Cluster]:
    """The operator serving the pattern `infer*` (as `--namespace 'infer*'`), with
    `--pod-monitor`; namespaces `inference` and `other` exist."""
    cluster = cluster_on(kmock)
    kmock.resources["monitoring.coreos.com/v1/podmonitors"] = kmock_module.ResourceInfo(
        kind="PodMonitor", namespaced=True, verbs={"create", "get", "list", "patch", "watch"}
    )
    for ns in (NAMESPACE, "other"):
        await cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    base = cluster.options
    settings = dataclasses.replace(base.settings, pod_monitor=True)
    async with cluster.running(
        dataclasses.replace(base, namespaces=["infer*"], settings=settings)
    ):
        yield cluster


async def _pool_life(cluster: Cluster) -> bytes:
    """Everything the operator does for one pool, start to end; returns the pool's peer
    secret (the value of the Secret the operator made)."""
    secret = copy.deepcopy(example("pool.yaml", "Secret"))
    secret["stringData"] = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    # The tests' own client echoes the Secret it creates at DEBUG; only the operator's
    # logging is under test (it reads no Secret before the pool exists).
    rest = logging.getLogger("kubernetes.client.rest")
    level = rest.level
    rest.setLevel(logging.INFO)
    try:
        await cluster.create(secret)
    finally:
        rest.setLevel(level)
    await cluster.create(copy.deepcopy(example("policy.yaml", api.POLICY_KIND)))
    body = copy.deepcopy(example("pool.yaml", api.POOL_KIND))
    body["spec"]["tiers"]["shared"]["reclaimPolicy"] = "Delete"
    await cluster.create(body)

    async def healthy() -> dict[str, Any] | None:
        pool = await cluster.pool(POOL)
        ok = condition(pool, "Degraded").get("status") == "False"
        return pool if ok and ((pool or {}).get("status") or {}).get("policy") else None

    await cluster.eventually(healthy, "the pool healthy")
    assert await cluster.get("monitoring.coreos.com/v1", "PodMonitor", CHILD) is not None

    # Drift on every child: the next reconcile patches each back.
    children = [
        ("v1", "ServiceAccount", CHILD, NAMESPACE),
        ("v1", "ConfigMap", CHILD, NAMESPACE),
        ("v1", "Service", f"{CHILD}-metrics", NAMESPACE),
        ("v1", "Service", f"{CHILD}-events", NAMESPACE),
        ("v1", "Service", PEERS, NAMESPACE),
        ("v1", "Secret", PEERS, NAMESPACE),
        ("networking.k8s.io/v1", "NetworkPolicy", PEERS, NAMESPACE),
        ("apps/v1", "DaemonSet", CHILD, NAMESPACE),
        ("monitoring.coreos.com/v1", "PodMonitor", CHILD, NAMESPACE),
        (RBAC, "ClusterRole", ROLE, None),
        (RBAC, "ClusterRoleBinding", ROLE, None),
    ]
    for api_version, kind, name, ns in children:
        await cluster.call(
            cluster.kube.patch,
            api_version,
            kind,
            ns,
            name,
            {"metadata": {"labels": {"app.kubernetes.io/part-of": "drifted"}}},
        )
    await cluster.edit_pool(POOL, {"chunkTokens": 512})

    async def repaired() -> bool:
        for api_version, kind, name, ns in children:
            obj = await cluster.call(cluster.kube.get, api_version, kind, ns, name)
            if (obj or {}).get("metadata", {}).get("labels", {}).get(
                "app.kubernetes.io/part-of"
            ) != ("kvpool"):
                return False
        return True

    await cluster.eventually(repaired, "every child repaired")

    # A policy change, a rollout, a deleted DaemonSet.
    await cluster.edit_policy("llama-70b", {"prefetch": {"lookaheadChunks": 4}})
    await cluster.report_agents(CHILD, desired=1, ready=1, updated=1, available=1)
    await cluster.condition_of(POOL, "Ready", "True", "AgentsReady")
    await cluster.delete("apps/v1", "DaemonSet", CHILD)

    async def recreated() -> bool:
        return await cluster.get("apps/v1", "DaemonSet", CHILD) is not None

    await cluster.eventually(recreated, "the DaemonSet put back")

    # An edit the operator policy does not allow (stored past the webhook): no agents; and
    # back within it: the agents return.
    await cluster.edit_pool(POOL, {"agent": {"runAsUser": 0}})

    async def no_agents() -> bool:
        return await cluster.get("apps/v1", "DaemonSet", CHILD) is None

    await cluster.eventually(no_agents, "the DaemonSet deleted")
    await cluster.edit_pool(POOL, {"agent": {"runAsUser": 65532}})
    await cluster.eventually(recreated, "the DaemonSet back")

    # KV events turned off (last: it changes the agents' template, which the rollout steps
    # above read): the operator deletes the pool's events Service.
    events_service = Names(NAMESPACE, POOL).events_service
    assert await cluster.get("v1", "Service", events_service) is not None
    await cluster.edit_pool(POOL, {"events": {"enabled": False}})

    async def events_off() -> bool:
        return await cluster.get("v1", "Service", events_service) is None

    await cluster.eventually(events_off, "the events Service deleted")

    # Peers turned off: the operator deletes the pool's peer Secret, Service and policy.
    secret = await cluster.get("v1", "Secret", PEERS)
    peer_secret = base64.b64decode(((secret or {}).get("data") or {}).get("secret", ""))
    assert len(bytes.fromhex(peer_secret.decode())) == 32
    peer_objects = [
        ("v1", "Secret"), ("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy")
    ]
    await cluster.patch(
        api.API_VERSION, api.POOL_KIND, POOL, {"spec": {"peers": {"enabled": False}}}
    )

    async def peers_off() -> bool:
        return all([await cluster.get(v, k, PEERS) is None for v, k in peer_objects])

    await cluster.eventually(peers_off, "the peer objects deleted")

    # Deletion: the gc Job runs and succeeds, the cluster-scoped RBAC goes.
    pool = await cluster.pool(POOL)
    assert pool is not None
    job = Names(NAMESPACE, POOL).gc_job(pool["metadata"]["uid"])
    await cluster.delete(api.API_VERSION, api.POOL_KIND, POOL)
    await cluster.eventually(lambda: cluster.get("batch/v1", "Job", job), "the gc Job")
    await cluster.patch("batch/v1", "Job", job, {"status": {"succeeded": 1}}, "status")
    await cluster.report_reclaimed(POOL)

    async def gone() -> bool:
        return await cluster.pool(POOL) is None

    await cluster.eventually(gone, "the pool deleted")
    assert await cluster.get(RBAC, "ClusterRole", ROLE, None) is None
    return peer_secret


async def test_chart_grants_exactly_what_the_operator_calls(
    patterned: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await _pool_life(patterned)
    used = _used(patterned.emulator.calls)
    granted = _chart_role(
        {"operator": {"watchNamespaces": ["infer*"], "extraArgs": ["--pod-monitor"]}}
    )
    # What the operator holds only so that it may grant it to each pool's agents (RBAC
    # lets a subject grant only permissions it has): the agents' ClusterRole, as rendered.
    role = next(
        o
        for o in patterned.emulator.objects.values()
        if o.history[0] is not None and dict(o.history[0]).get("kind") == "ClusterRole"
    )
    for_agents = _grants(dict(role.history[0])["rules"])
    assert for_agents == {("", "nodes", "get"), ("", "nodes", "patch")}

    assert used - granted == set(), "the operator calls what the chart does not grant"
    assert granted - used == for_agents, "the chart grants what the operator never calls"
    assert for_agents.isdisjoint(used)  # the operator itself never touches nodes


async def test_namespace_pattern_is_served_and_others_are_not(patterned: Cluster) -> None:
    for ns in (NAMESPACE, "other"):
        body = copy.deepcopy(example("pool-minimal.yaml", api.POOL_KIND))
        body["metadata"]["namespace"] = ns
        await patterned.create(body)

    async def served() -> dict[str, Any] | None:
        return await patterned.get("v1", "ConfigMap", "kvpool-small", NAMESPACE)

    await patterned.eventually(served, "the pool in the matching namespace reconciled")
    # The other pool is outside the pattern: never reconciled (its watch never existed).
    assert await patterned.get("v1", "ConfigMap", "kvpool-small", "other") is None
    pools = {c.namespace for c in patterned.emulator.calls if c.resource == api.POOL_PLURAL}
    assert "other" not in pools
    # A namespace created later that matches is picked up by kopf's namespace watch.
    await patterned.create(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "inference-b"}}
    )
    body = copy.deepcopy(example("pool-minimal.yaml", api.POOL_KIND))
    body["metadata"]["namespace"] = "inference-b"
    await patterned.create(body)

    async def served_later() -> dict[str, Any] | None:
        return await patterned.get("v1", "ConfigMap", "kvpool-small", "inference-b")

    await patterned.eventually(served_later, "the pool in a new matching namespace")


async def test_without_patterns_the_operator_never_lists_namespaces_or_crds(
    cluster: Cluster,
) -> None:
    body = copy.deepcopy(example("pool-minimal.yaml", api.POOL_KIND))
    body["metadata"]["namespace"] = NAMESPACE
    await cluster.create(body)
    await cluster.eventually(
        lambda: cluster.get("v1", "ConfigMap", "kvpool-small"), "the pool reconciled"
    )
    resources = {c.resource for c in cluster.emulator.calls}
    assert api.POOL_PLURAL in resources
    assert not {"namespaces", "customresourcedefinitions"} & resources
    granted = _chart_role({"operator": {"watchNamespaces": [NAMESPACE]}})
    assert not {g for g in granted if g[1] in ("namespaces", "customresourcedefinitions")}
    assert _used(cluster.emulator.calls) <= granted


def _leaks(text: str, peer_secret: bytes = b"") -> list[str]:
    forms = {
        ACCESS_KEY,
        SECRET_KEY,
        base64.b64encode(ACCESS_KEY.encode()).decode(),
        base64.b64encode(SECRET_KEY.encode()).decode(),
    }
    if peer_secret:
        forms |= {base64.b64encode(peer_secret).decode(), peer_secret.decode()}
    return [f for f in forms if f in text]


async def test_credentials_never_leave_their_secret(
    patterned: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    peer_secret = await _pool_life(patterned)

    checked = set()
    for key, obj in patterned.emulator.objects.items():
        resource, _, name = key
        for version in obj.history:
            if version is None:
                continue
            raw = dict(getattr(version, "raw", version))
            plural = getattr(resource, "plural", "")
            if plural == "secrets":
                continue
            checked.add(plural)
            assert not _leaks(json.dumps(raw), peer_secret), f"{plural} {name}"
            containers = [
                c
                for spec in (((raw.get("spec") or {}).get("template") or {}).get("spec") or {},)
                for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
            ]
            for container in containers:
                for env in container.get("env") or []:
                    if env["name"].startswith("AWS_") and env["name"].endswith(("_ID", "_KEY")):
                        assert "value" not in env, (raw.get("kind"), env)
    # What the run wrote: children, the gc Job, kopf's Events.
    assert {"configmaps", "daemonsets", "jobs", "events", api.POOL_PLURAL} <= checked
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) > 20  # kopf's and the operator's debug logging was captured
    leaked = [m for m in messages if _leaks(m, peer_secret)]
    assert leaked == []
