"""A peer DELETE that waits for a peer the deleting agent cannot reach survives that agent's
restart (docs/cross-node.md#delete): kept in its state directory, it is sent once the peer
is reachable, before its inventory is taken, so no node lists or reads the deleted copy."""

from __future__ import annotations

import os
import signal
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.client import KVPoolClient

from .conftest import metric, wait_until
from .nodes import Network, block, peer_agent
from .test_peer_reads import seen_as

GONE = ([], ["none"])


def test_a_delete_waiting_for_an_unreachable_peer_is_sent_after_the_deleter_is_killed(
        net: Network, tmp_path: Path, secret: Path) -> None:
    a_node, c_node = net.nodes[0], net.nodes[2]
    block(a_node, c_node, True)  # node 0 cannot reach node 2; node 1 can, and node 2 them
    with ExitStack() as stack:
        # Node 2 first: node 1 follows it at its first try, not after a back-off.
        c, b, a = (stack.enter_context(peer_agent(net, i, tmp_path / f"node{i}", secret,
                                                  nvme=False, prefetch=False, state=i == 0))
                   for i in (2, 1, 0))
        cb, cc = (stack.enter_context(KVPoolClient(x.socket_path)) for x in (b, c))
        key, data = os.urandom(16), os.urandom(1 << 14)
        assert cc.put(key, data)
        seen_as(cb, [key], ["peer"])  # node 1 follows node 2: node 0's DELETE is not its
        with KVPoolClient(a.socket_path) as ca:  # to pass on
            ca.delete(key)  # on file before it is answered: killed at once, it still goes
        a.kill(signal.SIGKILL)
        assert cc.lookup_tiers([key]) == ["dram"]
        a.start()
        block(a_node, c_node, False)
        wait_until(lambda: cc.lookup_tiers([key]) in GONE, "node 2 to take the DELETE")
        assert cc.get(key) is None
        with KVPoolClient(a.socket_path) as ca:
            assert ca.lookup_tiers([key]) in GONE and ca.get(key) is None
        wait_until(lambda: cb.lookup_tiers([key]) in GONE, "node 1 to list none")
        assert cb.get(key) is None
        assert metric(a, "kvpool_peer_deletes_total", direction="sent", result="ok") == 1
        assert metric(a, "kvpool_peer_deletes_total", result="dropped") == 0
        assert "deletes waiting for it since before the restart" in a.log()
