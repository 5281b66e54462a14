"""What only the S3 backend does: multipart uploads, AWS settings, outages of the server."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent.config import SharedTier
from kvpool.agent.gc import collect
from kvpool.agent.metrics import AgentMetrics
from kvpool.agent.tiers.factory import open_shared_tier
from kvpool.agent.tiers.s3 import S3SharedTier, bucket_and_prefix
from kvpool.agent.tiers.shared import SharedTierUnavailable
from kvpool.agent.writebehind import WriteBehindQueue

from .conftest import RestartableMoto, counter, make_chunk, s3_client

MiB = 1 << 20


def etag(endpoint: str, tier: S3SharedTier, key: bytes) -> str:
    head = s3_client(endpoint).head_object(Bucket=tier.bucket, Key=tier.object_key(key))
    return str(head["ETag"]).strip('"')


@pytest.mark.parametrize(("url", "expected"), [
    ("s3://b", ("b", "")),
    ("s3://b/", ("b", "")),
    ("s3://b/pools/ns.pool", ("b", "pools/ns.pool/")),
    ("s3://b/pools/ns.pool/", ("b", "pools/ns.pool/")),
])
def test_url_gives_bucket_and_prefix(url: str, expected: tuple[str, str]) -> None:
    assert bucket_and_prefix(url) == expected


def test_chunk_at_the_threshold_is_uploaded_in_parts(moto_endpoint: str, bucket: str) -> None:
    cfg = SharedTier(url=f"s3://{bucket}/p", endpoint_url=moto_endpoint,
                     multipart_threshold=5 * MiB)
    tier = open_shared_tier(cfg)
    assert isinstance(tier, S3SharedTier)
    try:
        big, small = make_chunk(1, size=6 * MiB), make_chunk(2, size=MiB)
        tier.write(big)
        tier.write(small)
        assert etag(moto_endpoint, tier, big.key).endswith("-2")  # 5 MiB + the rest
        assert "-" not in etag(moto_endpoint, tier, small.key)
        got = tier.read(big.key)
        assert got is not None and bytes(got.data) == big.data
    finally:
        tier.close()


def test_gc_aborts_uploads_a_crashed_agent_left_unfinished(
        moto_endpoint: str, bucket: str) -> None:
    tier = open_shared_tier(SharedTier(url=f"s3://{bucket}/p", endpoint_url=moto_endpoint))
    assert isinstance(tier, S3SharedTier)
    client = s3_client(moto_endpoint)
    try:
        name = tier.object_key(make_chunk(1).key)
        started = client.create_multipart_upload(Bucket=bucket, Key=name)
        client.upload_part(Bucket=bucket, Key=name, UploadId=started["UploadId"], PartNumber=1,
                           Body=b"x" * MiB)
        tier.write(make_chunk(2))
        # (moto reports a fixed upload start date, so the grace period a TTL run
        # gives young uploads is tested with the file backend's temporary files)
        result = collect(tier, ttl_seconds=None, all_objects=True)
        assert (result.deleted, result.errors) == (2, 0)
        assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    finally:
        tier.close()


def test_credentials_come_from_the_configured_file(
        moto_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    creds = tmp_path / "credentials"  # as mounted from a Secret
    creds.write_text("[default]\naws_access_key_id = fromsecret\n"
                     "aws_secret_access_key = fromsecret\n")
    tier = open_shared_tier(SharedTier(url=f"s3://{bucket}/p", endpoint_url=moto_endpoint,
                                       credentials_file=creds))
    try:
        rec = make_chunk(3)
        tier.write(rec)
        assert tier.read(rec.key) is not None
    finally:
        tier.close()


def test_without_credentials_the_tier_is_unhealthy_not_crashing(
        moto_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    tier = open_shared_tier(SharedTier(url=f"s3://{bucket}/p", endpoint_url=moto_endpoint))
    try:
        ok, reason = tier.probe()
        assert not ok and reason.startswith("s3 unreachable:") and "credentials" in reason
    finally:
        tier.close()


def test_endpoint_comes_from_aws_endpoint_url(
        moto_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    tier = open_shared_tier(SharedTier(url=f"s3://{bucket}/p"))
    try:
        assert tier.probe() == (True, "")
        rec = make_chunk(4)
        tier.write(rec)
        assert tier.contains(rec.key)
    finally:
        tier.close()


def test_missing_bucket_is_unhealthy_with_a_reason(moto_endpoint: str) -> None:
    tier = open_shared_tier(SharedTier(url="s3://no-such-bucket-here/p",
                                       endpoint_url=moto_endpoint))
    try:
        ok, reason = tier.probe()
        assert not ok and reason
    finally:
        tier.close()


# -------------------------------------------------------------------------- outages


def test_stopped_store_turns_unhealthy_and_recovers_after_restart(
        own_moto: RestartableMoto, metrics: AgentMetrics) -> None:
    endpoint = own_moto.endpoint
    s3_client(endpoint).create_bucket(Bucket="outage")
    tier = open_shared_tier(SharedTier(url="s3://outage/p", endpoint_url=endpoint,
                                       request_timeout=2.0, lookup_budget=2.0), metrics)
    queue = WriteBehindQueue(tier, depth=16, concurrency=2, metrics=metrics)
    try:
        kept = make_chunk(1)
        tier.write(kept)
        assert tier.probe() == (True, "")

        own_moto.stop()
        with pytest.raises(OSError):
            tier.contains(make_chunk(2).key)
        ok, reason = tier.healthy()
        assert not ok and reason.startswith("s3 unreachable:")
        assert counter(metrics, "kvpool_shared_requests_total", op="head", result="error") == 1

        # Degraded: presence is unknown at once, reads and writes fail fast.
        keys = [make_chunk(i).key for i in range(10, 20)]
        assert tier.contains_many(keys, budget_s=60.0) == dict.fromkeys(keys)
        with pytest.raises(SharedTierUnavailable):
            tier.read(kept.key)
        with pytest.raises(SharedTierUnavailable):
            tier.write(make_chunk(3))
        for i in range(10, 20):
            queue.offer(make_chunk(i))
        assert queue.stats().dropped == 10
        assert counter(metrics, "kvpool_shared_dropped_writes_total") == 10
        assert tier.probe()[0] is False  # still down: the probe says so

        own_moto.start()
        assert tier.probe() == (True, "")
        got = tier.read(kept.key)
        assert got is not None and bytes(got.data) == kept.data
        fresh = make_chunk(4)
        queue.offer(fresh)
        assert queue.drain(timeout=30)
        assert tier.contains(fresh.key)
    finally:
        queue.close(drain_timeout=0)
        tier.close()


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An endpoint that accepts connections and never answers (a hung store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_store_that_does_not_answer_times_out_into_unhealthy(
        black_hole: str, metrics: AgentMetrics) -> None:
    tier = open_shared_tier(SharedTier(url="s3://hung/p", endpoint_url=black_hole,
                                       request_timeout=0.5), metrics)
    try:
        with pytest.raises(OSError):
            tier.contains(make_chunk(1).key)
        ok, reason = tier.healthy()
        assert not ok and reason.startswith("s3 unreachable:")
        assert counter(metrics, "kvpool_tier_errors_total", tier="shared", kind="timeout") == 1
    finally:
        tier.close()


def test_lookup_returns_within_budget_while_the_store_hangs(black_hole: str) -> None:
    tier = open_shared_tier(SharedTier(url="s3://hung/p", endpoint_url=black_hole,
                                       request_timeout=30.0))
    try:
        keys = [make_chunk(i).key for i in range(50)]
        # With a 30 s request timeout, only the budget can bring this back.
        assert tier.contains_many(keys, budget_s=0.2) == dict.fromkeys(keys)
    finally:
        tier.close()


def test_offer_never_blocks_while_every_worker_is_stalled(black_hole: str) -> None:
    tier = open_shared_tier(SharedTier(url="s3://hung/p", endpoint_url=black_hole,
                                       request_timeout=30.0))
    queue = WriteBehindQueue(tier, depth=8, concurrency=2)
    try:
        offered = 200
        for i in range(offered):
            queue.offer(make_chunk(i, size=256))
        s = queue.stats()
        assert s.written == 0
        assert s.pending == 8
        assert s.in_flight <= 2
        assert s.pending + s.in_flight + s.dropped == offered
    finally:
        queue.close(drain_timeout=0)
        tier.close()
