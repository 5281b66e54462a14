"""kvpool's vLLM connector, run by vLLM's own engine (its CPU build) against a real agent.

Each engine is a fresh process (`vllm_engine.py`) in the vLLM test environment
(tests/install-vllm), as a vLLM pod would be (forked from the run's zygote, `engines.py`);
nothing but the agent connects them. Engine starts are what these tests cost, so one module
runs every scenario on few engines, started in two waves: engine A that stores, beside
engines D (another model) and E (another KV-cache dtype) that ask only once A is done; then
engines B (same tenant) and C (another tenant) at once. The no-connector reference engine
is the run's (tests/conftest.py).
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvpool.agent.client import KVPoolClient
from kvpool.agent.integrations.vllm.worker import IDLE_WAIT
from kvpool.bench.local import LocalAgent

from ..agent.conftest import wait_until
from ..agent.test_events import MapBatch, Mirror, events_agent
from ..support import REPO_ROOT, scrape
from . import vllm_engine
from .engines import KVPOOL_CONNECTOR, START_TIMEOUT, Engine, Reference, stats, tokens

# Up to three engines at a time, each a process that takes a core or more: beside other
# tests they would only slow each other down (tests/run runs `alone` tests one at a time,
# after the rest). The hang guard covers the module's engine starts, which the first
# test's set-up pays for: ~1 min on an idle machine, several on one busy with other work.
pytestmark = [pytest.mark.alone, pytest.mark.timeout(900)]

CHUNK = 64
"""Tokens per chunk: two vLLM blocks of 32."""
CONNECTOR = KVPOOL_CONNECTOR
DOWN = "serving without the pool (recomputing) until it is back"
"""The connector's warning when it finds the agent unreachable: once per incident."""
FP8 = {"kv_cache_dtype": "fp8"}
"""Engine E's KV cache: vLLM's fp8 (e4m3) cache, 1 byte an element where A's is float32's 4;
the model's dtype stays float32. vLLM's CPU build runs an fp8 cache on x86 with AVX-512 or
AMX (what CI's machines have); float16 and bfloat16 models run there too."""


MAIN = tokens(1, 8 * CHUNK + 10)
"""Eight whole chunks and a tail."""
PREFIX = MAIN[: 3 * CHUNK + 17] + tokens(2, 4 * CHUNK)
"""Shares three whole chunks (and 17 tokens of the fourth) with MAIN."""
CORRUPT, EVICT, KILLED = (tokens(seed, 6 * CHUNK + 5) for seed in (3, 4, 5))
OWN_B = [tokens(10 + i, 4 * CHUNK + 3 * i) for i in range(3)]
OWN_C = [tokens(20 + i, 4 * CHUNK + 5 * i) for i in range(3)]
STORED_BY_A = [MAIN, CORRUPT, EVICT, KILLED]
STALLED = tokens(6, 4 * CHUNK + 7)
"""Stored by no engine before the agent stalls: its saves need the agent."""
EVERYTHING = [MAIN, PREFIX, CORRUPT, EVICT, KILLED, STALLED, *OWN_B, *OWN_C]


class Run:
    """What the module's engines did, and engines B, C, D and E still serving."""

    def __init__(self, agent: LocalAgent, mirror: Mirror, reference: Reference,
                 stored: dict[str, Any], after_a: dict[str, Any],
                 engines: dict[str, Engine]) -> None:
        self.agent, self.mirror, self.reference = agent, mirror, reference
        self.stored, self.after_a = stored, after_a
        self.b, self.c, self.odd = engines["b"], engines["c"], engines["odd-chunk"]
        self.other_model, self.fp8 = engines["other-model"], engines["fp8-kv"]

    def expected(self, prompt: list[int]) -> list[int]:
        return self.reference(prompt)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, vllm_model: Path, vllm_other_model: Path,
        vllm_reference: Reference) -> Iterator[Run]:
    work = tmp_path_factory.mktemp("vllm")
    model, reference = vllm_model, vllm_reference
    ctx: zmq.Context[object] = zmq.Context()
    # With an NVMe tier the shared-memory index cannot answer a prefix that ends in DRAM
    # (NVMe may go on): the scheduler then asks the socket, in the background.
    with events_agent(work, "node", "map", "64Mi", nvme=work / "nvme") as (agent, endpoint,
                                                                          replay):
        mirror = Mirror(ctx, endpoint, replay, b"kv@n1@default", MapBatch)
        engines: dict[str, Engine] = {}

        def start(name: str, path: Path = model, **kw: Any) -> Engine:
            engines[name] = Engine(name, path, agent, work, **kw)
            return engines[name]
        try:
            # First wave, beside the reference if this module starts it: A, and the two
            # engines that must miss what A stores (they ask only once A is done).
            a = start("a")
            start("other-model", vllm_other_model)
            start("fp8-kv", llm_args=FP8)
            outputs = {json.dumps(p): reference(p) for p in EVERYTHING}
            a.ready()
            stored = {json.dumps(p): a.generate(p) for p in STORED_BY_A}
            assert a("drain")["drained"]
            after_a = stats(agent)
            # What vLLM leaves in its temp directory (its distributed-init file) is in the
            # engine's own, which goes with it: not in the machine's /tmp for good.
            assert list(a.scratch.glob("vllm_dist_*")), list(a.scratch.iterdir())
            a.quit()
            assert not a.scratch.exists()
            # Second wave: B, C, and an engine that must not start.
            start("b")
            start("c", tenant="team-b")
            # 48 tokens a chunk: not whole blocks of 32. It must not start.
            odd = start("odd-chunk", chunk_tokens=48)
            for name in ("other-model", "fp8-kv", "b", "c"):
                engines[name].ready()
            odd.proc.wait(timeout=START_TIMEOUT)
            assert len(outputs) == len(EVERYTHING)
            yield Run(agent, mirror, reference, stored, after_a, engines)
        finally:
            for e in engines.values():
                e.quit()
            for e in engines.values():
                print(f"engine {e.name}: {e.started}")
            mirror.disconnect()
            ctx.destroy(linger=0)


