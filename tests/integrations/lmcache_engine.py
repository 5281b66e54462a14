"""One inference process using LMCache's real engine on the CPU, with kvpool as its remote store.

Run as a script by the tests (a fresh interpreter per engine, as a second
vLLM pod would be)::

    python lmcache_engine.py store|retrieve|retrieve-twice CONFIG MODEL RESULT

`store` writes the KV of `TOKENS` (made from a fixed seed) through
`LMCacheEngine.store` and saves the chunks' LMCache hashes to RESULT;
`retrieve` asks `LMCacheEngine.retrieve` for the same tokens into a zeroed
KV buffer and saves what came back to RESULT, with the retrieved-token count.

No GPU here: the serving engine's "GPU" KV buffer is a CPU tensor, and
`CPUBufferConnector` moves chunks between it and LMCache's memory objects,
which is what a GPU connector does with device memory.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata

from kvpool.bench.engine_process import run_main

LAYERS, HEADS, HEAD_DIM, CHUNK = 4, 2, 16, 16
DTYPE = torch.bfloat16
TOKENS = [(i * 7919 + 13) % 32000 for i in range(CHUNK * 4 + 5)]
"""Four full chunks and a partial one."""


def expected_kv() -> torch.Tensor:
    """The KV a model would compute for TOKENS: [2, layers, tokens, heads * head_dim]."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(2, LAYERS, len(TOKENS), HEADS * HEAD_DIM, generator=gen).to(DTYPE)


class CPUBufferConnector(MockGPUConnector):  # type: ignore[misc]
    """LMCache's mock GPU connector, moving real bytes: the KV buffer is a CPU tensor."""

    def __init__(self, kv: torch.Tensor) -> None:
        super().__init__(kv_shape=(LAYERS, 2, len(TOKENS), HEADS, HEAD_DIM))
        self.kv = kv

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(self.kv[:, :, start:end, :])
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.kv[:, :, start:end, :].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * HEAD_DIM])


def build_engine(config_path: str, model: str, kv: torch.Tensor) -> Any:
    config = LMCacheEngineConfig.from_file(config_path)
    metadata = LMCacheMetadata(
        model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=DTYPE, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK,
    )
    engine = LMCacheEngineBuilder.get_or_create(
        "kvpool-test", config, metadata, CPUBufferConnector(kv),
        mock_up_broadcast_fn, mock_up_broadcast_object_fn)
    engine.post_init()
    return engine


def remote_backend(engine: Any) -> Any:
    backends = engine.storage_manager.storage_backends
    return next(b for name, b in backends.items() if name.startswith("RemoteBackend"))


def store(config_path: str, model: str, result_path: str) -> None:
    engine = build_engine(config_path, model, expected_kv())
    remote = remote_backend(engine)
    assert remote.connection is not None, "the kvpool plugin did not load"
    engine.store(torch.tensor(TOKENS), slot_mapping=torch.arange(len(TOKENS)))
    # The chunk hashes LMCache names the stored chunks by (what KV events carry).
    hashes = [r[2].chunk_hash for r in engine.token_database.process_tokens(TOKENS)]
    torch.save({"chunk_hashes": hashes}, result_path)
    # Remote puts run as tasks on LMCache's event loop, and batched ones are
    # not tracked in `put_tasks`: a no-op queued behind them on the same loop
    # returns once they have run (the connector's batched_put never yields).
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), remote.loop).result(timeout=60)
    LMCacheEngineBuilder.destroy("kvpool-test")


def _retrieves(config_path: str, model: str, times: int) -> tuple[list[int], list[Any]]:
    """Tokens retrieved and the KV buffer after each of `times` retrieves of the prompt by
    one fresh engine (the buffer zeroed before each)."""
    kv = torch.zeros_like(expected_kv())
    engine = build_engine(config_path, model, kv)
    assert remote_backend(engine).connection is not None, "the kvpool plugin did not load"
    retrieved, kvs = [], []
    for _ in range(times):
        kv.zero_()
        mask = engine.retrieve(torch.tensor(TOKENS), slot_mapping=torch.arange(len(TOKENS)))
        retrieved.append(int(mask.sum()))
        kvs.append(kv.clone())
    LMCacheEngineBuilder.destroy("kvpool-test")
    return retrieved, kvs


def retrieve(config_path: str, model: str, result_path: str) -> None:
    (retrieved,), (kv,) = _retrieves(config_path, model, 1)
    torch.save({"retrieved": retrieved, "kv": kv}, result_path)


def retrieve_twice(config_path: str, model: str, result_path: str) -> None:
    """Two retrieves of the same prompt by one engine (each from the pool, with LMCache's
    CPU buffer keeping nothing, `local_cpu: false`): the first teaches the connector the
    chunks' metadata, as an engine's first load does."""
    retrieved, kvs = _retrieves(config_path, model, 2)
    torch.save({"retrieved": retrieved, "kv": kvs}, result_path)


def main(argv: list[str]) -> int:
    op, config_path, model = argv[:3]
    ops = {"store": store, "retrieve": retrieve, "retrieve-twice": retrieve_twice}
    ops[op](config_path, model, argv[3])
    return 0


if __name__ == "__main__":
    run_main(main)
