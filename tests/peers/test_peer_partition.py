"""A partition and its heal: a node cut off loses its entries at the others (unreachable:
they expire), and once it is back its inventory brings the directory into agreement,
deletes made meanwhile included."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

from .conftest import metric, wait_until
from .nodes import Network
from .test_peer_reads import seen_as, start


def test_after_a_partition_heals_every_node_agrees_on_what_the_cut_node_holds(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        # No prefetch: node 0's chunks stay node 0's alone (a LOOKUP elsewhere would copy
        # them over, and a copy is another holder's entry).
        (_a, ca), (b, cb), (c, cc) = start(stack, net, tmp_path, secret, nvme=False,
                                           prefetch=False)
        before, after = os.urandom(16), os.urandom(16)
        assert ca.put(before, b"b" * 8192)
        for client in (cb, cc):
            seen_as(client, [before], ["peer"])
        net.cut(net.nodes[0])
        try:
            assert ca.delete(before)  # node 0 still serves its own clients
            assert ca.put(after, b"a" * 8192)
            # Unreachable: node 0's entries expire at the others.
            for agent, client in ((b, cb), (c, cc)):
                wait_until(lambda client=client: client.lookup_tiers([before]) == [],
                           "node 0's entries to expire", timeout=120)
                assert metric(agent, "kvpool_peer_up", peer=f"{net.nodes[0].addr}:9410") == 0
        finally:
            net.heal(net.nodes[0])
        for client in (cb, cc):
            seen_as(client, [after], ["peer"])
            assert client.lookup_tiers([before]) == []
            assert client.get(after) == b"a" * 8192
