"""An invalid edit stored past the validating webhook changes nothing that runs: the agents
keep the last good spec, Degraded says why, status describes what runs, Ready follows the
agents, and pods still join the pool."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest
from op_cluster import NAMESPACE, Cluster, Emulator
from op_support import example
from test_op_pod_webhook import _admit, _pod

from kvpool.operator import api

pytestmark = pytest.mark.kmock(cls=Emulator)


def _condition(pool: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((pool or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


async def test_an_invalid_edit_keeps_the_agents_and_says_why(cluster: Cluster) -> None:
    body = copy.deepcopy(example("pool-minimal.yaml", api.POOL_KIND))
    body["metadata"]["namespace"] = NAMESPACE
    await cluster.create(body)
    ds = await cluster.eventually(
        lambda: cluster.get("apps/v1", "DaemonSet", "kvpool-small"), "the agents"
    )
    await cluster.patch(
        "apps/v1",
        "DaemonSet",
        "kvpool-small",
        {
            "status": {
                "observedGeneration": ds["metadata"]["generation"],
                "desiredNumberScheduled": 2,
                "numberReady": 2,
                "updatedNumberScheduled": 2,
                "numberAvailable": 2,
            }
        },
        "status",
    )

    async def ready() -> bool:
        return _condition(await cluster.pool("small"), "Ready").get("status") == "True"

    await cluster.eventually(ready, "Ready")

    # Stored past the webhook: a DRAM size that is not whole 2Mi pages with hugePages.
    await cluster.patch(
        api.API_VERSION,
        api.POOL_KIND,
        "small",
        {"spec": {"tiers": {"dram": {"size": "3Mi", "hugePages": True}}}},
    )

    async def refused() -> dict[str, Any] | None:
        pool = await cluster.pool("small")
        degraded = _condition(pool, "Degraded")
        return pool if degraded.get("reason") == "InvalidSpec" else None

    pool = await cluster.eventually(refused, "Degraded/InvalidSpec")
    assert "spec.tiers.dram" in _condition(pool, "Degraded")["message"]
    status = pool["status"]
    assert status["observedGeneration"] == 2 and status["appliedGeneration"] == 1
    assert status["capacity"]["dram"]["perNode"] == "8Gi"  # what runs
    ready_now = _condition(pool, "Ready")
    assert (ready_now["status"], ready_now["reason"]) == ("True", "AgentsReady")
    after = await cluster.get("apps/v1", "DaemonSet", "kvpool-small")
    assert after is not None and after["spec"]["template"] == ds["spec"]["template"]

    pod = _pod()
    response = await _admit(cluster, pod)
    assert response["allowed"] is True, response
    assert any("is invalid" in w for w in response.get("warnings") or [])
    ops = json.loads(base64.b64decode(response["patch"]))
    assert any(op.get("path") == "/spec/volumes" for op in ops)
