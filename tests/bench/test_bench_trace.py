"""The offline cache simulators, on traces small enough to work out by hand."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.agent.config import EvictionOrder
from kvpool.bench.sim import (
    NEVER,
    belady,
    capacity_blocks,
    lru,
    next_uses,
    queue_sim,
    unbounded,
)


@pytest.mark.parametrize(
    ("trace", "capacity", "prefix_hits", "reference_hits"),
    [
        # cap 2. r1: 1,2 inserted {1,2}. r2: 3 evicts 1 -> {2,3}. r3: 1 misses, evicts 2
        # -> {3,1}; 2 misses, evicts 3 -> {1,2}. No hits at all.
        ([[1, 2], [3], [1, 2]], 2, 0, 0),
        # cap 3. r1 fills {1,2,3}. r2: 4 misses and evicts 1 -> {2,3,4}; 2 and 3 are
        # cached but follow a miss: 2 reference hits, 0 prefix hits.
        ([[1, 2, 3], [4, 2, 3]], 3, 0, 2),
        # cap 3, LRU cuts the head off a prefix: r2's 4 evicts 1, then r3's 1 evicts 2,
        # its 2 evicts 3, its 3 evicts 4: every block of r3 misses.
        ([[1, 2, 3], [4], [1, 2, 3]], 3, 0, 0),
        # cap 2. {1,2}; 3 evicts 1 -> {2,3}; 1 misses, evicts 2 -> {3,1}; 3 hits.
        ([[1], [2], [3], [1], [3]], 2, 1, 1),
        # cap 1: r2's 1 hits (it is the only cached block), then 2 evicts 1.
        ([[1], [1, 2]], 1, 1, 1),
        # cap 0 caches nothing.
        ([[1], [1]], 0, 0, 0),
    ],
)
def test_lru_matches_hand_derivation(trace: list[list[int]], capacity: int, prefix_hits: int,
                                     reference_hits: int) -> None:
    got = lru(trace, capacity)
    assert (got.prefix_hits, got.reference_hits) == (prefix_hits, reference_hits)
    assert got.references == sum(map(len, trace))


@pytest.mark.parametrize(
    ("trace", "capacity", "prefix_hits", "reference_hits"),
    [
        # next uses: 1@0->3, 2@1->4, 3@2->never. 3 is never used again so MIN does not
        # cache it; r3 finds 1 and 2: 2 prefix hits (LRU: 0).
        ([[1, 2], [3], [1, 2]], 2, 2, 2),
        # next uses: 1@0->5, 2@1->never, 3@2->4. On 3 the cache is {1:5, 2:never}; 2 is
        # farthest, so it goes -> {1,3}; then 1 and 3 hit: 2 hits (LRU: 1).
        ([[1], [2], [3], [1], [3]], 2, 2, 2),
        # 4 is never used again: bypassed; r3 finds the whole prefix (LRU: 0).
        ([[1, 2, 3], [4], [1, 2, 3]], 3, 3, 3),
        # cap 3, r2 = [4,2,3]: 4 (never again) bypassed, 2 and 3 hit after a miss.
        ([[1, 2, 3], [4, 2, 3]], 3, 0, 2),
        ([[1], [1]], 0, 0, 0),
    ],
)
def test_belady_matches_hand_derivation(trace: list[list[int]], capacity: int,
                                        prefix_hits: int, reference_hits: int) -> None:
    got = belady(trace, capacity)
    assert (got.prefix_hits, got.reference_hits) == (prefix_hits, reference_hits)


def test_next_uses_index_the_flattened_references() -> None:
    # flattened: 1 2 | 2 3 | 1  -> 1@0 next at 4, 2@1 next at 2, the rest never.
    assert next_uses([[1, 2], [2, 3], [1]]) == [4, 2, NEVER, NEVER, NEVER]


def test_unbounded_counts_every_repeated_prefix_block() -> None:
    # r2 hits 1 and 2, r3 hits 1 then misses 9: 3 prefix hits of 7 references.
    got = unbounded([[1, 2], [1, 2, 3], [1, 9]])
    assert (got.prefix_hits, got.references) == (3, 7)
    assert got.hit_ratio == pytest.approx(3 / 7)


def test_capacity_blocks_rounds_and_keeps_at_least_one() -> None:
    assert capacity_blocks(1000, 0.2) == 200
    assert capacity_blocks(3, 0.05) == 1


def _optimal_reference_hits(trace: list[list[int]], capacity: int) -> int:
    """Exhaustive search over every evict-or-bypass choice: the true optimum."""
    flat = tuple(b for r in trace for b in r)

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(flat):
            return 0
        b = flat[i]
        if b in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {b}))
        else:
            options.extend(best(i + 1, (cache - {v}) | {b}) for v in cache)
        return max(options)

    return best(0, frozenset())


traces = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True),
                  min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(trace=traces, capacity=st.integers(0, 3))
def test_belady_reference_hits_are_optimal_and_bound_lru(trace: list[list[int]],
                                                         capacity: int) -> None:
    opt = belady(trace, capacity)
    assert opt.reference_hits == _optimal_reference_hits(trace, capacity)
    plain = lru(trace, capacity)
    assert plain.reference_hits <= opt.reference_hits
    assert plain.prefix_hits <= opt.reference_hits  # the bound every policy is under
    assert opt.prefix_hits <= opt.reference_hits <= unbounded(trace).reference_hits


def test_s3fifo_queue_keeps_a_reused_block_that_lru_evicts() -> None:
    # cap 2. r1 inserts 1 (probation), r2 hits it, r3 inserts 2. r4's 3 finds the
    # cache full: S3-FIFO moves the hit 1 to main and evicts the unhit 2, so r5
    # hits 1 (2 prefix hits); LRU evicts 1, the least recent, and r5 misses (1 hit).
    trace = [[1], [1], [2], [3], [1]]
    assert queue_sim(trace, 2, EvictionOrder.S3FIFO).prefix_hits == 2
    assert queue_sim(trace, 2, EvictionOrder.LRU).prefix_hits == 1
    assert lru(trace, 2).prefix_hits == 1


def test_queue_sim_evicts_for_a_whole_put_window_before_queueing_it() -> None:
    # cap 3, S3-FIFO. r1 inserts 1, r2 hits it. r3's put_many of 2, 3, 4 in one window
    # ALLOCs all three first: 4's ALLOC finds the cache full (1 cached, 2 reserved) with
    # only 1 queued, so the walk moves the hit 1 to main and then evicts it there; r4
    # misses. Block by block (window 1), 2 and 3 are queued by then and 2 goes: r4 hits.
    trace = [[1], [1], [2, 3, 4], [1]]
    assert queue_sim(trace, 3, EvictionOrder.S3FIFO, window=1).prefix_hits == 2
    assert queue_sim(trace, 3, EvictionOrder.S3FIFO, window=3).prefix_hits == 1
    assert queue_sim(trace, 3, EvictionOrder.S3FIFO).prefix_hits == 1  # the client's window


def test_queue_sim_refuses_an_alloc_with_nothing_left_to_evict() -> None:
    # cap 2: one window ALLOCs 1 and 2, and 3 finds nothing committed to evict (the
    # agent's NO_SPACE): 1 and 2 are stored and r2 hits 1. Block by block, 3 evicts 1.
    trace = [[1, 2, 3], [1]]
    assert queue_sim(trace, 2, EvictionOrder.LRU, window=3).prefix_hits == 1
    assert queue_sim(trace, 2, EvictionOrder.LRU, window=1).prefix_hits == 0


single_block_traces = st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=1),
                               min_size=1, max_size=30)


@settings(max_examples=100, deadline=None)
@given(trace=single_block_traces, capacity=st.integers(0, 4))
def test_lru_queue_matches_the_lru_simulator(trace: list[list[int]], capacity: int) -> None:
    # With one block per request every hit is a leading hit, so the queue (touched
    # on LOOKUP hits only) and the simulator (touched on every hit) agree exactly.
    assert queue_sim(trace, capacity, EvictionOrder.LRU) == lru(trace, capacity)


@settings(max_examples=100, deadline=None)
@given(trace=traces, capacity=st.integers(0, 3), order=st.sampled_from(list(EvictionOrder)))
def test_every_queue_stays_under_the_optimum(trace: list[list[int]], capacity: int,
                                             order: EvictionOrder) -> None:
    got = queue_sim(trace, capacity, order)
    assert got.prefix_hits <= got.reference_hits <= belady(trace, capacity).reference_hits
