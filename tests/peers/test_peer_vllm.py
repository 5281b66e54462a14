"""Disaggregated prefill and decode on two nodes: vLLM's own engines, kvpool's connector and
the peer tier between the nodes' agents.

Two agents are two nodes (network namespaces, `nodes.py`), peers of one pool (same secret),
with no shared tier: the peer tier is the only way a chunk goes from node 1 to node 2. A
prefill engine (`kv_producer`) runs in node 1's namespace on node 1's agent, a decode engine
(`kv_consumer`) in node 2's on node 2's agent, and the run's reference engine with no
connector (tests/conftest.py) gives the recomputed output. The engines start at once
(engine starts are what this costs).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from ..integrations import vllm_engine
from ..integrations.engines import KVPOOL_CONNECTOR as CONNECTOR
from ..integrations.engines import Engine, Reference, tokens
from ..integrations.test_vllm_engine import DOWN
from ..support import REPO_ROOT
from .conftest import metric, wait_until
from .nodes import PEER_PORT, Network, peer_agent

# Engines take a core or more each: one test module at a time (tests/run's `alone` phase).
pytestmark = [pytest.mark.alone, pytest.mark.timeout(900)]

CHUNK = 64
"""Tokens per chunk: two vLLM blocks of 32."""
CHUNK_BYTES = (vllm_engine.LAYERS * (CHUNK // vllm_engine.BLOCK) * vllm_engine.BLOCK
               * vllm_engine.KV_HEADS * 2 * vllm_engine.HEAD_DIM * 4)
"""A chunk's bytes: per layer and block, K and V of each KV head and token, in float32."""
PREFILL = {**CONNECTOR, "kv_role": "kv_producer"}
DECODE = {**CONNECTOR, "kv_role": "kv_consumer"}
"""What docs/integrations.md tells a user to pass to the prefill and the decode engines."""

HANDED = tokens(31, 8 * CHUNK + 10)
"""The request handed from prefill to decode: eight whole chunks and a tail."""
KILLED = tokens(32, 6 * CHUNK + 7)
"""Prefilled on node 1, whose agent is killed before decode asks for it."""
OWN = tokens(33, 4 * CHUNK + 20)
"""Served by the decode engine only: a consumer computes it and stores nothing."""
PUSHED = tokens(34, 6 * CHUNK + 3)
"""Prefilled with a hand-off hint naming the decode node: pushed there before decode asks."""
DECODE_NODE = "node1"
"""The decode node's name (`peer_agent(named=True)`: node<i>), as a router names it."""


@dataclass
class PD:
    net: Network
    node1: LocalAgent
    node2: LocalAgent
    prefill: Engine
    decode: Engine
    reference: dict[str, list[int]]
    prefilled: dict[str, Any]
    again: dict[str, Any]
    """The prefill engine's second run of HANDED, its chunks stored on node 1."""
    after_prefill: tuple[dict[str, Any], dict[str, Any]]
    """Node 1's and node 2's STATS once the prefill engine's chunks were stored."""

    def expected(self, prompt: list[int]) -> list[int]:
        return self.reference[json.dumps(prompt)]


def stats(agent: LocalAgent) -> dict[str, Any]:
    with KVPoolClient(agent.socket_path) as c:
        return c.stats()


