"""LOOKUP of remote keys answered from shared memory (docs/client.md, "Local LOOKUP"): a
client with `local_lookup` on a node whose agent reads peers gets, without a round trip,
the answer its agent's socket gives, and stops counting a peer's keys as soon as the
agent does (the key deleted, the peer gone, the peer suspect)."""

from __future__ import annotations

import os
import random
import signal
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent import lookupkernel
from kvpool.agent.client import KVPoolClient

from .conftest import metric, wait_until
from .nodes import Network
from .test_peer_reads import seen_as, start


def test_a_local_lookup_of_remote_keys_answers_what_the_socket_does_until_the_peer_goes(
        net: Network, tmp_path: Path, secret: Path) -> None:
    assert lookupkernel.kernels() is not None  # compiled now: every answer below is its
    with ExitStack() as stack:
        (a, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False,
                                 prefetch=False)
        local = stack.enter_context(KVPoolClient(b.socket_path, local_lookup=True))
        remote = [os.urandom(16) for _ in range(40)]
        mine = [os.urandom(16) for _ in range(8)]
        absent = [os.urandom(16) for _ in range(4)]
        ca.put_many(remote, [os.urandom(4096)] * len(remote))
        cb.put_many(mine, [os.urandom(4096)] * len(mine))
        seen_as(cb, remote, ["peer"] * len(remote))
        # Prefixes of every mix of keys node 1 holds, node 0 holds, and none does, short
        # and long (128 keys), asked both ways: the same tiers, the local one answered
        # from shared memory alone (`lookup_nowait` never asks the socket).
        rnd = random.Random(1)
        pool = remote + mine
        cases = [remote, mine + remote, [remote[0], mine[0], remote[1]],
                 [remote[0], absent[0], remote[1]], absent[:1], [],
                 [rnd.choice(pool) for _ in range(128)],
                 [rnd.choice(pool) for _ in range(100)] + absent[:1] + remote[:27]]
        cases += [rnd.sample(pool, rnd.randrange(1, len(pool))) + rnd.sample(absent, 1)
                  for _ in range(20)]
        for keys in cases:
            asked = cb.lookup_tiers(keys)
            assert local.lookup_tiers(keys) == asked
            assert local.lookup_nowait(keys) == len(asked)
        assert local.lookup_tiers(mine + remote) == ["dram"] * 8 + ["peer"] * 40
        # One with peer keys is told to the agent at once, not with the client's next call
        # (the agent batches the peer reads that follow a key by it, and an engine's reads
        # come from other connections): its hits are counted with no other call made.
        hits = metric(b, "kvpool_tier_hits_total", tier="peer")
        assert local.lookup_nowait(remote) == len(remote)
        wait_until(lambda: metric(b, "kvpool_tier_hits_total", tier="peer") == hits + 40,
                   "the local LOOKUP told")
        # A key deleted in the pool stops counting.
        assert ca.delete(remote[0])
        wait_until(lambda: cb.lookup_tiers(remote[:2]) == [], "the delete on node 1")
        assert local.lookup_nowait(remote[:2]) == 0
        assert local.lookup_tiers(remote[1:3]) == ["peer", "peer"]
        # The peer gone (killed: its stream to node 1 ends): none of its keys counts, at
        # once (its entries' generation moves on), node 1's own still do.
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGKILL)
        wait_until(lambda: cb.lookup_tiers(remote[1:]) == [], "node 1 to drop the peer")
        assert local.lookup_nowait(remote[1:]) == 0
        assert local.lookup_nowait(mine + remote[1:]) == len(mine)
        assert local.lookup_tiers(mine + remote[1:]) == ["dram"] * len(mine)
