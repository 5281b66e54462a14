"""What the spec no longer says leaves the cluster: the operator's apply is a three-way
merge against what it applied last, as `kubectl apply` is."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from op_cluster import Cluster, Emulator, cluster_on
from op_support import example

from kvpool.operator import api
from kvpool.operator.kube import LAST_APPLIED, deletions
from kvpool.operator.operator_policy import OperatorPolicy
from kvpool.operator.render import Names

POOL = "llama-70b"
AGENTS = Names("inference", POOL).agent

pytestmark = pytest.mark.kmock(cls=Emulator)


def test_deletions_remove_only_what_was_applied_and_is_no_longer_rendered() -> None:
    last = {"spec": {"a": 1, "b": {"c": 2, "d": 3}, "l": [1]}}
    desired = {"spec": {"b": {"c": 2}}}
    live = {"spec": {"a": 1, "b": {"c": 2, "d": 3, "default": 4}, "l": [1], "other": 5}}
    assert deletions(last, desired, live) == {"spec": {"a": None, "b": {"d": None}, "l": None}}
    # Already gone from the live object: nothing to send.
    assert deletions(last, desired, {"spec": {"b": {"c": 2}}}) == {}


@pytest.fixture
async def root_allowed(kmock: Any) -> AsyncIterator[Cluster]:
    """The operator with an operator policy that lets pools run their agent as root."""
    cluster = cluster_on(kmock)
    base = cluster.options
    settings = dataclasses.replace(base.settings, policy=OperatorPolicy(allow_root=True))
    async with cluster.running(dataclasses.replace(base, settings=settings)):
        yield cluster


def _pool() -> dict[str, Any]:
    body = copy.deepcopy(example("pool.yaml", api.POOL_KIND))
    del body["spec"]["policyRef"]
    del body["spec"]["tiers"]["shared"]  # no Secret needed
    body["spec"]["nodeSelector"]["zone"] = "a"
    body["spec"]["tenants"] = [{"name": "chat"}, {"name": "batch"}]
    return body


async def test_removed_fields_leave_the_live_daemon_set(root_allowed: Cluster) -> None:
    cluster = root_allowed
    await cluster.create(_pool())
    ds = await cluster.eventually(lambda: cluster.get("apps/v1", "DaemonSet", AGENTS), "agents")
    pod = ds["spec"]["template"]["spec"]
    assert pod["tolerations"] and pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"]["zone"] == "a" and "initContainers" in pod
    assert LAST_APPLIED in ds["metadata"]["annotations"]

    # Tolerations, the priority class, a nodeSelector entry and a tenant go; the agent
    # becomes root (no init container then).
    await cluster.edit_pool(
        POOL,
        {
            "tolerations": None,
            "nodeSelector": {"zone": None},
            "tenants": [{"name": "chat"}],
            "agent": {"priorityClassName": None, "runAsUser": 0},
        },
    )

    async def root() -> dict[str, Any] | None:
        live = await cluster.get("apps/v1", "DaemonSet", AGENTS)
        spec = (live or {}).get("spec", {}).get("template", {}).get("spec", {})
        return live if spec.get("securityContext", {}).get("runAsUser") == 0 else None

    ds = await cluster.eventually(root, "the DaemonSet of a root agent")
    pod = ds["spec"]["template"]["spec"]
    assert "tolerations" not in pod
    assert "priorityClassName" not in pod
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "initContainers" not in pod
    cm = await cluster.get("v1", "ConfigMap", AGENTS)
    assert cm is not None and "batch" not in cm["data"]["agent.yaml"]


async def test_fields_others_set_are_left_alone(root_allowed: Cluster) -> None:
    """A field the operator never rendered (another controller's annotation, a server
    default) survives its applies, and the second reconcile sends nothing."""
    cluster = root_allowed
    await cluster.create(_pool())
    await cluster.eventually(lambda: cluster.get("apps/v1", "DaemonSet", AGENTS), "agents")
    await cluster.patch(
        "apps/v1",
        "DaemonSet",
        AGENTS,
        {
            "metadata": {"annotations": {"example.com/owner": "someone"}},
            "spec": {"revisionHistoryLimit": 10},
        },
    )
    await cluster.edit_pool(POOL, {"tolerations": None})

    async def applied() -> dict[str, Any] | None:
        live = await cluster.get("apps/v1", "DaemonSet", AGENTS)
        pod = (live or {}).get("spec", {}).get("template", {}).get("spec", {})
        return live if live and "tolerations" not in pod else None

    ds = await cluster.eventually(applied, "the tolerations removed")
    assert ds["metadata"]["annotations"]["example.com/owner"] == "someone"
    assert ds["spec"]["revisionHistoryLimit"] == 10
