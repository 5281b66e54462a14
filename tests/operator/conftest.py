"""Fixtures of the operator tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
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
async def cluster(kmock: Any) -> AsyncIterator[Any]:
    """The operator, running against the emulator; stopped (bounded) at teardown."""
    from op_cluster import cluster_on

    async with cluster_on(kmock).running() as c:
        yield c
