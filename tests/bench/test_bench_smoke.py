"""`kvpool bench --quick --json` end to end: the JSON shape, every figure a positive number.

No timing thresholds: absolute numbers depend on the machine; docs/benchmarks.md
discusses them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool.agent.config import EvictionOrder, TierPolicy
from kvpool.bench.trace import bundled_trace_path

SIZES_QUICK = ("1MiB", "16MiB")
CONTROL = ("lookup_p50_us_1c", "lookup_p99_us_1c", "lookup_p50_us_8c", "lookup_p99_us_8c",
           "acquire_p50_us_1c", "acquire_p99_us_8c")

pytestmark = [
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="the bench starts redis-server (Debian redis-server)"),
    # A hang guard over the module's one bench run (about 2-5 minutes on a loaded 2-core
    # machine), which the first test's set-up pays.
    pytest.mark.timeout(900),
]


def _figures(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every leaf of the result except the `meta` section, with its dotted path."""
    if isinstance(node, dict):
        return [f for k, v in node.items() if not (path == "" and k == "meta")
                for f in _figures(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [f for i, v in enumerate(node) for f in _figures(v, f"{path}[{i}]")]
    return [(path, node)]


TRACE_REQUESTS = 500
"""The run replays the bundled trace's first 500 requests (`--trace`), half of what `--quick`
takes: its replays through an agent, one per eviction order, were a third of the run, and
every figure of the part is there as with the whole (test_bench_trace.py and
test_bench_peers.py check the replay and the simulators' figures themselves)."""


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    trace = tmp_path_factory.mktemp("bench-trace") / "trace.jsonl"
    trace.write_text("".join(bundled_trace_path().read_text().splitlines(True)[:TRACE_REQUESTS]))
    cmd = [sys.executable, "-m", "kvpool.agent", "bench", "--quick", "--json", "--out", str(out),
           "--trace", str(trace)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    data["_out"] = str(out)
    return data


def test_quick_bench_reports_every_required_figure(result: dict[str, Any]) -> None:
    for size in SIZES_QUICK:
        assert {"put_gbps", "put_ahead_gbps", "get_gbps", "memcpy_gbps", "xxh3_gbps",
                "copy_xxh3_gbps", "put_many_gbps", "get_many_gbps", "put_many_vs_memcpy",
                "get_many_vs_memcpy", "wsum_gbps", "wsum_vs_xxh3", "verify_xxh3_gbps",
                "verify_wsum_gbps", "verify_wsum_vs_xxh3"} <= set(result["g2"][size])
        assert {"put_gbps", "get_gbps"} <= set(result["inline"][size])
        assert {"put_gbps", "get_gbps"} <= set(result["redis"][size])
    assert set(CONTROL) <= set(result["control"])
    assert {"put_gbps_events_off", "put_gbps_events_on",
            "events_on_vs_off"} <= set(result["events"]["sizes"]["64KiB"])
    assert {"write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps"} <= set(result["g3"])
    assert {"put_gbps", "get_gbps", "boto3_put_gbps", "boto3_get_gbps",  # through agents
            "tier_put_gbps", "tier_get_gbps"} <= set(result["g4"])  # the tier in process
    assert {"bytes_per_chunk", "lookup_p50_us_1e4", "lookup_p50_us_1e6",
            "g3_rebuild_s_1e5", "nvme_index_bytes_per_chunk_1e4",
            "nvme_index_lookup_ns_per_key_1e4"} <= set(result["scale"])
    assert result["trace"]["requests"] == TRACE_REQUESTS
    caps = result["trace"]["capacities"]
    assert 0.2 in [c["fraction"] for c in caps]
    orders = {o.value for o in EvictionOrder}
    assert result["meta"]["default_policy"] == TierPolicy().tiers.dram.eviction.value
    for cap in caps:
        assert {"fraction", "policies", "simulated", "lru", "optimal", "unbounded"} <= set(cap)
        # every eviction order is replayed through an agent, and simulated beside it
        assert set(cap["policies"]) == set(cap["simulated"]) == orders


@pytest.mark.skipif(os.geteuid() != 0, reason="the peer part's nodes are network namespaces: "
                    "root only (the bench leaves the part out and says so)")
def test_the_peer_part_reads_every_chunk_back_and_reports_each_figure(
        result: dict[str, Any]) -> None:
    peer = result["peer"]
    assert result["meta"]["peer_congestion_control"] == "reno"  # as both namespaces said
    assert set(peer["sizes"]) == set(SIZES_QUICK)
    for size, row in peer["sizes"].items():
        assert {"peer_read_gbps", "peer_read_many_gbps", "raw_tcp_gbps", "peer_vs_raw",
                "peer_many_vs_raw"} <= set(row)
        # Every round's chunks (the warm-up rounds' too), read from node 0 through node 1's
        # agent one by one and in one window, were compared with what was stored (a wrong
        # byte stops the bench).
        rounds = 2 * (result["meta"]["reps"] + 1)
        mib = int(size.removesuffix("MiB"))
        assert row["bytes_verified"] == row["chunks"] * mib * 2**20 * rounds
    tls = peer["tls"]  # the same 16 MiB reads in one window, agents speaking TLS
    assert {"peer_read_many_gbps", "vs_plain"} <= set(tls) and tls["chunk_bytes"] == 16 * 2**20
    assert tls["bytes_verified"] == tls["chunks"] * tls["chunk_bytes"] * (
        result["meta"]["reps"] + 1)
    assert {"p50_us", "p99_us", "local_p50_us", "local_p99_us", "dram_p50_us", "dram_p99_us",
            "one_key_p50_us", "one_key_p99_us", "load_average"} <= set(peer["lookup"])
    assert peer["lookup"]["keys"] == 128
    assert peer["lookup"]["remote_entries"] == peer["directory"]["remote_entries"] == 10**5
    assert {"samples", "p50_ms", "p99_ms"} <= set(peer["propagation"])
    assert {"agent_rss_bytes_per_entry", "shared_bytes_per_entry"} <= set(peer["directory"])
    # Every handed-off chunk (pushed, and pulled by key beside it) was read back on node 1
    # and compared with what node 0 was given.
    h = peer["handoff"]
    assert {"p50_ms", "p99_ms", "pull_p50_ms", "pull_p99_ms"} <= set(h)
    assert h["bytes_verified"] == 2 * h["samples"] * h["chunk_bytes"] == 2 * 4 * 16 * 2**20
    for name, chunks in (("handoff_window", 16), ("handoff_small_window", 64)):
        w = peer[name]  # windows of one put_many each, every chunk read back and compared
        assert {"p50_ms", "p99_ms"} <= set(w) and w["chunks"] == chunks
        assert w["bytes_verified"] == w["samples"] * w["bytes"] > 0


def test_every_figure_is_a_positive_number(result: dict[str, Any]) -> None:
    figures = _figures({k: v for k, v in result.items() if k != "_out"})
    assert len(figures) > 50
    for path, value in figures:
        assert isinstance(value, int | float) and not isinstance(value, bool), path
        assert math.isfinite(value) and value > 0, f"{path} = {value}"


def test_hit_ratios_are_ordered_like_the_bounds(result: dict[str, Any]) -> None:
    for cap in result["trace"]["capacities"]:
        assert cap["lru"] <= cap["optimal_bound"] <= cap["unbounded"] <= 1
        for ratio in cap["policies"].values():
            assert ratio <= cap["unbounded"]


def test_plots_are_written(result: dict[str, Any]) -> None:
    for name in ("throughput.png", "hit_ratio.png"):
        png = Path(result["_out"]) / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
