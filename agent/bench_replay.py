"""Trace part of `kvpool bench`: hit ratio per capacity, agent policies against the simulators.

At each capacity (a fraction of the trace's distinct blocks, sized as
`kvpool demo --dram N%` does) the bundled Mooncake trace is

- simulated offline with plain LRU and Belady's MIN (`bench_trace`);
- replayed through a real agent (`replay`: LOOKUP, read the hits, write the
  misses) once per eviction order of the policy engine, with the DRAM tier
  holding that many blocks. Its watermarks are set to 0.999 (high) and
  0.99 (low) and its DRAM to `blocks / 0.9945` pages, so it holds between
  99.5% and 100.5% of the simulators' capacity: eviction by watermark frees
  ~1% at a time instead of one chunk per allocation (the store sorts every
  chunk on each eviction round, so per-chunk rounds are far too slow).

Until the store evicts through the policy engine, the agent is replayed once
with its built-in LRU, reported as policy `builtin-lru`.
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from typing import Any

import yaml

from . import store
from .bench_trace import belady, capacity_blocks, lru, unbounded
from .client import KVPoolClient
from .config import EvictionOrder, TierPolicy
from .demo import PAGE
from .local import LocalAgent
from .replay import replay
from .trace import TraceRequest, distinct_blocks

BLOCK_BYTES = 4096
"""Bytes per trace block in the replay: one page, so capacity is exact in blocks."""
HIGH, LOW = 0.999, 0.99


def policy_engine_wired() -> bool:
    """Whether the store's eviction goes through `policy.choose_victims`."""
    return "choose_victims" in inspect.getsource(store)


def agent_orders() -> list[str]:
    if not policy_engine_wired():
        return []
    return [o.value for o in EvictionOrder]


def default_order() -> str:
    return str(TierPolicy().tiers.dram.eviction.value)


def replay_agent(trace: list[TraceRequest], blocks: int, order: str | None,
                 workdir: Path) -> tuple[float, float]:
    """(block hit ratio, requests per second) of a real agent holding `blocks` blocks."""
    args = ["--no-lock"]
    if order is not None:
        cfg = {"policy": {"tiers": {"dram": {
            "eviction": order, "highWatermark": HIGH, "lowWatermark": LOW}}}}
        path = workdir / f"agent-{order}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        args += ["--config", str(path)]
    pages = round(blocks / ((HIGH + LOW) / 2)) if order is not None else blocks
    dram = pages * (-(-BLOCK_BYTES // PAGE)) * PAGE
    with LocalAgent(*args, dram=str(dram), start_timeout=60) as agent, \
            KVPoolClient(agent.socket_path) as client:
        res = replay(client, trace, BLOCK_BYTES)
    if res.wrong_bytes:
        raise RuntimeError(f"replay read {res.wrong_bytes} wrong chunks")
    return res.block_hit_ratio, res.requests / res.seconds


def run_trace(trace: list[TraceRequest], fractions: list[float]) -> dict[str, Any]:
    """The `trace` section."""
    blocks_per_req = [r.blocks for r in trace]
    distinct = distinct_blocks(trace)
    ceiling = unbounded(blocks_per_req).hit_ratio
    orders = agent_orders()
    rps: list[float] = []
    capacities: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-trace-") as tmp:
        for fraction in fractions:
            blocks = capacity_blocks(distinct, fraction)
            opt = belady(blocks_per_req, blocks)
            policies: dict[str, float] = {}
            runs: list[str | None] = list(orders) if orders else [None]
            for order in runs:
                ratio, speed = replay_agent(trace, blocks, order, Path(tmp))
                policies[order or "builtin-lru"] = round(ratio, 4)
                rps.append(speed)
            capacities.append({
                "fraction": fraction,
                "blocks": blocks,
                "policies": policies,
                "lru": round(lru(blocks_per_req, blocks).hit_ratio, 4),
                "optimal": round(opt.hit_ratio, 4),
                "optimal_bound": round(opt.reference_hit_ratio, 4),
                "unbounded": round(ceiling, 4),
            })
    return {
        "requests": len(trace),
        "references": sum(map(len, blocks_per_req)),
        "distinct_blocks": distinct,
        "block_bytes": BLOCK_BYTES,
        "policy_engine": bool(orders),
        "default_policy": default_order() if orders else "builtin-lru",
        "requests_per_second": round(sorted(rps)[len(rps) // 2], 1),
        "capacities": capacities,
    }
