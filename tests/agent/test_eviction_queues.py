"""The eviction queues (`agent/eviction.py`): each tier's chunks in the order they leave.

Chunks are tiny `Chunk` records (test data with the fields of `policy.Entry`). A "walk" is the
`candidates()` protocol the store follows: read entries, discard the ones it evicts, close.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.agent.config import EvictionOrder
from kvpool.agent.eviction import (
    ADAPT_MAX,
    ADAPT_MIN,
    MAX_FREQ,
    AdaptiveQueue,
    EvictionQueue,
    KeyedQueue,
    S3FifoQueue,
    new_queue,
)
from kvpool.agent.policy import order_key

from ..support import Chunk
from ..support import chunk as c


def names(entries: Iterable[Chunk | bytes]) -> str:
    return " ".join((e if isinstance(e, bytes) else e.key).decode() for e in entries)


def walk_all(q: EvictionQueue, evict: str = "") -> list[Chunk]:
    """One whole walk, discarding the named chunks as they come (what the store evicts)."""
    out: list[Chunk] = []
    with contextlib.closing(q.candidates()) as walk:
        for entry in walk:
            out.append(entry)  # type: ignore[arg-type]
            if entry.key.decode() in evict.split():
                q.discard(entry.key)
    return out


def walk_bound(q: EvictionQueue) -> int:
    """Most entries a walk can yield plus the steps it may spend: generous, finite."""
    return (MAX_FREQ + 2) * len(q) + 2


# --------------------------------------------------------------------------- lru / lfu / prefix


@pytest.mark.parametrize(
    ("order", "facts", "want"),
    [
        # name: (hits, last_seq, depth)
        pytest.param("lru", {"a": (0, 3, 0), "b": (5, 1, 0), "c": (0, 2, 0)}, "b c a",
                     id="lru-least-recent-first"),
        pytest.param("lfu", {"a": (3, 1, 0), "b": (1, 5, 0), "c": (1, 4, 0), "d": (0, 9, 0)},
                     "d c b a", id="lfu-fewest-hits-then-least-recent"),
        pytest.param("prefix",
                     {"a": (0, 7, 0), "b": (0, 7, 1), "c": (0, 7, 2), "d": (0, 3, 0),
                      "e": (0, 3, 1)},
                     "e d c b a", id="prefix-oldest-request-deepest-first"),
    ],
)
def test_keyed_queue_walks_in_its_order(order: str, facts: dict[str, tuple[int, int, int]],
                                        want: str) -> None:
    q = KeyedQueue(EvictionOrder(order))
    for n, (hits, seq, depth) in facts.items():
        q.add(c(n, hits=hits, last_seq=seq, depth=depth))
    assert names(walk_all(q)) == want


def test_keyed_queue_a_touched_chunk_moves_back() -> None:
    q = KeyedQueue(EvictionOrder.LRU)
    a, b, d = c("a", last_seq=1), c("b", last_seq=2), c("d", last_seq=3)
    for e in (a, b, d):
        q.add(e)
    a.last_seq = 4
    q.touched(a)
    assert names(walk_all(q)) == "b d a"


def test_keyed_queue_discarded_chunk_is_gone_and_the_rest_keep_their_order() -> None:
    q = KeyedQueue(EvictionOrder.LRU)
    for i, n in enumerate("abcd"):
        q.add(c(n, last_seq=i))
    q.discard(b"b")
    assert b"b" not in q and len(q) == 3
    assert names(walk_all(q)) == "a c d"


def test_keyed_queue_chunks_yielded_but_not_discarded_stay_in_order() -> None:
    q = KeyedQueue(EvictionOrder.LRU)
    for i, n in enumerate("abcd"):
        q.add(c(n, last_seq=i))
    assert names(walk_all(q, evict="b")) == "a b c d"
    assert len(q) == 3 and b"a" in q and b"b" not in q
    assert names(walk_all(q)) == "a c d"


def test_keyed_queue_a_walk_closed_early_keeps_everything() -> None:
    q = KeyedQueue(EvictionOrder.LRU)
    for i, n in enumerate("abcd"):
        q.add(c(n, last_seq=i))
    with contextlib.closing(q.candidates()) as walk:
        assert names(itertools.islice(walk, 2)) == "a b"
    assert len(q) == 4
    assert names(walk_all(q)) == "a b c d"


facts = st.tuples(st.integers(0, 2**40), st.integers(0, 2**62), st.integers(0, 2**20))


@pytest.mark.parametrize("order", [EvictionOrder.LRU, EvictionOrder.LFU, EvictionOrder.PREFIX])
@settings(max_examples=50, deadline=None)
@given(rows=st.lists(facts, min_size=1, max_size=40))
def test_keyed_queue_walks_as_sorting_by_the_order_key(
        order: EvictionOrder, rows: list[tuple[int, int, int]]) -> None:
    """Its heap rows are ints that sort as `policy.order_key` does (equal keys: in the order
    the chunks were pushed)."""
    q = KeyedQueue(order)
    chunks = [c(f"k{i}", hits=h, last_seq=s, depth=d) for i, (h, s, d) in enumerate(rows)]
    for e in chunks:
        q.add(e)
    want = sorted(chunks, key=order_key(order))  # stable: pushes in list order
    assert [e.key for e in walk_all(q)] == [e.key for e in want]


def test_keyed_queue_drops_stale_rows_however_often_its_chunks_are_touched() -> None:
    q = KeyedQueue(EvictionOrder.LRU)
    chunks = [c(f"k{i}", last_seq=i) for i in range(10)]
    for e in chunks:
        q.add(e)
    for seq in range(10, 20_000):
        e = chunks[seq % 10]
        e.last_seq = seq
        q.touched(e)
        assert len(q._heap) <= 2 * len(q) + 1024  # rows of chunks that moved on go
    assert names(walk_all(q)) == "k0 k1 k2 k3 k4 k5 k6 k7 k8 k9"


# --------------------------------------------------------------------------- s3fifo


def s3fifo_with_main(*main: str) -> S3FifoQueue:
    """A queue whose main FIFO holds these chunks (a chunk already hit enters main)."""
    q = S3FifoQueue()
    for n in main:
        q.add(c(n, hits=1))
    return q


def test_s3fifo_a_new_chunk_leaves_probation_first() -> None:
    q = s3fifo_with_main("m1", "m2", "m3")
    q.add(c("new"))
    assert names(walk_all(q))[:3] == "new"


def test_s3fifo_a_chunk_hit_in_probation_survives_into_main() -> None:
    q = S3FifoQueue()
    a, b = c("a"), c("b")
    q.add(a)
    q.add(b)
    q.touched(a)  # hit while in probation
    # FIFO would give up a first; a's hit moves it to main and b, never hit, goes instead.
    assert names(walk_all(q, evict="b")) == "b a"
    assert b"a" in q and b"b" not in q


def test_s3fifo_a_chunk_that_left_probation_and_comes_back_goes_to_main() -> None:
    q = S3FifoQueue()
    q.add(c("a"))
    assert names(walk_all(q, evict="a")) == "a"  # left probation unhit: remembered (ghost)
    q.add(c("a"))  # comes back
    q.add(c("b"))  # never seen
    # Had a gone back to probation it would leave first (it came in first); from main, the
    # newcomer in probation goes first.
    assert names(walk_all(q)) == "b a"


def test_s3fifo_without_the_ghost_first_in_first_out_of_probation() -> None:
    """The control for the test above: two chunks never seen leave probation in FIFO order."""
    q = S3FifoQueue()
    q.add(c("a"))
    q.add(c("b"))
    assert names(walk_all(q)) == "a b"


def test_s3fifo_a_prompts_last_chunk_goes_first() -> None:
    q = S3FifoQueue()
    for n in ("p0", "p1"):
        q.add(c(n))
    q.add(c("tail"), tail=True)
    assert names(walk_all(q)) == "tail p0 p1"


def test_s3fifo_protected_chunks_yielded_but_not_discarded_stay() -> None:
    q = S3FifoQueue()
    for n in "abc":
        q.add(c(n))
    # a is leased (the store does not discard it), b is evicted, c is never reached.
    with contextlib.closing(q.candidates()) as walk:
        assert next(walk).key == b"a"
        second = next(walk)
        assert second.key == b"b"
        q.discard(second.key)
    assert b"a" in q and b"c" in q and b"b" not in q and len(q) == 2
    assert names(walk_all(q)) in ("c a", "a c")
    assert len(q) == 2


def test_s3fifo_walk_ends_even_when_every_chunk_is_hit_during_it() -> None:
    q = S3FifoQueue()
    entries = [c(f"k{i}", hits=i % 2) for i in range(50)]
    for e in entries:
        q.add(e)
    bound = walk_bound(q)
    seen: list[bytes] = []
    with contextlib.closing(q.candidates()) as walk:
        for n, entry in enumerate(walk):
            assert n < bound, "the walk did not end"
            seen.append(entry.key)
            for e in entries:  # every chunk hit again at every step
                q.touched(e)
    assert len(seen) == len(set(seen))
    assert len(q) == 50


@pytest.mark.parametrize("order", list(EvictionOrder))
def test_candidates_protocol_walk_discard_close(order: EvictionOrder) -> None:
    """As documented on `EvictionQueue.candidates`: what the caller discards during the walk
    is gone, what it was offered but kept stays, and a later walk offers it again."""
    q = new_queue(order)
    for i, n in enumerate("abcdef"):
        q.add(c(n, last_seq=i))
    taken: list[bytes] = []
    kept: list[bytes] = []
    with contextlib.closing(q.candidates()) as walk:
        for i, entry in enumerate(walk):
            if i == 4:
                break
            (taken if i % 2 == 0 else kept).append(entry.key)
            if i % 2 == 0:
                q.discard(entry.key)
    assert len(q) == 4
    assert all(k not in q for k in taken) and all(k in q for k in kept)
    again = [e.key for e in walk_all(q)]
    assert sorted(again) == sorted(k for k in (n.encode() for n in "abcdef") if k not in taken)


# --------------------------------------------------------------------------- properties

KEYS = [f"k{i}".encode() for i in range(12)]

op = st.one_of(
    # add: key, size, hits, tail, depth (runs of consecutive depths link chunks in a request)
    st.tuples(st.just("add"), st.sampled_from(KEYS), st.integers(1, 50), st.integers(0, 3),
              st.booleans(), st.integers(0, 3)),
    st.tuples(st.just("touch"), st.sampled_from(KEYS), st.integers(0, 3)),
    st.tuples(st.just("discard"), st.sampled_from(KEYS)),
    # walk: how many entries to read before closing, and which of them to evict
    st.tuples(st.just("walk"), st.integers(0, 40), st.lists(st.booleans(), max_size=40)),
)


@pytest.mark.parametrize("order", list(EvictionOrder))
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=60))
def test_members_are_added_minus_discarded_and_walks_end(order: EvictionOrder,
                                                         ops: list[tuple[object, ...]]) -> None:
    q = new_queue(order)
    model: dict[bytes, Chunk] = {}
    seq = itertools.count(1)
    for o in ops:
        if o[0] == "add":
            _, key, size, hits, tail, depth = o
            entry = Chunk(key, size=size, hits=hits, last_seq=next(seq),  # type: ignore[arg-type]
                          depth=depth)  # type: ignore[arg-type]
            q.add(entry, tail=bool(tail))
            model[entry.key] = entry
        elif o[0] == "touch":
            entry_or_none = model.get(o[1])  # type: ignore[call-overload]
            if entry_or_none is not None:
                entry_or_none.hits += 1
                entry_or_none.last_seq = next(seq)
                entry_or_none.depth = o[2]  # type: ignore[assignment]
                q.touched(entry_or_none)
        elif o[0] == "discard":
            q.discard(o[1])  # type: ignore[arg-type]
            model.pop(o[1], None)  # type: ignore[call-overload]
        else:
            _, read, evict = o
            bound = walk_bound(q)
            yielded: list[bytes] = []
            with contextlib.closing(q.candidates()) as walk:
                for i, entry in enumerate(walk):
                    assert i < bound, "the walk did not end"
                    assert entry.key in model, "walk offered a chunk that is not in the queue"
                    yielded.append(entry.key)
                    if i < len(evict) and evict[i]:  # type: ignore[arg-type]
                        q.discard(entry.key)
                        del model[entry.key]
                    if len(yielded) >= read:  # type: ignore[operator]
                        break
            assert len(yielded) == len(set(yielded)), "walk offered a chunk twice"
        assert {k for k in KEYS if k in q} == set(model)
        assert len(q) == len(model)
        if isinstance(q, S3FifoQueue):
            # Probation's share of the bytes decides where eviction starts: keep it true.
            assert q.small_bytes + q.main_bytes == sum(e.size for e in model.values())
            # The two linked lists hold every member once (bounded: a broken link could loop).
            listed = [*itertools.islice(q.small, len(model) + 1),
                      *itertools.islice(q.main, len(model) + 1)]
            assert sorted(listed) == sorted(model)

    # A whole walk that evicts nothing offers every chunk exactly once, and ends.
    bound = walk_bound(q)
    offered: list[bytes] = []
    with contextlib.closing(q.candidates()) as walk:
        for i, entry in enumerate(walk):
            assert i < bound, "the walk did not end"
            offered.append(entry.key)
    assert sorted(offered) == sorted(model)
    assert len(q) == len(model)


def test_one_victim_at_a_time_leaves_the_rest_of_probation_in_probation() -> None:
    """What an eviction walk looks at but does not take is not a hit: it keeps its place.

    A full tier evicting one chunk per write must drain probation oldest first, exactly as
    S3-FIFO does; were the passed-over chunk promoted, every write would move a never-hit
    chunk into main and probation would protect nothing.
    """
    from kvpool.agent import policy as pol
    from kvpool.agent.config import TierPolicy

    q = S3FifoQueue()
    chunks = [c(f"k{i}") for i in range(10)]
    for ch in chunks:
        q.add(ch)
    taken: list[bytes] = []
    for _ in range(5):
        with contextlib.closing(q.candidates()) as walk:
            victims = pol.choose_victims(walk, tier="dram", policy=TierPolicy(), used=100,
                                         target=90, reason="capacity",
                                         protected=lambda k: False)
            for v in victims:
                q.discard(v.key)
                taken.append(v.key)
    assert taken == [f"k{i}".encode() for i in range(5)]
    assert list(q.small) == [f"k{i}".encode() for i in range(5, 10)] and not q.main


def test_a_protected_chunk_passed_over_keeps_its_place_at_the_head() -> None:
    q = S3FifoQueue()
    for name in ("pinned", "a", "b"):
        q.add(c(name))
    with contextlib.closing(q.candidates()) as walk:
        for e in walk:
            if e.key != b"pinned":
                q.discard(e.key)
                break
    assert list(q.small) == [b"pinned", b"b"] and not q.main


# --------------------------------------------------------------------------- adaptive


def test_adaptive_is_the_default_order() -> None:
    from kvpool.agent.config import TierPolicy

    assert TierPolicy().tiers.dram.eviction is EvictionOrder.ADAPTIVE
    assert isinstance(new_queue(EvictionOrder.ADAPTIVE), AdaptiveQueue)


def evicted(q: EvictionQueue, n: int) -> list[bytes]:
    """Evict `n` chunks one walk each, the way a full tier does per insertion."""
    out: list[bytes] = []
    for _ in range(n):
        with contextlib.closing(q.candidates()) as walk:
            e = next(walk)
            q.discard(e.key)
            out.append(e.key)
    return out


@pytest.mark.parametrize(
    ("history", "direction"),
    [
        # a left probation unhit and came back: probation was too short -> it grows
        pytest.param("probation", +1, id="probation-ghost-hit-grows-probation"),
        # a was hit, went to main, left main and came back: main too small -> it shrinks
        pytest.param("main", -1, id="main-ghost-hit-shrinks-probation"),
        # never seen: no signal
        pytest.param("new", 0, id="a-new-chunk-moves-nothing"),
    ],
)
def test_adaptive_probation_share_follows_ghost_hits(history: str, direction: int) -> None:
    q = AdaptiveQueue(start=0.5)
    fillers = [c(f"f{i}", size=10) for i in range(8)]
    a = c("a", size=10)
    if history == "probation":
        q.add(a)
        assert evicted(q, 1) == [b"a"] and b"a" in q.ghost
    elif history == "main":
        q.add(a, tail=False)
        q.touched(a)
        for f in fillers:
            q.add(f)
        # the walk promotes the hit a to main and evicts the unhit fillers from probation
        # until main's share is above probation's; then a leaves from main
        while b"a" in q:
            evicted(q, 1)
        assert b"a" in q.main_ghost and b"a" not in q.ghost
    for f in (fillers if history != "main" else []):
        q.add(f)
    before = q.small_fraction
    q.add(c("a", size=10))
    assert (q.small_fraction > before) - (q.small_fraction < before) == direction
    assert (b"a" in q.main) == (history != "new")  # a returning chunk goes to main


def test_adaptive_main_is_lru_a_hit_moves_a_chunk_to_the_far_end() -> None:
    q = AdaptiveQueue()
    a, b, d = c("a", hits=1), c("b", hits=1), c("d", hits=1)  # hit elsewhere: straight to main
    for e in (a, b, d):
        q.add(e)
    q.touched(a)
    assert names(walk_all(q)) == "b d a"


def test_s3fifo_main_is_fifo_the_control_for_the_test_above() -> None:
    """In S3-FIFO's main a hit earns a reinsertion instead, so a is passed over once and b
    leaves first too; a walk that evicts nothing shows the difference in the order."""
    q = S3FifoQueue()
    a, b, d = c("a", hits=1), c("b", hits=1), c("d", hits=1)
    for e in (a, b, d):
        q.add(e)
    q.touched(a)
    assert names(walk_all(q)) == "b d a"  # a reinserted behind d: same order, other cause
    q2 = AdaptiveQueue()
    for e in (c("a", hits=1), c("b", hits=1)):
        q2.add(e)
    assert names(walk_all(q2)) == "a b"


def test_adaptive_share_stays_within_its_bounds() -> None:
    q = AdaptiveQueue(start=0.5)
    for i in range(3000):  # every chunk leaves probation unhit and comes back at once
        q.add(c(f"k{i % 50}", size=1))
        if len(q) > 20:
            evicted(q, 1)
    assert ADAPT_MIN <= q.small_fraction <= ADAPT_MAX


@pytest.mark.parametrize(
    ("hit_depth", "new_depths", "in_main"),
    [
        # the request hit depths 0-1, then writes 2 and 3: both extend the hit prefix (in
        # main the deeper ahead: see the deeper-first tests below)
        pytest.param(1, [2, 3], "n3 n2", id="chunks-right-after-a-hit-prefix-join-main"),
        # a gap (the chunk at depth 2 is not new, not hit): no extension
        pytest.param(1, [3, 4], "", id="a-gap-breaks-the-chain"),
        # a request with no hit starts at depth 0: probation, as in S3-FIFO
        pytest.param(None, [0, 1], "", id="a-prompt-with-no-hit-waits-in-probation"),
    ],
)
def test_adaptive_new_chunks_extending_a_hit_prefix_go_to_main(
        hit_depth: int | None, new_depths: list[int], in_main: str) -> None:
    q = AdaptiveQueue()
    if hit_depth is not None:
        hit = c("h", hits=1, depth=hit_depth)
        q.add(hit)
        q.touched(hit)
    for d in new_depths:
        q.add(c(f"n{d}", depth=d))
    assert names(k for k in q.main if k != b"h") == in_main


def test_adaptive_a_prompts_tail_extending_a_hit_prefix_still_waits_in_probation() -> None:
    q = AdaptiveQueue()
    hit = c("h", hits=1, depth=0)
    q.add(hit)
    q.touched(hit)
    q.add(c("t", depth=1), tail=True)  # a partial last block: unique to this prompt
    assert b"t" in q.small and b"t" not in q.main


@pytest.mark.parametrize("hits", [0, 1],
                         ids=["new-chunks-in-probation", "chunks-hit-before-in-main"])
def test_adaptive_a_requests_deeper_chunks_leave_first(hits: int) -> None:
    """A chunk serves a prefix hit only while every chunk above it is cached, so of one
    request's run, added in depth order, the deepest leaves first (FIFO would take n0 first,
    which wastes the three below it)."""
    q = AdaptiveQueue()
    for d in range(4):
        q.add(c(f"n{d}", depth=d, hits=hits))
    assert names(walk_all(q)) == "n3 n2 n1 n0"


def test_adaptive_a_lookups_hit_prefix_leaves_main_deepest_first() -> None:
    q = AdaptiveQueue()
    run = [c(f"a{d}", depth=d, hits=1) for d in range(3)]
    for e in (*run, c("x", hits=1)):  # hit elsewhere: straight to main
        q.add(e)
    for e in run:  # a LOOKUP touches its hit prefix in depth order
        q.touched(e)
    assert names(walk_all(q)) == "x a2 a1 a0"


@pytest.mark.parametrize(
    ("depths", "gone", "order"),
    [
        # depth 2 does not follow depth 0: another request's chunk, at the far end
        pytest.param([0, 2], "", "n0 n2", id="a-gap-in-depth-is-another-request"),
        # the chunk above left the queue: the next one goes to the far end
        pytest.param([0, 1, 2], "n1", "n0 n2", id="the-chunk-above-gone"),
        # a new request starts at depth 0 behind the last one's run
        pytest.param([0, 1, 0, 1], "", "n1 n0 n1b n0b", id="each-request-its-own-run"),
    ],
)
def test_adaptive_deeper_first_only_right_after_the_chunk_above(
        depths: list[int], gone: str, order: str) -> None:
    q = AdaptiveQueue()
    seen: set[str] = set()
    for d in depths:
        name = f"n{d}" if f"n{d}" not in seen else f"n{d}b"
        seen.add(name)
        q.add(c(name, depth=d))
        if name == gone:
            q.discard(name.encode())
    assert names(walk_all(q)) == order
