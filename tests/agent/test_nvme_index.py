"""NVMe's flat index (`tiers/nvmeindex.py`): it answers as the dict of entries it replaced,
its views tell writes apart, and a slot is handed back only once neither the index nor
the eviction queue holds it (worker threads take keys out; the event loop hands slots back)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.agent import checksums
from kvpool.agent.config import EvictionOrder
from kvpool.agent.constants import KEY_BYTES
from kvpool.agent.tiers.base import ChunkRecord
from kvpool.agent.tiers.nvme import NvmeTier
from kvpool.agent.tiers.nvmeindex import NvmeIndex


def key(i: int) -> bytes:
    return i.to_bytes(KEY_BYTES, "little")


_runs = st.tuples(st.integers(0, 2**32), st.integers(2, 1500), st.sampled_from(list(EvictionOrder)))


@settings(max_examples=10, deadline=None)
@given(_runs)
def test_index_and_queue_answer_as_a_dict_and_hand_back_every_slot(
        run: tuple[int, int, EvictionOrder]) -> None:
    """Random writes, rewrites, drops (the loop: out of the index, the queue, then reaped)
    and failed reads (a worker takes the key out; the loop discards and reaps it later)."""
    seed, n_keys, order = run
    rnd = random.Random(seed)
    index = NvmeIndex()
    queue = index.new_queue(order, "last_access")
    model: dict[bytes, tuple[int, str]] = {}
    failed: list[bytes] = []  # out of the index by a worker, not yet seen by the loop
    for i in range(4000):
        op = rnd.choice(["put", "put", "drop", "fail", "seen", "evict"])
        k = key(rnd.randrange(n_keys))
        if op == "put":
            size, tenant = rnd.randrange(1, 1 << 20), rnd.choice(["", "a", "b"])
            assert index.put(k, size, tenant, float(i)) == (model[k][0] if k in model else 0)
            model[k] = (size, tenant)
            entry = index.get(k)
            assert entry is not None
            entry.hits, entry.last_seq = rnd.randrange(3), i
            queue.add(entry)  # as a landed demotion does
        elif op == "drop" and k in model:
            assert index.unindex(k) == model.pop(k)[0]
            queue.discard(k)
            index.reap(k)
        elif op == "fail" and k in model:
            index.unindex(k)
            model.pop(k)
            failed.append(k)
        elif op == "seen" and failed:
            gone = failed.pop(rnd.randrange(len(failed)))
            if gone not in model:  # not written again meanwhile
                queue.discard(gone)
                index.reap(gone)
        elif op == "evict":
            with contextlib.closing(queue.candidates()) as walk:
                for n, entry in enumerate(walk):
                    if n == 3:
                        break
                    if entry.key in model:
                        assert (entry.size, entry.tenant) == model[entry.key]
                    index.unindex(entry.key)
                    model.pop(entry.key, None)
                    queue.discard(entry.key)
                    index.reap(entry.key)
        got = index.get(k)
        assert ((got.size, got.tenant) if got is not None else None) == model.get(k)
        assert len(index) == len(model) and (k in index) == (k in model)
    assert sorted(index) == sorted(model)
    assert {e.key: (e.size, e.tenant) for e in index.values()} == model
    for k in failed:
        if k not in model:
            queue.discard(k)
            index.reap(k)
    # Every slot not indexed is free again: the next writes take no new ones.
    taken = index.table.slots
    for j in range(taken - len(model)):
        index.put(key(n_keys + j), 1, "", 0.0)
    assert index.table.slots == taken


def test_a_view_equals_only_views_of_the_same_write() -> None:
    index = NvmeIndex()
    index.put(key(1), 100, "", 0.0)
    first = index.get(key(1))
    assert first is not None and first == index.get(key(1))
    index.put(key(1), 200, "", 0.0)  # rewritten in place: the same slot, another write
    second = index.get(key(1))
    assert second is not None and second.slot == first.slot and second != first
    index.unindex(key(1))
    index.reap(key(1))
    index.put(key(1), 200, "", 0.0)  # deleted and written again
    assert index.get(key(1)) != second


def test_a_slot_a_worker_took_out_stays_the_queues_until_it_lets_go() -> None:
    index = NvmeIndex()
    queue = index.new_queue(EvictionOrder.ADAPTIVE, "last_access")
    index.put(key(1), 100, "", 0.0)
    entry = index.get(key(1))
    assert entry is not None
    queue.add(entry)
    slot = entry.slot
    index.unindex(key(1))  # a worker found its file bad
    index.reap(key(1))  # the queue still holds the slot: not handed back
    assert key(1) not in index and key(1) in queue
    index.put(key(2), 100, "", 0.0)
    other = index.get(key(2))
    assert other is not None and other.slot != slot
    queue.discard(key(1))  # the loop sees the failed read
    assert key(1) not in queue
    index.put(key(3), 100, "", 0.0)
    reused = index.get(key(3))
    assert reused is not None and reused.slot == slot


def test_a_key_written_again_before_the_queue_let_go_keeps_its_slot() -> None:
    index = NvmeIndex()
    queue = index.new_queue(EvictionOrder.S3FIFO, "last_access")
    index.put(key(1), 100, "", 0.0)
    entry = index.get(key(1))
    assert entry is not None
    queue.add(entry)
    index.unindex(key(1))
    index.put(key(1), 300, "", 0.0)  # demoted again before the loop saw the failure
    again = index.get(key(1))
    assert again is not None and again.slot == entry.slot and again.size == 300
    queue.add(again)
    assert len(queue) == 1


def test_a_new_queue_takes_the_chunks_oldest_first() -> None:
    index = NvmeIndex()
    for i, t in enumerate([30.0, 10.0, 20.0]):
        index.put(key(i), 100, "", t)
    queue = index.new_queue(EvictionOrder.LRU, "last_access")
    assert len(queue) == 3
    for i in range(3):
        entry = index.get(key(i))
        assert entry is not None
        entry.last_seq = i
    fresh = index.new_queue(EvictionOrder.S3FIFO, "last_seq")
    with contextlib.closing(fresh.candidates()) as walk:
        assert [e.key for e in walk] == [key(0), key(1), key(2)]
    with contextlib.closing(index.new_queue(EvictionOrder.S3FIFO, "last_access")
                            .candidates()) as walk:
        assert [e.key for e in walk] == [key(1), key(2), key(0)]


def test_lookups_in_one_thread_never_miss_while_another_writes() -> None:
    """The event loop reads the index while a worker indexes files: the table grows
    (rebuilt several times over) and keys come and go, and a key indexed throughout is
    found every time."""
    index = NvmeIndex()
    stable = [key(i) for i in range(500)]
    for k in stable:
        index.put(k, 1, "", 0.0)
    done = threading.Event()

    def write() -> None:
        try:
            for i in range(1000, 40_000):
                index.put(key(i), 1, "", 0.0)
                if i % 3 == 0:
                    index.unindex(key(i - 1))
        finally:
            done.set()

    writer = threading.Thread(target=write)
    writer.start()
    misses = passes = 0
    while not done.is_set() and passes < 100_000:
        misses += sum(index.table.find(k) < 0 for k in stable)
        passes += 1
    writer.join(timeout=120)
    assert not writer.is_alive() and passes > 1
    assert misses == 0


def test_a_failed_read_forgets_only_the_entry_it_was_made_under(tmp_path: Path) -> None:
    """A worker's read that finds no file takes its entry out of the index, but not the
    entry of a newer write: the key was dropped (its file removed) and written again
    while the read ran, and forgetting the new entry would lose the chunk."""
    tier = NvmeTier(tmp_path / "nvme", 64 << 20)
    k, data = key(7), b"x" * 4096
    rec = ChunkRecord(k, data, checksums.compute(checksums.XXH3, [data], b""))
    tier.write(rec)
    read_under = tier.index.get(k)
    tier.forget(k)  # dropped: a promotion took it up
    tier.remove_file(k)
    tier.write(rec)  # back down before the read opened the file
    os.unlink(tier.path_of(k))  # and the read finds no file at its open, as it did then
    assert tier.read_file(k, read_under) is None
    assert k in tier.index
    # Under the entry the index holds, a missing file is a chunk gone: out of the index.
    assert tier.read(k) is None
    assert k not in tier.index
