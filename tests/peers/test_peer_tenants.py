"""Tenants across nodes: a peer serves a key only into the same tenant's space."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import tenant_socket_path
from kvpool.bench.local import LocalAgent

from .conftest import wait_until
from .nodes import Network, peer_agent

TENANTS = ["blue", "green"]


def tenant_agent(stack: ExitStack, net: Network, i: int, tmp: Path,
                 secret: Path) -> LocalAgent:
    # The tenants' arenas, journals and locks live beside the pool's arena, one directory
    # each: all in a directory of this test's own, removed at the end.
    arenas = Path(tempfile.mkdtemp(prefix="kvpool-peers-", dir="/dev/shm"))
    stack.callback(shutil.rmtree, arenas, True)
    agent = peer_agent(net, i, tmp / f"node{i}", secret, nvme=False, tenants=TENANTS,
                       arena=arenas / "arena")
    pool_socket = agent.socket_path
    agent.socket_path = tenant_socket_path(pool_socket, TENANTS[-1])  # up when it answers
    stack.enter_context(agent)
    agent.socket_path = pool_socket
    return agent


def test_a_peer_serves_a_key_only_into_the_same_tenants_space(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        a = tenant_agent(stack, net, 0, tmp_path, secret)
        b = tenant_agent(stack, net, 1, tmp_path, secret)

        def client(agent: LocalAgent, tenant: str) -> KVPoolClient:
            path = tenant_socket_path(agent.socket_path, tenant)
            return stack.enter_context(KVPoolClient(path))
        key, data = os.urandom(16), os.urandom(1 << 16)
        assert client(a, "blue").put(key, data)
        blue, green = client(b, "blue"), client(b, "green")
        wait_until(lambda: blue.lookup_tiers([key]) == ["peer"], "blue's directory on node 1")
        assert green.lookup_tiers([key]) == []
        assert green.get(key) is None
        assert blue.get(key) == data
        assert green.get(key) is None  # blue's copy on node 1 is blue's too
