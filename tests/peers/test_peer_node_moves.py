"""A peer that comes back at another address (its pod made again with a new IP, on the same
node) still gets the DELETEs that waited for it, and those made while it was away
(docs/cross-node.md#delete, "A node at a new address"): they wait for its node, by the name
its inventory stream says, not for the address that went; its copies of those keys are
never listed meanwhile, and the rest of its inventory is. Discovery looks for it again
sooner while the pool is changing."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import Peers
from kvpool.agent.peers import network
from kvpool.agent.peers.network import PeerNetwork
from kvpool.bench.local import free_port

from .conftest import metric, wait_until
from .nodes import PEER_PORT, Network, ip, peer_agent
from .test_peer_reads import seen_as

GONE = ([], ["none"])
DISCOVERY_WAIT = 60.0
"""Seconds a wait on discovery may take (a guard against a hang: it resolves every 2 s
while a peer is unreachable or a node away, every 10 s otherwise)."""
NAME = "kvpool-peers.test"
"""What the deleting node's discovery resolves (its namespace's hosts file, which
`ip netns exec` mounts over /etc/hosts): the agents' addresses, as a headless Service
lists its pods'."""


def test_deletes_wait_for_a_node_and_reach_it_at_its_new_address(
        net: Network, tmp_path: Path, secret: Path) -> None:
    a_node, c_node = net.nodes[0], net.nodes[1]
    etc = Path("/etc/netns") / a_node.ns
    etc.mkdir(parents=True, exist_ok=True)
    hosts = etc / "hosts"

    def listed(*nodes: str) -> None:  # (in place: the agent's mount shows this file)
        hosts.write_text("".join(f"{addr} {NAME}\n" for addr in nodes))

    listed(a_node.addr, c_node.addr)
    moved = dataclasses.replace(c_node, addr=f"{net.prefix}.{100 + len(net.nodes)}")
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, etc, True)
        c = stack.enter_context(peer_agent(net, 1, tmp_path / "node1", secret, nvme=False,
                                           prefetch=False, named=True,
                                           extra={"addresses": [f"{a_node.addr}:{PEER_PORT}"]}))
        a = stack.enter_context(peer_agent(net, 0, tmp_path / "node0", secret, nvme=False,
                                           prefetch=False, named=True,
                                           extra={"addresses": [], "discovery": NAME}))
        ca = stack.enter_context(KVPoolClient(a.socket_path))
        k1, k2, kept = (os.urandom(16) for _ in range(3))
        data = {k: os.urandom(1 << 14) for k in (k1, k2, kept)}
        with KVPoolClient(c.socket_path) as cc:
            for k, d in data.items():
                assert cc.put(k, d)
        seen_as(ca, [k1, k2, kept], ["peer"] * 3)

        # Node 1's agent is killed (its arena keeps the chunks: a warm restart finds them).
        # A DELETE made now waits for its link; once discovery no longer lists that
        # address, for its node; one made after that waits for the node too.
        c.kill(signal.SIGKILL)
        ca.delete(k1)

        def waiting(peer: str) -> float:
            return metric(a, "kvpool_peer_deletes_waiting", peer=f"{peer}:{PEER_PORT}",
                          peer_node="node1")
        assert waiting(c_node.addr) == 1
        listed(a_node.addr)
        wait_until(lambda: "no longer listed" in a.log(), "the link to node 1 to go",
                   DISCOVERY_WAIT)
        ca.delete(k2)
        assert waiting(c_node.addr) == 2  # (node 1 away: under its last address)

        # Its pod made again: the same node, another address.
        # (The old address first: deleting a subnet's primary address takes the others.)
        ip("-n", c_node.ns, "addr", "del", f"{c_node.addr}/24", "dev", c_node.inner)
        ip("-n", c_node.ns, "addr", "add", f"{moved.addr}/24", "dev", c_node.inner)
        net.nodes[1] = moved
        c2 = stack.enter_context(peer_agent(net, 1, tmp_path / "node1", secret, nvme=False,
                                            prefetch=False, named=True,
                                            extra={"addresses": [f"{a_node.addr}:{PEER_PORT}"]}))
        cc2 = stack.enter_context(KVPoolClient(c2.socket_path))
        assert cc2.lookup_tiers([kept]) == ["dram"]  # (warm: what it held is back)
        listed(a_node.addr, moved.addr)

        for k in (k1, k2):
            wait_until(lambda k=k: cc2.lookup_tiers([k]) in GONE,
                       "node 1 at its new address to take the DELETEs", DISCOVERY_WAIT)
        # What it holds besides is listed and read as before; the deleted keys nowhere.
        seen_as(ca, [kept], ["peer"])
        assert ca.lookup_tiers([k1]) in GONE and ca.lookup_tiers([k2]) in GONE
        assert ca.get(kept) == data[kept]
        for k in (k1, k2):
            assert cc2.get(k) is None and ca.get(k) is None
        wait_until(lambda: metric(a, "kvpool_peer_deletes_total", direction="sent",
                                  result="ok") == 2, "node 0 to count both DELETEs taken")
        assert metric(a, "kvpool_peer_deletes_total", result="dropped") == 0
        assert waiting(moved.addr) == 0 and waiting(c_node.addr) == 0
        assert "deletes waiting for it since its node node1 was at" in a.log()


