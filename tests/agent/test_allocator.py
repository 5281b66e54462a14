"""The arena allocator under long random mixes of chunk sizes."""

import itertools
import random

from kvpool.agent.arena import PAGE_BYTES, ExtentAllocator


def test_random_alloc_free_keeps_utilisation_above_85_percent_before_refusing() -> None:
    rng = random.Random(1234)
    alloc = ExtentAllocator(64 << 20)
    live: list[list[tuple[int, int]]] = []
    refusals = 0
    for _ in range(20_000):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
            continue
        size = rng.choice([rng.randint(1, 64 << 10), rng.randint(64 << 10, 2 << 20)])
        got = alloc.alloc(size)
        if got is None:
            refusals += 1
            # Refusing is only allowed when the arena is really full.
            assert alloc.used_bytes / alloc.capacity_bytes > 0.85
            assert alloc.capacity_bytes - alloc.used_bytes < size + PAGE_BYTES
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            assert sum(n for _, n in got) == size
            live.append(got)
    assert refusals > 0, "the sequence never filled the arena; it tests nothing"


def test_extents_never_overlap_and_free_coalesces() -> None:
    rng = random.Random(7)
    alloc = ExtentAllocator(4 << 20)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.5:
            alloc.free(live.pop(rng.randrange(len(live))))
        elif (got := alloc.alloc(rng.randint(1, 200_000))) is not None:
            live.append(got)
        pages = [(o // PAGE_BYTES, -(-n // PAGE_BYTES)) for ext in live for o, n in ext]
        covered = sorted(pages)
        for (a, la), (b, _) in itertools.pairwise(covered):
            assert a + la <= b, "two live extents share a page"
    for ext in live:
        alloc.free(ext)
    assert alloc.used_bytes == 0
    assert alloc.largest_free_run_bytes() == 4 << 20  # fully coalesced again


def test_reserve_marks_journaled_extents_used() -> None:
    alloc = ExtentAllocator(1 << 20)
    assert alloc.reserve([(8192, 5000)])
    assert alloc.used_bytes == 2 * PAGE_BYTES
    assert not alloc.reserve([(8192, 10)])  # already taken
    got = alloc.alloc(8192)
    assert got is not None and all(o != 8192 for o, _ in got)
