"""A key deleted in the pool and put again is seen by the other nodes again
(docs/cross-node.md#delete): a directory holds other nodes' announcements of a deleted key
off for a while (`peers.deleteHoldoff`), but never drops one for good (an inventory stream
sends a chunk once), and never holds off the deleting node's own; the deleted bytes are
never read."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.client import KVPoolClient

from .conftest import wait_until
from .nodes import Network, peer_agent
from .test_peer_reads import seen_as


def test_a_key_deleted_and_put_again_is_seen_by_the_other_node_with_its_new_bytes(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        # Node 1 holds announcements off for an hour: only the deleting node's own ADD can
        # list the key there again. Node 0 holds them off 2 s: node 1's ADD, sent within
        # them, is listed when they end.
        holdoffs = ["2s", "1h"]
        agents = [stack.enter_context(peer_agent(
            net, i, tmp_path / f"node{i}", secret, nvme=False, prefetch=False,
            extra={"deleteHoldoff": holdoffs[i]})) for i in range(2)]
        c0, c1 = (stack.enter_context(KVPoolClient(a.socket_path)) for a in agents)
        key, old = os.urandom(16), os.urandom(1 << 16)
        buf = bytearray(len(old))

        def taken_by_node1() -> bool:  # its copy gone: it took node 0's DELETE
            return c1.lookup_tiers([key]) in ([], ["none"])

        # Put on node 0, read on node 1 (which then holds a copy too), deleted on node 0.
        assert c0.put(key, old)
        seen_as(c1, [key], ["peer"])
        assert c1.get_into(key, buf) == len(old) and buf == old
        assert c1.lookup_tiers([key]) == ["dram"]
        assert c0.delete(key)
        wait_until(taken_by_node1, "node 1 to take the DELETE")
        # Put again on the deleting node at once, well within node 1's holdoff: listed on
        # node 1 as a new key is, and read there with the new bytes.
        new = os.urandom(1 << 16)
        assert c0.put(key, new)
        seen_as(c1, [key], ["peer"])
        assert c1.get_into(key, buf) == len(new) and buf == new
        # Deleted on node 0 again, then put again on node 1 (another node than the deleting
        # one) within node 0's holdoff: held off there, and listed when it ends.
        assert c0.delete(key)
        wait_until(taken_by_node1, "node 1 to take the second DELETE")
        newer = os.urandom(1 << 16)
        assert c1.put(key, newer)
        seen_as(c0, [key], ["peer"])
        assert c0.get_into(key, buf) == len(newer) and buf == newer
