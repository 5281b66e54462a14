"""The pool validating webhook, as the API server calls it: what it warns about, and the
requests it leaves alone whatever its registration sends."""

from __future__ import annotations

import pytest
from op_cluster import Cluster, Emulator
from op_support import policy_body, pool_body

pytestmark = pytest.mark.kmock(cls=Emulator)


async def test_a_pool_naming_a_missing_policy_is_admitted_with_a_warning(
    cluster: Cluster,
) -> None:
    pool = pool_body(policyRef={"name": "fast"})
    response = await cluster.admit_pool(pool)
    assert response["allowed"] is True, response
    (warning,) = response["warnings"]
    assert warning.startswith(
        "KVTierPolicy 'fast' (spec.policyRef) not found in namespace 'inference'"
    ), warning
    assert "Degraded with reason PolicyNotFound" in warning

    await cluster.create(policy_body("fast"))
    response = await cluster.admit_pool(pool)
    assert response["allowed"] is True and "warnings" not in response, response


async def test_a_pool_the_operator_policy_forbids_can_still_be_deleted(
    cluster: Cluster,
) -> None:
    """A registration that also sends DELETE (or CONNECT) gets no refusal for a stored
    spec a tightened operator policy no longer allows."""
    forbidden = pool_body(agent={"runAsUser": 0})
    response = await cluster.admit_pool(forbidden)
    assert response["allowed"] is False  # as a create it is refused ...
    response = await cluster.admit_pool(forbidden, "DELETE")
    assert response["allowed"] is True, response  # ... as a deletion it goes through


async def test_a_pool_whose_tenant_socket_path_is_too_long_is_refused(cluster: Cluster) -> None:
    """A tenant's socket (`<socketDir>/<ns>.<name>/tenants/<tenant>/agent.sock`) past the
    107 bytes of a Unix socket path: the agent could start on no node, so admission says
    why instead of a DaemonSet that crash-loops."""
    long_tenant = "t" * 63
    response = await cluster.admit_pool(pool_body(tenants=[{"name": long_tenant}]))
    assert response["allowed"] is False, response
    message = response["status"]["message"]
    assert f"tenant {long_tenant}'s socket" in message, message
    assert "at most 107 bytes" in message and "spec.socketDir" in message, message

    response = await cluster.admit_pool(pool_body(tenants=[{"name": "short"}]))
    assert response["allowed"] is True, response
