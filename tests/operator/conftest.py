"""Fixtures of the operator tests."""

from __future__ import annotations

from typing import Any

import pytest
from op_support import example


@pytest.fixture
def pool_full() -> dict[str, Any]:
    return example("pool.yaml", "KVCachePool")


@pytest.fixture
def pool_minimal() -> dict[str, Any]:
    return example("pool-minimal.yaml", "KVCachePool")


@pytest.fixture
def policy_full() -> dict[str, Any]:
    return example("policy.yaml", "KVTierPolicy")


@pytest.fixture
async def cluster(kmock: Any) -> Any:
    """The operator, running against the emulator; stopped (bounded) at teardown."""
    from op_cluster import (
        Cluster,
        client_for_tests,
        declare_resources,
        free_port,
        options_for_tests,
    )

    declare_resources(kmock)
    port = free_port()
    c = Cluster(
        emulator=kmock,
        kube=client_for_tests(str(kmock.url)),
        webhook_url=f"http://127.0.0.1:{port}",
    )
    c.start(options_for_tests(port))
    try:
        await c.wait_ready()
        yield c
    finally:
        await c.shutdown()
