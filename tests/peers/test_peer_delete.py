"""A DELETE reaches the pool's other copies: every node that holds the key in the same
tenant's space deletes it, another tenant's copy of the same key stays, and a node that
was down when the DELETE was made gets it when it is back, before any agent reads its
inventory again (docs/cross-node.md#delete)."""

from __future__ import annotations

import os
import signal
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import tenant_socket_path
from kvpool.bench.local import LocalAgent

from .conftest import metric, wait_until
from .nodes import Network
from .test_peer_tenants import tenant_agent


def deletes(agent: LocalAgent, direction: str, result: str) -> float:
    return metric(agent, "kvpool_peer_deletes_total", direction=direction, result=result)


def test_a_delete_reaches_every_copy_of_the_key_in_its_tenants_space_across_the_pool(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        nodes = [tenant_agent(stack, net, i, tmp_path, secret) for i in range(3)]

        def client(i: int, tenant: str) -> KVPoolClient:
            path = tenant_socket_path(nodes[i].socket_path, tenant)
            return stack.enter_context(KVPoolClient(path))
        blue = [client(i, "blue") for i in range(3)]
        green = [client(i, "green") for i in range(3)]
        wait_until(lambda: all(metric(n, "kvpool_peer_up") == 2 for n in nodes),
                   "every node following the two others")
        # One key in two tenants' spaces: blue's put on node 0 and read on nodes 1 and 2
        # (a copy each), green's (other bytes) put on node 2 and read on node 1.
        key, ours, theirs = os.urandom(16), os.urandom(1 << 16), os.urandom(1 << 16)
        assert blue[0].put(key, ours) and green[2].put(key, theirs)
        for c in (blue[1], blue[2], green[1]):
            wait_until(lambda c=c: c.lookup_tiers([key]) == ["peer"], "the directories")
            assert c.get(key) is not None
        assert [c.lookup_tiers([key]) for c in blue] == [["dram"]] * 3
        # A DELETE with `local` takes this node's copy only (as an eviction would).
        assert blue[2].delete(key, local=True)
        wait_until(lambda: blue[2].lookup_tiers([key]) == ["peer"], "node 0's copy, listed")
        assert blue[2].get(key) == ours
        # Blue deletes it on node 1 (which holds a copy it read): blue's copies on nodes 0
        # and 2 go too, and no node finds it in blue's space any more; green's stay.
        assert blue[1].delete(key)
        wait_until(lambda: [c.lookup_tiers([key]) for c in blue] == [[]] * 3,
                   "blue's copies to go on every node")
        assert all(c.get(key) is None for c in blue)
        assert green[1].get(key) == green[2].get(key) == theirs
        assert deletes(nodes[1], "sent", "ok") == 2
        assert deletes(nodes[0], "received", "ok") == deletes(nodes[2], "received", "ok") == 1
        # A node down when a DELETE is made: node 2 holds a copy of blue's `late`, and is
        # killed; node 0 deletes it meanwhile, then node 2 restarts with its arena (a warm
        # restart: the copy is back). Its peers deliver the DELETE as they reach it again,
        # before they take its inventory: neither ever lists the deleted copy.
        late = os.urandom(16)
        assert blue[0].put(late, ours)
        wait_until(lambda: blue[2].lookup_tiers([late]) == ["peer"], "node 2's directory")
        assert blue[2].get(late) == ours
        down = nodes[2]
        down.kill(signal.SIGKILL)
        wait_until(lambda: metric(nodes[0], "kvpool_peer_up") == 1, "node 0 to lose node 2")
        wait_until(lambda: metric(nodes[1], "kvpool_peer_up") == 1, "node 1 to lose node 2")
        assert blue[0].delete(late)
        assert blue[1].lookup_tiers([late]) == []
        pool_socket = down.socket_path
        down.socket_path = tenant_socket_path(pool_socket, "green")  # up when it answers
        down.start()
        down.socket_path = pool_socket
        wait_until(lambda: metric(nodes[0], "kvpool_peer_up") == 2, "node 0 following node 2")
        # Node 0 follows node 2 only once node 2 has taken the DELETE.
        assert deletes(down, "received", "ok") >= 1
        with KVPoolClient(tenant_socket_path(pool_socket, "blue")) as back:
            assert back.lookup_tiers([late]) == [] and back.get(late) is None
        wait_until(lambda: metric(nodes[1], "kvpool_peer_up") == 2, "node 1 following node 2")
        assert blue[0].lookup_tiers([late]) == blue[1].lookup_tiers([late]) == []
