"""The documented LMCache path through vLLM's own engine: vLLM's `LMCacheConnectorV1`, LMCache,
and kvpool's LMCache plugin, against a real agent (docs/integrations.md, "vLLM with LMCache").

The native path's scenarios (test_vllm_engine.py) on two LMCache engines, A and B, started
at once beside the run's no-connector reference engine (tests/conftest.py): A stores
prompts; B, a fresh process on the same agent, loads them through the pool with the
reference's greedy output; a prompt sharing a prefix hits exactly the shared whole chunks;
a chunk deleted from the pool, or corrupted in its arena, between requests is recomputed
with the reference's output; A and B at once serve their own prompts; B keeps serving with
the agent killed, and reads through the pool again once the agent is back. Each scenario
asks B for prompts it has never seen: LMCache keeps what an engine stored or loaded in its
own CPU buffer in front of the pool, and a hit there never reaches kvpool.

Test scaffolding (`lmcache_vllm_engine.py`): LMCache 0.5.6 has no CPU connector between
vLLM's KV cache and LMCache's memory objects, so a CPU copier stands in for LMCache's CUDA
`VLLMPagedMemGPUConnectorV2` (the same copies, in torch). The rest is LMCache's and vLLM's
own code with the configuration the docs give.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.bench.local import LocalAgent

from ..support import REPO_ROOT, wait_until
from . import lmcache_vllm_engine
from .engines import Engine, Reference, stats, tokens

pytestmark = [pytest.mark.alone, pytest.mark.timeout(900)]  # three engine processes at once

LMCACHE_HARNESS = Path(lmcache_vllm_engine.__file__)
CHUNK = 64
"""LMCache's chunk_size here (the docs' 256 is the pool's chunkTokens of a real model)."""
CONNECTOR = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
             "kv_load_failure_policy": "recompute"}
"""The --kv-transfer-config docs/integrations.md gives for this path."""
PROMPT = tokens(7, 9 * CHUNK + 24)
"""Nine whole chunks and a tail of 24 tokens."""
SOURCE = tokens(40, 6 * CHUNK + 10)
PREFIX = SOURCE[: 3 * CHUNK + 17] + tokens(41, 3 * CHUNK)
"""Shares three whole chunks (and 17 tokens of the fourth) with SOURCE."""
SPOILED = {"evict": tokens(42, 6 * CHUNK + 5), "corrupt": tokens(43, 6 * CHUNK + 5)}
"""Their chunk 2 is deleted from the pool / flipped in the arena before B asks."""
KILLED, AFTER = tokens(44, 5 * CHUNK + 9), tokens(45, 5 * CHUNK + 9)
"""Asked with the agent killed; asked once it is back."""
OWN_A = [tokens(50 + i, 4 * CHUNK + 3 * i) for i in range(2)]
OWN_B = [tokens(60 + i, 4 * CHUNK + 5 * i) for i in range(2)]
STORED_BY_A = [PROMPT, SOURCE, *SPOILED.values(), KILLED, AFTER]
EVERYTHING = [*STORED_BY_A, PREFIX, *OWN_A, *OWN_B]


