"""The shared tier through real agent processes: one node's chunks are every node's hits.

Two agents with their own DRAM arenas and NVMe directories stand for two
nodes; they share one bucket (moto's S3 server on 127.0.0.1) or one directory
(a shared mount). Clients talk to them over their real sockets.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.agent.client import KVPoolClient
from kvpool.agent.tiers.shared import object_name
from kvpool.bench.local import LocalAgent

from ..support import scrape, wait_until
from .conftest import RestartableMoto, s3_client

CHUNK = 64 * 1024


def payload(key: bytes) -> bytes:
    return (key * (CHUNK // len(key) + 1))[:CHUNK]


def node(stack: ExitStack, root: Path, name: str, shared: dict[str, Any]) -> LocalAgent:
    """An agent with its own DRAM and NVMe, pointed at the shared tier."""
    workdir = root / name
    workdir.mkdir()
    cfg = workdir / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"pool": "shared-test", "tiers": {
        "nvme": {"path": str(workdir / "nvme"), "size": "64Mi"},
        "shared": {"lookupBudget": "2s", "requestTimeout": "2s", **shared},
    }}))
    return stack.enter_context(
        LocalAgent("--no-lock", "--config", str(cfg), workdir=workdir, dram="16Mi"))


def uploaded(client: KVPoolClient, n: int) -> bool:
    queue = client.stats()["tiers"]["shared"]["queue"]
    return bool(queue["written"] >= n and queue["pending"] == 0 and queue["in_flight"] == 0)


@pytest.fixture(params=["file", "s3"])
def shared_cfg(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if request.param == "file":
        (tmp_path / "mount").mkdir()  # the agent never makes a file:// store's directory
        return {"url": (tmp_path / "mount").as_uri()}
    endpoint: str = request.getfixturevalue("moto_endpoint")
    bucket: str = request.getfixturevalue("bucket")
    return {"url": f"s3://{bucket}/pools/shared-test", "endpointUrl": endpoint}


@pytest.fixture
def two_nodes(tmp_path: Path, shared_cfg: dict[str, Any]) -> Iterator[tuple[LocalAgent,
                                                                            LocalAgent]]:
    with ExitStack() as stack:
        yield node(stack, tmp_path, "a", shared_cfg), node(stack, tmp_path, "b", shared_cfg)


def test_prefix_written_through_one_agent_is_a_hit_with_correct_bytes_on_another(
        two_nodes: tuple[LocalAgent, LocalAgent]) -> None:
    a, b = two_nodes
    keys = [os.urandom(16) for _ in range(8)]
    with KVPoolClient(a.socket_path) as ca, KVPoolClient(b.socket_path) as cb:
        for k in keys:
            assert ca.put(k, payload(k))
        wait_until(lambda: uploaded(ca, len(keys)), "agent A's uploads")
        assert cb.lookup_tiers(keys) == ["shared"] * len(keys)
        for k in keys:
            assert cb.get(k) == payload(k)
        # Read once, promoted: the next LOOKUP on B finds the prefix in its own DRAM.
        assert cb.lookup_tiers(keys) == ["dram"] * len(keys)
        stats = cb.stats()["tiers"]["shared"]
    assert stats["healthy"] and stats["hits"] == len(keys)
    # Each came up into DRAM once: read and promoted, or loaded ahead by prefetch.
    moved = sum(scrape(b)[f'kvpool_tier_{kind}_total{{pool="shared-test",tier="shared"}}']
                for kind in ("promotions", "prefetches"))
    assert moved == len(keys)


def test_lookup_stops_at_the_first_key_no_tier_holds(
        two_nodes: tuple[LocalAgent, LocalAgent]) -> None:
    a, b = two_nodes
    keys = [os.urandom(16) for _ in range(4)]
    with KVPoolClient(a.socket_path) as ca, KVPoolClient(b.socket_path) as cb:
        for k in keys[:2] + keys[3:]:
            assert ca.put(k, payload(k))
        wait_until(lambda: uploaded(ca, 3), "agent A's uploads")
        assert cb.lookup_tiers(keys) == ["shared", "shared"]


def test_object_overwritten_behind_the_agents_back_is_a_miss_and_counted(
        tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    mount.mkdir()
    with ExitStack() as stack:
        a = node(stack, tmp_path, "a", {"url": mount.as_uri()})
        b = node(stack, tmp_path, "b", {"url": mount.as_uri()})
        key = os.urandom(16)
        with KVPoolClient(a.socket_path) as ca, KVPoolClient(b.socket_path) as cb:
            assert ca.put(key, payload(key))
            wait_until(lambda: uploaded(ca, 1), "the upload")
            [path] = mount.rglob(object_name(key))
            blob = bytearray(path.read_bytes())
            blob[-1] ^= 0xFF  # one flipped byte in the chunk data
            path.write_bytes(bytes(blob))
            assert cb.get(key) is None
        assert scrape(b)['kvpool_integrity_failures_total{pool="shared-test",tier="shared"}'] == 1


def test_store_outage_keeps_local_tiers_serving_and_recovers_by_itself(
        tmp_path: Path, own_moto: RestartableMoto) -> None:
    bucket = "kvpool-outage"
    s3_client(own_moto.endpoint).create_bucket(Bucket=bucket)
    shared = {"url": f"s3://{bucket}/p", "endpointUrl": own_moto.endpoint,
              "lookupBudget": "200ms", "requestTimeout": "1s"}
    with ExitStack() as stack:
        agent = node(stack, tmp_path, "a", shared)
        local = [os.urandom(16) for _ in range(4)]
        with KVPoolClient(agent.socket_path) as c:
            for k in local:
                assert c.put(k, payload(k))
            wait_until(lambda: uploaded(c, len(local)), "the uploads")

            own_moto.stop()
            # Clients keep working: local hits are hits, unknown keys are misses, puts land.
            during = [os.urandom(16) for _ in range(16)]
            for k in during:
                assert c.lookup([k, *local]) == 0
                assert c.lookup(local) == len(local)
                assert c.put(k, payload(k))
                assert c.get(k) == payload(k)
            for k in local:
                assert c.get(k) == payload(k)
            wait_until(lambda: not c.stats()["tiers"]["shared"]["healthy"], "unhealthy")
            down = c.stats()["tiers"]["shared"]
            assert down["reason"]
            assert scrape(agent)['kvpool_tier_healthy{pool="shared-test",tier="shared"}'] == 0

            own_moto.start()
            wait_until(lambda: c.stats()["tiers"]["shared"]["healthy"], "recovery")
            again = os.urandom(16)
            written = c.stats()["tiers"]["shared"]["queue"]["written"]
            assert c.put(again, payload(again))
            wait_until(lambda: uploaded(c, written + 1), "an upload after recovery")
        assert s3_client(own_moto.endpoint).head_object(
            Bucket=bucket, Key=f"p/{object_name(again)}")["ContentLength"] > CHUNK
        assert scrape(agent)['kvpool_tier_healthy{pool="shared-test",tier="shared"}'] == 1


def test_deleted_chunk_leaves_the_shared_tier_too(
        two_nodes: tuple[LocalAgent, LocalAgent]) -> None:
    a, b = two_nodes
    key = os.urandom(16)
    with KVPoolClient(a.socket_path) as ca, KVPoolClient(b.socket_path) as cb:
        assert ca.put(key, payload(key))
        wait_until(lambda: uploaded(ca, 1), "the upload")
        assert cb.lookup([key]) == 1
        assert cb.get(key) == payload(key)  # B now holds it in DRAM too
        assert ca.delete(key) and cb.delete(key)
        wait_until(lambda: ca.lookup([key]) == 0 and cb.lookup([key]) == 0,
                   "the object to be gone for both nodes")
        assert ca.get(key) is None and cb.get(key) is None
