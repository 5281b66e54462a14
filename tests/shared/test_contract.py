"""The shared-tier contract, run against both backends (a directory and moto's S3)."""

from __future__ import annotations

import pytest

from kvpool.agent.gc import collect
from kvpool.agent.tiers import base
from kvpool.agent.tiers.base import ChunkRecord, IntegrityError

from .conftest import Backend, counter, make_chunk


def test_round_trip_returns_the_verified_chunk(backend: Backend) -> None:
    tier = backend.open()
    rec = make_chunk(1)
    tier.write(rec)
    assert tier.contains(rec.key)
    got = tier.read(rec.key)
    assert got is not None
    assert bytes(got.data) == rec.data
    assert (got.key, got.checksum, got.meta, got.tenant, got.fingerprint_id) == \
        (rec.key, rec.checksum, rec.meta, rec.tenant, rec.fingerprint_id)
    assert list(tier.keys()) == [rec.key]
    assert counter(backend.metrics, "kvpool_shared_requests_total", op="put", result="ok") == 1


def test_absent_key_is_a_miss_not_an_error(backend: Backend) -> None:
    tier = backend.open()
    key = make_chunk(2).key
    assert tier.read(key) is None
    assert not tier.contains(key)
    assert not tier.delete(key) or backend.kind == "s3"  # S3 cannot tell (204 either way)


def test_delete_removes_the_object(backend: Backend) -> None:
    tier = backend.open()
    rec = make_chunk(3)
    tier.write(rec)
    assert tier.delete(rec.key)
    assert tier.read(rec.key) is None
    assert backend.raw_get(rec.key) is None


def test_chunk_written_by_one_node_is_read_by_another(backend: Backend) -> None:
    node_a, node_b = backend.open(), backend.open()
    rec = make_chunk(4, size=64 << 10)
    node_a.write(rec)
    assert node_b.contains_many([rec.key]) == {rec.key: True}
    got = node_b.read(rec.key)
    assert got is not None and bytes(got.data) == rec.data


def test_object_overwritten_with_wrong_bytes_is_deleted_and_counted(backend: Backend) -> None:
    tier = backend.open()
    rec = make_chunk(5)
    tier.write(rec)
    # A valid-looking blob for the same key whose bytes do not match its checksum.
    forged = ChunkRecord(rec.key, make_chunk(6).data, rec.checksum, rec.meta, rec.tenant)
    backend.raw_put(rec.key, b"".join(base.encode(forged)))
    with pytest.raises(IntegrityError):
        tier.read(rec.key)
    assert counter(backend.metrics, "kvpool_integrity_failures_total", tier="shared") == 1
    assert backend.raw_get(rec.key) is None
    assert tier.read(rec.key) is None  # after the delete: a plain miss


def test_flipped_byte_is_never_served(backend: Backend) -> None:
    tier = backend.open()
    rec = make_chunk(7)
    tier.write(rec)
    blob = bytearray(backend.raw_get(rec.key) or b"")
    blob[-100] ^= 0x01
    backend.raw_put(rec.key, bytes(blob))
    with pytest.raises(IntegrityError):
        tier.read(rec.key)
    assert backend.raw_get(rec.key) is None


def test_blob_under_another_keys_name_is_rejected(backend: Backend) -> None:
    tier = backend.open()
    a, b = make_chunk(8), make_chunk(9)
    backend.raw_put(a.key, b"".join(base.encode(b)))
    with pytest.raises(IntegrityError):
        tier.read(a.key)


def test_contains_many_reports_hits_and_misses(backend: Backend) -> None:
    tier = backend.open()
    present = [make_chunk(i) for i in range(10, 15)]
    for rec in present:
        tier.write(rec)
    absent = [make_chunk(i).key for i in range(20, 25)]
    keys = [present[0].key, absent[0], *(r.key for r in present[1:]), *absent[1:]]
    got = tier.contains_many(keys, budget_s=10.0)
    assert got == {k: (k not in absent) for k in keys}


def test_negative_cache_answers_absent_keys_until_this_node_writes_them(
        backend: Backend) -> None:
    node_a = backend.open(negative_cache_ttl=3600)
    node_b = backend.open()
    rec = make_chunk(30)
    assert node_a.contains_many([rec.key], budget_s=10.0) == {rec.key: False}
    node_b.write(rec)
    # Within the TTL node A does not ask the store again: a short-lived stale miss.
    assert node_a.contains_many([rec.key], budget_s=10.0) == {rec.key: False}
    heads = counter(backend.metrics, "kvpool_shared_requests_total", op="head", result="ok")
    assert heads == 1
    node_a.write(rec)  # a node's own write forgets the negative entry
    assert node_a.contains_many([rec.key], budget_s=10.0) == {rec.key: True}


def test_zero_budget_returns_unknown_rather_than_waiting(backend: Backend) -> None:
    tier = backend.open()
    keys = [make_chunk(i).key for i in range(40, 140)]
    got = tier.contains_many(keys, budget_s=0.0)
    assert set(got) == set(keys)
    assert all(v in (None, False) for v in got.values())


def test_gc_deletes_objects_older_than_the_ttl(backend: Backend) -> None:
    tier = backend.open()
    for i in range(50, 53):
        tier.write(make_chunk(i))
    backend.raw_put_foreign("README.txt")
    written_at = max(o.last_modified for o in tier.list_objects())
    kept = collect(tier, ttl_seconds=3600, now=written_at + 60)
    assert (kept.deleted, kept.kept) == (0, 3)
    gone = collect(tier, ttl_seconds=3600, now=written_at + 7200, metrics=backend.metrics)
    assert (gone.deleted, gone.kept, gone.errors) == (3, 0, 0)
    assert gone.bytes_freed > 3 * 4096
    assert list(tier.keys()) == []
    assert counter(backend.metrics, "kvpool_tier_evictions_total", tier="shared",
                   reason="ttl") == 3


def test_gc_all_empties_the_pool_but_leaves_foreign_objects(backend: Backend) -> None:
    tier = backend.open()
    for i in range(60, 65):
        tier.write(make_chunk(i))
    backend.raw_put_foreign("README.txt")
    result = collect(tier, ttl_seconds=None, all_objects=True)
    assert (result.deleted, result.kept, result.errors) == (5, 0, 0)
    assert list(tier.keys()) == []


def test_gc_needs_exactly_one_of_ttl_or_all(backend: Backend) -> None:
    tier = backend.open()
    with pytest.raises(ValueError):
        collect(tier, ttl_seconds=None)
    with pytest.raises(ValueError):
        collect(tier, ttl_seconds=10, all_objects=True)


def test_usage_is_refreshed_from_a_listing(backend: Backend) -> None:
    tier = backend.open()
    assert tier.capacity_bytes == 0
    for i in range(70, 73):
        tier.write(make_chunk(i, size=1000))
    assert tier.refresh_usage() == (3, tier.used_bytes)
    assert tier.chunks == 3 and tier.used_bytes > 3000


def test_closed_tier_answers_unknown_instead_of_raising(backend: Backend) -> None:
    tier = backend.open()
    tier.close()
    key = make_chunk(80).key
    assert tier.contains_many([key], budget_s=1.0) == {key: None}
    assert tier.probe() == tier.healthy()