def test_the_documented_kv_transfer_config_is_the_one_tested() -> None:
    doc = (REPO_ROOT / "docs" / "integrations.md").read_text()
    found = re.search(r"'(\{\"kv_connector\":\"KVPoolConnector\".*?\})'", doc)
    assert found and json.loads(found.group(1)) == CONNECTOR


def whole_chunks(prompt: list[int]) -> int:
    """Chunks a prompt can take from the pool: whole ones, before its last token."""
    return (len(prompt) - 1) // CHUNK


def test_a_chunk_size_that_is_not_whole_vllm_blocks_is_refused_at_start(run: Run) -> None:
    assert run.odd.proc.returncode != 0
    assert ("kvpool: the pool's chunk size (KVPOOL_CHUNK_TOKENS / chunk_tokens = 48) must be "
            "a positive multiple of vLLM's block size (32)") in run.odd.log()


def test_the_models_greedy_output_depends_on_the_whole_prompt(run: Run) -> None:
    """What makes output equality a check of the KV: no two prompts (PREFIX shares its
    first 209 tokens with MAIN) give the same output, and none repeats one token."""
    outputs = [tuple(run.expected(p)) for p in EVERYTHING]
    assert len(set(outputs)) == len(outputs)
    assert all(len(set(o)) > 1 for o in outputs)


