"""Demotions are durable and bounded: a chunk on its way from DRAM to NVMe keeps its arena
pages and its journal entry until its file has landed, and writers wait rather than let
the demotions in flight grow without bound.

An agent SIGKILLed while chunks stream through a small DRAM tier into NVMe comes back
serving every acknowledged chunk with its bytes: from NVMe where its file landed, else
from DRAM (warm restart). The writers are the ones of test_restart (separate processes
that log each key before and after its put; bytes derive from the key).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.agent.store.demotion import DEMOTION_BYTES_SHARE, DEMOTIONS_IN_FLIGHT
from kvpool.bench.local import LocalAgent

from .conftest import scrape, wait_until
from .test_restart import WRITER, data_for, read_log

MiB = 1 << 20
ROUNDS = 2
"""Kills per test: each round adds chunks on top of what the earlier rounds left."""
IN_FLIGHT = "kvpool_nvme_demotions_in_flight"
POOL = '{pool="default"}'
POLICY = "prefetch:\n  enabled: false\n"


WIDE_WATERMARK = POLICY + "tiers:\n  dram:\n    highWatermark: 0.9\n    lowWatermark: 0.2\n"


def nvme_agent(tmp_path: Path, dram: str, nvme: str = "512Mi",
               policy: str = POLICY) -> LocalAgent:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy)
    return LocalAgent("--no-lock", "--policy", str(policy_file),
                      "--nvme-dir", str(tmp_path / "nvme"), "--nvme", nvme,
                      workdir=tmp_path, dram=dram)


def start_writers(agent: LocalAgent, logs: list[Path], count: int) -> list[subprocess.Popen[bytes]]:
    modes = ["zero_copy", "inline"]
    return [subprocess.Popen([sys.executable, "-c", WRITER, str(agent.socket_path), str(log),
                              modes[i % 2], str(count)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for i, log in enumerate(logs)]


def acknowledged(logs: list[Path], n: int) -> bool:
    return sum(len(read_log(log)[1]) for log in logs) >= n


def test_sigkill_while_small_chunks_stream_into_nvme_loses_no_acknowledged_chunk(
        tmp_path: Path) -> None:
    """Six writers of 4-32 KiB chunks through a 2 MiB DRAM tier into NVMe (which has
    room for all), SIGKILLed mid-burst, twice: every acknowledged chunk of every
    round is served with its bytes after the restart; an unacknowledged one is served
    whole or not at all."""
    agent = nvme_agent(tmp_path, "2Mi")
    tried: set[bytes] = set()
    acked: set[bytes] = set()
    try:
        for r in range(ROUNDS):  # the rounds add up: at most 2 x 6 x 4,000 x 32 KiB in NVMe
            agent.start()
            logs = [tmp_path / f"writer-{r}-{i}.log" for i in range(6)]
            writers = start_writers(agent, logs, 4000)
            try:
                # Well past the arena: 600 chunks of 18 KiB on average are about 11 MiB.
                wait_until(functools.partial(acknowledged, logs, 600), timeout=120,
                           what="600 chunks acknowledged")
            finally:
                agent.kill()  # SIGKILL mid-burst: the writers end with it (no reconnect)
                for w in writers:
                    w.wait(timeout=60)
            for log in logs:
                t, a = read_log(log)
                tried |= t
                acked |= a
            agent.start()
            with KVPoolClient(agent.socket_path) as c:
                lost = [k.hex() for k in acked if c.get(k, verify=True) != data_for(k)]
                assert not lost, f"{len(lost)} of {len(acked)} acknowledged chunks lost"
                for k in tried - acked:
                    got = c.get(k)
                    assert got is None or got == data_for(k), f"{k.hex()} served other bytes"
            agent.kill()
    finally:
        agent.stop()


# Alone: the writers must outrun NVMe to fill the backlog it checks ("nothing was ever being
# demoted" where the writers share the CPU with other tests).
@pytest.mark.alone
def test_the_demotion_backlog_stays_within_its_bound_under_fast_small_chunk_writers(
        tmp_path: Path) -> None:
    """Six writers of 4-32 KiB chunks through a 16 MiB DRAM tier whose watermark evicts
    down to a fifth of it at each crossing (some 600 chunks at once): however far they
    outrun NVMe, the demotions in flight (STATS and the metrics, sampled, and the most
    ever in flight) never exceed their bound, in chunks and in bytes; the writers are held
    back instead."""
    agent = nvme_agent(tmp_path, "16Mi", policy=WIDE_WATERMARK)
    arena = 16 * MiB
    most_bytes = max(arena // DEMOTION_BYTES_SHARE, 32 << 10)
    logs = [tmp_path / f"writer-{i}.log" for i in range(6)]
    try:
        agent.start()
        writers = start_writers(agent, logs, 600)
        seen = 0
        try:
            with KVPoolClient(agent.socket_path) as c:
                for _ in range(2000):
                    nvme = c.stats()["tiers"]["nvme"]
                    seen = max(seen, nvme["inflight"])
                    assert nvme["inflight"] <= DEMOTIONS_IN_FLIGHT, nvme
                    assert nvme["inflight_bytes"] <= most_bytes, nvme
                    if all(w.poll() is not None for w in writers):
                        break
            metrics = scrape(agent)
            assert metrics[f"{IN_FLIGHT}{POOL}"] <= DEMOTIONS_IN_FLIGHT
            assert metrics[f"{IN_FLIGHT}_bytes{POOL}"] <= most_bytes
        finally:
            for w in writers:
                w.wait(timeout=300)
        assert all(w.returncode == 0 for w in writers)
        # The most ever in flight, as the agent counted it: the samples above may miss a
        # burst (they did, once, in CI), this may not.
        with KVPoolClient(agent.socket_path) as c:
            nvme = c.stats()["tiers"]["nvme"]
        assert 0 < nvme["inflight_peak"] <= DEMOTIONS_IN_FLIGHT, nvme
        assert nvme["inflight_peak_bytes"] <= most_bytes, nvme
        assert seen <= nvme["inflight_peak"]
        acked = set().union(*(read_log(log)[1] for log in logs))
        assert len(acked) == 6 * 600
        with KVPoolClient(agent.socket_path) as c:
            for k in list(acked)[::97]:
                assert c.get(k, verify=True) == data_for(k)
    finally:
        agent.stop()
