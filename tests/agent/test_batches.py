"""`batches.Batches`: background work offered on the event loop, done a batch per executor call.

The store writes demoted chunks to NVMe and removes NVMe files this way. What is offered in
one loop tick goes in one batch, what is offered while batches run goes in the next, nothing
is done twice or left behind, and what still waits at shutdown is done by `close()`.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvpool.agent.arena import Arena
from kvpool.agent.batches import Batches
from kvpool.agent.config import AgentConfig, TierPolicy
from kvpool.agent.metrics import AgentMetrics
from kvpool.agent.protocol import checksum
from kvpool.agent.store import IO_THREADS, ChunkStore, OpError
from kvpool.agent.tiers.dram import DramTier
from kvpool.agent.tiers.nvme import NvmeTier


def test_a_read_that_misses_while_its_chunk_moves_up_and_back_down_finds_it_again(
        tmp_path: Path) -> None:
    """A GET's NVMe read can miss: a prefetch promoted the chunk and dropped its file
    first, and the watermark sent it straight back down. The GET then reads it again
    (it is not NOT_FOUND), and the new NVMe entry keeps its place in the eviction
    order (the miss once took it out, so it was never evicted).

    The GET's read runs the real read, held at both ends by the test: it starts once the
    chunk has gone up, and its miss reaches the event loop once the chunk is back down."""
    store = _store(tmp_path, 2 << 20, {"highWatermark": 0.6, "lowWatermark": 0.5})
    assert store.nvme is not None
    nvme = store.nvme
    key = b"k" * 16
    filler = [bytes([i]) * 16 for i in range(1, 7)]
    go, read, landed = threading.Event(), threading.Event(), threading.Event()
    read_many = store.loads.read_nvme_many

    def held(keys: list[bytes]) -> list[object]:
        go.wait(30)
        got = read_many(keys)
        read.set()
        landed.wait(30)
        return got  # type: ignore[return-value]

    async def main() -> None:
        for k in [key, *filler[:4]]:  # the fifth chunk crosses the watermark: key goes
            await _put(store, k, _data(k))
        await _settle(store)
        assert key in nvme.nvme.index
        store.loads.read_nvme_many = held  # type: ignore[method-assign]
        reader = asyncio.create_task(store.get(key))
        while key not in store.loads.loading:  # the GET's read has started
            await asyncio.sleep(0.01)
        rec = nvme.nvme.read(key)  # what a prefetch read before the GET came
        assert rec is not None
        await store._promote(rec, "prefetch", "nvme", 1)  # up; its NVMe file goes
        await _settle(store)
        assert key not in nvme.nvme.index and not _on_disk(store).count(key)
        gate = _hold_io(store)
        try:
            for k in filler[2:4]:
                await store.get(k)
            await _put(store, filler[4], _data(filler[4]))
            await _put(store, filler[5], _data(filler[5]))
            assert key in nvme.inflight and store.dram.get(key) is None  # back down
            go.set()  # the GET reads now: the file is gone and the index has no entry
            assert await asyncio.to_thread(read.wait, 30)
        finally:
            gate.set()
        await _settle(store)  # the new file lands and is indexed, in the order
        assert key in nvme.nvme.index and key in nvme.queue
        landed.set()  # the GET's miss reaches the loop
        try:
            got: object = await reader
        except OpError as e:
            got = e
        indexed = sorted(nvme.nvme.index)
        assert [k for k in indexed if k not in nvme.queue] == [], \
            "the miss took the new entry out of the eviction order"
        assert len(nvme.queue) == len(indexed)
        assert isinstance(got, tuple) and (got[0], got[3]) == (_data(key), 3), got

    try:
        asyncio.run(main())
    finally:
        go.set()
        landed.set()
        store.close()


class Recorder:
    """A work function that records its batches; `gate` holds the workers until set."""

    def __init__(self) -> None:
        self.ran: list[list[int]] = []
        self.done: list[tuple[list[int], int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()

    def work(self, batch: list[int]) -> int:
        self.gate.wait(timeout=30)
        with self.lock:
            self.ran.append(batch)
        return sum(batch)

    def finished(self, batch: list[int], result: int) -> None:
        self.done.append((batch, result))


async def settle(b: Batches[int, int]) -> None:
    while b.running or len(b):
        await asyncio.sleep(0.01)


def test_what_one_tick_offers_goes_in_one_batch_with_its_result() -> None:
    rec = Recorder()

    async def main() -> None:
        with ThreadPoolExecutor(2) as pool:
            b = Batches(pool, rec.work, rec.finished)
            for i in range(10):
                b.offer(i)
            await settle(b)
            assert b.batches == 1

    asyncio.run(main())
    assert rec.ran == [list(range(10))]
    assert rec.done == [(list(range(10)), 45)]


def test_items_offered_while_batches_run_wait_and_go_together_in_order() -> None:
    rec = Recorder()
    rec.gate.clear()

    async def main() -> None:
        with ThreadPoolExecutor(2) as pool:
            b = Batches(pool, rec.work, rec.finished, concurrency=1)
            b.offer(0)
            await asyncio.sleep(0)  # the tick ends: batch [0] is handed to the pool
            for i in range(1, 6):
                b.offer(i)
                await asyncio.sleep(0)  # a tick each, but a batch is already running
            assert b.running == 1 and len(b) == 5
            rec.gate.set()
            await settle(b)
            assert b.batches == 2

    asyncio.run(main())
    assert rec.ran == [[0], [1, 2, 3, 4, 5]]
    assert [d[0] for d in rec.done] == rec.ran


def test_batches_are_capped_by_items_and_by_weight() -> None:
    rec = Recorder()

    async def main() -> None:
        with ThreadPoolExecutor(2) as pool:
            by_count = Batches(pool, rec.work, rec.finished, max_items=4, concurrency=1)
            for i in range(10):
                by_count.offer(i)
            await settle(by_count)
            by_weight = Batches(pool, rec.work, rec.finished, weight=lambda i: i,
                                max_weight=10, concurrency=1)
            for i in (6, 5, 1, 20, 3):  # a batch stops once it weighs max_weight or more
                by_weight.offer(i)
            await settle(by_weight)

    asyncio.run(main())
    assert rec.ran == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [6, 5], [1, 20], [3]]


def test_with_a_key_an_item_waits_while_a_running_batch_holds_its_key() -> None:
    """Batches run side by side, but two items of one key never do, nor out of order."""
    rec = Recorder()
    rec.gate.clear()

    async def main() -> None:
        with ThreadPoolExecutor(4) as pool:
            b = Batches(pool, rec.work, rec.finished, key=lambda i: bytes([i % 10]),
                        concurrency=4)
            b.offer(1)
            await asyncio.sleep(0)  # [1] runs, holding key 1
            for i in (11, 2, 21, 3):  # 11 and 21 share key 1: they wait; 2 and 3 go
                b.offer(i)
            await asyncio.sleep(0)
            assert b.running == 2 and b.waiting == [11, 21]
            rec.gate.set()
            await settle(b)

    asyncio.run(main())
    # (`running == 2` above is what shows [1] and [2, 3] side by side; the order in which
    # they finish after the gate opens is the threads', so only the batches are compared.)
    assert sorted(map(tuple, rec.ran)) == [(1,), (2, 3), (11, 21)]
    order = [x for batch in rec.ran for x in batch if x % 10 == 1]
    assert order == [1, 11, 21]


def test_close_does_what_still_waits() -> None:
    rec = Recorder()
    rec.gate.clear()

    async def main() -> Batches[int, int]:
        pool = ThreadPoolExecutor(1)
        b = Batches(pool, rec.work, rec.finished, concurrency=1)
        b.offer(1)
        await asyncio.sleep(0)
        b.offer(2)
        b.offer(3)
        rec.gate.set()
        pool.shutdown(wait=True)  # as the store closes: the running batch finishes first
        return b

    b = asyncio.run(main())
    b.close()
    assert sorted(x for batch in rec.ran for x in batch) == [1, 2, 3]
    assert len(b) == 0


# ---------------------------------------------------------------- the store's NVMe batches


def _store(tmp_path: Path, arena_bytes: int = 1 << 20,
           dram: dict[str, object] | None = None) -> ChunkStore:
    """A store on a 1 MiB arena over an NVMe directory: LRU, no prefetch, no server."""
    config = AgentConfig(socket_path=tmp_path / "agent.sock")
    arena = Arena(tmp_path / "arena", arena_bytes, lock=False)
    policy = TierPolicy.model_validate({"prefetch": {"enabled": False},
                                        "tiers": {"dram": {"eviction": "lru", **(dram or {})}}})
    return ChunkStore(config, DramTier(arena), NvmeTier(tmp_path / "nvme", 64 << 20),
                      AgentMetrics("test"), policy)


def _data(key: bytes, tag: bytes = b"") -> bytes:
    return ((tag + key) * (CHUNK // 16 + 1))[:CHUNK]


CHUNK = 256 << 10


async def _put(store: ChunkStore, key: bytes, data: bytes) -> None:
    assert await store.put(key, data, checksum(data, b""), b"", "")


async def _settle(store: ChunkStore) -> None:
    assert store.nvme is not None
    nvme = store.nvme
    while nvme.writes.running or len(nvme.writes) or nvme.removals.running \
            or len(nvme.removals):
        await asyncio.sleep(0.01)


def _hold_io(store: ChunkStore) -> threading.Event:
    """Occupy every io thread until the event is set: batches queue up behind it."""
    gate = threading.Event()
    for _ in range(IO_THREADS):
        store.io.submit(gate.wait, 30)
    return gate


def _on_disk(store: ChunkStore) -> list[bytes]:
    assert store.nvme is not None
    return sorted(bytes.fromhex(p.stem) for p in store.nvme.nvme.root.glob("??/*.kvc"))


@pytest.mark.parametrize("again", ["promoted", "deleted-and-rewritten"])
def test_a_key_demoted_twice_before_the_first_write_lands_stays_in_nvme(
        tmp_path: Path, again: str) -> None:
    """Demoted, then (promoted from the in-flight copy, or deleted and written again with
    other bytes) and demoted again, all while the first write waits: the newest bytes end
    up in NVMe, indexed, in the eviction order and on disk, and nothing else does.

    A chunk being demoted keeps its arena pages until its write lands, so the arena (2 MiB,
    8 chunks) has room to spare: the watermark (60%, down to 50%) evicts one chunk at a
    time past 4 while the writes wait."""
    store = _store(tmp_path, 2 << 20, {"highWatermark": 0.6, "lowWatermark": 0.5})
    key = b"k" * 16
    filler = [bytes([i]) * 16 for i in range(1, 6)]
    gate = _hold_io(store)

    async def main() -> None:
        await _put(store, key, _data(key, b"old"))
        for k in filler[:4]:  # the fifth chunk crosses the watermark: the key is evicted
            await _put(store, k, _data(k))
        assert store.nvme is not None
        assert key in store.nvme.inflight
        if again == "promoted":
            data, *_ = await store.get(key)  # served from the in-flight copy, promoted
            assert data == _data(key, b"old")
            want = _data(key, b"old")
        else:
            assert store.delete(key)
            want = _data(key, b"new")
            await _put(store, key, want)
        assert store.dram.get(key) is not None
        for k in filler[1:4]:  # read: the key is the least recently used again
            await store.get(k)
        await _put(store, filler[4], _data(filler[4]))
        assert key in store.nvme.inflight and store.dram.get(key) is None  # demoted again
        gate.set()
        await _settle(store)
        index = store.nvme.nvme.index
        assert key in index and key in store.nvme.queue and not store.nvme.inflight
        data, _, _, tier, _ = await store.get(key)
        assert (data, tier) == (want, 3)
        await _settle(store)
        indexed = sorted(index)
        assert _on_disk(store) == indexed
        assert store.nvme.nvme.used_bytes == sum(e.size for e in index.values())
        assert sorted(indexed + list(store.dram)) == sorted([key, *filler])

    try:
        asyncio.run(main())
    finally:
        gate.set()
        store.close()


def test_one_nvme_read_takes_the_rest_of_the_prompt_and_never_serves_a_stale_chunk(
        tmp_path: Path) -> None:
    """Reading the first NVMe chunk of a looked-up prompt reads the ones after it in the
    same worker-thread call; each is then served from that read, unless it was deleted
    (or rewritten) since."""
    store = _store(tmp_path)
    prompt = [bytes([0x40 + i]) * 16 for i in range(6)]
    filler = [bytes([i]) * 16 for i in range(1, 5)]
    calls: list[list[bytes]] = []
    read_many = store.loads.read_nvme_many

    def counted(keys: list[bytes]) -> list[object]:
        calls.append(keys)
        return read_many(keys)  # type: ignore[return-value]

    store.loads.read_nvme_many = counted  # type: ignore[method-assign]

    async def main() -> None:
        for k in prompt + filler:  # the filler pushes the whole prompt down to NVMe
            await _put(store, k, _data(k))
        await _settle(store)
        count, tiers = await store.lookup(prompt)
        assert (count, tiers) == (6, b"\x03" * 6)
        data, *_ = await store.get(prompt[0])
        assert data == _data(prompt[0])
        assert calls == [prompt]  # one read for the whole prompt
        assert list(store.loads.ahead) == prompt[1:]
        assert store.delete(prompt[3])  # the read-ahead copy must not bring it back
        other = _data(prompt[4], b"other")  # already stored: refused, the copy is kept
        assert not await store.put(prompt[4], other, checksum(other, b""), b"", "")
        for k in prompt[1:]:
            if k == prompt[3]:
                with pytest.raises(OpError):
                    await store.get(k)
                continue
            data, _, _, tier, _ = await store.get(k)
            assert (data, tier) == (_data(k), 3)
        assert calls == [prompt]  # served from the read-ahead copies
        assert not list(store.loads.ahead) and store.loads.ahead.bytes == 0
        await _settle(store)
        # Written again with other bytes and pushed down again: read afresh, new bytes.
        await _put(store, prompt[3], _data(prompt[3], b"new"))
        for k in filler:
            await store.get(k)
        await _settle(store)
        assert prompt[3] in store.nvme.nvme.index  # type: ignore[union-attr]
        data, *_ = await store.get(prompt[3])
        assert data == _data(prompt[3], b"new")

    try:
        asyncio.run(main())
    finally:
        store.close()