def directory(agent: LocalAgent) -> int:
    """Remote chunks in the agent's peer directory (a STATS: no LOOKUP, so no prefetch)."""
    return int(stats(agent)["tiers"]["peer"]["chunks"])


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, vllm_model: Path,
       vllm_reference: Reference) -> Iterator[PD]:
    work = tmp_path_factory.mktemp("pd")
    secret = work / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o400)
    model = vllm_model
    net = Network(2)
    engines: list[Engine] = []
    try:
        with peer_agent(net, 0, work / "node1", secret, nvme=False, named=True) as node1, \
                peer_agent(net, 1, work / "node2", secret, nvme=False, named=True) as node2:
            # The engine processes start at once, each in its node's network namespace,
            # beside the reference if no module before started it.
            prefill = Engine("prefill", model, node1, work, tenant="", connector=PREFILL,
                             netns=net.nodes[0].ns)
            decode = Engine("decode", model, node2, work, tenant="", connector=DECODE,
                            netns=net.nodes[1].ns)
            engines += [prefill, decode]
            reference = {json.dumps(p): vllm_reference(p) for p in (HANDED, KILLED, OWN, PUSHED)}
            for e in engines:
                e.ready()
            prefilled = prefill.generate(HANDED)
            assert prefill("drain")["drained"]
            again = prefill.generate(HANDED)
            assert prefill("drain")["drained"]
            after_prefill = stats(node1), stats(node2)
            wait_until(lambda: directory(node2) == after_prefill[0]["tiers"]["dram"]["chunks"],
                       "node 2's directory to list node 1's chunks")
            yield PD(net, node1, node2, prefill, decode, reference, prefilled, again,
                     after_prefill)
    finally:
        for e in engines:
            e.quit()
        for e in engines:
            print(f"engine {e.name}: {e.started}")
        net.close()


def test_the_documented_prefill_and_decode_configs_are_the_ones_tested() -> None:
    doc = (REPO_ROOT / "docs" / "integrations.md").read_text()
    found = [json.loads(j) for j in re.findall(
        r"'(\{\"kv_connector\":\"KVPoolConnector\".*?\})'", doc)]
    assert PREFILL in found and DECODE in found


def test_the_prefill_engine_stores_its_chunks_on_its_own_node_and_never_loads(pd: PD) -> None:
    node1, node2 = pd.after_prefill
    assert node1["tiers"]["dram"]["chunks"] == 8
    assert node2["tiers"]["dram"]["chunks"] == 0  # only node 1 holds them
    assert "shared" not in node2["tiers"]  # no shared tier: the peer tier or nothing
    assert pd.prefilled["outputs"] == [pd.expected(HANDED)]
    # A producer never loads: its second run computes all again though node 1 holds it.
    assert pd.again["external_prefix_cache_hits"] == 0
    assert pd.again["cached"] == [0]
    assert pd.again["outputs"] == [pd.expected(HANDED)]


def test_the_decode_engine_loads_every_chunk_from_the_prefill_node_through_the_peer_tier(
        pd: PD) -> None:
    got = pd.decode.generate(HANDED)

    assert got["external_prefix_cache_hits"] == 8 * CHUNK  # every whole chunk, from the pool
    assert got["prefix_cache_hits"] == 0
    assert got["cached"] == [8 * CHUNK]  # it computed only the 10 tokens past them
    assert got["outputs"] == [pd.expected(HANDED)]  # the same as recomputing
    node1 = f"{pd.net.nodes[0].addr}:{PEER_PORT}"
    # Node 2 read all eight from node 1 over the network, each once, byte for byte...
    assert metric(pd.node2, "kvpool_peer_requests_total", peer=node1, direction="read",
                  result="ok") == 8
    assert metric(pd.node2, "kvpool_peer_bytes_total", peer=node1,
                  direction="read") == 8 * CHUNK_BYTES
    assert metric(pd.node1, "kvpool_peer_bytes_total", direction="served") == 8 * CHUNK_BYTES
    # ...because its LOOKUP found them in the peer tier.
    assert metric(pd.node2, "kvpool_tier_hits_total", tier="peer") >= 8
    assert stats(pd.node2)["tiers"]["peer"]["hits"] >= 8
    # The connector reads without a lease: it waited for the chunks to land (WAIT) and
    # read them from the arena, with no ACQUIRE (docs/protocol.md, "Waiting for peer
    # chunks").
    assert metric(pd.node2, "kvpool_ops_total", op="wait", result="ok") >= 1
    assert metric(pd.node2, "kvpool_ops_total", op="acquire") == 0
    # They are node 2's now: a second decode of the prompt reads them locally.
    again = pd.decode.generate(HANDED)
    assert again["external_prefix_cache_hits"] == 8 * CHUNK
    assert again["outputs"] == [pd.expected(HANDED)]
    assert metric(pd.node2, "kvpool_peer_requests_total", direction="read") == 8


