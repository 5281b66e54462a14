"""A DELETE a peer refused because it did not follow the deleting agent yet reaches it once
it does (docs/cross-node.md#delete): a peer takes a DELETE only from an agent it follows,
and one that cannot reach the deleting agent (just started, or cut off from it in one
direction) refuses it; its subscription to that agent, when it can, sends it again, and
meanwhile the deleting agent never lists that peer's copy of the key."""

from __future__ import annotations

import os
import signal
from contextlib import ExitStack
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvpool.agent.client import KVPoolClient
from kvpool.agent.peers import links
from kvpool.agent.peers.links import PeerLink
from kvpool.agent.peers.metrics import PeerMetrics

from .conftest import credentials, metric, wait_until
from .nodes import PEER_PORT, Network, block, peer_agent
from .test_peer_reads import seen_as


def test_a_delete_refused_by_a_peer_that_did_not_follow_the_deleter_reaches_it_once_it_does(
        net: Network, tmp_path: Path, secret: Path) -> None:
    a_node, b_node = net.nodes[0], net.nodes[1]
    block(b_node, a_node, True)  # node 1 never follows node 0: it cannot connect to it
    with ExitStack() as stack:
        a, b = (stack.enter_context(peer_agent(net, i, tmp_path / f"node{i}", secret,
                                               nvme=False, prefetch=False))
                for i in range(2))
        ca, cb = (stack.enter_context(KVPoolClient(x.socket_path)) for x in (a, b))
        key, data = os.urandom(16), os.urandom(1 << 14)
        assert cb.put(key, data)
        seen_as(ca, [key], ["peer"])  # node 0 follows node 1
        ca.delete(key)
        # Node 1 refuses node 0's DELETE and keeps serving its copy meanwhile.
        wait_until(lambda: metric(b, "kvpool_peer_deletes_total", direction="received",
                                  result="refused") >= 1, "node 1 to refuse the DELETE")
        assert metric(a, "kvpool_peer_deletes_total", direction="sent", result="refused") >= 1
        assert cb.lookup_tiers([key]) == ["dram"]
        # Node 1 reaches node 0 again: it follows it, and takes the DELETE it refused.
        block(b_node, a_node, False)
        wait_until(lambda: cb.lookup_tiers([key]) in ([], ["none"]),
                   "node 1 to take the DELETE it refused")
        assert cb.get(key) is None
        assert metric(b, "kvpool_peer_deletes_total", direction="received", result="ok") == 1
        assert metric(a, "kvpool_peer_deletes_total", direction="sent", result="ok") == 1
        assert ca.lookup_tiers([key]) in ([], ["none"])


def test_a_peer_back_from_a_restart_that_refuses_a_delete_is_never_read_for_the_key(
        net: Network, tmp_path: Path, secret: Path) -> None:
    a_node, b_node = net.nodes[0], net.nodes[1]
    b_peer = f"{b_node.addr}:{PEER_PORT}"
    with ExitStack() as stack:
        # Node 0 holds announcements of a deleted key off 1 ms (`deleteHoldoff`): only the
        # DELETE node 1 refused keeps node 1's copy out of node 0's directory.
        a = stack.enter_context(peer_agent(net, 0, tmp_path / "node0", secret, nvme=False,
                                           prefetch=False, extra={"deleteHoldoff": "1ms"}))
        b = stack.enter_context(peer_agent(net, 1, tmp_path / "node1", secret, nvme=False,
                                           prefetch=False))
        ca = stack.enter_context(KVPoolClient(a.socket_path))
        key, data = os.urandom(16), os.urandom(1 << 14)
        with KVPoolClient(b.socket_path) as cb:
            assert cb.put(key, data)
        seen_as(ca, [key], ["peer"])
        b.kill(signal.SIGKILL)
        wait_until(lambda: metric(a, "kvpool_peer_up", peer=b_peer) == 0, "node 1 down")
        ca.delete(key)  # waits for node 1 to be back
        # Node 1 restarts warm (its copy is back) and cannot reach node 0: node 0 follows
        # it again, its DELETE sent first and refused, and lists none of it.
        block(b_node, a_node, True)
        b.start()
        wait_until(lambda: metric(a, "kvpool_peer_up", peer=b_peer) == 1, "node 1 back")
        assert metric(b, "kvpool_peer_deletes_total", direction="received",
                      result="refused") >= 1
        assert ca.lookup_tiers([key]) in ([], ["none"]) and ca.get(key) is None
        with KVPoolClient(b.socket_path) as cb:
            assert cb.lookup_tiers([key]) == ["dram"]
            block(b_node, a_node, False)
            wait_until(lambda: cb.lookup_tiers([key]) in ([], ["none"]),
                       "node 1 to take the DELETE it refused")
        assert ca.lookup_tiers([key]) in ([], ["none"])


def test_refused_deletes_wait_bounded_in_number_and_time_and_go_again_when_followed(
        secret: Path) -> None:
    registry = CollectorRegistry()
    link = PeerLink(0, "192.0.2.1", PEER_PORT, credentials=credentials(secret),
                    agent_id=bytes(16), connections=1, directories={},
                    metrics=PeerMetrics(registry, "p"))

    def dropped() -> float:
        return registry.get_sample_value("kvpool_peer_deletes_total", {
            "pool": "p", "peer": link.name, "direction": "sent", "result": "dropped"}) or 0

    first, second, third = (("", bytes([i]) * 16) for i in range(3))
    # Refused, sent before a subscription of the peer was seen: held for the next one.
    assert not link.hold_refused([first, second], link.follows)
    assert list(link.refused) == [first, second] and not link.deletes
    # The peer subscribes: they are queued again, first in line.
    link.queue_delete(*third)
    assert link.followed()
    assert link.take_deletes() == [first, second, third] and not link.refused
    # Refused, but the peer subscribed while their answer came: queued again at once.
    follows = link.follows
    assert not link.followed()
    assert link.hold_refused([first], follows) and list(link.deletes) == [first]
    link.take_deletes()
    # Past REFUSED_KEEP seconds without a subscription, they are dropped (counted).
    assert not link.hold_refused([first, second], link.follows)
    link.expire_refused(next(iter(link.refused.values())) - 1)
    assert len(link.refused) == 2 and dropped() == 0
    link.expire_refused(next(iter(link.refused.values())))
    assert not link.refused and dropped() == 2
    # Past MAX_PENDING_DELETES, the oldest is dropped (counted).
    many = [("", i.to_bytes(16, "big")) for i in range(links.MAX_PENDING_DELETES + 1)]
    assert not link.hold_refused(many, link.follows)
    assert len(link.refused) == links.MAX_PENDING_DELETES and dropped() == 3
    assert many[0] not in link.refused and many[1] in link.refused
