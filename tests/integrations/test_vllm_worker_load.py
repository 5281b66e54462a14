"""The vLLM connector's worker side loading into CPU KV-cache layers against a real agent
(no vLLM: layers shaped as vLLM 0.32's CPU worker makes them, jobs as its scheduler side
makes them): a load's chunks land in the blocks it names, and its report ends at once a
step that waits for it (`WorkerSide.finished(idle=True)`). vLLM's own engine runs the
connector in tests/integrations/test_vllm_engine.py."""

from __future__ import annotations

import array
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.agent.integrations.vllm import worker as worker_module
from kvpool.agent.integrations.vllm.jobs import LoadJob, SaveJob, StepJobs
from kvpool.agent.integrations.vllm.layout import Layout
from kvpool.agent.integrations.vllm.settings import Settings
from kvpool.agent.integrations.vllm.worker import WorkerSide
from kvpool.bench.local import LocalAgent

torch = pytest.importorskip("torch")

BLOCK, BLOCKS = 32, 16
LAYOUT = Layout(model="m", dtype="float32", layers=2, kv_heads=2, head_size=64,
                head_size_v=64, block_size=BLOCK, chunk_tokens=2 * BLOCK)
RANK = (0, 0)


def layers() -> dict[str, Any]:
    """Two layers of BLOCKS blocks (K and V of each token: 2 x 2 heads x 64 floats)."""
    return {f"l{i}": torch.randn(BLOCKS * BLOCK, 2, 2, 64) for i in range(2)}


def worker(agent: LocalAgent, kv: dict[str, Any]) -> WorkerSide:
    side = WorkerSide(Settings(socket=str(agent.socket_path), layout=LAYOUT, loads=True,
                               saves=True, timeout=5.0, lookup_wait=5.0), "m", RANK)
    side.register(kv, BLOCKS)
    return side


@pytest.fixture
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    with LocalAgent("--no-lock", workdir=tmp_path_factory.mktemp("worker"), dram="16Mi") as a:
        yield a


def test_a_load_fills_its_blocks_and_its_report_ends_the_steps_wait_for_it(
        agent: LocalAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine A saves three chunks from its blocks; engine B loads them into other blocks
    (not one run, the first chunk's first block already held: read past). B's step that
    computed nothing waits for the load in flight (IDLE_WAIT made far longer than the test
    here) and the load's report ends that wait: the step returns the request loaded."""
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
