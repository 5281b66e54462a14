"""A KVTierPolicy's status.pools follows its pools: created, re-pointed, deleted."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from op_cluster import Cluster, Emulator
from op_support import example

from kvpool.operator import api
from kvpool.operator.handlers import policy_pools

pytestmark = pytest.mark.kmock(cls=Emulator)


def test_policy_pools_lists_live_referencing_pools_by_policy() -> None:
    pools = [
        {"metadata": {"name": "b"}, "spec": {"policyRef": {"name": "p"}}},
        {"metadata": {"name": "a"}, "spec": {"policyRef": {"name": "p"}}},
        {"metadata": {"name": "c"}, "spec": {}},
        {"metadata": {"name": "d", "deletionTimestamp": "x"}, "spec": {"policyRef": {"name": "p"}}},
    ]
    assert policy_pools(pools) == {"p": ["a", "b"]}


def _policy(name: str) -> dict[str, Any]:
    body = copy.deepcopy(example("policy.yaml", api.POLICY_KIND))
    body["metadata"]["name"] = name
    return body


def _pool(name: str, policy: str) -> dict[str, Any]:
    body = copy.deepcopy(example("pool-minimal.yaml", api.POOL_KIND))
    body["metadata"] = {"name": name, "namespace": "inference"}
    body["spec"]["policyRef"] = {"name": policy}
    return body


async def _pools_of(cluster: Cluster, policy: str, want: list[str]) -> None:
    async def listed() -> bool:
        body = await cluster.get(api.API_VERSION, api.POLICY_KIND, policy)
        return ((body or {}).get("status") or {}).get("pools") == want

    await cluster.eventually(listed, f"{policy}.status.pools == {want}")


async def test_policy_status_follows_pools_created_repointed_and_deleted(cluster: Cluster) -> None:
    await cluster.create(_policy("fast"))
    await cluster.create(_policy("slow"))
    await _pools_of(cluster, "fast", [])
    await cluster.create(_pool("a", "fast"))
    await cluster.create(_pool("b", "fast"))
    await _pools_of(cluster, "fast", ["a", "b"])

    repoint = {"spec": {"policyRef": {"name": "slow"}}}
    await cluster.patch(api.API_VERSION, api.POOL_KIND, "a", repoint)
    await _pools_of(cluster, "slow", ["a"])
    await _pools_of(cluster, "fast", ["b"])

    await cluster.delete(api.API_VERSION, api.POOL_KIND, "b")
    await _pools_of(cluster, "fast", [])
    await _pools_of(cluster, "slow", ["a"])
