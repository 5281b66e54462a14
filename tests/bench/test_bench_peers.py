"""libCacheSim as a peer, the conversation workload, NVMe admission, and the adaptive order's
replay through a real agent against its simulated queue. Small slices only: CI stays fast."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvpool.agent.config import EvictionOrder
from kvpool.bench.conversation import conversation_trace
from kvpool.bench.hit_ratio import replay_agent
from kvpool.bench.peers import ONLINE_POLICIES, available, peer_sim, peers
from kvpool.bench.sim import capacity_blocks, lru, queue_sim, tiered_sim
from kvpool.bench.trace import distinct_blocks, load_trace

needs_libcachesim = pytest.mark.skipif(not available(),
                                       reason="libcachesim (the test extra) is not installed")


@needs_libcachesim
def test_libcachesim_lru_under_prefix_semantics_equals_the_lru_simulator() -> None:
    # Both touch every cached block a request references and count only its leading hits,
    # so libCacheSim's LRU and ours must agree to the block: the harness adds nothing.
    trace = [r.blocks for r in load_trace(limit=300)]
    cap = capacity_blocks(len({b for r in trace for b in r}), 0.2)
    assert peer_sim(trace, cap, "LRU") == lru(trace, cap)


@needs_libcachesim
def test_every_online_policy_runs_and_stays_under_the_ceiling() -> None:
    trace = [r.blocks for r in load_trace(limit=200)]
    cap = capacity_blocks(len({b for r in trace for b in r}), 0.2)
    got = peers(trace, cap)
    assert set(got) == set(ONLINE_POLICIES)
    ceiling = lru(trace, 10**9).hit_ratio
    for name, ratio in got.items():
        assert 0 <= ratio <= ceiling, name


def test_conversation_trace_is_deterministic_and_resends_each_conversation() -> None:
    a, b = conversation_trace(500, seed=3), conversation_trace(500, seed=3)
    assert a == b and len(a) == 500
    assert conversation_trace(500, seed=4) != a
    assert all(x.timestamp_ms <= y.timestamp_ms for x, y in itertools.pairwise(a))
    # A later turn starts with an earlier turn's blocks (all but its partial last one):
    # reuse is per conversation, so an infinite cache hits much of it.
    blocks = [r.blocks for r in a]
    extended = sum(any(len(p) > 1 and q[:len(p) - 1] == p[:-1] and len(q) > len(p) - 1
                       for p in blocks[:i]) for i, q in enumerate(blocks[:200]))
    assert extended > 20
    assert lru(blocks, 10**9).hit_ratio > 0.3


@pytest.mark.parametrize(
    ("min_hits", "min_seen", "writes"),
    [
        # DRAM 1 block over NVMe 4. [1] [2] [1] [3]: 2 evicts 1 (demoted: write 1); 1 hits
        # in NVMe, is promoted and evicts 2 (write 2); 3 evicts 1, already in NVMe.
        (None, 1, 2),
        # only chunks hit in DRAM: no chunk is ever hit there (each leaves before its
        # return), so nothing is demoted, nothing hits in NVMe, nothing is written.
        (1, 1, 0),
        # seen twice: 1's first demotion is refused (seen once); 2 likewise; nothing hits
        # in NVMe, and when 3 evicts 1 (seen twice now) it is written.
        (None, 2, 1),
    ],
)
def test_tiered_sim_nvme_admission_matches_hand_derivation(min_hits: int | None, min_seen: int,
                                                           writes: int) -> None:
    got = tiered_sim([[1], [2], [1], [3]], 1, 4, EvictionOrder.LRU, min_hits,
                     min_seen=min_seen)
    assert got.nvme_writes == writes
    assert got.nvme_hits == (1 if writes == 2 else 0)


def test_a_filter_writes_fewer_blocks_to_nvme_on_the_bundled_trace() -> None:
    trace = [r.blocks for r in load_trace(limit=600)]
    d = len({b for r in trace for b in r})
    args = (trace, capacity_blocks(d, 0.05), capacity_blocks(d, 0.3), EvictionOrder.ADAPTIVE)
    always, seen2 = tiered_sim(*args, None), tiered_sim(*args, None, min_seen=2)
    assert 0 < seen2.nvme_writes < always.nvme_writes
    assert always.hit_ratio >= queue_sim(trace, capacity_blocks(d, 0.05),
                                         EvictionOrder.ADAPTIVE).hit_ratio


@pytest.mark.parametrize(
    ("requests", "fraction"),
    [
        (400, 0.1),
        # Here the client's put_many windows matter: the agent evicts for a window's 128
        # ALLOCs before any of its COMMITs queues a chunk (63 more prefix hits than
        # evicting and inserting block by block, `queue_sim(..., window=1)`).
        (600, 0.2),
    ],
)
def test_the_adaptive_orders_agent_replay_equals_its_simulated_queue(
        tmp_path: Path, requests: int, fraction: float) -> None:
    # The store evicts through the queue exactly as `queue_sim` drives it: same prefix hits.
    trace = load_trace(limit=requests)
    blocks = capacity_blocks(distinct_blocks(trace), fraction)
    replayed, _ = replay_agent(trace, blocks, EvictionOrder.ADAPTIVE.value, tmp_path)
    simulated = queue_sim([r.blocks for r in trace], blocks, EvictionOrder.ADAPTIVE)
    assert round(replayed, 6) == round(simulated.hit_ratio, 6)
