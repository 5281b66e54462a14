"""vLLM's engine with vLLM's own `LMCacheConnectorV1` and kvpool's LMCache plugin, on the CPU.

Run as `vllm_engine.py` is (`serve DIR CONNECTOR_JSON`, the same commands over the same
pipe), in the vLLM test environment with LMCache installed. LMCACHE_CONFIG_FILE names the
LMCache configuration, as in docs/integrations.md.

Test scaffolding: LMCache 0.5.6 has no CPU connector between vLLM's KV cache and its memory
objects (`CreateGPUConnector`: "No supported cpu connector found", and LMCache then runs
without its storage). `CpuCopier` stands in for LMCache's `VLLMPagedMemGPUConnectorV2`
(the CUDA kernel `multi_layer_kv_transfer`): the same copies, in torch on the CPU, between
vLLM 0.32's CPU KV cache layers ([blocks, KV heads, block tokens, K and V head dims]) and
memory objects in LMCache's KV_2LTD format ([K or V, layer, token, KV heads x head dim]).
Everything else is LMCache's and vLLM's own code: the adapter, LMCache's engine, its token
database and keys, its local CPU buffer and its remote backend with kvpool's plugin.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from kvpool.bench.engine_process import reply_channel, run_main

try:  # the engine driver beside this file: run as a script, its folder is on the path
    from . import vllm_engine
except ImportError:
    import vllm_engine  # type: ignore[no-redef]


def _cpu_copier(base: type) -> type:
    class CpuCopier(base):  # type: ignore[misc, valid-type]
        """LMCache's GPU connector interface over vLLM's CPU KV cache (see the module)."""

        def __init__(self, hidden_dim_size: int, num_layers: int, block_size: int) -> None:
            self.hidden_dim_size = hidden_dim_size
            self.num_layers = num_layers
            self.block_size = block_size
            self.kvcaches: list[torch.Tensor] | None = None

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

        def _where(self, start: int, end: int, kwargs: dict[str, Any]
                   ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
            if "kvcaches" in kwargs:
                self.kvcaches = list(kwargs["kvcaches"])
            assert self.kvcaches is not None, "no KV caches given"
            slots = kwargs["slot_mapping"][start:end].to(torch.long)
            return self.kvcaches, slots // self.block_size, slots % self.block_size

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            from lmcache.v1.memory_management import MemoryFormat

            layers, blocks, offsets = self._where(start, end, kwargs)
            out = memory_obj.tensor
            n = end - start
            for i, layer in enumerate(layers):
                kv = layer[blocks, :, offsets, :]  # [tokens, KV heads, K and V head dims]
                d = kv.shape[-1] // 2
                out[0, i, :n] = kv[..., :d].reshape(n, -1)
                out[1, i, :n] = kv[..., d:].reshape(n, -1)
            memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            layers, blocks, offsets = self._where(start, end, kwargs)
            # tokens vLLM computed itself at the front of this chunk are left as they are
            skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
            src = memory_obj.tensor
            n = end - start
            for i, layer in enumerate(layers):
                heads, d = layer.shape[1], layer.shape[-1] // 2
                k = src[0, i, skip:n].reshape(n - skip, heads, d)
                v = src[1, i, skip:n].reshape(n - skip, heads, d)
                layer[blocks[skip:], :, offsets[skip:], :] = torch.cat([k, v], dim=-1)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any,
                             **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None,
                           ends: Any = None, **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(obj, start, end, **kwargs)

    return CpuCopier


def _patch(connectors: Any) -> None:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    copier = _cpu_copier(GPUConnectorInterface)
    original = connectors.CreateGPUConnector

    def create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        from lmcache.utils import EngineType

        if engine != EngineType.VLLM:
            return original(config, metadata, engine, layout_hints)
        layers, _, _, kv_heads, head_size = metadata.kv_shape
        return copier(kv_heads * head_size, layers, vllm_engine.BLOCK)

    connectors.CreateGPUConnector = create


def install_cpu_copier() -> None:
    """Make LMCache's connector factory build `CpuCopier` for vLLM on this CPU, once vLLM's
    LMCache connector imports it (not before: LMCache imported ahead of vLLM's worker set-up
    breaks vLLM's kernel overrides)."""
    import importlib.abc
    import importlib.machinery

    name = "lmcache.v1.gpu_connector"

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            assert spec is not None and spec.loader is not None
            exec_module = spec.loader.exec_module

            def patched(module: Any) -> None:
                exec_module(module)
                _patch(module)
            spec.loader.exec_module = patched  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, Finder())


class LMCacheEngine(vllm_engine.Engine):
    """`vllm_engine.Engine` with LMCache's connector: the same LLM, no kvpool worker to reach
    into (fault hooks and draining saves are kvpool's connector's; LMCache stores a step's
    chunks before the step returns). One more command:

    - {"op": "spoil", "kind": "corrupt" | "evict", "prompt": [ids], "chunk": i}: flip a byte
      of the pool's copy of the prompt's chunk i in the arena, or delete it, now (between
      requests). The chunk's pool key is kvpool's plugin's (`pool_key`) of the key LMCache's
      own token database gives that chunk in this engine.
    """

    def __init__(self, model: str, connector: dict[str, Any], reply: Any) -> None:
        import time

        t0 = time.monotonic()
        import vllm  # noqa: F401

        self.imported_s = time.monotonic() - t0
        self.reply = reply
        self.llm = vllm_engine.llm(model, connector)
        self.started_s = time.monotonic() - t0
        self.fault = None
        self.worker = None

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] != "spoil":
            return super().handle(cmd)
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvpool.agent.client import KVPoolClient
        from kvpool.agent.integrations.lmcache import pool_key

        engine = get_kv_transfer_group()._lmcache_engine.lmcache_engine
        chunks = list(engine.token_database.process_tokens(tokens=cmd["prompt"]))
        tenant = os.environ.get("KVPOOL_TENANT", "")
        keys = [pool_key(key, tenant) for _, _, key in chunks]
        with KVPoolClient(tenant=tenant) as kv:
            held = kv.lookup(keys)
        vllm_engine.spoil(cmd["kind"], keys[cmd["chunk"]], tenant)
        return {"spoiled": cmd["kind"], "chunks": len(keys), "held": held}


def main(argv: list[str]) -> int:
    import json

    LMCacheEngine(argv[1], json.loads(argv[2]), reply_channel()).serve()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    install_cpu_copier()
    run_main(main)
