"""`LocalAgent`, the agent process the demo, the bench and the tests start: its metrics port
is picked free before the agent starts, and a test running beside it may take it meanwhile."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvpool.bench.local import LocalAgent

from ..support import scrape


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_an_agent_whose_metrics_port_was_taken_before_it_started_starts_on_another(
        tmp_path: Path, host: str) -> None:
    """On the address it was given (a node's own, for the peer tests' agents), not only on
    127.0.0.1."""
    agent = LocalAgent("--no-lock", workdir=tmp_path, dram="16Mi", metrics_host=host)
    picked = agent.metrics_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((host, picked))
        taken.listen(1)
        with agent:
            assert agent.metrics_port != picked
            assert agent.metrics_url == f"http://{host}:{agent.metrics_port}"
            assert any(k.startswith("kvpool_") for k in scrape(agent))