def documented_config() -> dict[str, Any]:
    """The LMCache configuration file docs/integrations.md gives, as YAML."""
    doc = (REPO_ROOT / "docs" / "integrations.md").read_text()
    section = doc[doc.index("## 3a. vLLM with LMCache"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    config: dict[str, Any] = yaml.safe_load(block.group(1))
    return config


def whole(prompt: list[int]) -> int:
    return len(prompt) // CHUNK


@dataclass
class Run:
    agent: LocalAgent
    reference: Reference
    stored: dict[str, Any]
    """A's result of each prompt of STORED_BY_A."""
    after_a: dict[str, Any]
    a: Engine
    b: Engine

    def expected(self, prompt: list[int]) -> list[list[int]]:
        return [self.reference(prompt)]

    def dram_hits(self) -> int:
        return int(stats(self.agent)["tiers"]["dram"]["hits"])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, vllm_model: Path,
        vllm_reference: Reference) -> Iterator[Run]:
    work = tmp_path_factory.mktemp("lmcache-vllm")
    config = documented_config()
    # a small model: smaller chunks and LMCache CPU buffer than the docs' (a 70B's)
    config.update(chunk_size=CHUNK, max_local_cpu_size=0.2)
    # LMCache's health check of the pool every second, not every 30 s: the agent-restart
    # test waits for it
    config["extra_config"]["ping_interval"] = 1
    path = work / "lmcache.yaml"
    path.write_text(yaml.safe_dump(config))
    with LocalAgent("--no-lock", workdir=work, dram="64Mi") as agent:
        started: list[Engine] = []
        try:
            # both start at once, beside the reference; B asks only once A has stored
            for name in ("a", "b"):
                started.append(Engine(f"lmcache-{name}", vllm_model, agent, work,
                                      connector=CONNECTOR, harness=LMCACHE_HARNESS,
                                      LMCACHE_CONFIG_FILE=str(path)))
            a, b = started
            for p in EVERYTHING:
                vllm_reference(p)
            a.ready()
            b.ready()
            stored = {json.dumps(p): a.generate(p) for p in STORED_BY_A}
            yield Run(agent, vllm_reference, stored, stats(agent), a, b)
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


def test_the_documented_kv_transfer_config_is_the_one_tested() -> None:
    doc = (REPO_ROOT / "docs" / "integrations.md").read_text()
    found = re.search(r"'(\{\"kv_connector\":\"LMCacheConnectorV1\".*?\})'", doc)
    assert found and json.loads(found.group(1)) == CONNECTOR


def test_engine_a_stores_every_whole_chunk_of_its_prompts_in_the_pool(run: Run) -> None:
    for p in STORED_BY_A:
        got = run.stored[json.dumps(p)]
        assert got["external_prefix_cache_hits"] == 0
        assert got["outputs"] == run.expected(p)
    # the whole chunks (no tail: save_unfull_chunk is false in the docs)
    assert run.after_a["tiers"]["dram"]["chunks"] == sum(whole(p) for p in STORED_BY_A)


def test_a_fresh_engine_loads_them_through_the_pool_with_the_same_output(run: Run) -> None:
    before = run.dram_hits()
    got = run.b.generate(PROMPT)
    assert got["external_prefix_cache_hits"] == 9 * CHUNK  # every stored chunk, from LMCache
    assert got["cached"] == [9 * CHUNK]  # B computed only the tail
    assert got["outputs"] == run.expected(PROMPT) == run.stored[json.dumps(PROMPT)]["outputs"]
    assert run.dram_hits() - before == 9  # read from kvpool's arena


def test_a_prompt_sharing_a_prefix_hits_exactly_the_shared_whole_chunks(run: Run) -> None:
    before = run.dram_hits()
    got = run.b.generate(PREFIX)
    assert got["external_prefix_cache_hits"] == 3 * CHUNK
    assert got["outputs"] == run.expected(PREFIX)
    assert run.dram_hits() - before == 3


def test_a_chunk_deleted_from_the_pool_between_requests_is_recomputed(run: Run) -> None:
    """LMCache's lookup finds the chunks before the deleted one; B computes the rest with
    the reference's output and stores it, so the next request takes all six."""
    prompt = SPOILED["evict"]
    assert run.b("spoil", kind="evict", prompt=prompt, chunk=2) == \
        {"spoiled": "evict", "chunks": 6, "held": 6}  # LMCache's keys are the pool's

    got = run.b.generate(prompt)

    assert got["external_prefix_cache_hits"] == 2 * CHUNK
    assert got["outputs"] == run.expected(prompt)
    assert run.b.generate(prompt)["external_prefix_cache_hits"] == 6 * CHUNK


def test_a_chunk_corrupted_in_the_arena_between_requests_is_recomputed(run: Run) -> None:
    """LMCache's lookup finds all six chunks (a lookup reads no bytes); kvpool's plugin
    reads chunk 2, finds its checksum wrong, and gives LMCache a miss for it; LMCache reports
    its blocks to vLLM, which recomputes them (`kv_load_failure_policy: recompute`; under
    vLLM's default, `fail`, the request ends with an error and no output): the reference's
    output. The plugin deletes the corrupt chunk, so LMCache stores B's recomputed chunk in
    its place and the next request takes all six (with the corrupt chunk left in the pool,
    every request found it, and recomputed the four chunks from it on)."""
    prompt = SPOILED["corrupt"]
    assert run.b("spoil", kind="corrupt", prompt=prompt, chunk=2)["held"] == 6

    got = run.b.generate(prompt)

    assert got["external_prefix_cache_hits"] == 6 * CHUNK  # looked up
    assert got["finish"] == ["length"]
    assert got["outputs"] == run.expected(prompt)
    assert "1 chunk(s) failed their checksum" in run.b.log()
    again = run.b.generate(prompt)
    assert again["external_prefix_cache_hits"] == again["cached"][0] == 6 * CHUNK
    assert again["outputs"] == run.expected(prompt)


def test_two_engines_at_once_store_and_serve_their_own_prompts(run: Run) -> None:
    before = stats(run.agent)["tiers"]["dram"]["chunks"]
    run.a.submit(*OWN_A)
    run.b.submit(*OWN_B)
    got_a, got_b = run.a.read(), run.b.read()

    assert got_a["outputs"] == [run.reference(p) for p in OWN_A]
    assert got_b["outputs"] == [run.reference(p) for p in OWN_B]
    after = stats(run.agent)
    assert after["leases"] == {"read": 0, "write": 0}
    assert after["tiers"]["dram"]["chunks"] == before + sum(whole(p) for p in [*OWN_A, *OWN_B])


def test_the_agent_killed_then_back(run: Run) -> None:
    """With the agent killed, B serves a prompt A stored by computing it (the plugin's
    calls fail at once; LMCache counts a miss); LMCache's health check then puts it in its
    degraded mode (no lookups, no stores). Once the agent is back (a warm restart: the
    arena keeps its chunks), LMCache's next health check restores it, and B reads another
    prompt A stored through the pool again."""
    degraded = "System unhealthy, entering degraded mode"
    recovered = "System recovered, restoring normal operations"
    run.agent.kill()

    down = run.b.generate(KILLED)

    assert down["external_prefix_cache_hits"] == 0
    assert down["outputs"] == run.expected(KILLED)
    wait_until(lambda: degraded in run.b.log(), "LMCache's health check to fail")
    assert run.b.generate(AFTER)["outputs"] == run.expected(AFTER)  # degraded: computed
    run.agent.start()
    wait_until(lambda: recovered in run.b.log(), "LMCache's health check to pass again")
    before = run.dram_hits()
    back = run.b.generate(AFTER)
    assert back["external_prefix_cache_hits"] == whole(AFTER) * CHUNK
    assert back["outputs"] == run.expected(AFTER)
    assert run.dram_hits() - before == whole(AFTER)  # from kvpool's arena
