"""A KVTierPolicy's status.pools follows its pools: created, re-pointed, deleted."""

from __future__ import annotations

from typing import Any

import pytest
from op_cluster import Cluster, Emulator
from op_support import policy_body, pool_body

from kvpool.operator import api
from kvpool.operator.handlers import policy_pools

pytestmark = pytest.mark.kmock(cls=Emulator)


def test_policy_pools_lists_live_referencing_pools_bypolicy_body() -> None:
    pools = [
        {"metadata": {"name": "b"}, "spec": {"policyRef": {"name": "p"}}},
        {"metadata": {"name": "a"}, "spec": {"policyRef": {"name": "p"}}},
        {"metadata": {"name": "c"}, "spec": {}},
        {"metadata": {"name": "d", "deletionTimestamp": "x"}, "spec": {"policyRef": {"name": "p"}}},
    ]
    assert policy_pools(pools) == {"p": ["a", "b"]}


def _pool(name: str, policy: str) -> dict[str, Any]:
    return pool_body(name, policyRef={"name": policy})


async def _pools_of(cluster: Cluster, policy: str, want: list[str]) -> None:
    async def listed() -> bool:
        body = await cluster.get(api.API_VERSION, api.POLICY_KIND, policy)
        return ((body or {}).get("status") or {}).get("pools") == want

    await cluster.eventually(listed, f"{policy}.status.pools == {want}")


async def test_policy_status_follows_pools_created_repointed_and_deleted(cluster: Cluster) -> None:
    await cluster.create(policy_body("fast"))
    await cluster.create(policy_body("slow"))
    await _pools_of(cluster, "fast", [])
    await cluster.create(_pool("a", "fast"))
    await cluster.create(_pool("b", "fast"))
    await _pools_of(cluster, "fast", ["a", "b"])

    await cluster.edit_pool("a", {"policyRef": {"name": "slow"}})
    await _pools_of(cluster, "slow", ["a"])
    await _pools_of(cluster, "fast", ["b"])

    await cluster.delete(api.API_VERSION, api.POOL_KIND, "b")
    await cluster.report_reclaimed("b")
    await _pools_of(cluster, "fast", [])
    await _pools_of(cluster, "slow", ["a"])
