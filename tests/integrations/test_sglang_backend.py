"""The kvpool HiCache backend as SGLang loads and calls it, against a real agent.

SGLang's own code here: `StorageBackendFactory` loads the backend by module
path from the dynamic-backend extra config, `HiCacheStorageConfig` describes
the rank, `get_hash_str` makes the page hashes, and the pages are shaped as
SGLang's MHA host pool hands them out (`get_data_page` / `get_dummy_flat_data_page`:
flat `[2, layers, page, heads, head_dim]`). The calls are the ones
`HiCacheController` makes on its generic page path (`batch_set` on backup,
`batch_exists` on the prefetch hit query, `batch_get` into dummy pages on
prefetch). The controller itself needs a device KV pool and does not run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zmq
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

from kvpool.agent.integrations.sglang import KVPoolHiCacheStorage
from kvpool.bench.local import LocalAgent

from ..agent.conftest import scrape, wait_until
from ..agent.test_events import MapBatch, Mirror, events_agent

LAYERS, PAGE, HEADS, HEAD_DIM = 2, 8, 2, 16
EXTRA = {"backend_name": "kvpool", "module_path": "kvpool.agent.integrations.sglang",
         "class_name": "KVPoolHiCacheStorage"}
TOKENS = list(range(1000, 1000 + 4 * PAGE))


def backend(agent: LocalAgent, model: str = "org/model-a",
            tp_rank: int = 0, **extra: object) -> KVPoolHiCacheStorage:
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model,
        extra_config={**EXTRA, "socket_path": str(agent.socket_path), **extra})
    made = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(made, KVPoolHiCacheStorage)
    return made


def pages(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shape = (2, LAYERS, PAGE, HEADS, HEAD_DIM)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16).flatten() for _ in range(n)]


def dummy_page(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(2, LAYERS, PAGE, HEADS, HEAD_DIM, dtype=dtype).flatten()


@pytest.fixture
def hashes() -> list[str]:
    got = get_hash_str(TOKENS, None, page_size=PAGE)
    assert isinstance(got, list) and len(got) == 4
    return got


def test_pages_backed_up_by_one_backend_are_prefetched_by_another(
        agent: LocalAgent, hashes: list[str]) -> None:
    data = pages(4)
    writer = backend(agent)
    assert writer.batch_set(hashes, data) is True
    writer.close()

    reader = backend(agent)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert reader.batch_exists(hashes, info) == 4
    other = get_hash_str(list(range(9)), hashes[-1], page_size=PAGE)
    assert reader.batch_exists([*hashes, *other], info) == 4
    targets = [dummy_page() for _ in hashes]
    got = reader.batch_get(hashes, targets)
    assert all(g is t for g, t in zip(got, targets, strict=True))
    for page, want in zip(targets, data, strict=True):
        assert torch.equal(page, want)
    assert reader.exists(hashes[0]) and not reader.exists(other[0])
    assert scrape(agent)['kvpool_ops_total{op="commit",pool="default",result="ok"}'] == 4


@pytest.mark.parametrize("lease_free", [True, False])
def test_a_backend_reads_dram_pages_without_a_lease_once_it_knows_their_layout(
        agent: LocalAgent, hashes: list[str], lease_free: bool) -> None:
    """A prefetch of pages the reader has read before (their metadata known) takes no
    ACQUIRE: they are read from the arena without a lease. `lease_free: false` in the
    extra config reads every page under a lease."""
    data = pages(4)
    assert backend(agent).batch_set(hashes, data) is True
    reader = backend(agent, lease_free=lease_free)
    acquires = 'kvpool_ops_total{op="acquire",pool="default",result="ok"}'
    for load in range(2):
        before = scrape(agent).get(acquires, 0.0)
        targets = [dummy_page() for _ in hashes]
        assert all(g is t for g, t in zip(reader.batch_get(hashes, targets), targets,
                                          strict=True))
        for page, want in zip(targets, data, strict=True):
            assert torch.equal(page, want)
        under_lease = 4 if load == 0 or not lease_free else 0
        assert scrape(agent).get(acquires, 0.0) - before == under_lease
    assert reader.client.reads_without_lease == (4 if lease_free else 0)


def test_hit_prefix_stops_at_the_first_missing_page(agent: LocalAgent, hashes: list[str]) -> None:
    b = backend(agent)
    data = pages(4)
    assert b.batch_set([hashes[0], hashes[1], hashes[3]], [data[0], data[1], data[3]])
    assert b.batch_exists(hashes) == 2
    got = b.batch_get(hashes, [dummy_page() for _ in hashes])
    assert [g is not None for g in got] == [True, True, False, True]


def test_another_model_or_tensor_parallel_rank_misses(agent: LocalAgent, hashes: list[str]) -> None:
    assert backend(agent).batch_set(hashes, pages(4))
    assert backend(agent, model="org/model-b").batch_exists(hashes) == 0
    assert backend(agent, tp_rank=1).batch_exists(hashes) == 0


def test_page_read_into_a_tensor_of_another_dtype_is_a_miss(
        agent: LocalAgent, hashes: list[str]) -> None:
    b = backend(agent)
    assert b.set(hashes[0], pages(1)[0])
    target = dummy_page(torch.float16)
    assert b.get(hashes[0], target) is None
    assert not torch.any(target)


def test_backed_up_pages_are_published_under_sglangs_own_block_hashes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page SGLang backs up is announced, in the engine pod's topic for its model, under
    the block hash SGLang's own KV events give that page (`hash_str_to_int64` of its page
    hash): a router sees one page whichever of the two announced it."""
    monkeypatch.setenv("POD_NAME", "engine-0")
    ctx: zmq.Context[object] = zmq.Context()
    with events_agent(tmp_path, "pod", "map", "8Mi") as (agent, endpoint, replay):
        mirror = Mirror(ctx, endpoint, replay, b"kv@engine-0@org/model-a", MapBatch)
        store = backend(agent)
        try:
            nudges = iter(range(1, 500))

            def heard() -> bool:
                # A subscriber hears only what is published once it is connected: back up
                # one more page until it has, then replay fills in the rest.
                n = next(nudges)
                store.batch_set(get_hash_str([n] * PAGE, None, page_size=PAGE), pages(1))
                mirror.pump()
                return bool(mirror.held.get("CPU_PINNED"))
            wait_until(heard, "the engine pod's topic to hear a backed-up page")
            hashes = get_hash_str(TOKENS, None, page_size=PAGE)
            assert store.batch_set(hashes, pages(4))
            expected = {hash_str_to_int64(h) for h in hashes}

            def published() -> bool:
                mirror.pump()
                return expected <= mirror.held.get("CPU_PINNED", set())
            wait_until(published, "the backed-up pages' block hashes")
        finally:
            store.close()
            mirror.disconnect()
            ctx.destroy(linger=0)
