"""`kvpool bench`: every figure against its baseline, measured in one run on this machine.

Parts (each in its own module): data path G2 against memcpy and Redis
(`bench_data`), control latency (`bench_control`), G3 and G4 against raw
file I/O and boto3 (`bench_tiers`), trace hit ratio against LRU and Belady's
MIN (`bench_replay`, `bench_trace`), scale (`bench_scale`), the peer tier between two
network namespaces against raw TCP (`peer_tier`), plots (`bench_plots`). `run_bench`
runs them in order and returns one dict; with `--json` it is printed as the last line of
stdout.

Run it as `kvpool bench [--quick] [--json] [--out DIR] [--trace FILE] [--part NAME]...`;
`--part` runs only the named parts (`PARTS`), e.g. `hit-ratio` to rerun the eviction
orders' figures without the 20 minutes of the rest.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from kvpool.agent.commandline import console as new_console

from .control import run_control
from .conversation import conversation_trace
from .data_path import run_data_path
from .events import run_events
from .hit_ratio import run_admission, run_trace
from .needs import left_out
from .scale import run_nvme_index, run_scale
from .stats import KiB, MiB
from .tiers import run_g3, run_g4
from .trace import load_trace

FULL_SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [1 * MiB, 16 * MiB]
FULL_EVENT_SIZES = [64 * KiB, 1 * MiB, 16 * MiB]
QUICK_EVENT_SIZES = [64 * KiB]
"""Chunk sizes of the events part: the cost is per chunk, so small chunks are the worst."""
FULL_FRACTIONS = [0.05, 0.10, 0.20, 0.35]
QUICK_FRACTIONS = [0.20]
QUICK_TRACE_REQUESTS = 1000
"""--quick replays (and simulates) only the trace's first requests."""
QUICK_PEER_REQUESTS = 300
"""--quick runs libCacheSim's policies on this many requests only (CI stays fast)."""
PARTS = ("data", "events", "control", "tiers", "hit-ratio", "scale", "peer", "vllm")
"""The parts a run can take, in order (`--part`): G2 vs memcpy and Redis; KV events on vs
off; control latency; G3 and G4; the trace, conversation and NVMe admission figures
(`trace`, `conversation`, `admission`); scale; the peer tier between two nodes (network
namespaces: root) against raw TCP; vLLM's time to first token with a hit."""
DEFAULT_PARTS = PARTS[:-1]
"""What a run without `--part` takes: all but `vllm` (engine starts, in an environment of
its own)."""


_WHAT = {"data": "the data part: G2 vs memcpy and Redis", "g4": "the tiers part's G4 figures",
         "libcachesim": "the hit-ratio part's libCacheSim peers", "plots": "the PNG plots",
         "vllm": "the vllm part: time to first token with a kvpool hit",
         "peer": "the peer part: reads between two nodes vs raw TCP"}
"""What each name `needs.left_out` may give stands for, in words."""


