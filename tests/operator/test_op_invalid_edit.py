"""An invalid edit stored past the validating webhook changes nothing that runs: the agents
keep the last good spec, Degraded says why, status describes what runs (its capacity
following the nodes), Ready follows the agents, and pods still join the pool, also after
the operator restarts (the last good spec is kept in the pool's status)."""

from __future__ import annotations

from typing import Any

import pytest
from op_cluster import Cluster, Emulator, patched, pool_known
from op_support import condition, pod_body, pool_body

pytestmark = pytest.mark.kmock(cls=Emulator)


async def _serving(cluster: Cluster, nodes: int) -> dict[str, Any]:
    """Pool `small` (8Gi of DRAM per node) with its agents ready on `nodes` nodes; its
    DaemonSet as the operator made it."""
    await cluster.create(pool_body())
    ds = await cluster.eventually(
        lambda: cluster.get("apps/v1", "DaemonSet", "kvpool-small"), "the agents"
    )
    await cluster.report_agents("kvpool-small", nodes, nodes, nodes, nodes)
    await cluster.condition_of("small", "Ready", "True", "AgentsReady")
    return ds


def _joined(response: dict[str, Any]) -> bool:
    """Whether the pod webhook admitted the pod into pool `small`, with its socket."""
    volumes = patched(pod_body(), response)["spec"]["volumes"]  # asserts it was allowed
    return any(v["name"] == "kvpool-socket" for v in volumes)


async def _edit_invalidly(cluster: Cluster, spec: dict[str, Any]) -> dict[str, Any]:
    """Store `spec` past the webhook (the emulator has none) and wait for the refusal."""
    await cluster.edit_pool("small", spec)
    await cluster.condition_of("small", "Degraded", "True", "InvalidSpec")
    pool = await cluster.pool("small")
    assert pool is not None
    return pool


async def test_an_invalid_edit_keeps_the_agents_and_says_why(cluster: Cluster) -> None:
    ds = await _serving(cluster, nodes=2)
    # A DRAM size that is not whole 2Mi pages with hugePages.
    pool = await _edit_invalidly(cluster, {"tiers": {"dram": {"size": "3Mi", "hugePages": True}}})
    assert "spec.tiers.dram" in condition(pool, "Degraded")["message"]
    status = pool["status"]
    assert status["observedGeneration"] == 2 and status["appliedGeneration"] == 1
    assert status["capacity"]["dram"]["perNode"] == "8Gi"  # what runs
    assert status["appliedSpec"]["tiers"]["dram"] == {"size": "8Gi"}
    ready_now = condition(pool, "Ready")
    assert (ready_now["status"], ready_now["reason"]) == ("True", "AgentsReady")
    after = await cluster.get("apps/v1", "DaemonSet", "kvpool-small")
    assert after is not None and after["spec"]["template"] == ds["spec"]["template"]

    response = await cluster.admit_pod(pod_body())
    assert any("is invalid" in w for w in response.get("warnings") or [])
    assert _joined(response)


async def test_pods_still_join_a_pool_with_an_invalid_edit_after_the_operator_restarts(
    cluster: Cluster,
) -> None:
    await _serving(cluster, nodes=3)
    await _edit_invalidly(cluster, {"agent": {"resources": {"limits": {"memory": "1Gi"}}}})
    await cluster.restart()

    # The new operator's webhook answers once its watch has listed the pool.
    response = await cluster.admit_pod(pod_body(), until=pool_known)
    (invalid,) = response.get("warnings") or [""]  # the pool is Ready: no other warning
    assert "at least 8513Mi is needed" in invalid
    assert invalid.endswith("the pod joins the pool as its agents run it")
    assert _joined(response)


async def test_capacity_follows_the_nodes_while_an_invalid_edit_is_stored(
    cluster: Cluster,
) -> None:
    await _serving(cluster, nodes=3)
    pool = await _edit_invalidly(cluster, {"agent": {"resources": {"limits": {"memory": "1Gi"}}}})
    assert pool["status"]["capacity"]["dram"] == {"perNode": "8Gi", "total": "24Gi"}

    await cluster.report_agents("kvpool-small", desired=4, ready=3, updated=4, available=3)

    async def four_nodes() -> dict[str, Any] | None:
        pool = await cluster.pool("small")
        status = (pool or {}).get("status") or {}
        return status if status.get("nodes", {}).get("desired") == 4 else None

    status = await cluster.eventually(four_nodes, "status.nodes.desired == 4")
    assert status["capacity"]["dram"] == {"perNode": "8Gi", "total": "32Gi"}
    assert condition(await cluster.pool("small"), "Degraded")["reason"] == "InvalidSpec"
