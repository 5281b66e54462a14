"""The vLLM connector's roles, as vLLM defines them, on its scheduler side against a real
agent (no vLLM: the request and step objects carry the attributes vLLM 0.32's have, as the
connector reads them): a `kv_consumer` loads and never stores, a `kv_producer` stores and
never loads. `tests/peers/test_peer_vllm.py` runs both roles in vLLM's own engines.

And its worker side loading into CPU KV-cache layers on the same agent (layers shaped as
vLLM 0.32's CPU worker makes them, jobs as its scheduler side makes them): a load's chunks
land in the blocks it names, and its report ends at once a step that waits for it."""

from __future__ import annotations

import array
import os
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.agent import leasefree, leasekernel
from kvpool.agent.client import KVPoolClient
from kvpool.agent.integrations.vllm import worker as worker_module
from kvpool.agent.integrations.vllm.jobs import LoadJob, SaveJob, StepJobs
from kvpool.agent.integrations.vllm.layout import KeyChain, Layout
from kvpool.agent.integrations.vllm.scheduler import SchedulerSide
from kvpool.agent.integrations.vllm.settings import Settings
from kvpool.agent.integrations.vllm.worker import WorkerSide
from kvpool.bench.local import LocalAgent

CHUNK, BLOCK = 64, 32
LAYOUT = Layout(model="m", dtype="float32", layers=2, kv_heads=2, head_size=64,
                head_size_v=64, block_size=BLOCK, chunk_tokens=CHUNK)
PROMPT = [(i * 31) % 990 + 5 for i in range(4 * CHUNK + 9)]
"""Four whole chunks and a tail: in the pool."""
NEW = [t + 1 for t in PROMPT]
"""Not in the pool."""


def scheduler(agent: LocalAgent, *, loads: bool, saves: bool) -> SchedulerSide:
    return SchedulerSide(Settings(socket=str(agent.socket_path), layout=LAYOUT, loads=loads,
                                  saves=saves, timeout=5.0, lookup_wait=30.0), "m")


