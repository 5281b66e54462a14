"""Names of what the operator creates: unique per (namespace, pool), valid for their kinds
for every pool name the CRD accepts, and cleaned up per pool by labels."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from op_cluster import NAMESPACE, Cluster, Emulator, cluster_on, name_problem
from op_support import pool_body

from kvpool.operator import api
from kvpool.operator.render import Names, Settings, render

RBAC = "rbac.authorization.k8s.io/v1"
OTHER = f"{NAMESPACE}-b"
PLURALS = {
    "ServiceAccount": "serviceaccounts",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "ConfigMap": "configmaps",
    "DaemonSet": "daemonsets",
    "Service": "services",
    "PodMonitor": "podmonitors",
}


def _pool(namespace: str, name: str) -> dict[str, Any]:
    return pool_body(name, namespace=namespace)


def _names(namespace: str, name: str) -> dict[str, str]:
    objects = render(api.parse_pool(_pool(namespace, name)), None, Settings(pod_monitor=True))
    return {o["kind"]: o["metadata"]["name"] for o in objects}


def test_cluster_scoped_names_differ_for_pools_whose_dashed_names_coincide() -> None:
    """Pool `b-x` in `team` and pool `x` in `team-b` once shared one ClusterRole."""
    a = _names("team", "b-x")
    b = _names("team-b", "x")
    assert a["ClusterRole"] != b["ClusterRole"]
    assert a["ClusterRoleBinding"] != b["ClusterRoleBinding"]


# The longest (namespace, name) pairs the operator accepts (`<namespace>.<name>` is a node
# label name: at most 63 characters), with dots where a DNS subdomain allows them.
LONGEST = [
    ("n" * 61, "a"),
    ("ns", "p" * 60),
    ("ns", "cache.v1"),
    ("ns", ".".join(["abcdefghi"] * 6)),
    ("a" * 30, "b.c" * 10 + "d"),
]


@pytest.mark.parametrize(("namespace", "name"), LONGEST)
def test_every_derived_name_is_valid_for_its_kind(namespace: str, name: str) -> None:
    api.check_pool_id(namespace, name)  # accepted
    for kind, object_name in _names(namespace, name).items():
        assert name_problem(PLURALS[kind], object_name) is None, (kind, object_name)
        if kind in ("DaemonSet", "ConfigMap", "ServiceAccount", "PodMonitor", "Service"):
            assert len(object_name) <= 63, (kind, object_name)
    job = Names(namespace, name).gc_job("0123456789abcdef")
    assert name_problem("jobs", job) is None and len(job) <= 63


def test_dotted_and_dashed_pool_names_get_different_services() -> None:
    assert _names("ns", "cache.v1")["Service"] != _names("ns", "cache-v1")["Service"]


def test_operator_upgrade_alone_changes_no_pod_template() -> None:
    """The operator's version labels the objects, never the agents' pod template."""
    body = api.parse_pool(_pool("ns", "p"))

    def daemon_set(version: str) -> dict[str, Any]:
        objects = render(body, None, Settings(agent_image="r/kvpool:1", version=version))
        return next(o for o in objects if o["kind"] == "DaemonSet")

    old, new = daemon_set("1.0.0"), daemon_set("1.1.0")
    assert old["spec"]["template"] == new["spec"]["template"]
    assert old["metadata"]["labels"]["app.kubernetes.io/version"] == "1.0.0"
    assert new["metadata"]["labels"]["app.kubernetes.io/version"] == "1.1.0"
    assert "app.kubernetes.io/version" not in old["spec"]["template"]["metadata"]["labels"]


# --------------------------------------------------------------------------- operator


@pytest.fixture
async def two_namespaces(kmock: Any) -> AsyncIterator[Cluster]:
    """The operator serving namespaces `inference` and `inference-b`."""
    cluster = cluster_on(kmock)
    async with cluster.running(
        dataclasses.replace(cluster.options, namespaces=[NAMESPACE, OTHER])
    ):
        yield cluster


def _ready_pool(cluster: Cluster, namespace: str, name: str) -> Any:
    async def reconciled() -> dict[str, Any] | None:
        p = await cluster.get(api.API_VERSION, api.POOL_KIND, name, namespace)
        return p if p and (p.get("status") or {}).get("socket") else None

    return reconciled


@pytest.mark.kmock(cls=Emulator)
async def test_deleting_one_of_two_colliding_pools_keeps_the_others_rbac(
    two_namespaces: Cluster,
) -> None:
    cluster = two_namespaces
    await cluster.create(_pool(NAMESPACE, "b-x"))
    await cluster.create(_pool(OTHER, "x"))
    await cluster.eventually(_ready_pool(cluster, NAMESPACE, "b-x"), "pool b-x")
    await cluster.eventually(_ready_pool(cluster, OTHER, "x"), "pool x")
    kept = Names(OTHER, "x").cluster_role
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        binding = await cluster.get(RBAC, kind, kept, None)
        assert binding is not None, kind

    await cluster.delete(api.API_VERSION, api.POOL_KIND, "b-x", NAMESPACE)
    await cluster.report_reclaimed("b-x")

    async def gone() -> bool:
        return await cluster.get(api.API_VERSION, api.POOL_KIND, "b-x", NAMESPACE) is None

    await cluster.eventually(gone, "pool b-x deleted")
    gone_role = Names(NAMESPACE, "b-x").cluster_role
    assert await cluster.get(RBAC, "ClusterRole", gone_role, None) is None
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        obj = await cluster.get(RBAC, kind, kept, None)
        assert obj is not None, f"pool x lost its {kind}"
    binding = await cluster.get(RBAC, "ClusterRoleBinding", kept, None)
    assert binding is not None
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvpool-x", "namespace": OTHER}
    ]


@pytest.mark.kmock(cls=Emulator)
async def test_a_dotted_pool_name_gets_every_object(cluster: Cluster) -> None:
    await cluster.create(_pool(NAMESPACE, "cache.v1"))

    async def healthy() -> dict[str, Any] | None:
        p = await cluster.pool("cache.v1")
        conditions = {c["type"]: c for c in ((p or {}).get("status") or {}).get("conditions", [])}
        degraded = conditions.get("Degraded")
        return p if degraded and degraded["status"] == "False" else None

    await cluster.eventually(healthy, "the dotted pool reconciled without a problem")
    names = Names(NAMESPACE, "cache.v1")
    assert await cluster.get("v1", "Service", names.service) is not None
    assert await cluster.get("apps/v1", "DaemonSet", names.agent) is not None