def test_a_peer_the_pool_lists_no_more_under_an_unknown_node_still_drops_its_deletes(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """Without a node name (an agent older than it), a peer's address is all it is known by:
    its DELETEs go when the address does, as before."""
    a_node, c_node = net.nodes[0], net.nodes[1]
    etc = Path("/etc/netns") / a_node.ns
    etc.mkdir(parents=True, exist_ok=True)
    hosts = etc / "hosts"
    hosts.write_text(f"{a_node.addr} {NAME}\n{c_node.addr} {NAME}\n")
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, etc, True)
        # Unnamed: both agents report this host's name, which is node 0's own too, so it
        # names no node (two agents of one pool on one node are not told apart by it).
        c = stack.enter_context(peer_agent(net, 1, tmp_path / "node1", secret, nvme=False,
                                           prefetch=False,
                                           extra={"addresses": [f"{a_node.addr}:{PEER_PORT}"]}))
        a = stack.enter_context(peer_agent(net, 0, tmp_path / "node0", secret, nvme=False,
                                           prefetch=False, extra={"addresses": [],
                                                                  "discovery": NAME}))
        ca = stack.enter_context(KVPoolClient(a.socket_path))
        key = os.urandom(16)
        with KVPoolClient(c.socket_path) as cc:
            assert cc.put(key, b"x" * 4096)
        seen_as(ca, [key], ["peer"])
        c.kill(signal.SIGKILL)
        ca.delete(key)
        hosts.write_text(f"{a_node.addr} {NAME}\n")
        wait_until(lambda: "no longer listed" in a.log(), "the link to node 1 to go",
                   DISCOVERY_WAIT)
        assert "went:" not in a.log()


def test_discovery_looks_again_sooner_while_a_peer_is_unreachable(
        monkeypatch: pytest.MonkeyPatch, secret: Path) -> None:
    """While a peer is unreachable (or a node away), discovery resolves its name every
    `DISCOVERY_RETRY`, not once a `DISCOVERY_INTERVAL`: a pod made again is found at its
    new address in seconds. (The interval made an hour here: at it, one resolve only.)"""
    monkeypatch.setattr(network, "DISCOVERY_INTERVAL", 3600.0)
    monkeypatch.setattr(network, "DISCOVERY_RETRY", 0.01)
    cfg = Peers.model_validate({
        "enabled": True, "port": free_port(), "address": "127.0.0.1",
        "secretFile": str(secret), "discovery": "localhost",
        "addresses": [f"127.0.0.1:{free_port()}"]})  # (nobody listens: unreachable)

    async def resolves() -> int:
        loop = asyncio.get_running_loop()
        asked = 0
        resolve = loop.getaddrinfo

        async def counted(*args: Any, **kw: Any) -> Any:
            nonlocal asked
            asked += 1
            return await resolve(*args, **kw)
        loop.getaddrinfo = counted  # type: ignore[method-assign]
        peers = PeerNetwork(cfg, {}, CollectorRegistry(), "p", node="node0")
        await peers.start()
        try:
            for _ in range(3000):  # (bounded: 30 s)
                if asked >= 3:
                    break
                await asyncio.sleep(0.01)
            return asked
        finally:
            await peers.close()

    assert asyncio.run(resolves()) >= 3
