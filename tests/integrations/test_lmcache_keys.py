"""How LMCache chunk keys and memory-object layouts map onto kvpool keys and chunk metadata."""

from __future__ import annotations

import msgspec
import pytest
import torch
from lmcache.utils import CacheEngineKey

from kvpool.agent.integrations.lmcache import ChunkMeta, decode_meta, pool_key


def key(model: str = "org/model-a", world: int = 1, worker: int = 0,
        chunk_hash: int = 0x1234ABCD, dtype: torch.dtype = torch.bfloat16) -> CacheEngineKey:
    return CacheEngineKey(model, world, worker, chunk_hash, dtype)


def test_pool_key_is_fixed_across_processes_and_releases() -> None:
    # A change here is a new KEY_SCHEME: pools filled by older clients would all miss.
    assert pool_key(key()).hex() == "9cba9b425d5fa3de56d069795f546c1a"
    assert pool_key(key(), "team-a").hex() == "1147af949854006f2b727c001a201e50"


@pytest.mark.parametrize("other", [
    key(model="org/model-b"), key(world=2), key(worker=1), key(chunk_hash=0x1234ABCE),
    key(dtype=torch.float16),
])
def test_every_field_of_the_lmcache_key_changes_the_pool_key(other: CacheEngineKey) -> None:
    assert pool_key(other) != pool_key(key())


def test_tenants_never_share_a_key() -> None:
    assert pool_key(key(), "team-a") != pool_key(key(), "team-b") != pool_key(key())


def meta_bytes(shapes: list[list[int]], dtypes: list[str], fmt: str = "KV_2LTD") -> bytes:
    return msgspec.msgpack.encode(ChunkMeta("lmcache/v1", fmt, shapes, dtypes))


def test_metadata_that_describes_the_chunk_decodes() -> None:
    meta = decode_meta(meta_bytes([[2, 4, 5, 32]], ["bfloat16"]), 2 * 4 * 5 * 32 * 2)
    assert meta is not None
    assert meta.torch_dtypes() == [torch.bfloat16] and meta.shapes == [[2, 4, 5, 32]]


@pytest.mark.parametrize(("raw", "size"), [
    (meta_bytes([[2, 4, 5, 32]], ["bfloat16"]), 2 * 4 * 16 * 32 * 2),   # size disagrees
    (meta_bytes([[2, 4, 5, 32]], ["no_such_dtype"]), 2 * 4 * 5 * 32 * 2),
    (meta_bytes([[2, 4, 5, 32]], ["bfloat16"], fmt="NO_SUCH_FORMAT"), 2 * 4 * 5 * 32 * 2),
    (b"not msgpack", 10),
    (b"", 10),
])
def test_metadata_that_does_not_describe_the_chunk_is_a_miss(raw: bytes, size: int) -> None:
    assert decode_meta(raw, size) is None
