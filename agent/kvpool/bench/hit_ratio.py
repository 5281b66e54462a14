"""Trace part of `kvpool bench`: hit ratio per capacity, agent policies against the simulators.

At each capacity (a fraction of the trace's distinct blocks, sized as
`kvpool demo --dram N%` does) the bundled Mooncake trace is

- simulated offline with plain LRU and Belady's MIN (`bench_trace`), and with
  each of the agent's own eviction queues (`queue_sim`: what the order should
  reach when one victim leaves per insertion into a full tier);
- replayed through a real agent (`replay`: per request one LOOKUP, one
  batched read of the hit prefix, one batched write of the misses) once per
  eviction order (`EvictionOrder`, the default `s3fifo` included), with the
  DRAM tier holding exactly the simulators' capacity.

Capacity is exact because every block is one arena page, the arena has
`blocks` pages, and the high watermark is 1.0: background eviction never
starts, and each ALLOC that finds the arena full (a batched write sends one
per missing block) evicts one chunk through the tier's eviction queue (O(1)
for s3fifo, O(log n) for the heap orders), the way the simulators do. An
order whose replay differs from its `simulated` figure shows the store not
evicting the way its queue says (`prefix`, whose order has no ties, matches
to the digit).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import EvictionOrder, TierPolicy
from kvpool.agent.constants import PAGE_BYTES as PAGE

from .local import LocalAgent
from .peers import available as peers_available
from .peers import peers
from .replay import replay
from .sim import belady, capacity_blocks, lru, queue_sim, tiered_sim, unbounded
from .trace import TraceRequest, distinct_blocks

BLOCK_BYTES = PAGE
"""Bytes per trace block in the replay: one arena page, so capacity is exact in blocks."""
HIGH, LOW = 1.0, 0.99
"""DRAM watermarks of the replays: with high at 1.0 the tier evicts only when full, one
chunk per allocation, so it always holds the simulators' capacity (LOW is never used)."""


def default_order() -> str:
    return str(TierPolicy().tiers.dram.eviction.value)


def agent_orders() -> list[str]:
    """Every eviction order, the default first."""
    default = default_order()
    return [default, *(o.value for o in EvictionOrder if o.value != default)]


def replay_agent(trace: list[TraceRequest], blocks: int, order: str,
                 workdir: Path) -> tuple[float, float]:
    """(block hit ratio, requests per second) of a real agent holding `blocks` blocks."""
    cfg = {"policy": {"tiers": {"dram": {
        "eviction": order, "highWatermark": HIGH, "lowWatermark": LOW}}}}
    path = workdir / f"agent-{order}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with LocalAgent("--no-lock", "--config", str(path), dram=str(blocks * PAGE),
                    start_timeout=60) as agent, \
            KVPoolClient(agent.socket_path) as client:
        res = replay(client, trace, BLOCK_BYTES)
        held = client.stats()["tiers"]["dram"]["chunks"]
    if res.wrong_bytes:
        raise RuntimeError(f"replay read {res.wrong_bytes} wrong chunks")
    if held != blocks:
        raise RuntimeError(f"{order} replay ended holding {held} blocks, not {blocks}")
    return res.block_hit_ratio, res.requests / res.seconds


def run_trace(trace: list[TraceRequest], fractions: list[float], *, replay_orders: bool = True,
              peer_requests: int | None = None) -> dict[str, Any]:
    """The `trace` section (or, with `replay_orders` off, its simulated part only).

    With libCacheSim installed, each capacity also carries `libcachesim`: every
    online policy of it on the same blocks (`peers`), on the trace's first
    `peer_requests` requests (all when None) at that slice's own capacity, and
    the agent's orders simulated on that same slice (`peer_agent`), so the
    comparison is like for like.
    """
    blocks_per_req = [r.blocks for r in trace]
    distinct = distinct_blocks(trace)
    ceiling = unbounded(blocks_per_req).hit_ratio
    orders = agent_orders()
    rps: list[float] = []
    capacities: list[dict[str, Any]] = []
    peer_trace = blocks_per_req[:peer_requests] if peer_requests else blocks_per_req
    peer_distinct = len({b for r in peer_trace for b in r})
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-trace-") as tmp:
        for fraction in fractions:
            blocks = capacity_blocks(distinct, fraction)
            opt = belady(blocks_per_req, blocks)
            plain = lru(blocks_per_req, blocks).hit_ratio
            policies: dict[str, float] = {}
            simulated: dict[str, float] = {}
            for order in orders:
                if replay_orders:
                    ratio, speed = replay_agent(trace, blocks, order, Path(tmp))
                    policies[order] = round(ratio, 4)
                    rps.append(speed)
                sim = queue_sim(blocks_per_req, blocks, EvictionOrder(order))
                simulated[order] = round(sim.hit_ratio, 4)
            cap: dict[str, Any] = {
                "fraction": fraction,
                "blocks": blocks,
                "policies": policies if replay_orders else dict(simulated),
                "simulated": simulated,
                "lru": round(plain, 4),
                "optimal": round(opt.hit_ratio, 4),
                "optimal_bound": round(opt.reference_hit_ratio, 4),
                "unbounded": round(ceiling, 4),
            }
            if peers_available():
                peer_blocks = capacity_blocks(peer_distinct, fraction)
                lcs = peers(peer_trace, peer_blocks)
                best = max(lcs, key=lambda p: lcs[p])
                cap["libcachesim"] = lcs
                cap["libcachesim_best"] = {best: lcs[best]}
                cap["peer_agent"] = {
                    o: round(queue_sim(peer_trace, peer_blocks, EvictionOrder(o)).hit_ratio, 4)
                    for o in orders}
                cap["peer_optimal"] = round(belady(peer_trace, peer_blocks).hit_ratio, 4)
            capacities.append(cap)
    out: dict[str, Any] = {
        "requests": len(trace),
        "references": sum(map(len, blocks_per_req)),
        "distinct_blocks": distinct,
        "block_bytes": BLOCK_BYTES,
        "default_policy": orders[0],
        "capacities": capacities,
    }
    if replay_orders:
        out["requests_per_second"] = round(sorted(rps)[len(rps) // 2], 1)
    if peers_available():
        out["peer_requests"] = len(peer_trace)
    return out


ADMISSION_DRAM, ADMISSION_NVME = 0.05, 0.30
"""Tier sizes of the admission comparison, as fractions of the trace's distinct blocks."""


def run_admission(trace: list[TraceRequest]) -> dict[str, Any]:
    """NVMe admission filters: hit ratio and NVMe blocks written (`sim.tiered_sim`)."""
    blocks_per_req = [r.blocks for r in trace]
    distinct = distinct_blocks(trace)
    dram = capacity_blocks(distinct, ADMISSION_DRAM)
    nvme = capacity_blocks(distinct, ADMISSION_NVME)
    order = EvictionOrder(default_order())
    rows: dict[str, Any] = {}
    for name, min_hits, min_seen in (("always", None, 1), ("seen twice", None, 2),
                                     ("minHits 1", 1, 1), ("minHits 2", 2, 1)):
        r = tiered_sim(blocks_per_req, dram, nvme, order, min_hits, min_seen=min_seen)
        rows[name] = {"hit_ratio": round(r.hit_ratio, 4), "nvme_hits": r.nvme_hits,
                      "nvme_writes": r.nvme_writes,
                      "nvme_bytes_written": r.nvme_writes * BLOCK_BYTES}
    return {"dram_blocks": dram, "nvme_blocks": nvme, "filters": rows}
