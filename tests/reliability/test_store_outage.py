"""The object store (moto's S3 server on 127.0.0.1) stopped and started again while
several client processes keep working through one agent.

The shared tier is a cache below the node's own tiers: while the store is down no
client call fails or waits past the lookup budget, uploads are dropped and counted,
the tier reports itself unhealthy, and it recovers by itself when the store is back.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.agent.tiers.shared import object_name

from ..shared.conftest import REGION, RestartableMoto, s3_client
from .chunks import chunk_bytes, chunk_key
from .conftest import (
    Load,
    assert_no_wrong_bytes,
    assert_stored,
    evictions,
    inline_client,
    metric,
    new_agent,
    no_leases,
    settled,
    wait_until,
)

BUCKET = "kvpool-reliability"
CLIENT_TIMEOUT = 10.0
"""Only a guard against a hang: any call this slow would already be far past the
tier's 200 ms lookup budget and 1 s request timeout."""


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[RestartableMoto]:
    # Dummy credentials for the agent (it inherits the environment) and for boto3 here;
    # nothing read from the machine's own AWS files.
    for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    server = RestartableMoto()
    s3_client(server.endpoint).create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


def shared_health(client: KVPoolClient) -> bool:
    return bool(client.stats()["tiers"]["shared"]["healthy"])


def test_store_outage_under_load_fails_no_client_call_and_recovers_by_itself(
        tmp_path: Path, store: RestartableMoto, loads: list[Load]) -> None:
    shared = {"url": f"s3://{BUCKET}/pool", "endpointUrl": store.endpoint,
              "lookupBudget": "200ms", "requestTimeout": "1s"}
    with new_agent(tmp_path / "agent", dram="32Mi", shared=shared) as agent:
        load = Load(agent.socket_path, tmp_path / "load", workers=4, space="outage",
                    timeout=CLIENT_TIMEOUT)
        loads.append(load)
        wait_until(lambda: load.all(lambda s: sum(s["ok"].values()) >= 50), "the load")
        written_before = 0
        with inline_client(agent) as c:
            wait_until(lambda: c.stats()["tiers"]["shared"]["queue"]["written"] > 0,
                       "uploads before the outage")

            store.stop()
            wait_until(lambda: not shared_health(c), "the tier to turn unhealthy")
            before = load.statuses()
            wait_until(lambda: load.progressed(before), "every client to go on during the outage")
            down = c.stats()["tiers"]["shared"]
            assert down["reason"].startswith("s3 ")
            assert metric(agent, "kvpool_tier_healthy", tier="shared") == 0
            assert metric(agent, "kvpool_shared_dropped_writes_total") > 0

            store.start()
            wait_until(lambda: shared_health(c), "the tier to recover")
            written_before = c.stats()["tiers"]["shared"]["queue"]["written"]
            before = load.statuses()
            wait_until(lambda: load.progressed(before), "every client to go on after recovery")
        statuses = load.finish()
        assert_no_wrong_bytes(statuses)
        failed = {e: n for s in statuses for e, n in s["errors"].items()}
        assert not failed, f"client calls failed during the store outage: {failed}"

        with inline_client(agent) as c:
            wait_until(lambda: no_leases(c) and settled(c), "leases and uploads to end")
            assert c.stats()["tiers"]["shared"]["queue"]["written"] > written_before
            assert metric(agent, "kvpool_tier_healthy", tier="shared") == 1
            assert evictions(agent) == 0
            assert_stored(c, load.acked(statuses))  # the local tiers kept them all
            again = chunk_key("outage-after", 0)
            assert c.put(again, chunk_bytes(again))
            wait_until(lambda: settled(c), "the upload after recovery")
        head = s3_client(store.endpoint).head_object(Bucket=BUCKET,
                                                     Key=f"pool/{object_name(again)}")
        assert head["ContentLength"] > len(chunk_bytes(again))
