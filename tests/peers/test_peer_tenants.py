"""Tenants across nodes: a peer serves a key only into the same tenant's space, and a DELETE
reaches every copy of the key in its tenant's space across the pool (every node that holds
it there deletes it; another tenant's copy of the same key stays; a node down when the
DELETE was made gets it when it is back, before any agent reads its inventory again:
docs/cross-node.md#delete)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import tenant_socket_path
from kvpool.bench.local import LocalAgent

from .conftest import metric, wait_until
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


def deletes(agent: LocalAgent, direction: str, result: str) -> float:
    return metric(agent, "kvpool_peer_deletes_total", direction=direction, result=result)


def test_a_key_is_served_and_deleted_only_in_its_tenants_space_across_the_pool(
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
        # A peer serves a key only into the same tenant's space: blue's chunk on node 0 is
        # in blue's directory on node 1, not green's, and a copy read into blue's space is
        # blue's too.
        key, ours, theirs = os.urandom(16), os.urandom(1 << 16), os.urandom(1 << 16)
        assert blue[0].put(key, ours)
        wait_until(lambda: blue[1].lookup_tiers([key]) == ["peer"], "blue's directory on node 1")
        assert green[1].lookup_tiers([key]) == [] and green[1].get(key) is None
        # Each tenant's shared-memory tables are its own: blue's clients answer the key
        # from them without a round trip (in the peer tier, or in DRAM once its LOOKUP
        # prefetched it), green's find it in neither.
        blue_local = stack.enter_context(KVPoolClient(
            tenant_socket_path(nodes[1].socket_path, "blue"), local_lookup=True))
        green_local = stack.enter_context(KVPoolClient(
            tenant_socket_path(nodes[1].socket_path, "green"), local_lookup=True))
        assert len(blue_local.lookup_tiers([key])) == 1 and green_local.lookup_tiers([key]) == []
        assert blue_local.lookup_nowait([key]) == 1 and green_local.lookup_nowait([key]) == 0
        assert blue[1].get(key) == ours
        assert green[1].get(key) is None
        # The same key in green's space (other bytes) put on node 2 and read on node 1;
        # blue's read on node 2 too (a copy on every node).
        assert green[2].put(key, theirs)
        for c in (blue[2], green[1]):
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
        wait_until(lambda: deletes(nodes[1], "sent", "ok") == 2, "node 1 to read the answers")
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
        wait_until(lambda: blue[1].lookup_tiers([late]) == [], "node 1 to take the DELETE")
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
