"""kvpool's vLLM connector, run by vLLM's own engine (its CPU build) against a real agent.

Each engine is a fresh process (`vllm_engine.py`) in the vLLM test environment
(tests/install-vllm), as a vLLM pod would be; nothing but the agent connects them. Engine
starts are what these tests cost (~20-35 s each), so one module runs every scenario on four
engines: a reference with no connector, engine A that stores, then engines B (same tenant)
and C (another tenant) at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvpool.agent.client import KVPoolClient
from kvpool.bench import needs
from kvpool.bench.local import LocalAgent

from ..agent.conftest import wait_until
from ..agent.test_events import MapBatch, Mirror, events_agent
from ..support import REPO_ROOT
from . import vllm_engine

# Two engines at a time, each a process that takes a core or more: beside other tests they
# would only slow each other down (tests/run runs `alone` tests one at a time, after the rest).
# The hang guard covers the module's engine starts, which the first test's set-up pays for:
# ~1.5 min on an idle machine, several on one busy with other work.
pytestmark = [pytest.mark.alone, pytest.mark.timeout(900)]

HARNESS = Path(vllm_engine.__file__)
CHUNK = 64
"""Tokens per chunk: two vLLM blocks of 32."""
CONNECTOR = {"kv_connector": "KVPoolConnector",
             "kv_connector_module_path": "kvpool.agent.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
"""What docs/integrations.md tells a user to pass as --kv-transfer-config."""
START_TIMEOUT = 300
DOWN = "serving without the pool (recomputing) until it is back"
"""The connector's warning when it finds the agent unreachable: once per incident."""


def vllm_python() -> Path:
    """The vLLM environment's python: $KVPOOL_VLLM_PYTHON, else tests/install-vllm's place."""
    path = needs.vllm_python()
    if not path.exists():
        pytest.fail(f"no vLLM test environment at {path}: run tests/install (tests/install-vllm)")
    return path


def tokens(seed: int, n: int) -> list[int]:
    """A prompt of `n` token ids (the model's vocabulary is 1000; ids 0-2 are special)."""
    return [(i * 7919 + seed * 104729 + seed * i * 31) % 990 + 5 for i in range(n)]


MAIN = tokens(1, 8 * CHUNK + 10)
"""Eight whole chunks and a tail."""
PREFIX = MAIN[: 3 * CHUNK + 17] + tokens(2, 4 * CHUNK)
"""Shares three whole chunks (and 17 tokens of the fourth) with MAIN."""
CORRUPT, EVICT, KILLED = (tokens(seed, 6 * CHUNK + 5) for seed in (3, 4, 5))
OWN_B = [tokens(10 + i, 4 * CHUNK + 3 * i) for i in range(3)]
OWN_C = [tokens(20 + i, 4 * CHUNK + 5 * i) for i in range(3)]
STORED_BY_A = [MAIN, CORRUPT, EVICT, KILLED]


