"""The write-behind queue against a real shared directory."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvpool.agent.metrics import AgentMetrics
from kvpool.agent.tiers.base import ChunkRecord
from kvpool.agent.writebehind import KeyBusy, WriteBehindQueue

from ..support import wait_until
from .conftest import Backend, counter, make_chunk


@pytest.fixture
def files(tmp_path: Path, metrics: AgentMetrics) -> Backend:
    return Backend("file", f"file://{tmp_path / 'shared'}", None, metrics)


def test_offered_chunks_are_uploaded(backend: Backend) -> None:
    tier = backend.open()
    queue = WriteBehindQueue(tier, depth=64, concurrency=4, metrics=backend.metrics)
    recs = [make_chunk(i) for i in range(20)]
    for rec in recs:
        queue.offer(rec)
    assert queue.drain(timeout=30)
    assert queue.stats().written == 20
    assert sorted(tier.keys()) == sorted(r.key for r in recs)
    queue.close(drain_timeout=1)


def test_full_queue_drops_the_oldest_and_counts_it(files: Backend) -> None:
    tier = files.open()
    queue = WriteBehindQueue(tier, depth=4, concurrency=2, metrics=files.metrics, start=False)
    recs = [make_chunk(i) for i in range(10)]
    for rec in recs:
        queue.offer(rec)
    assert queue.queue_depth == 4
    assert queue.stats().dropped == 6
    assert counter(files.metrics, "kvpool_shared_dropped_writes_total") == 6
    queue.start()
    assert queue.drain(timeout=30)
    assert sorted(tier.keys()) == sorted(r.key for r in recs[-4:])  # the newest survive
    queue.close(drain_timeout=1)


def test_queue_is_bounded_by_bytes_dropping_the_oldest(files: Backend) -> None:
    tier = files.open()
    # Room by count for all 10 chunks of 1 MiB, by bytes for 4.
    queue = WriteBehindQueue(tier, depth=64, concurrency=2, metrics=files.metrics, start=False,
                             max_bytes=4 << 20)
    recs = [make_chunk(i, size=1 << 20) for i in range(10)]
    for rec in recs:
        queue.offer(rec)
        assert queue.held_bytes <= 4 << 20
    assert queue.queue_depth == 4
    assert queue.stats().dropped == 6
    assert counter(files.metrics, "kvpool_shared_dropped_writes_total") == 6
    big = make_chunk(99, size=5 << 20)  # cannot fit even alone: dropped, nothing else goes
    queue.offer(big)
    assert queue.queue_depth == 4 and queue.stats().dropped == 7
    queue.start()
    assert queue.drain(timeout=30)
    assert queue.held_bytes == 0
    assert sorted(tier.keys()) == sorted(r.key for r in recs[-4:])  # the newest survive
    queue.close(drain_timeout=1)


def test_the_default_queue_is_bounded_by_bytes(files: Backend) -> None:
    queue = WriteBehindQueue(files.open(), depth=1024, concurrency=1, start=False)
    for i in range(300):  # 300 MiB offered, with room by count for 1,024 chunks
        queue.offer(make_chunk(i, size=1 << 20))
    assert queue.held_bytes <= 256 << 20
    queue.close(drain_timeout=0)


def test_a_key_already_pending_is_not_queued_twice(files: Backend) -> None:
    queue = WriteBehindQueue(files.open(), depth=4, concurrency=1, start=False)
    rec = make_chunk(1)
    queue.offer(rec)
    queue.offer(rec)
    assert queue.queue_depth == 1
    assert queue.close(drain_timeout=0) == 1


def test_queue_copies_views_so_it_never_points_into_the_arena(files: Backend) -> None:
    tier = files.open()
    queue = WriteBehindQueue(tier, depth=4, concurrency=1, start=False)
    arena = bytearray(make_chunk(1).data)
    rec = make_chunk(1)
    queue.offer(ChunkRecord(rec.key, memoryview(arena), rec.checksum, rec.meta, rec.tenant))
    arena[:] = bytes(len(arena))  # the arena reuses the extent
    queue.start()
    assert queue.drain(timeout=30)
    got = tier.read(rec.key)
    assert got is not None and bytes(got.data) == rec.data
    queue.close(drain_timeout=1)


def test_failed_upload_is_retried_until_the_fault_clears(files: Backend) -> None:
    tier = files.open()
    rec = make_chunk(1)
    # A file where the chunk's fan-out directory belongs: every write fails.
    blocker = Path(files.url[7:]) / rec.key.hex()[:2]
    blocker.write_bytes(b"")
    queue = WriteBehindQueue(tier, depth=4, concurrency=1, metrics=files.metrics,
                             retries=1000, backoff_s=0.001, max_backoff_s=0.01)
    queue.offer(rec)
    for _ in range(10_000):  # bounded: wait until the worker failed at least twice
        if counter(files.metrics, "kvpool_tier_errors_total", tier="shared", kind="write") >= 2:
            break
        time.sleep(0.001)
    assert tier.healthy() == (True, "")  # one bad path is not an outage
    blocker.unlink()
    assert queue.drain(timeout=30)
    assert queue.stats().written == 1 and queue.stats().dropped == 0
    assert tier.read(rec.key) is not None
    queue.close(drain_timeout=1)


def test_upload_that_keeps_failing_is_dropped_and_counted(files: Backend) -> None:
    tier = files.open()
    rec = make_chunk(1)
    (Path(files.url[7:]) / rec.key.hex()[:2]).write_bytes(b"")
    queue = WriteBehindQueue(tier, depth=4, concurrency=1, metrics=files.metrics,
                             retries=2, backoff_s=0.001)
    queue.offer(rec)
    assert queue.drain(timeout=30)
    assert queue.stats().dropped == 1
    assert counter(files.metrics, "kvpool_tier_errors_total", tier="shared", kind="write") == 3
    assert counter(files.metrics, "kvpool_shared_dropped_writes_total") == 1
    queue.close(drain_timeout=1)


def test_close_drops_what_it_cannot_upload(files: Backend) -> None:
    queue = WriteBehindQueue(files.open(), depth=8, concurrency=1, start=False)
    for i in range(5):
        queue.offer(make_chunk(i))
    assert queue.close(drain_timeout=0) == 5
    queue.offer(make_chunk(9))  # after close: dropped, never raises
    assert queue.stats().dropped == 6


def test_no_upload_of_a_key_starts_while_a_delete_holds_it(files: Backend) -> None:
    tier = files.open()
    queue = WriteBehindQueue(tier, depth=64, concurrency=2, metrics=files.metrics)
    rec, other = make_chunk(1), make_chunk(2)
    with queue.exclusive(rec.key, timeout=5):
        queue.offer(rec)
        queue.offer(other)  # another key is not held up
        wait_until(lambda: queue.stats().written == 1, "the other key's upload")
        assert queue.stats().pending == 1 and tier.keys() == [other.key]
    assert queue.drain(timeout=30)
    assert sorted(tier.keys()) == sorted([rec.key, other.key])
    queue.close(drain_timeout=1)


def test_a_delete_waits_for_the_upload_of_its_key_in_flight(files: Backend) -> None:
    """The upload has landed but its worker is not done with it (the `uploaded` hook
    runs): the key is in flight, so `exclusive` waits for it, up to its timeout."""
    tier = files.open()
    queue = WriteBehindQueue(tier, depth=64, concurrency=1, metrics=files.metrics)
    landed, finish = threading.Event(), threading.Event()

    def hook(key: bytes) -> None:
        landed.set()
        finish.wait(30)

    queue.uploaded = hook
    rec = make_chunk(1)
    queue.offer(rec)
    assert landed.wait(30)
    with pytest.raises(KeyBusy), queue.exclusive(rec.key, timeout=0.2):
        pass
    held = threading.Event()

    def delete() -> None:
        with queue.exclusive(rec.key, timeout=30):
            held.set()

    t = threading.Thread(target=delete)
    t.start()
    assert not held.wait(0.2), "the delete did not wait for the upload in flight"
    finish.set()
    t.join(30)
    assert held.is_set()
    queue.close(drain_timeout=1)
