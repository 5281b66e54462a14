"""Health of the file:// backend: a mount that goes away, and comes back."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.agent.gc import LEFTOVER_GRACE, collect, run_gc
from kvpool.agent.metrics import AgentMetrics
from kvpool.agent.tiers.shared import SharedTierUnavailable
from kvpool.agent.writebehind import WriteBehindQueue

from .conftest import Backend, counter, make_chunk


def test_missing_directory_turns_the_tier_unhealthy_until_it_returns(
        tmp_path: Path, metrics: AgentMetrics) -> None:
    root = tmp_path / "shared"
    files = Backend("file", f"file://{root}", None, metrics)
    tier = files.open()
    queue = WriteBehindQueue(tier, depth=8, concurrency=1, metrics=metrics)
    try:
        kept = make_chunk(1)
        tier.write(kept)
        assert tier.probe() == (True, "")

        root.rename(tmp_path / "away")  # the mount went away
        with pytest.raises(OSError):
            tier.write(make_chunk(2))
        ok, reason = tier.healthy()
        assert not ok and reason.startswith("shared filesystem directory missing")
        keys = [make_chunk(i).key for i in range(3)]
        assert tier.contains_many(keys, budget_s=60.0) == dict.fromkeys(keys)
        with pytest.raises(SharedTierUnavailable):
            tier.read(kept.key)
        queue.offer(make_chunk(3))
        assert counter(metrics, "kvpool_shared_dropped_writes_total") == 1
        assert tier.probe()[0] is False

        (tmp_path / "away").rename(root)  # mounted again
        assert tier.probe() == (True, "")
        tier.write(make_chunk(4))
        assert tier.contains(make_chunk(4).key)
    finally:
        queue.close(drain_timeout=1)
        files.close()


def test_interrupted_write_leaves_no_chunk_and_gc_removes_the_leftover(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    files = Backend("file", f"file://{root}", None, AgentMetrics("test"))
    tier = files.open()
    rec = make_chunk(1)
    leftover = root / rec.key.hex()[:2] / f"{rec.key.hex()}.kvc.tmp-deadbeef"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a chunk")
    assert tier.read(rec.key) is None
    assert list(tier.keys()) == []
    assert run_gc(files.url, all_objects=True).deleted == 1
    assert not leftover.exists()
    files.close()


def test_ttl_run_keeps_a_young_temporary_file_that_may_be_a_write_in_progress(
        tmp_path: Path) -> None:
    root = tmp_path / "shared"
    files = Backend("file", f"file://{root}", None, AgentMetrics("test"))
    tier = files.open()
    tmp = root / "ab" / f"{'ab' * 16}.kvc.tmp-0123"
    tmp.parent.mkdir(parents=True)
    tmp.write_bytes(b"being written")
    born = tmp.stat().st_mtime
    assert collect(tier, ttl_seconds=1, now=born + 60).kept == 1
    assert collect(tier, ttl_seconds=1, now=born + LEFTOVER_GRACE + 1).deleted == 1
    files.close()


def test_run_gc_takes_a_duration_string(tmp_path: Path) -> None:
    files = Backend("file", f"file://{tmp_path / 'shared'}", None, AgentMetrics("test"))
    files.open().write(make_chunk(1))
    result = run_gc(files.url, ttl="7d")
    assert (result.deleted, result.kept) == (0, 1)
    with pytest.raises(ValueError):
        run_gc(files.url, ttl="soon")
    files.close()


def test_run_gc_on_s3(moto_endpoint: str, bucket: str) -> None:
    files = Backend("s3", f"s3://{bucket}/pools/a", moto_endpoint, AgentMetrics("test"))
    for i in range(3):
        files.open().write(make_chunk(i))
    result = run_gc(files.url, all_objects=True, endpoint_url=moto_endpoint)
    assert (result.deleted, result.errors) == (3, 0)
    files.close()
