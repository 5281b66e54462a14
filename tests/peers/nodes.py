"""The peer tests' nodes: network namespaces joined by veth pairs (`kvpool.bench.netns`),
and a node whose only peer is a scripted one."""

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent
from kvpool.bench.netns import PEER_PORT, Network, Node, in_ns, ip, peer_agent
from kvpool.bench.scripted_peer import ScriptedPeer

__all__ = ["PEER_PORT", "Network", "Node", "block", "in_ns", "ip", "peer_agent", "served_by"]


def block(node: Node, to: Node, add: bool) -> None:
    """Block (or let through again) `node`'s TCP connections to `to`'s peer port, in
    `node`'s namespace: `to` still reaches `node`, and `node` still answers it."""
    if add:
        ip("-n", node.ns, "route", "add", "blackhole", f"{to.addr}/32", "table", "100")
    ip("-n", node.ns, "rule", "add" if add else "del", "ipproto", "tcp", "dport",
       str(PEER_PORT), "to", f"{to.addr}/32", "table", "100")


def served_by(stack: ExitStack, net: Network, workdir: Path, secret: Path,
              peer: ScriptedPeer, **peers: Any) -> tuple[LocalAgent, KVPoolClient]:
    """Node 1's agent (no NVMe, no prefetch: only the client's reads read) whose only peer
    is the scripted `peer`, with `peers` added to its peers section, and a client of it;
    the peer is closed with the stack."""
    stack.callback(peer.close)
    agent = stack.enter_context(peer_agent(
        net, 1, workdir, secret, nvme=False, prefetch=False,
        extra={**peers, "addresses": [f"{net.host}:{peer.port}"]}))
    return agent, stack.enter_context(KVPoolClient(agent.socket_path))
