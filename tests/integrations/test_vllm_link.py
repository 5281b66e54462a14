"""The vLLM connector's agent link against a real agent: absent, killed, back (no vLLM)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvpool.agent.integrations.vllm.link import LOGGER, AgentLink
from kvpool.bench.local import LocalAgent

DOWN = "serving without the pool (recomputing) until it is back"


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


def test_no_agent_then_an_agent_one_warning_then_back_by_itself(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    agent = LocalAgent("--no-lock", workdir=tmp_path, dram="8Mi")
    link = AgentLink(str(agent.socket_path), what="test", retry_every=0.0)

    for _ in range(5):  # every call while there is no agent: None at once, no exception
        assert link.call(lambda c: c.stats()) is None
    assert [DOWN in w for w in warnings(caplog)] == [True]

    with agent:
        assert link.call(lambda c: c.stats()["leases"]) == {"read": 0, "write": 0}
        assert any("is back after" in r.getMessage() for r in caplog.records)
        agent.kill()  # killed: the next calls find it gone, one warning more
        for _ in range(3):
            assert link.call(lambda c: c.put(b"k" * 16, b"v")) is None
        assert len(warnings(caplog)) == 2
        agent.start()
        assert link.call(lambda c: c.put(b"k" * 16, b"v")) is True
    link.close()


def test_an_agent_that_restarted_between_calls_is_reconnected_without_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    with LocalAgent("--no-lock", workdir=tmp_path, dram="8Mi") as agent:
        link = AgentLink(str(agent.socket_path), what="test", retry_every=60.0)
        client = link.connected()
        assert client is not None
        agent.kill()
        agent.start()
        assert client.lookup_nowait([b"k" * 16]) is None  # it notices the closed socket
        assert not client.connected
        assert link.connected() is not None  # at once, despite retry_every
        assert warnings(caplog) == []
        assert any("reconnected to the agent" in r.getMessage() for r in caplog.records)
        link.close()
