"""The peer directory: who holds which remote chunk, in flat arrays of bounded size."""

from __future__ import annotations

import os
import random
import tracemalloc

import pytest

from kvpool.agent import probekernel
from kvpool.agent.constants import PEER_TIER_CODE
from kvpool.agent.keytable import homes
from kvpool.agent.peers.directory import PeerDirectory

REMOTE_CHUNKS = 300_000
"""Enough for the table's cells to cycle through a rebuild at the load it then has (a
quarter to a half full: what the per-chunk cost swings between, at any count); the same
measurement at 10^6 chunks (41 B per chunk) takes a minute under tracemalloc, too long
for every CI run: docs/cross-node.md, "Directory", gives the command."""


def test_a_remote_chunk_costs_under_64_bytes_of_heap() -> None:
    keys = os.urandom(16 * REMOTE_CHUNKS)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        d = PeerDirectory()
        for i in range(REMOTE_CHUNKS):
            d.add(keys[16 * i : 16 * i + 16], i % 7, 1 << 20)
        per_chunk = (tracemalloc.get_traced_memory()[0] - before) / REMOTE_CHUNKS
    finally:
        tracemalloc.stop()
    assert len(d) == REMOTE_CHUNKS
    assert per_chunk < 64, f"{per_chunk:.1f} B of heap per remote chunk"
    assert d.holder(keys[16 * 12345 : 16 * 12346]) == (12345 % 7, 1 << 20)


def test_a_key_is_credited_to_its_last_announcer_and_a_peer_drops_only_its_own() -> None:
    d = PeerDirectory()
    k1, k2, k3 = (os.urandom(16) for _ in range(3))
    d.add(k1, 0, 100)
    d.add(k2, 0, 200)
    d.add(k3, 1, 300)
    d.add(k1, 1, 100)  # peer 1 holds k1 too now: it is read from there
    assert d.holder(k1) == (1, 100)
    d.remove(k1, 0)  # peer 0 lost its copy: peer 1's entry stays
    assert d.holder(k1) == (1, 100)
    assert d.drop_peer(0) == 1 and k2 not in d
    assert d.holder(k3) == (1, 300) and len(d) == 2
    d.remove(k3, 1)
    assert d.holder(k3) is None
    d.add(k3, 2, 0)  # nothing to reserve: never an entry
    assert k3 not in d


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_lookups_keys_are_coded_at_once_as_each_holder_says(compiled: bool) -> None:
    # LOOKUP's view of its keys past the local prefix, in one call: a local key is local
    # (2), a key held by a peer that may be read is the peer tier's, anything else (no
    # entry, a peer not readable, a peer this agent has no link for) ends the prefix (0).
    assert probekernel.kernels() is not None
    rnd = random.Random(29)
    d = PeerDirectory()
    keys = [rnd.randbytes(16) for _ in range(3000)]
    for i, k in enumerate(keys):
        d.add(k, i % 6, 4096)
    for k in keys[::5]:
        d.remove(k, keys.index(k) % 6)
    d.drop_peer(3)
    readable = bytes([1, 0, 1, 1, 1])  # peer 1 suspect, peer 5 unknown to the links
    for _ in range(20):
        asked = rnd.sample(keys, 100) + [rnd.randbytes(16) for _ in range(28)]
        local = bytes(rnd.random() < 0.1 for _ in asked)
        want = []
        for k, here in zip(asked, local, strict=True):
            held = d.holder(k)
            ok = held is not None and held[0] < len(readable) and readable[held[0]]
            want.append(2 if here else PEER_TIER_CODE if ok else 0)
        got = d.codes(asked, b"".join(asked), homes(asked), readable, local, PEER_TIER_CODE,
                      compiled)
        assert list(got) == want


def test_a_key_deleted_in_the_pool_is_not_listed_again_for_a_while() -> None:
    """An ADD of a deleted key still on its way from a holder that has not taken the DELETE
    yet must not list it again (a read of that copy would bring the deleted chunk back)."""
    d = PeerDirectory()
    k1, k2 = os.urandom(16), os.urandom(16)
    d.add(k1, 0, 100)
    d.forget(k1)
    assert k1 not in d
    d.add(k1, 1, 100)  # announced after the DELETE: ignored
    d.add(k2, 1, 100)
    assert k1 not in d and d.holder(k2) == (1, 100)
    brief = PeerDirectory(forget_for=0.0)  # past the while: announced again, listed
    brief.forget(k1)
    brief.add(k1, 1, 100)
    assert brief.holder(k1) == (1, 100)
