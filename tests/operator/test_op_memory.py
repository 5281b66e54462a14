"""A memory limit that cannot hold the DRAM arena is refused, naming the minimum: the arena
is shared memory, charged to the agent pod's memory cgroup."""

from __future__ import annotations

from typing import Any

import pytest
from op_support import pool_body

from kvpool.operator import api


def _pool(dram: dict[str, Any], limits: dict[str, str]) -> dict[str, Any]:
    return pool_body(tiers={"dram": dram}, agent={"resources": {"limits": limits}})


def test_a_memory_limit_below_the_arena_is_refused_with_the_minimum() -> None:
    with pytest.raises(api.InvalidSpec) as e:
        api.parse_pool(_pool({"size": "8Gi"}, {"memory": "1Gi"}))
    message = str(e.value)
    assert "spec.agent.resources.limits.memory" in message
    assert "at least 8448Mi" in message and "8Gi" in message


def test_a_memory_limit_of_arena_plus_overhead_is_accepted() -> None:
    api.parse_pool(_pool({"size": "8Gi"}, {"memory": "8448Mi"}))
    api.parse_pool(_pool({"size": "8Gi"}, {"cpu": "2"}))  # no memory limit: nothing to check


def test_a_limit_just_below_the_minimum_is_refused() -> None:
    with pytest.raises(api.InvalidSpec, match="at least 8448Mi"):
        api.parse_pool(_pool({"size": "8Gi"}, {"memory": "8447Mi"}))


def test_huge_pages_need_the_arena_in_the_hugepages_limit() -> None:
    huge = {"size": "1Gi", "hugePages": True}
    api.parse_pool(_pool(huge, {"memory": "256Mi", "hugepages-2Mi": "1Gi"}))
    with pytest.raises(api.InvalidSpec, match=r"limits\.hugepages-2Mi.*at least 1Gi"):
        api.parse_pool(_pool(huge, {"memory": "256Mi", "hugepages-2Mi": "512Mi"}))
    with pytest.raises(api.InvalidSpec, match=r"limits\.memory.*at least 256Mi"):
        api.parse_pool(_pool(huge, {"memory": "128Mi", "hugepages-2Mi": "1Gi"}))


def test_an_unreadable_limit_is_refused() -> None:
    with pytest.raises(api.InvalidSpec, match=r"limits\.memory"):
        api.parse_pool(_pool({"size": "8Gi"}, {"memory": "lots"}))
