"""The peer tests' nodes: network namespaces joined by veth pairs (`kvpool.bench.netns`)."""

from kvpool.bench.netns import PEER_PORT, Network, Node, in_ns, ip, peer_agent

__all__ = ["PEER_PORT", "Network", "Node", "in_ns", "ip", "peer_agent"]