def test_engine_a_stores_every_whole_chunk_of_its_prompts(run: Run) -> None:
    chunks = sum(len(p) // CHUNK for p in STORED_BY_A)
    assert run.after_a["tiers"]["dram"]["chunks"] == chunks
    assert run.after_a["leases"] == {"read": 0, "write": 0}
    for p in STORED_BY_A:
        got = run.stored[json.dumps(p)]
        assert got["external_prefix_cache_hits"] == 0
        assert got["outputs"] == [run.expected(p)]


def test_a_fresh_engine_loads_every_stored_chunk_and_computes_only_the_rest(run: Run) -> None:
    before = scrape(run.agent)
    got = run.b.generate(MAIN)

    assert got["external_prefix_cache_hits"] == 8 * CHUNK  # every stored whole chunk
    assert got["prefix_cache_hits"] == 0
    assert got["cached"] == [8 * CHUNK]  # B computed only the 10 tokens past them
    assert got["outputs"] == [run.expected(MAIN)] == run.stored[json.dumps(MAIN)]["outputs"]
    # Read without a lease (all in DRAM, one extent each): no ACQUIRE reached the agent,
    # and the told READ counted the chunks' bytes as reads.
    assert _op(scrape(run.agent), "acquire") == _op(before, "acquire")
    chunk_bytes = _op(before, "dram", "kvpool_tier_read_bytes_total")
    wait_until(lambda: _op(scrape(run.agent), "read") > _op(before, "read")
               and _op(scrape(run.agent), "dram", "kvpool_tier_read_bytes_total")
               > chunk_bytes)


def _op(metrics: dict[str, float], what: str, series: str = "kvpool_ops_total") -> float:
    """A counter's value for an op (its "ok" results) or a tier, whatever the pool."""
    label = f'tier="{what}"' if series != "kvpool_ops_total" else f'op="{what}"'
    return sum(v for k, v in metrics.items() if k.startswith(series + "{") and label in k
               and (series != "kvpool_ops_total" or 'result="ok"' in k))


def test_vllms_loop_waits_for_a_load_in_flight_instead_of_stepping_back_to_back(
        run: Run) -> None:
    """A load held in flight (paused before it reads the pool): vLLM's engine loop, with
    nothing else to compute, steps back to back; the connector's worker makes each of those
    steps wait for the load (up to IDLE_WAIT), so the loop does not take the GIL from the
    I/O thread thousands of times a second. A slower machine only makes fewer steps."""
    assert run.b("fault", kind="pause", chunk=0)["armed"] == "pause"
    run.b.submit(MAIN)
    assert run.b.read() == {"event": "loading"}
    time.sleep(1.0)  # the load stays in flight this long
    run.b.send("go")
    got = run.b.read()

    assert got["outputs"] == [run.expected(MAIN)]
    assert got["external_prefix_cache_hits"] == 8 * CHUNK
    assert got["paused_s"] >= 1.0
    # without the wait: ~10^4 steps a second here; with it at most one per IDLE_WAIT, and
    # the request's own steps (its prefill, 8 tokens, the steps around the load)
    assert got["steps"] <= got["paused_s"] / IDLE_WAIT + 50, got


def test_a_prompt_sharing_a_prefix_hits_exactly_the_shared_whole_chunks(run: Run) -> None:
    got = run.b.generate(PREFIX)

    assert got["external_prefix_cache_hits"] == 3 * CHUNK
    assert got["outputs"] == [run.expected(PREFIX)]


def test_another_tenant_misses(run: Run) -> None:
    got = run.c.generate(MAIN)

    assert got["external_prefix_cache_hits"] == 0
    assert got["outputs"] == [run.expected(MAIN)]


def test_another_model_of_the_same_shape_misses(run: Run) -> None:
    """An engine serving another model (the same shape, so the same KV bytes per chunk: only
    the key tells the two apart; other weights, as a fine-tune of the first has) finds none
    of the chunks A stored. It computes the whole prompt (what vLLM does with no connector);
    its output is not A's model's (A's KV would have been wrong KV for it); and its own
    chunks, stored under its own keys, serve it back with that output (its connector works:
    the miss is the key's doing)."""
    first = run.other_model.generate(MAIN)

    assert first["external_prefix_cache_hits"] == 0
    assert first["cached"] == [0]  # every token computed, as without a connector
    assert first["outputs"] != [run.expected(MAIN)]
    again = run.other_model.generate(MAIN)
    assert again["external_prefix_cache_hits"] == 8 * CHUNK
    assert again["outputs"] == first["outputs"]


def test_another_kv_cache_dtype_misses(run: Run) -> None:
    """An engine of the same model whose KV cache is another dtype (fp8: `FP8`) finds none of
    the chunks A's float32 cache stored, computes the whole prompt, and then loads its own
    fp8 chunks back with the output it computed."""
    first = run.fp8.generate(MAIN)

    assert first["external_prefix_cache_hits"] == 0
    assert first["cached"] == [0]
    again = run.fp8.generate(MAIN)
    assert again["external_prefix_cache_hits"] == 8 * CHUNK
    assert again["outputs"] == first["outputs"]


@pytest.mark.parametrize(("fault", "prompt"), [("corrupt", CORRUPT), ("evict", EVICT)])
def test_a_chunk_lost_between_lookup_and_load_is_recomputed(run: Run, fault: str,
                                                            prompt: list[int]) -> None:
    """A chunk flipped in the arena (its checksum fails) or deleted after the scheduler
    found it: the worker reports its blocks, vLLM recomputes from there, the output is the
    no-connector output."""
    assert run.b("fault", kind=fault, chunk=2)["armed"] == fault

    got = run.b.generate(prompt)

    assert got["external_prefix_cache_hits"] == whole_chunks(prompt) * CHUNK  # looked up
    assert re.search(r"1 of 6 chunks of request \S+ not loaded", run.b.log())
    assert got["outputs"] == [run.expected(prompt)]
    # The bad chunk is out of the pool (deleted when it failed its checksum), so the next
    # request takes the two before it and stores it again; the one after takes all six.
    again = run.b.generate(prompt)
    assert again["external_prefix_cache_hits"] == 2 * CHUNK
    assert again["outputs"] == [run.expected(prompt)]
    assert run.b.generate(prompt)["external_prefix_cache_hits"] == 6 * CHUNK


def test_two_engines_at_once_store_and_serve_their_own_prompts(run: Run) -> None:
    before = stats(run.agent)["tiers"]["dram"]["chunks"]
    run.b.submit(*OWN_B)
    run.c.submit(*OWN_C)
    got_b, got_c = run.b.read(), run.c.read()

    assert got_b["outputs"] == [run.expected(p) for p in OWN_B]
    assert got_c["outputs"] == [run.expected(p) for p in OWN_C]
    assert run.b("drain")["drained"] and run.c("drain")["drained"]
    after = stats(run.agent)
    assert after["leases"] == {"read": 0, "write": 0}
    assert after["tiers"]["dram"]["chunks"] == before + sum(
        len(p) // CHUNK for p in [*OWN_B, *OWN_C])


def test_the_agents_kv_events_carry_vllms_block_hashes(run: Run) -> None:
    """A plain pyzmq+msgpack subscriber of the agent's events sees BlockStored for engine A's
    chunks under the block hashes vLLM computes for them (what vLLM's own events say)."""
    hashes = set(run.b("block_hashes", prompt=MAIN)["hashes"])
    assert len(hashes) == 8 * CHUNK // vllm_engine.BLOCK  # 16 blocks of 32
    nudge = iter(range(1, 1000))

    def published() -> bool:
        with KVPoolClient(run.agent.socket_path) as c:  # a put the subscriber hears
            c.put(next(nudge).to_bytes(16, "big"), b"n")
        run.mirror.pump()
        return hashes <= run.mirror.held.get("CPU_PINNED", set())
    wait_until(published, "vLLM's block hashes in the agent's events")


def test_agent_killed_between_lookup_and_load_then_back(run: Run) -> None:
    """The agent dies while a load is due: vLLM recomputes (the no-connector output), keeps
    serving while the agent is away with one warning per connection, not per request, and
    the connector reconnects by itself once the agent is back (warm: its chunks hit again)."""
    assert run.b("fault", kind="pause", chunk=0)["armed"] == "pause"
    run.b.submit(KILLED)
    assert run.b.read() == {"event": "loading"}
    run.agent.kill()
    run.b.send("go")
    got = run.b.read()
    assert got["outputs"] == [run.expected(KILLED)]

    down = run.b.generate(MAIN)
    warnings = run.b.log().count(DOWN)
    assert 1 <= warnings <= 3  # the scheduler's and the worker's connections
    for _ in range(3):
        assert run.b.generate(MAIN)["outputs"] == [run.expected(MAIN)]
    assert run.b.log().count(DOWN) == warnings
    assert down["external_prefix_cache_hits"] == 0
    assert down["outputs"] == [run.expected(MAIN)]

    run.agent.start()  # a warm restart: the arena keeps its chunks

    def hits_again() -> bool:
        return bool(run.b.generate(MAIN)["external_prefix_cache_hits"] == 8 * CHUNK)
    wait_until(hits_again, "the connector to reconnect and hit again")
    assert "is back after" in run.b.log()


def test_a_stalled_agent_costs_one_timeout_then_vllm_recomputes_until_it_answers(
        run: Run) -> None:
    """The agent stops answering (SIGSTOP). A load of chunks its lookup index describes
    needs no answer (read without a lease): served as if nothing happened. A request whose
    chunks must be stored waits on it: the save gives up after the connector's timeout
    (one warning) and vLLM serves the request anyway; once the agent answers again the
    connector is back by itself, and no lease is left over."""
    warnings = run.b.log().count(DOWN)
    assert run.b.generate(MAIN)["external_prefix_cache_hits"] == 8 * CHUNK
    assert run.agent.proc is not None
    run.agent.proc.send_signal(signal.SIGSTOP)
    try:
        got = run.b.generate(MAIN)
        assert run.b.log().count(DOWN) == warnings  # the load asked the agent nothing
        fresh = run.b.generate(STALLED)
        assert run.b("drain")["drained"]  # its saves, given up after the timeout
    finally:
        run.agent.proc.send_signal(signal.SIGCONT)

    assert got["outputs"] == [run.expected(MAIN)]
    assert got["external_prefix_cache_hits"] == 8 * CHUNK
    assert fresh["outputs"] == [run.expected(STALLED)]
    assert run.b.log().count(DOWN) == warnings + 1  # the worker's connection

    def hits_again() -> bool:
        return bool(run.b.generate(MAIN)["external_prefix_cache_hits"] == 8 * CHUNK)
    wait_until(hits_again, "the connector to come back after the stall")
    # The timed-out connection's leases end when the agent, running again, sees it closed.
    wait_until(lambda: stats(run.agent)["leases"] == {"read": 0, "write": 0},
               "the stalled load's leases to end")
