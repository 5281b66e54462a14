"""A peer directory that is full (`peers.maxEntries`, which the operator sets to the pool's
`spec.peers.remoteChunks`, what the agent's memory is sized for) lists no new remote chunk:
a LOOKUP of one goes on past the peer tier, and each is counted."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

from .conftest import metric, wait_until
from .nodes import Network
from .test_peer_reads import start


def test_a_full_directory_lists_no_more_remote_chunks_and_counts_them(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        (_, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False,
                                 extra={"maxEntries": 4})
        keys = [os.urandom(16) for _ in range(6)]
        for k in keys:
            assert ca.put(k, os.urandom(4096))
        wait_until(lambda: metric(b, "kvpool_peer_directory_full_total") == 2,
                   "two announcements past the directory's room")
        assert cb.stats()["tiers"]["peer"]["chunks"] == 4
        assert metric(b, "kvpool_peer_directory_entries") == 4
        assert metric(b, "kvpool_peer_directory_capacity_entries") == 4  # the cap, as a gauge
        tiers = [(cb.lookup_tiers([k]) or ["none"])[0] for k in keys]
        assert sorted(tiers) == ["none", "none", "peer", "peer", "peer", "peer"]
        # Room comes back as a listed chunk goes: the next one announced is listed.
        listed = [k for k, t in zip(keys, tiers, strict=True) if t == "peer"]
        assert ca.delete(listed[0])
        new = os.urandom(16)
        assert ca.put(new, os.urandom(4096))
        wait_until(lambda: cb.lookup_tiers([new]) == ["peer"], "the new chunk listed")
        assert cb.stats()["tiers"]["peer"]["chunks"] == 4
        assert metric(b, "kvpool_peer_directory_full_total") == 2
        assert ca.get(new) is not None and cb.get(new) is not None  # read through the tier
