"""Soak: what found round 2's lost chunk (small chunks streaming through a small DRAM tier
into NVMe, the agent SIGKILLed mid-stream) with pressure on every side at once.

Six client processes put, read, delete and put again the same small chunks (1-48 KB)
through 1 MiB of DRAM into an NVMe tier they keep most of the way full, with every chunk
written through to an S3 store (moto on 127.0.0.1). Along the way the agent is SIGKILLed
under load twice: once with the store up, once while the store is down (a stall: uploads
and the store's deletes wait or are dropped, reads of it fail fast), after which the store
comes back. Afterwards: no read ever returned wrong bytes, no worker read a chunk it had
deleted, every chunk whose last acknowledged call was a put is served with its bytes, and
every chunk whose last acknowledged call was a delete is a miss, also once the store is
back with the object the agent had to delete while it was down.

The NVMe tier is sized for the whole key space, so nothing may be evicted from it (the
test checks that it was not): a chunk the audit cannot read is lost, never evicted.

The CI form runs about 30 s. The long form stretches each phase of load:

    KVPOOL_SOAK_SECONDS=120 pytest tests/reliability/test_durability_soak.py -m soak \
        -p no:timeout
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.agent.tiers.base import HEADER_BYTES
from kvpool.bench.local import LocalAgent

from ..shared.conftest import RestartableMoto
from ..support import scrape
from .chunks import chunk_bytes, chunk_key, chunk_size
from .conftest import (
    Load,
    alive,
    assert_dram_accounted,
    assert_no_wrong_bytes,
    inline_client,
    metric,
    new_agent,
    no_leases,
    settled,
    wait_until,
)
from .test_agent_signals import CLIENT_ERRORS
from .test_store_outage import BUCKET, shared_health
from .test_store_outage import store as store  # the fixture: a moto server to stop

SOAK_SECONDS = float(os.environ.get("KVPOOL_SOAK_SECONDS", "12"))
"""Seconds of load in all, spread over the four phases (before the first kill, after it,
with the store down, after it is back)."""
WORKERS = 6
KEYS_PER_WORKER = 64
MIX = {"lookup": 2, "get": 5, "put": 6, "delete": 1}
"""Reads, deletes and puts again of the same keys. No pins: pinned chunks stay in DRAM,
and 1 MiB of DRAM is what makes every put a demotion."""


def nvme_size(space: str) -> int:
    """An NVMe tier the whole key space would fill to 97%: with every key stored it is
    full, yet has no reason to evict (its watermark is 0.98)."""
    files = sum(HEADER_BYTES + chunk_size(chunk_key(space, i))
                for i in range(WORKERS * KEYS_PER_WORKER))
    return files * 100 // 97


def nvme_evictions(agent: LocalAgent) -> float:
    return sum(v for k, v in scrape(agent).items()
               if k.startswith("kvpool_tier_evictions_total{") and 'tier="nvme"' in k)


@pytest.mark.soak
@pytest.mark.alone  # its load is the test: all of the machine's CPU
def test_kills_and_a_store_stall_under_delete_and_reput_load_lose_and_revive_nothing(
        tmp_path: Path, store: RestartableMoto, loads: list[Load]) -> None:
    space = "durable"
    shared = {"url": f"s3://{BUCKET}/pool", "endpointUrl": store.endpoint,
              "lookupBudget": "200ms", "requestTimeout": "1s"}
    phase = SOAK_SECONDS / 4
    workdir = tmp_path / "agent"
    with new_agent(workdir, dram="1Mi", nvme=str(nvme_size(space)), shared=shared,
                   policy={"prefetch": {"enabled": False}}) as agent:
        load = Load(agent.socket_path, tmp_path / "load", workers=WORKERS, space=space,
                    keys_per_worker=KEYS_PER_WORKER, mix=MIX, timeout=5.0,
                    reconnect_timeout=0.5)
        loads.append(load)

        def run_for(seconds: float, what: str) -> None:
            """Load for `seconds` (its length, not a threshold), and at least until every
            worker made progress."""
            before = load.statuses()
            time.sleep(seconds)
            wait_until(lambda: load.progressed(before, ops=20), what)

        def kill_and_restart(what: str) -> None:
            agent.kill(signal.SIGKILL)
            wait_until(lambda: load.all(lambda s: s["errors"]), f"every client to see {what}")
            before = load.statuses()
            agent.start()  # the same arena, journal and NVMe directory: a warm restart
            wait_until(lambda: load.progressed(before), f"every client to go on after {what}")

        wait_until(lambda: load.all(lambda s: sum(s["ok"].values()) >= 20), "the load")
        run_for(phase, "the load with the store up")
        kill_and_restart("the first kill")
        run_for(phase, "the load after the first kill")

        with KVPoolClient(agent.socket_path, mode="inline") as c:
            store.stop()
            wait_until(lambda: not shared_health(c), "the store's tier to turn unhealthy")
        run_for(phase / 2, "the load with the store down")
        kill_and_restart("the kill while the store is down")
        run_for(phase / 2, "the load after it, the store still down")
        store.start()
        with inline_client(agent) as c:
            wait_until(lambda: shared_health(c), "the store's tier to recover")
        run_for(phase, "the load with the store back")
        statuses = load.finish()
        assert alive(agent)

        assert_no_wrong_bytes(statuses)  # and no worker read back a chunk it had deleted
        seen = {e for s in statuses for e in s["errors"]}
        assert seen <= CLIENT_ERRORS, f"errors a killed agent cannot explain: {seen}"
        assert agent.log().count("warm restart") >= 2
        with inline_client(agent) as c:
            wait_until(lambda: no_leases(c) and settled(c), "leases and tier moves to end")
            # The premise: nothing left NVMe but by a delete or a read, so a chunk that
            # cannot be read is lost, not evicted; the store's outage dropped uploads.
            assert nvme_evictions(agent) == 0
            assert metric(agent, "kvpool_shared_dropped_writes_total") > 0
            assert c.stats()["tiers"]["nvme"]["used_bytes"] > nvme_size(space) * 0.6
            acked, deleted = load.acked(statuses), load.deleted(statuses)
            assert len(acked) > WORKERS * KEYS_PER_WORKER // 2 and deleted
            lost = [k.hex() for k in acked if c.get(k) != chunk_bytes(k)]
            assert not lost, f"{len(lost)} of {len(acked)} acknowledged chunks lost, " \
                             f"e.g. {lost[:3]}\nagent log tail:\n{agent.log()[-3000:]}"
            revived = [k.hex() for k in deleted if c.get(k) is not None]
            assert not revived, f"{len(revived)} deleted chunks readable again: {revived[:3]}"
            assert_dram_accounted(c, [chunk_key(space, i)
                                      for i in range(WORKERS * KEYS_PER_WORKER)])
            wait_until(lambda: no_leases(c), "the audit's own leases to end")
        assert metric(agent, "kvpool_integrity_failures_total", tier="dram") == 0
        assert metric(agent, "kvpool_integrity_failures_total", tier="nvme") == 0
