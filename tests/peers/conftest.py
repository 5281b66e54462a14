"""Fixtures of the peer tier's tests: a network of namespaces, the pool's secret."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent.config import Peers
from kvpool.agent.peers.credentials import Credentials
from kvpool.bench.local import LocalAgent

from ..support import scrape
from ..support import wait_until as wait_until
from .nodes import Network


@pytest.fixture
def net() -> Iterator[Network]:
    network = Network(3)
    try:
        yield network
    finally:
        network.close()


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o400)
    return path


def credentials(secret: Path) -> Credentials:
    """The credentials of an agent of the pool whose secret is in `secret` (plain TCP)."""
    return Credentials(Peers(enabled=True, secret_file=secret))


def metric(agent: LocalAgent, name: str, **labels: str) -> float:
    """The sum of `name`'s series whose labels include `labels`."""
    total = 0.0
    for series, value in scrape(agent).items():
        base, _, rest = series.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total