def _machine() -> dict[str, Any]:
    return {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count() or 0,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def run_bench(quick: bool, as_json: bool, out: Path | None,
              trace_path: Path | None = None,
              parts: Collection[str] = DEFAULT_PARTS) -> dict[str, Any]:
    """Run `parts` (all but vllm by default); print the tables (to stderr when as_json) and
    the JSON line. The result holds the sections of the parts run only."""
    unknown = set(parts) - set(PARTS)
    if unknown or not parts:
        raise ValueError(f"bench parts are {', '.join(PARTS)}; got {', '.join(sorted(unknown))}"
                         if unknown else "no bench part named")
    console = new_console(stderr=as_json)
    reps = 5 if quick else 15
    started = time.perf_counter()
    result: dict[str, Any] = {"meta": {**_machine(), "quick": quick, "reps": reps}}
    skipped = left_out(parts, plots=out is not None)
    for name, why in skipped.items():  # before any part runs, not after
        console.print(f"left out: {name} ({_WHAT[name]}): {why}", markup=False)
    if skipped:
        result["meta"]["skipped"] = skipped
    parts = [p for p in parts if p not in skipped]
    if set(parts) != set(DEFAULT_PARTS):
        result["meta"]["parts"] = [p for p in PARTS if p in parts]
    g3: dict[str, Any] = {}

    def part(name: str) -> None:
        console.print(f"[dim]{time.perf_counter() - started:6.1f}s[/] {name}")

    if "data" in parts:
        part("G2 data path vs memcpy and Redis")
        result.update(run_data_path(QUICK_SIZES if quick else FULL_SIZES, reps))
    if "events" in parts:
        part("KV events: put throughput with events on vs off")
        result["events"] = run_events(QUICK_EVENT_SIZES if quick else FULL_EVENT_SIZES,
                                      3 if quick else reps)
    if "control" in parts:
        part("control path latency (1 and 8 client processes)")
        result["control"] = run_control(2000 if quick else 10000, 300 if quick else 2000)
    if "tiers" in parts:
        part("G3 tier vs raw file I/O")
        g3 = run_g3(16 * MiB, reps, rebuild_files=10**4 if quick else 10**5)
        result["g3"] = {k: v for k, v in g3.items() if not k.startswith("rebuild")}
        if "g4" not in skipped:
            part("G4 through agents vs boto3 on a local moto S3 server")
            # moto serves ~20 MB/s here: --quick (CI) only shows the path works, at 4 MiB
            # chunks.
            result["g4"] = run_g4(4 * MiB if quick else 16 * MiB, 2 if quick else 7)
    if "hit-ratio" in parts:
        part("trace replay vs LRU, Belady MIN and libCacheSim's online policies")
        trace = load_trace(trace_path, limit=QUICK_TRACE_REQUESTS if quick else None)
        fractions = QUICK_FRACTIONS if quick else FULL_FRACTIONS
        result["trace"] = run_trace(trace, fractions,
                                    peer_requests=QUICK_PEER_REQUESTS if quick else None)
        result["meta"]["trace"] = str(trace_path) if trace_path else "bundled"
        result["meta"]["default_policy"] = result["trace"].pop("default_policy")  # a word
        if not quick:
            part("conversation workload (simulated) and NVMe admission filters")
            chats = conversation_trace()
            result["conversation"] = run_trace(chats, fractions, replay_orders=False)
            result["conversation"].pop("default_policy")
            result["admission"] = {"trace": run_admission(trace),
                                   "conversation": run_admission(chats)}
    if "scale" in parts:
        part("scale: index memory and LOOKUP vs chunks indexed")
        counts = [10**4, 10**5] if quick else [10**4, 10**5, 10**6]
        scale = run_scale(counts)
        if "lookup_p50_us_1e6" not in scale:  # --quick stops at 10^5: say so, no extrapolating
            scale["lookup_p50_us_1e6"] = scale[
                f"lookup_p50_us_{counts[-1]:.0e}".replace("e+0", "e")]
        scale["lookup_1e6_measured_at"] = counts[-1]
        if g3:  # the G3 rebuild is timed by the tiers part
            scale["g3_rebuild_s_1e5"] = g3["rebuild_s"]
            scale["g3_rebuild_measured_at"] = g3["rebuild_files"]
        scale.update(run_nvme_index([10**4] if quick else [10**4, 10**6]))
        result["meta"]["nvme_index_order"] = scale.pop("nvme_index_order")  # a word
        result["scale"] = scale
    if "peer" in parts:
        part("peer tier: reads between two nodes vs raw TCP, LOOKUP, directory")
        from .peer_tier import run_peer

        result["peer"] = run_peer(quick, reps)
        result["meta"]["peer_congestion_control"] = result["peer"].pop("congestion_control")
    if "vllm" in parts:
        part("vLLM time to first token: a kvpool hit vs recomputed (three engine starts)")
        from .vllm_ttft import run_vllm

        result["vllm"] = run_vllm(quick)
    result["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    if out is not None and "plots" not in skipped:
        from .plots import write_plots

        result["meta"]["plots"] = [str(p) for p in write_plots(result, out)]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    _print_tables(console, result)
    if as_json:
        print(json.dumps(result))
    return result


def _print_tables(console: Console, r: dict[str, Any]) -> None:
    """The tables of the parts run."""
    default = r["meta"].get("default_policy", "")
    if "g2" in r:
        t = Table(title="data path, GB/s (median of reps; ratio in brackets)")
        for col in ("size", "memcpy", "G2 put", "G2 put ahead", "G2 get", "G2 put_many",
                    "G2 get_many", "inline put", "inline get", "Redis put", "Redis get"):
            t.add_column(col, justify="right")
        for size, g2 in r["g2"].items():
            il, rd = r["inline"][size], r["redis"][size]
            t.add_row(size, f"{g2['memcpy_gbps']:.2f}",
                      f"{g2['put_gbps']:.2f} ({g2['put_vs_memcpy']:.2f}x memcpy)",
                      f"{g2['put_ahead_gbps']:.2f} ({g2['put_ahead_vs_memcpy']:.2f}x)",
                      f"{g2['get_gbps']:.2f} ({g2['get_vs_memcpy']:.2f}x memcpy)",
                      f"{g2['put_many_gbps']:.2f} ({g2['put_many_vs_memcpy']:.2f}x)",
                      f"{g2['get_many_gbps']:.2f} ({g2['get_many_vs_memcpy']:.2f}x)",
                      f"{il['put_gbps']:.2f}", f"{il['get_gbps']:.2f}",
                      f"{rd['put_gbps']:.2f} ({rd['kvpool_put_vs_redis']:.0f}x)",
                      f"{rd['get_gbps']:.2f} ({rd['kvpool_get_vs_redis']:.0f}x)")
        console.print(t)
    if "events" in r:
        t = Table(title="KV events: G2 put_many GB/s with events off and on (a subscriber "
                        "receiving every message), median of reps")
        for col in ("size", "events off", "events on", "on / off"):
            t.add_column(col, justify="right")
        for size, ev in r["events"]["sizes"].items():
            t.add_row(size, f"{ev['put_gbps_events_off']:.3f}",
                      f"{ev['put_gbps_events_on']:.3f}", f"{ev['events_on_vs_off']:.3f}")
        console.print(t)
    if "control" in r:
        c = r["control"]
        t = Table(title=f"control path, µs (LOOKUP of {c['lookup_prefix_chunks']} chunks)")
        for col in ("op", "p50 1 client", "p99 1 client", "p50 8 clients", "p99 8 clients"):
            t.add_column(col, justify="right")
        for op in ("lookup", "lookup_local", "acquire"):
            t.add_row(op, *(f"{c[f'{op}_{q}_us_{n}']:.0f}" for n in ("1c", "8c")
                            for q in ("p50", "p99")))
        console.print(t)
    if "g3" in r:
        g3 = r["g3"]
        t = Table(title="G3 / G4, GB/s (16 MiB chunks)")
        for col in ("", "kvpool write/put", "baseline", "kvpool read/get", "baseline"):
            t.add_column(col, justify="right")
        t.add_row("G3 tier vs raw file", f"{g3['write_gbps']:.2f}",
                  f"{g3['raw_write_gbps']:.2f}", f"{g3['read_gbps']:.2f}",
                  f"{g3['raw_read_gbps']:.2f}")
        if "g4" in r:
            g4 = r["g4"]
            t.add_row("G4 through agents vs boto3", f"{g4['put_gbps']:.3f}",
                      f"{g4['boto3_put_gbps']:.3f}", f"{g4['get_gbps']:.3f}",
                      f"{g4['boto3_get_gbps']:.3f}")
            t.add_row("G4 tier in process vs boto3", f"{g4['tier_put_gbps']:.3f}",
                      f"{g4['boto3_put_gbps']:.3f}", f"{g4['tier_get_gbps']:.3f}",
                      f"{g4['boto3_get_gbps']:.3f}")
        console.print(t)
    if "trace" in r:
        tr = r["trace"]
        names = list(tr["capacities"][0]["policies"])
        t = Table(title=f"trace block hit ratio, agent replay (queue simulated) "
                        f"({tr['requests']} requests, {tr['requests_per_second']} requests/s)")
        for col in ("capacity", *names, "LRU (sim)", "MIN (sim)", "unbounded",
                    f"{default}: LRU-MIN gap closed"):
            t.add_column(col, justify="right")
        for cap in tr["capacities"]:
            gap = cap["optimal"] - cap["lru"]
            closed = (cap["policies"][default] - cap["lru"]) / gap if gap > 0 else 0.0
            t.add_row(f"{cap['fraction']:.0%}",
                      *(f"{cap['policies'][n]:.3f} ({cap['simulated'][n]:.3f})" for n in names),
                      f"{cap['lru']:.3f}", f"{cap['optimal']:.3f}", f"{cap['unbounded']:.3f}",
                      f"{closed:.0%}")
        console.print(t)
        _print_peers(console, "trace", tr, default)
    if "conversation" in r:
        _print_peers(console, "conversation workload (simulated)", r["conversation"], default)
    for workload, adm in r.get("admission", {}).items():
        t = Table(title=f"NVMe admission, {workload} (DRAM {adm['dram_blocks']} blocks over "
                        f"NVMe {adm['nvme_blocks']}, simulated)")
        for col in ("filter", "hit ratio", "NVMe hits", "NVMe blocks written"):
            t.add_column(col, justify="right")
        for name, row in adm["filters"].items():
            t.add_row(name, f"{row['hit_ratio']:.4f}", str(row["nvme_hits"]),
                      str(row["nvme_writes"]))
        console.print(t)
    if "scale" in r:
        s = r["scale"]
        rebuild = (f"; G3 rebuild {s['g3_rebuild_s_1e5']:.2f}s for "
                   f"{s['g3_rebuild_measured_at']} files" if "g3_rebuild_s_1e5" in s else "")
        at = s["nvme_index_measured_at"]
        console.print(
            f"scale: {s['bytes_per_chunk']:.0f} B of agent heap per chunk at "
            f"{s['bytes_per_chunk_at']} chunks; LOOKUP p50 {s['lookup_p50_us_1e4']:.0f} µs "
            f"at 1e4, {s['lookup_p50_us_1e6']:.0f} µs at {s['lookup_1e6_measured_at']:.0e}"
            f"{rebuild}; NVMe index ({r['meta']['nvme_index_order']}) "
            f"{s['nvme_index_bytes_per_chunk_' + _tag(at)]:.0f} B a chunk at {at:.0e}")
    if "peer" in r:
        _print_peer(console, r["peer"])
    if "vllm" in r:
        v = r["vllm"]
        t = Table(title=f"vLLM time to first token, s: a kvpool hit vs recomputed "
                        f"({v['model']['layers']} layers of {v['model']['hidden']}, "
                        f"random weights)")
        for col in ("prompt tokens", "recomputed", "hit", "speedup", "lookup", "load",
                    "rest", "loaded MiB", "overhead / load", "best load",
                    "overhead / best", "(cold copy)"):
            t.add_column(col, justify="right")
        for n, row in v["sizes"].items():
            over, best = row["overhead_of_load"], row["overhead_of_best_load"]
            cold = row["overhead_of_best_load_cold"]
            t.add_row(n, f"{row['recompute_ttft_s']:.3f}", f"{row['hit_ttft_s']:.3f}",
                      f"{row['speedup']:.1f}x", f"{row['lookup_s']:.4f}",
                      f"{row['load_s']:.4f}", f"{row['rest_s']:.3f}",
                      f"{row['loaded_mib']:.1f}", "-" if over is None else f"{over:.0%}",
                      f"{row['best_load_s']:.4f}", "-" if best is None else f"{best:.0%}",
                      "-" if cold is None else f"{cold:.0%}")
        console.print(t)
    console.print(f"total {r['meta']['seconds']}s")


def _print_peer(console: Console, pr: dict[str, Any]) -> None:
    t = Table(title="peer tier: reads on node 1 of chunks node 0 holds, GB/s (median of reps)")
    for col in ("size", "chunks a round", "get_into each", "get_many_into", "raw TCP",
                "each / raw", "many / raw"):
        t.add_column(col, justify="right")
    for size, row in pr["sizes"].items():
        t.add_row(size, str(row["chunks"]), f"{row['peer_read_gbps']:.3f}",
                  f"{row['peer_read_many_gbps']:.3f}", f"{row['raw_tcp_gbps']:.3f}",
                  f"{row['peer_vs_raw']:.2f}x", f"{row['peer_many_vs_raw']:.2f}x")
    console.print(t)
    tls = pr["tls"]
    console.print(f"peer tier over TLS: {tls['chunk_bytes'] >> 20} MiB chunks in one window "
                  f"{tls['peer_read_many_gbps']:.3f} GB/s, {tls['vs_plain']:.2f}x plain TCP's")
    lk, pg, d = pr["lookup"], pr["propagation"], pr["directory"]
    console.print(
        f"peer tier: LOOKUP of {lk['keys']} remote keys with {lk['remote_entries']:.0e} remote "
        f"entries p50 {lk['p50_us']:.0f} µs, p99 {lk['p99_us']:.0f} µs over the socket, "
        f"{lk['local_p50_us']:.0f} / {lk['local_p99_us']:.0f} µs from shared memory (of "
        f"{lk['keys']} DRAM "
        f"keys: {lk['dram_p50_us']:.0f} / {lk['dram_p99_us']:.0f} µs, of one remote key: "
        f"{lk['one_key_p50_us']:.0f} / {lk['one_key_p99_us']:.0f} µs; load average "
        f"{lk['load_average'][0]:.1f} to {lk['load_average'][1]:.1f}); directory propagation "
        f"p50 {pg['p50_ms']:.2f} ms, p99 {pg['p99_ms']:.2f} ms; "
        f"{d['agent_rss_bytes_per_entry']:.0f} B of agent heap per remote entry (and "
        f"{d['shared_bytes_per_entry']:.0f} B of its shared-memory peer table)")
    h = pr["handoff"]
    console.print(
        f"hand-off of a {h['chunk_bytes'] >> 20} MiB chunk, put on node 0 to in node 1's DRAM: "
        f"p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms (without the hint, put to read "
        f"by key on node 1: {h['pull_p50_ms']:.1f} / {h['pull_p99_ms']:.1f} ms)")
    for name in ("handoff_window", "handoff_small_window"):
        w = pr[name]
        console.print(
            f"hand-off of a window of {w['chunks']} chunks ({w['bytes'] / 2**20:.0f} MiB) in "
            f"one put_many, put on node 0 to all in node 1's DRAM: p50 {w['p50_ms']:.1f} ms, "
            f"p99 {w['p99_ms']:.1f} ms")


def _tag(n: int) -> str:
    return f"{n:.0e}".replace("e+0", "e")


def _print_peers(console: Console, title: str, tr: dict[str, Any], default: str) -> None:
    """The agent's orders (simulated) beside every libCacheSim online policy, per capacity."""
    caps = [c for c in tr["capacities"] if "libcachesim" in c]
    if not caps:
        return
    t = Table(title=f"{title}: prefix hit ratio vs libCacheSim "
                    f"(first {tr['peer_requests']} requests)")
    t.add_column("policy")
    for cap in caps:
        t.add_column(f"{cap['fraction']:.0%}", justify="right")
    for name in caps[0]["peer_agent"]:
        t.add_row(f"kvpool {name}" + (" (default)" if name == default else ""),
                  *(f"{c['peer_agent'][name]:.4f}" for c in caps))
    for name in caps[0]["libcachesim"]:
        t.add_row(name, *(f"{c['libcachesim'][name]:.4f}" for c in caps))
    t.add_row("best online", *(f"{next(iter(c['libcachesim_best']))} "
                               f"{next(iter(c['libcachesim_best'].values())):.4f}" for c in caps))
    t.add_row(f"{default} - best", *(
        f"{c['peer_agent'][default] - next(iter(c['libcachesim_best'].values())):+.4f}"
        for c in caps))
    t.add_row("Belady MIN", *(f"{c['peer_optimal']:.4f}" for c in caps))
    console.print(t)
