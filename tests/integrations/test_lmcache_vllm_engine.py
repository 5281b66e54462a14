"""The documented LMCache path through vLLM's own engine: vLLM's `LMCacheConnectorV1`, LMCache,
and kvpool's LMCache plugin, against a real agent (docs/integrations.md, "vLLM with LMCache").

Engine A stores a prompt; engine B, a fresh process on the same agent, loads A's chunks
through the pool and gives the same greedy output. Two engine starts, at once.

Test scaffolding (`lmcache_vllm_engine.py`): LMCache 0.5.6 has no CPU connector between
vLLM's KV cache and LMCache's memory objects, so a CPU copier stands in for LMCache's CUDA
`VLLMPagedMemGPUConnectorV2` (the same copies, in torch). The rest is LMCache's and vLLM's
own code with the configuration the docs give.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.bench.local import LocalAgent

from ..support import REPO_ROOT
from . import lmcache_vllm_engine
from .engines import Engine, stats, tokens

pytestmark = pytest.mark.alone  # two engine processes: they want the machine's two cores

LMCACHE_HARNESS = Path(lmcache_vllm_engine.__file__)
CHUNK = 64
"""LMCache's chunk_size here (the docs' 256 is the pool's chunkTokens of a real model)."""
CONNECTOR = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
"""The --kv-transfer-config docs/integrations.md gives for this path."""
PROMPT = tokens(7, 9 * CHUNK + 24)
"""Nine whole chunks and a tail of 24 tokens."""


def documented_config() -> dict[str, Any]:
    """The LMCache configuration file docs/integrations.md gives, as YAML."""
    doc = (REPO_ROOT / "docs" / "integrations.md").read_text()
    section = doc[doc.index("## 3a. vLLM with LMCache"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    config: dict[str, Any] = yaml.safe_load(block.group(1))
    return config


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, vllm_model: Path
            ) -> Iterator[tuple[LocalAgent, dict[str, Any], Engine]]:
    """The agent after engine A ran PROMPT, A's result, and engine B (not asked yet)."""
    work = tmp_path_factory.mktemp("lmcache-vllm")
    model = vllm_model
    config = documented_config()
    # a small model: smaller chunks and LMCache CPU buffer than the docs' (a 70B's)
    config.update(chunk_size=CHUNK, max_local_cpu_size=0.2)
    path = work / "lmcache.yaml"
    path.write_text(yaml.safe_dump(config))
    with LocalAgent("--no-lock", workdir=work, dram="64Mi") as agent:
        started: list[Engine] = []
        try:
            # both start at once (two cores); B asks the pool only after A has stored
            for name in ("a", "b"):
                started.append(Engine(f"lmcache-{name}", model, agent, work,
                                      connector=CONNECTOR, harness=LMCACHE_HARNESS,
                                      LMCACHE_CONFIG_FILE=str(path)))
            a, b = started
            a.ready()
            b.ready()
            stored = a.generate(PROMPT)
            a.quit()
            yield agent, stored, b
        finally:
            for e in started:
                e.quit()
            for e in started:
                print(f"engine {e.name}: {e.started}")


def test_the_documented_lmcache_config_keys_chunks_the_same_in_every_process() -> None:
    config = documented_config()
    # LMCache's default, `builtin`, seeds its chunk hashes anew in every process: a second
    # engine would never find what the first stored
    assert config["pre_caching_hash_algorithm"] == "sha256_cbor"
    assert config["remote_storage_plugins"] == ["kvpool"]
    assert config["extra_config"]["remote_storage_plugin.kvpool.module_path"] == \
        "kvpool.agent.integrations.lmcache"


def test_engine_a_stores_every_chunk_of_its_prompt_in_the_pool(
        engines: tuple[LocalAgent, dict[str, Any], Engine]) -> None:
    agent, stored, _ = engines
    assert stored["external_prefix_cache_hits"] == 0
    assert stats(agent)["tiers"]["dram"]["chunks"] == 9  # the whole chunks (no tail: docs)


def test_a_fresh_engine_loads_them_through_the_pool_with_the_same_output(
        engines: tuple[LocalAgent, dict[str, Any], Engine]) -> None:
    agent, stored, b = engines
    before = stats(agent)["tiers"]["dram"]["hits"]
    got = b.generate(PROMPT)
    assert got["external_prefix_cache_hits"] == 9 * CHUNK  # every stored chunk, from LMCache
    assert got["cached"] == [9 * CHUNK]  # B computed only the tail
    assert got["outputs"] == stored["outputs"]
    assert stats(agent)["tiers"]["dram"]["hits"] - before == 9  # read from kvpool's arena
