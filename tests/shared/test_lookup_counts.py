"""A LOOKUP's keys and their hits are counted together, so that no window between two
scrapes sees more hits than keys asked for.

The dashboard's hit ratio is two rates, hits over keys looked up. The keys used to be
counted when a LOOKUP arrived and its hits when it was answered: a LOOKUP waiting on the
shared tier (keys past the local prefix are asked of the store) straddled a scrape, and
the window after it counted hits whose keys it never saw: a ratio above 1 on a loaded
pool. The store here answers HEAD only when the test lets it (`StallingMoto`): a real agent
and real S3 requests.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import yaml

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from ..support import scrape, wait_until
from .conftest import StallingMoto, s3_client

BUCKET = "kvpool-lookup-counts"


def hits_and_keys(agent: LocalAgent) -> tuple[float, float]:
    series = scrape(agent)
    hits = sum(v for k, v in series.items() if k.startswith("kvpool_tier_hits_total{"))
    keys = sum(v for k, v in series.items() if k.startswith("kvpool_lookup_keys_total{"))
    return hits, keys


def test_a_lookup_waiting_on_the_shared_tier_counts_its_keys_with_its_hits(
        tmp_path: Path, stalling_moto: StallingMoto) -> None:
    s3_client(stalling_moto.endpoint).create_bucket(Bucket=BUCKET)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"pool": "lookup-counts", "tiers": {
        # A budget longer than the test holds the store: the LOOKUP waits for its answer.
        "shared": {"url": f"s3://{BUCKET}/pool", "endpointUrl": stalling_moto.endpoint,
                   "lookupBudget": "60s", "requestTimeout": "60s"},
    }}))
    with LocalAgent("--no-lock", "--config", str(cfg), workdir=tmp_path) as agent, \
            KVPoolClient(agent.socket_path) as c:
        stored = [os.urandom(16) for _ in range(4)]
        for key in stored:
            c.put(key, b"kv" * 512)
        before = hits_and_keys(agent)
        stalling_moto.hold("HEAD")
        answer: list[int] = []
        # The four stored keys, then one the agent does not hold: asked of the store.
        lookup = threading.Thread(
            target=lambda: answer.append(c.lookup([*stored, os.urandom(16)])))
        lookup.start()
        try:
            wait_until(lambda: stalling_moto.held > 0, "the LOOKUP's HEAD held")
            during = hits_and_keys(agent)
        finally:
            stalling_moto.free()
        lookup.join(60)
        after = hits_and_keys(agent)
    assert answer == [4]
    assert after[0] - before[0] == 4 and after[1] - before[1] == 5
    # Each window between two scrapes counts no more hits than keys.
    assert during[0] - before[0] <= during[1] - before[1]
    assert after[0] - during[0] <= after[1] - during[1]
