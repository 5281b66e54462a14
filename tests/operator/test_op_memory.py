"""A memory limit that cannot hold the DRAM arena is refused, naming the minimum: the arena
is shared memory, charged to the agent pod's memory cgroup. With peers on, the memory the
operator gives the agent (and the minimum it accepts) holds each tenant space's lookup
table and, with peers on, its peer directory too."""

from __future__ import annotations

from typing import Any

import pytest
from op_support import NAMESPACE, pool_body

from kvpool.agent import lookupindex
from kvpool.operator import api, render

NVME = {"hostPath": "/mnt/nvme0/kvpool", "size": "1Ti"}


def _pool(dram: dict[str, Any], limits: dict[str, str]) -> dict[str, Any]:
    return pool_body(tiers={"dram": dram}, agent={"resources": {"limits": limits}})


def test_a_memory_limit_below_the_arena_is_refused_with_the_minimum() -> None:
    with pytest.raises(api.InvalidSpec) as e:
        api.parse_pool(_pool({"size": "8Gi"}, {"memory": "1Gi"}))
    message = str(e.value)
    assert "spec.agent.resources.limits.memory" in message
    assert "at least 8513Mi" in message and "8Gi" in message


def test_a_memory_limit_of_arena_plus_overhead_is_accepted() -> None:
    api.parse_pool(_pool({"size": "8Gi"}, {"memory": "8513Mi"}))
    api.parse_pool(_pool({"size": "8Gi"}, {"cpu": "2"}))  # no memory limit: nothing to check


def test_a_limit_just_below_the_minimum_is_refused() -> None:
    with pytest.raises(api.InvalidSpec, match="at least 8513Mi"):
        api.parse_pool(_pool({"size": "8Gi"}, {"memory": "8512Mi"}))


def test_huge_pages_need_the_arena_in_the_hugepages_limit() -> None:
    huge = {"size": "1Gi", "hugePages": True}
    api.parse_pool(_pool(huge, {"memory": "289Mi", "hugepages-2Mi": "1Gi"}))  # + the table
    with pytest.raises(api.InvalidSpec, match=r"limits\.hugepages-2Mi.*at least 1Gi"):
        api.parse_pool(_pool(huge, {"memory": "289Mi", "hugepages-2Mi": "512Mi"}))
    with pytest.raises(api.InvalidSpec, match=r"limits\.memory.*at least 289Mi"):
        api.parse_pool(_pool(huge, {"memory": "128Mi", "hugepages-2Mi": "1Gi"}))


def test_an_unreadable_limit_is_refused() -> None:
    with pytest.raises(api.InvalidSpec, match=r"limits\.memory"):
        api.parse_pool(_pool({"size": "8Gi"}, {"memory": "lots"}))


def _agent_resources(**spec: Any) -> dict[str, Any]:
    body = pool_body(**spec)
    body["metadata"]["uid"] = "6f1e3c1a-2b7d-4c55-9a0e-1d2c3b4a5f60"
    (ds,) = [o for o in render.render(api.parse_pool(body), None)
             if o["kind"] == "DaemonSet"
             and o["metadata"]["name"] == render.Names(NAMESPACE, "small").agent]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    resources: dict[str, Any] = container["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    return resources


def _memory(**spec: Any) -> str:
    return str(_agent_resources(**spec)["limits"]["memory"])


def test_with_peers_on_the_agent_gets_memory_for_each_spaces_directory() -> None:
    # 8Gi arena + 256Mi + its lookup table (65Mi, below), and with peers per tenant space
    # 64 B a remote chunk (the
    # directory's heap bound) plus, without NVMe, the peer table clients read (24 B a slot,
    # the power of two at least twice the chunks, at most 2^22, and a 256 KiB header), in
    # MiB rounded up: 10^6 chunks (the default) = 61.04 MiB of heap + 48.25 MiB of table.
    dram = {"dram": {"size": "8Gi"}}
    on = {"enabled": True}
    assert _memory(tiers=dram) == "8513Mi"  # peers off
    assert _memory(tiers=dram, peers={"enabled": False, "remoteChunks": 10**7}) == "8513Mi"
    assert _memory(tiers=dram, peers=on) == f"{8513 + 110}Mi"
    assert _memory(tiers={**dram, "nvme": NVME}, peers=on) == f"{8513 + 62}Mi"  # no table
    three = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    # 3 lookup tables of 64Mi (193Mi rounded up) and 3 x 109.29 for the peers
    assert _memory(tiers=dram, peers=on, tenants=three) == f"{8448 + 193 + 328}Mi"
    # 4·10^6: 244.14 MiB of heap, and the table at its most, 2^22 slots (96.25 MiB).
    assert _memory(tiers=dram, peers={**on, "remoteChunks": 4 * 10**6}) == f"{8513 + 341}Mi"
    assert _memory(tiers={**dram, "nvme": NVME}, peers={**on, "remoteChunks": 0}) == "8513Mi"


def test_the_agent_gets_memory_for_each_spaces_lookup_table() -> None:
    # The DRAM lookup table clients read (64 B a slot, the power of two at least twice the
    # space's 4 KiB pages, at most 2^20, and a 64 B header) is shared memory the agent
    # makes, charged to its pod as the arena is: one per tenant space.
    assert _memory(tiers={"dram": {"size": "256Mi"}}) == f"{256 + 256 + 9}Mi"  # 2^17 slots
    assert _memory(tiers={"dram": {"size": "8Gi"}}) == f"{8192 + 256 + 65}Mi"  # 2^20: the most
    two = [{"name": "a", "dram": "64Mi"}, {"name": "b"}]  # 64Mi: 2^15 slots, 192Mi: 2^17
    assert _memory(tiers={"dram": {"size": "256Mi"}}, tenants=two) == f"{256 + 256 + 11}Mi"
    for size in (4 << 20, 256 << 20, 8 << 30):  # the agent's own sizing, at its bounds too
        assert lookupindex.dram_table_bytes(size) == lookupindex.HEADER_BYTES + \
            lookupindex.slots_for(size // 4096) * lookupindex.SLOT_BYTES


def test_with_huge_pages_the_peer_directory_is_in_the_memory_beside_them() -> None:
    resources = _agent_resources(tiers={"dram": {"size": "1Gi", "hugePages": True}},
                                 peers={"enabled": True})
    # 256Mi, the lookup table (2^19 slots: 32Mi and its header) and the peers' 110Mi
    assert resources["limits"] == {"memory": f"{256 + 33 + 110}Mi", "hugepages-2Mi": "1Gi"}


def test_with_peers_on_a_limit_without_room_for_the_directory_is_refused() -> None:
    peers = {"enabled": True, "remoteChunks": 2 * 10**6}  # 122.07 + 96.25 MiB: 219Mi
    body = _pool({"size": "8Gi"}, {"memory": "8513Mi"})  # the arena, 256Mi, 65Mi: peers off's
    body["spec"]["peers"] = peers
    with pytest.raises(api.InvalidSpec) as e:
        api.parse_pool(body)
    assert "at least 8732Mi" in str(e.value) and "remoteChunks (2000000)" in str(e.value)
    body["spec"]["agent"]["resources"]["limits"]["memory"] = "8732Mi"
    api.parse_pool(body)
