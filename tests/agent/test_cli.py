"""The `kvpool` command as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from ..support import REPO_ROOT
from .conftest import wait_until


def kvpool(*args: str, timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.agent", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)


def test_demo_json_reports_all_three_tiers_and_hit_ratios() -> None:
    run = kvpool("demo", "--json", "--requests", "400")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["requests"] == 400
    assert report["wrong_bytes"] == 0
    assert 0 < report["local_hit_ratio"] <= report["block_hit_ratio"]
    assert report["block_hit_ratio"] <= report["unbounded_hit_ratio"] <= 1
    assert report["bytes_read"] > 0 and report["bytes_written"] > 0
    assert report["block_bytes"] == 16 * 1024
    tiers = report["tiers"]
    assert set(tiers) == {"dram", "nvme", "shared"}
    assert tiers["dram"]["capacity_bytes"] > 0 and tiers["dram"]["hits"] > 0
    assert tiers["nvme"]["capacity_bytes"] > 0
    assert tiers["shared"]["capacity_bytes"] == 0  # the store's, unbounded for the agent
    hits = sum(t["hits"] for t in tiers.values())
    assert hits == round(report["block_hit_ratio"] * report["blocks"])
    local = tiers["dram"]["hits"] + tiers["nvme"]["hits"]
    assert local == round(report["local_hit_ratio"] * report["blocks"])


def test_demo_without_a_shared_tier() -> None:
    run = kvpool("demo", "--json", "--requests", "100", "--shared", "none")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(report["tiers"]) == {"dram", "nvme"}
    assert report["local_hit_ratio"] == report["block_hit_ratio"]


def test_demo_removes_its_directory_after_it_reports(tmp_path: Path) -> None:
    """The chunk files go in a detached process (tens of thousands of unlinks for the full
    trace): the report does not wait for them, but nothing is left behind."""
    run = kvpool("demo", "--json", "--requests", "50", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["wrong_bytes"] == 0
    wait_until(lambda: not list(tmp_path.glob("kvpool-demo-*")), what="the demo's directory to go")


def test_demo_runs_from_the_repository_root() -> None:
    """`python -m kvpool.agent demo` from a checkout's root: `python -m` puts the working
    directory first on sys.path, so nothing at the root may shadow a module the agent (or the
    standard library) imports, and the processes the demo starts run there too."""
    run = subprocess.run([sys.executable, "-m", "kvpool.agent", "demo", "--json",
                          "--requests", "20", "--shared", "none"], capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["wrong_bytes"] == 0


def test_stats_command_prints_json(agent: LocalAgent, client: KVPoolClient) -> None:
    client.put(b"k" * 16, b"v" * 100)
    run = kvpool("stats", "--socket", str(agent.socket_path), "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["tiers"]["dram"]["chunks"] == 1


def test_agent_rejects_a_bad_config_with_the_field_named(tmp_path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("tiers:\n  dram:\n    size: huge\n")
    run = kvpool("agent", "--config", str(cfg), timeout=60)
    assert run.returncode == 2
    assert "tiers.dram.size" in run.stderr and "'huge' is not a size" in run.stderr


def test_stats_on_a_missing_socket_fails_clearly(tmp_path) -> None:
    run = kvpool("stats", "--socket", str(tmp_path / "nope.sock"), timeout=60)
    assert run.returncode == 2 and "cannot reach the agent" in run.stderr


def test_gc_all_deletes_every_chunk_of_a_file_shared_tier(tmp_path) -> None:
    from kvpool.agent.config import SharedTier
    from kvpool.agent.protocol import checksum
    from kvpool.agent.tiers.base import ChunkRecord
    from kvpool.agent.tiers.shared import open_shared_tier

    url = f"file://{tmp_path / 'shared'}"
    tier = open_shared_tier(SharedTier(url=url))
    for i in range(3):
        data = bytes([i]) * 1000
        tier.write(ChunkRecord(bytes([i]) * 16, data, checksum(data)))
    assert len(list(tier.keys())) == 3
    run = kvpool("gc", "--shared", url, "--all", "--json", timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["deleted"] == 3
    assert list(tier.keys()) == []
    tier.close()