class Engine:
    """A vLLM engine process answering the harness's JSON commands."""

    def __init__(self, name: str, model: Path, agent: LocalAgent | None, workdir: Path,
                 tenant: str = "team-a", connector: dict[str, Any] | None = CONNECTOR,
                 chunk_tokens: int = CHUNK, harness: Path = HARNESS,
                 prefix: tuple[str, ...] = (), **env_extra: str) -> None:
        self.name = name
        self.log_path = workdir / f"vllm-{name}.log"
        env = dict(os.environ, KVPOOL_TENANT=tenant, KVPOOL_CHUNK_TOKENS=str(chunk_tokens),
                   POD_NAME=f"vllm-{name}", **env_extra)
        if agent is not None:
            env["KVPOOL_SOCKET"] = str(agent.socket_path)
        # `prefix`: run it under this command (e.g. `ip netns exec NS`: on another node)
        args = [*prefix, str(vllm_python()), str(harness), "serve", str(model)]
        if connector is not None:
            args.append(json.dumps(connector))
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=env, cwd=workdir)
        self.started: dict[str, Any] = {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            raise AssertionError(f"engine {self.name} exited ({self.proc.returncode}):\n"
                                 f"{self.log()[-8000:]}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ready(self) -> dict[str, Any]:
        self.started = self.read()
        assert self.started.get("ready"), self.started
        return self.started

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(json.dumps({"op": op, **args}))
        return self.read()

    def generate(self, *prompts: list[int], max_tokens: int = 8) -> dict[str, Any]:
        return self("generate", prompts=list(prompts), max_tokens=max_tokens)

    def quit(self) -> None:
        if self.proc.poll() is None:
            self.send(json.dumps({"op": "quit"}))
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def stats(agent: LocalAgent) -> dict[str, Any]:
    with KVPoolClient(agent.socket_path) as c:
        return c.stats()


class Run:
    """What the module's engines did, and engines B and C still serving."""

    def __init__(self, agent: LocalAgent, mirror: Mirror, reference: dict[str, list[int]],
                 stored: dict[str, Any], after_a: dict[str, Any], b: Engine,
                 c: Engine, odd: Engine) -> None:
        self.agent, self.mirror, self.reference = agent, mirror, reference
        self.stored, self.after_a, self.b, self.c, self.odd = stored, after_a, b, c, odd

    def expected(self, prompt: list[int]) -> list[int]:
        return self.reference[json.dumps(prompt)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, vllm_model: Path) -> Iterator[Run]:
    work = tmp_path_factory.mktemp("vllm")
    model = vllm_model
    ctx: zmq.Context[object] = zmq.Context()
    # With an NVMe tier the shared-memory index cannot answer a prefix that ends in DRAM
    # (NVMe may go on): the scheduler then asks the socket, in the background.
    with events_agent(work, "node", "map", "64Mi", nvme=work / "nvme") as (agent, endpoint,
                                                                          replay):
        mirror = Mirror(ctx, endpoint, replay, b"kv@n1@default", MapBatch)
        engines: list[Engine] = []
        try:
            # The reference (no connector) and engine A start at once: two cores.
            ref = Engine("reference", model, None, work, connector=None)
            a = Engine("a", model, agent, work)
            engines += [ref, a]
            ref.ready()
            a.ready()
            everything = [MAIN, PREFIX, CORRUPT, EVICT, KILLED, *OWN_B, *OWN_C]
            reference = {json.dumps(p): ref.generate(p)["outputs"][0] for p in everything}
            stored = {json.dumps(p): a.generate(p) for p in STORED_BY_A}
            assert a("drain")["drained"]
            after_a = stats(agent)
            ref.quit()
            a.quit()
            b = Engine("b", model, agent, work)
            c = Engine("c", model, agent, work, tenant="team-b")
            # 48 tokens a chunk: not whole blocks of 32. It must not start.
            odd = Engine("odd-chunk", model, agent, work, chunk_tokens=48)
            engines += [b, c, odd]
            b.ready()
            c.ready()
            odd.proc.wait(timeout=START_TIMEOUT)
            yield Run(agent, mirror, reference, stored, after_a, b, c, odd)
        finally:
            for e in engines:
                e.quit()
            for e in engines:
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
    outputs = [tuple(o) for o in run.reference.values()]
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
    got = run.b.generate(MAIN)

    assert got["external_prefix_cache_hits"] == 8 * CHUNK  # every stored whole chunk
    assert got["prefix_cache_hits"] == 0
    assert got["cached"] == [8 * CHUNK]  # B computed only the 10 tokens past them
    assert got["outputs"] == [run.expected(MAIN)] == run.stored[json.dumps(MAIN)]["outputs"]


def test_a_prompt_sharing_a_prefix_hits_exactly_the_shared_whole_chunks(run: Run) -> None:
    got = run.b.generate(PREFIX)

    assert got["external_prefix_cache_hits"] == 3 * CHUNK
    assert got["outputs"] == [run.expected(PREFIX)]


def test_another_tenant_misses(run: Run) -> None:
    got = run.c.generate(MAIN)

    assert got["external_prefix_cache_hits"] == 0
    assert got["outputs"] == [run.expected(MAIN)]


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
    run.b.send(json.dumps({"op": "generate", "prompts": OWN_B, "max_tokens": 8}))
    run.c.send(json.dumps({"op": "generate", "prompts": OWN_C, "max_tokens": 8}))
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
    run.b.send(json.dumps({"op": "generate", "prompts": [KILLED], "max_tokens": 8}))
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
    """The agent stops answering (SIGSTOP) with a load due: the load gives up after the
    connector's timeout and vLLM recomputes; once the agent answers again the connector
    is back by itself, and no lease is left over."""
    warnings = run.b.log().count(DOWN)
    assert run.b.generate(MAIN)["external_prefix_cache_hits"] == 8 * CHUNK
    assert run.agent.proc is not None
    run.agent.proc.send_signal(signal.SIGSTOP)
    try:
        got = run.b.generate(MAIN)
    finally:
        run.agent.proc.send_signal(signal.SIGCONT)

    assert got["outputs"] == [run.expected(MAIN)]
    assert run.b.log().count(DOWN) == warnings + 1  # the worker's connection

    def hits_again() -> bool:
        return bool(run.b.generate(MAIN)["external_prefix_cache_hits"] == 8 * CHUNK)
    wait_until(hits_again, "the connector to come back after the stall")
    # The timed-out connection's leases end when the agent, running again, sees it closed.
    wait_until(lambda: stats(run.agent)["leases"] == {"read": 0, "write": 0},
               "the stalled load's leases to end")