def request(req_id: str, prompt: list[int]) -> Any:
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=len(prompt),
                           all_token_ids=prompt, num_computed_tokens=0,
                           block_hashes=[bytes([i]) * 32 for i in range(len(prompt) // BLOCK)])


def matched(side: SchedulerSide, req: Any) -> tuple[int | None, bool]:
    """vLLM asks each step until the answer is not None (the socket's lookup is due)."""
    for _ in range(2000):
        got = side.matched_tokens(req, 0)
        if got[0] is not None:
            return got
        time.sleep(0.005)
    raise AssertionError("the lookup never answered")


def whole_prompt_step(req: Any) -> Any:
    """A step that computes the whole prompt, its blocks 0, 1, ..."""
    blocks = list(range(len(PROMPT) // BLOCK + 1))
    return SimpleNamespace(num_scheduled_tokens={req.request_id: len(PROMPT)},
                           preempted_req_ids=set(),
                           kv_connector_block_state=SimpleNamespace(
                               get_block_ids=lambda _: [blocks]))


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalAgent, list[bytes]]]:
    """An agent holding PROMPT's four chunks, and their keys (the scheduler-side tests store
    nothing; the worker's stores chunks of keys of its own)."""
    keys = KeyChain(LAYOUT.fingerprint()).upto(PROMPT, 4)
    with LocalAgent("--no-lock", workdir=tmp_path_factory.mktemp("roles"), dram="8Mi") as a, \
            KVPoolClient(a.socket_path) as c:
        for k in keys:
            assert c.put(k, b"kv")
        yield a, keys


def test_both_loads_what_the_pool_holds_and_stores_what_it_computes(
        pool: tuple[LocalAgent, list[bytes]]) -> None:
    side = scheduler(pool[0], loads=True, saves=True)
    try:
        assert matched(side, request("r", PROMPT)) == (4 * CHUNK, True)
        new = request("n", NEW)
        assert matched(side, new) == (0, False)
        assert [len(j.block_ids) for j in side.step_jobs(whole_prompt_step(new)).saves] == [4]
    finally:
        side.close()


def test_a_consumer_loads_and_never_stores(pool: tuple[LocalAgent, list[bytes]]) -> None:
    side = scheduler(pool[0], loads=True, saves=False)
    try:
        assert matched(side, request("r", PROMPT)) == (4 * CHUNK, True)
        new = request("n", NEW)
        assert matched(side, new) == (0, False)
        assert side.step_jobs(whole_prompt_step(new)).saves == []
        assert side.finished(new) is False  # vLLM frees its blocks at once
    finally:
        side.close()


def test_a_producer_stores_and_never_loads(pool: tuple[LocalAgent, list[bytes]]) -> None:
    agent, stored = pool
    side = scheduler(agent, loads=False, saves=True)
    try:
        req = request("r", PROMPT)
        assert matched(side, req) == (0, False)  # though the pool holds all four
        jobs = side.step_jobs(whole_prompt_step(req))
        assert jobs.loads == []
        assert [j.keys[(0, 0)] for j in jobs.saves] == [stored]
        assert side.finished(req) is True  # its blocks kept until the saves are done
    finally:
        side.close()


BLOCKS = 16
WORKER_LAYOUT = Layout(model="m", dtype="float32", layers=2, kv_heads=2, head_size=64,
                       head_size_v=64, block_size=BLOCK, chunk_tokens=2 * BLOCK)
RANK = (0, 0)


def layers() -> dict[str, Any]:
    """Two CPU KV-cache layers of BLOCKS blocks (K and V of a token: 2 x 2 heads x 64)."""
    import torch

    return {f"l{i}": torch.randn(BLOCKS * BLOCK, 2, 2, 64) for i in range(2)}


def worker(agent: LocalAgent, kv: dict[str, Any]) -> WorkerSide:
    side = WorkerSide(Settings(socket=str(agent.socket_path), layout=WORKER_LAYOUT,
                               loads=True, saves=True, timeout=5.0, lookup_wait=5.0),
                      "m", RANK)
    side.register(kv, BLOCKS)
    return side


def test_a_load_fills_its_blocks_and_its_report_ends_the_steps_wait_for_it(
        pool: tuple[LocalAgent, list[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine A saves three chunks from its blocks; engine B loads them into other blocks
    (not one run, the first chunk's first block already held: read past). B's step that
    computed nothing waits for the load in flight (IDLE_WAIT made far longer than the test
    here) and the load's report ends that wait: the step returns the request loaded."""
    import torch
    agent = pool[0]
    monkeypatch.setattr(worker_module, "IDLE_WAIT", 600.0)
    kv_a, kv_b = layers(), layers()
    before = {name: t.clone() for name, t in kv_b.items()}
    a, b = worker(agent, kv_a), worker(agent, kv_b)
    try:
        keys = [os.urandom(16) for _ in range(3)]
        saved = [[0, 1], [2, 3], [4, 5]]
        a.end_step(StepJobs(saves=[SaveJob("r", {RANK: keys}, saved, [None] * 3)]))
        a.wait_for_saves({"r"})

        release = threading.Event()
        b.fault_hook = lambda _: release.wait(60)
        into = [[9, 10], [3, 4], [15, 14]]
        ids = array.array("q", [b for chunk in into for b in chunk])
        b.start_step(StepJobs(loads=[LoadJob("r", {RANK: keys}, ids, skip_blocks=1)]))
        got: list[tuple[set[str] | None, set[str] | None]] = []
        step = threading.Thread(target=lambda: got.append(b.finished(idle=True)))
        step.start()
        for _ in range(6000):  # until the step waits for the load
            with b._lock:
                if b._idle:
                    break
            threading.Event().wait(0.01)
        release.set()
        step.join(60)
        assert got == [(None, {"r"})], "the load's report ended the step's wait"
        assert b.load_errors() == set()

        per = BLOCK  # rows of a block in a layer's first dimension
        for name in kv_a:
            for src, dst, skip in zip(saved, into, [1, 0, 0], strict=True):
                for j, (s, d) in enumerate(zip(src, dst, strict=True)):
                    # a skipped block is vLLM's own (untouched), the others the chunk's
                    want = before[name][d * per : (d + 1) * per] if j < skip \
                        else kv_a[name][s * per : (s + 1) * per]
                    assert torch.equal(kv_b[name][d * per : (d + 1) * per], want), (name, d)
    finally:
        a.close()
        b.close()


def test_a_load_with_a_chunk_gone_reads_the_others_once_and_reports_its_blocks(
        pool: tuple[LocalAgent, list[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A load whose middle chunk left the pool: the chunks there land in their blocks, each
    read once (the compiled read's copies are not made again by the load of what it left),
    and the gone chunk's blocks are reported for vLLM to recompute."""
    import torch
    assert leasekernel.kernels() is not None  # (compiled now: the load's first read is so)
    agent = pool[0]
    kv_a, kv_b = layers(), layers()
    a, b = worker(agent, kv_a), worker(agent, kv_b)
    try:
        assert b._host is not None, "the CPU layers are read as block ids"
        keys = [os.urandom(16) for _ in range(3)]
        a.end_step(StepJobs(saves=[SaveJob("r", {RANK: keys}, [[0, 1], [2, 3], [4, 5]],
                                           [None] * 3)]))
        a.wait_for_saves({"r"})
        with KVPoolClient(agent.socket_path) as c:
            assert c.delete(keys[1])
        into = [[9, 10], [3, 4], [15, 14]]
        planned: list[int] = []  # the keys of each compiled read (the real one, counted)
        read_planned = leasefree.read_planned

        def counted(*args: Any) -> Any:
            planned.append(len(args[3]))
            return read_planned(*args)
        monkeypatch.setattr(leasefree, "read_planned", counted)
        assert b.link.connected() is not None  # (as after the worker's first step)
        b.start_step(StepJobs(loads=[LoadJob("r", {RANK: keys},
                                             array.array("q", [x for c in into for x in c]))]))
        assert b.drain(60)
        assert b.load_errors() == {3, 4}
        assert planned == [3], "one compiled read of the load, not a second of the same keys"
        client = b.link.client
        assert client is not None and client.reads_without_lease == 2
        for name in kv_a:
            for s, d in ((0, 9), (1, 10), (4, 15), (5, 14)):
                assert torch.equal(kv_b[name][d * BLOCK : (d + 1) * BLOCK],
                                   kv_a[name][s * BLOCK : (s + 1) * BLOCK]), (name, d)
    finally:
        a.close()
        b.close()