def test_the_decode_engine_never_stores(pd: PD) -> None:
    before = stats(pd.node2)["tiers"]["dram"]["chunks"]
    got = pd.decode.generate(OWN)
    assert pd.decode("drain")["drained"]

    assert got["external_prefix_cache_hits"] == 0
    assert got["outputs"] == [pd.expected(OWN)]
    assert stats(pd.node2)["tiers"]["dram"]["chunks"] == before  # four whole chunks, unsaved
    assert stats(pd.node1)["tiers"]["dram"]["chunks"] == 8


def test_a_prefill_request_naming_the_decode_node_is_pushed_there_and_read_locally(
        pd: PD) -> None:
    """The hand-off: the router names the decode node in the prefill request's
    `kv_transfer_params`; node 1's agent pushes each chunk to node 2 after storing it, and
    the decode engine loads them from node 2's own DRAM, no peer read on its path."""
    got = pd.prefill("generate", prompts=[PUSHED], max_tokens=8,
                     kv_transfer_params={"kvpool_push_to": DECODE_NODE})
    assert got["outputs"] == [pd.expected(PUSHED)]
    assert pd.prefill("drain")["drained"]
    chunks = len(PUSHED) // CHUNK

    def pushes(agent: LocalAgent, direction: str) -> float:
        return metric(agent, "kvpool_peer_pushes_total", direction=direction, result="ok")
    wait_until(lambda: pushes(pd.node2, "received") == chunks, "the pushes to land on node 2")
    assert pushes(pd.node1, "sent") == chunks
    reads = metric(pd.node2, "kvpool_peer_requests_total", direction="read")

    got = pd.decode.generate(PUSHED)

    assert got["external_prefix_cache_hits"] == chunks * CHUNK
    assert got["outputs"] == [pd.expected(PUSHED)]
    assert metric(pd.node2, "kvpool_peer_requests_total", direction="read") == reads
    assert metric(pd.node2, "kvpool_peer_handoff_pins_total", end="read") == chunks


def test_the_prefill_node_killed_the_decode_engine_recomputes_with_one_warning(
        pd: PD) -> None:
    """Node 1's agent dies (SIGKILL) after prefilling a prompt and before the decode
    engine asks for it: node 2 drops node 1's chunks from its directory with one warning,
    the decode engine computes the prompt itself (the same output) and serves on, its own
    agent untouched."""
    listed = directory(pd.node2)
    assert pd.prefill.generate(KILLED)["outputs"] == [pd.expected(KILLED)]
    assert pd.prefill("drain")["drained"]
    wait_until(lambda: directory(pd.node2) == listed + len(KILLED) // CHUNK,
               "node 2's directory to list the prompt's chunks")
    node1 = f"{pd.net.nodes[0].addr}:{PEER_PORT}"
    unreachable = f"peer {node1} unreachable"
    warned = pd.node2.log().count(unreachable)

    pd.node1.kill()
    wait_until(lambda: unreachable in pd.node2.log(), "node 2 to see node 1 gone")
    got = pd.decode.generate(KILLED)
    again = pd.decode.generate(KILLED)

    assert got["outputs"] == again["outputs"] == [pd.expected(KILLED)]
    assert got["external_prefix_cache_hits"] == 0
    assert directory(pd.node2) == 0
    assert pd.node2.log().count(unreachable) == warned + 1  # one, not one per request
    assert DOWN not in pd.decode.log()  # the decode engine's own agent never went away
    # What node 2 already read from node 1 is still served.
    assert pd.decode.generate(HANDED)["external_prefix_cache_hits"] == 8 * CHUNK
