"""LMCache's own engine, in separate processes, storing to and loading from a real agent.

Each engine runs in a fresh interpreter (`lmcache_engine.py`), as two vLLM
pods on one node would: nothing but the agent connects them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from ..agent.conftest import scrape, wait_until
from ..agent.test_events import MapBatch, Mirror, events_agent
from . import lmcache_engine as engine

ENGINE = Path(engine.__file__)
CHUNKS = -(-len(engine.TOKENS) // engine.CHUNK)
"""Four full chunks and the partial tail."""

# What docs/integrations.md tells a user to write, with a tiny local CPU buffer.
CONFIG = """\
chunk_size: 16
local_cpu: true
max_local_cpu_size: 0.05
save_unfull_chunk: true
remote_serde: naive
remote_storage_plugins: ["kvpool"]
extra_config:
  remote_storage_plugin.kvpool.module_path: kvpool.agent.integrations.lmcache
  remote_storage_plugin.kvpool.class_name: KVPoolConnector
"""


def run_engine(agent: LocalAgent, workdir: Path, op: str, model: str, lmcache: str = CONFIG,
               **env_extra: str) -> dict[str, object]:
    config = workdir / "lmcache.yaml"
    config.write_text(lmcache)
    result = workdir / f"{op}-{model.replace('/', '_')}.pt"
    env = dict(os.environ, KVPOOL_SOCKET=str(agent.socket_path), **env_extra)
    proc = subprocess.run(
        [sys.executable, str(ENGINE), op, str(config), model, str(result)],
        env=env, capture_output=True, text=True, timeout=240, cwd=workdir)
    assert proc.returncode == 0, f"{op} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    loaded: dict[str, object] = torch.load(result)
    return loaded


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalAgent, Path]]:
    """An agent holding what one LMCache engine stored for model-a, and a work dir."""
    workdir = tmp_path_factory.mktemp("lmcache")
    with LocalAgent("--no-lock", workdir=workdir, dram="32Mi") as agent:
        run_engine(agent, workdir, "store", "org/model-a")
        yield agent, workdir


def test_fresh_engine_in_another_process_retrieves_every_token(
        stored: tuple[LocalAgent, Path]) -> None:
    agent, workdir = stored
    m = scrape(agent)
    assert m['kvpool_ops_total{op="commit",pool="default",result="ok"}'] == CHUNKS

    got = run_engine(agent, workdir, "retrieve", "org/model-a")

    assert got["retrieved"] == len(engine.TOKENS)
    assert torch.equal(got["kv"], engine.expected_kv())  # type: ignore[arg-type]
    m = scrape(agent)
    assert m['kvpool_ops_total{op="acquire",pool="default",result="ok"}'] >= CHUNKS
    assert m['kvpool_tier_hits_total{pool="default",tier="dram"}'] >= CHUNKS
    assert m['kvpool_ops_total{op="commit",pool="default",result="ok"}'] == CHUNKS


@pytest.mark.parametrize("lease_free", ["1", "0"])
def test_an_engine_reads_dram_chunks_without_a_lease_once_it_knows_their_layout(
        stored: tuple[LocalAgent, Path], lease_free: str) -> None:
    """An engine's second load of a prompt (LMCache's CPU buffer keeping nothing, so both
    come from the pool) reads every chunk without an ACQUIRE: its first taught the
    connector the chunks' metadata. `KVPOOL_LEASE_FREE=0` reads both under leases."""
    agent, workdir = stored
    acquires = 'kvpool_ops_total{op="acquire",pool="default",result="ok"}'
    before = scrape(agent)[acquires]

    got = run_engine(agent, workdir, "retrieve-twice", "org/model-a",
                     lmcache=CONFIG.replace("local_cpu: true", "local_cpu: false"),
                     KVPOOL_LEASE_FREE=lease_free)

    assert got["retrieved"] == [len(engine.TOKENS)] * 2
    for kv in got["kv"]:  # type: ignore[attr-defined]
        assert torch.equal(kv, engine.expected_kv())
    loads_under_lease = 1 if lease_free == "1" else 2
    assert scrape(agent)[acquires] - before == loads_under_lease * CHUNKS


def test_retrieve_for_another_model_is_a_miss(stored: tuple[LocalAgent, Path]) -> None:
    agent, workdir = stored
    acquired = scrape(agent)['kvpool_ops_total{op="acquire",pool="default",result="ok"}']

    got = run_engine(agent, workdir, "retrieve", "org/model-b")

    assert got["retrieved"] == 0
    assert not torch.any(got["kv"])  # type: ignore[call-overload]
    assert scrape(agent)['kvpool_ops_total{op="acquire",pool="default",result="ok"}'] == acquired


def test_chunks_demoted_to_nvme_come_back_equal(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    with LocalAgent("--no-lock", "--nvme-dir", str(nvme), "--nvme", "64Mi",
                    workdir=tmp_path, dram="1Mi") as agent:
        run_engine(agent, tmp_path, "store", "org/model-a")
        # Four times the DRAM tier in other chunks: every LMCache chunk is evicted.
        filler = 64
        with KVPoolClient(agent.socket_path) as c:
            for i in range(filler):
                c.put(i.to_bytes(16, "little"), bytes([i]) * 65536)

            def settled() -> bool:
                tiers = c.stats()["tiers"]
                return bool(tiers["dram"]["chunks"] + tiers["nvme"]["chunks"] == CHUNKS + filler)
            wait_until(settled, what="demotions to finish")
        assert scrape(agent)['kvpool_tier_demotions_total{pool="default",tier="dram"}'] >= CHUNKS

        got = run_engine(agent, tmp_path, "retrieve", "org/model-a")

        assert got["retrieved"] == len(engine.TOKENS)
        assert torch.equal(got["kv"], engine.expected_kv())  # type: ignore[arg-type]
        assert scrape(agent)['kvpool_tier_hits_total{pool="default",tier="nvme"}'] >= CHUNKS


def test_stored_chunks_are_published_under_lmcaches_chunk_hashes(tmp_path: Path) -> None:
    """KV events of the chunks an LMCache engine stores carry LMCache's own chunk hashes
    (what the connector tells the agent), not kvpool's keys."""
    ctx: zmq.Context[object] = zmq.Context()
    with events_agent(tmp_path, "node", "map", "32Mi") as (agent, endpoint, replay):
        mirror = Mirror(ctx, endpoint, replay, b"kv@n1@default", MapBatch)
        try:
            stored = run_engine(agent, tmp_path, "store", "org/model-a", POD_NAME="engine-0")
            expected = set(stored["chunk_hashes"])  # type: ignore[call-overload]
            assert len(expected) == CHUNKS
            nudge = iter(range(1, 1000))

            def published() -> bool:
                # A subscriber hears only what is published once it is connected: a put of
                # our own makes one event it hears, and the replay brings the engine's.
                with KVPoolClient(agent.socket_path) as c:
                    c.put(next(nudge).to_bytes(16, "big"), b"n")
                mirror.pump()
                return expected <= mirror.held.get("CPU_PINNED", set())
            wait_until(published, "the engine's chunk hashes in the events")
        finally:
            mirror.disconnect()
            ctx.destroy(linger=0)
