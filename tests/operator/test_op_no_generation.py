"""Servers without metadata.generation (kmock as shipped): the policy checksum still tells."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from op_cluster import Cluster, EmulatorWithoutGenerations
from op_support import policy_body, pool_body

pytestmark = pytest.mark.kmock(cls=EmulatorWithoutGenerations)


async def test_policy_change_shows_in_status_without_generations(cluster: Cluster) -> None:
    await cluster.create(policy_body())
    await cluster.create(pool_body(policyRef={"name": "llama-70b"}))

    async def status() -> dict[str, Any] | None:
        p = await cluster.pool("small")
        return (p or {}).get("status", {}).get("policy")

    first = await cluster.eventually(status, "the policy in the pool's status")
    assert "generation" not in first and first["name"] == "llama-70b"
    p = await cluster.pool("small")
    assert p is not None and "observedGeneration" not in p["status"]

    await cluster.edit_policy("llama-70b", {"prefetch": {"lookaheadChunks": 2}})

    async def new_checksum() -> dict[str, Any] | None:
        st = await status()
        return st if st and st["checksum"] != first["checksum"] else None

    await cluster.eventually(new_checksum, "a new policy checksum in the pool's status")
    cm = await cluster.get("v1", "ConfigMap", "kvpool-small")
    assert cm is not None
    assert yaml.safe_load(cm["data"]["policy.yaml"])["prefetch"]["lookaheadChunks"] == 2
