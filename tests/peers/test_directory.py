"""The peer directory: who holds which remote chunk, in flat arrays of bounded size."""

from __future__ import annotations

import os
import random
import time
import tracemalloc
from array import array

import pytest

from kvpool.agent import probekernel
from kvpool.agent.constants import PEER_TIER_CODE
from kvpool.agent.keytable import KeyTable, homes
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
    d.add(k1, 1, 100)  # announced after the DELETE by another holder: held off
    d.add(k2, 1, 100)
    assert k1 not in d and d.holder(k2) == (1, 100)
    brief = PeerDirectory(forget_for=0.0)  # past the while: announced again, listed
    brief.forget(k1)
    brief.add(k1, 1, 100)
    assert brief.holder(k1) == (1, 100)


def test_a_deleted_key_announced_again_is_listed_by_its_deleter_at_once_else_after_the_holdoff(
        ) -> None:
    """A key put again after a DELETE is never unlisted for good: the deleting peer's ADD
    (it took the DELETE before sending it) is listed at once, and its entry survives the
    DELETE that comes after it on the other connection; another holder's ADD is listed when
    the holdoff ends, unless that holder removed the key meanwhile (its ADD was of the
    deleted copy) or its entries were dropped (its next inventory says what it holds)."""
    d = PeerDirectory(forget_for=60.0)
    k1, k2, k3, k4 = (os.urandom(16) for _ in range(4))
    d.forget(k1, by=0)
    d.add(k1, 1, 100)  # another holder's: held off
    assert k1 not in d and d.holding == 1
    d.add(k1, 0, 200)  # the deleter's: listed at once
    assert d.holder(k1) == (0, 200)
    d.add(k2, 0, 100)
    d.forget(k2, by=0)  # its ADD came before its DELETE: the entry stays
    assert d.holder(k2) == (0, 100)
    d.forget(k2, by=1)  # another's DELETE takes it
    assert k2 not in d
    d.forget(k3)
    d.add(k3, 1, 300)
    d.remove(k3, 1)  # the ADD held off was of the copy it deleted
    d.forget(k4)
    d.add(k4, 2, 400)
    assert d.drop_peer(2) == 0 and d.holding == 1  # no entry; its ADD held off goes (k1 left)
    d.add(k4, 3, 500)
    assert d.holding == 2 and d.release() == 0  # not due yet
    assert d.release(time.monotonic() + 61.0) == 1 and d.holding == 0
    assert d.holder(k1) == (0, 200)  # the last announced stays credited
    assert k3 not in d and d.holder(k4) == (3, 500)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_the_directory_agrees_with_a_dict_through_drops_and_reannouncements(
        compiled: bool) -> None:
    # A peer's entries go in one pass over the table (compiled, or the walk in Python where
    # llvmlite is missing): every other entry stays as it was, the dropped slots are reused
    # by later keys, and a key of a dropped peer is never answered as that peer's, even
    # once the peer is back and announces again (only what it announces anew is its).
    assert probekernel.kernels() is not None
    rnd = random.Random(2911)
    d = PeerDirectory(forget_for=0.0)
    model: dict[bytes, tuple[int, int]] = {}
    keys = [rnd.randbytes(16) for _ in range(4000)]  # past a few of the table's rebuilds
    peers = range(6)
    dropped = 0
    for step in range(30_000):
        op = rnd.random()
        key = rnd.choice(keys)
        if op < 0.7:
            peer, size = rnd.choice(peers), rnd.randrange(1, 1 << 20)
            d.add(key, peer, size)
            model[key] = (peer, size)
        elif op < 0.9:
            peer = rnd.choice(peers)
            d.remove(key, peer)
            if model.get(key, (None,))[0] == peer:
                del model[key]
        elif op < 0.998:
            d.forget(key)
            model.pop(key, None)
        else:
            peer = rnd.choice(peers)
            want = [k for k, (p, _) in model.items() if p == peer]
            assert d.drop_peer(peer, compiled) == len(want)
            for k in want:
                del model[k]
            dropped += len(want)
        if step % 500 == 0 or op >= 0.998:
            assert len(d) == len(model)
            assert [d.count(p) for p in peers] == [
                sum(1 for p2, _ in model.values() if p2 == p) for p in peers]
            assert {k: d.holder(k) for k in keys} == {k: model.get(k) for k in keys}
    assert dropped > 1000  # the drops took out entries that were there
    readable = bytes([1] * len(peers))
    asked = keys[:128]
    got = d.codes(asked, b"".join(asked), homes(asked), readable, bytes(128),
                  PEER_TIER_CODE, compiled)
    assert list(got) == [PEER_TIER_CODE if k in model else 0 for k in asked]


def test_a_dropped_peer_back_again_holds_only_what_it_announces_anew() -> None:
    assert probekernel.kernels() is not None
    d = PeerDirectory()
    mine = [os.urandom(16) for _ in range(3000)]
    theirs = [os.urandom(16) for _ in range(3000)]
    for k in mine:
        d.add(k, 4, 100)
    for k in theirs:
        d.add(k, 1, 200)
    assert d.drop_peer(4) == 3000 and d.count(4) == 0 and len(d) == 3000
    assert d.drop_peer(4) == 0  # nothing of it left
    back = mine[::3]
    for k in back:  # its new inventory: the dropped slots are reused, by it and by others
        d.add(k, 4, 300)
    fresh = [os.urandom(16) for _ in range(1000)]
    for k in fresh:
        d.add(k, 2, 400)
    assert [d.holder(k) for k in mine] == [
        (4, 300) if i % 3 == 0 else None for i in range(len(mine))]
    assert all(d.holder(k) == (1, 200) for k in theirs)
    assert all(d.holder(k) == (2, 400) for k in fresh)
    assert (d.count(1), d.count(2), d.count(4)) == (3000, 1000, len(back))


def test_a_sweep_with_too_little_room_for_its_slots_still_takes_them_all() -> None:
    # `most` only sizes the first room made for the released slots: a pass that fills it
    # goes on, so a wrong bound can leave no entry of the value behind.
    assert probekernel.kernels() is not None
    table = KeyTable()
    column = array("H")
    for i in range(5000):
        table.add(os.urandom(16))
        column.append(i % 3)
    assert table.release_where(column, 1, most=10) == 1667
    assert len(table) == 5000 - 1667
    assert {column[s] for s in table.live_slots()} == {0, 2}
    reused = {table.claim(os.urandom(16)) for _ in range(1667)}
    assert reused == {s for s in range(5000) if column[s] == 1}  # released, handed out again


def test_a_full_directory_lists_no_new_key_but_keeps_those_it_has() -> None:
    # `peers.maxEntries`: what the agent's memory is sized for. Past it a new key is not
    # listed (and counted); a listed key may still change holder; room comes back as keys go.
    d = PeerDirectory(max_entries=3)
    k = [os.urandom(16) for _ in range(5)]
    for key in k[:4]:
        d.add(key, 0, 100)
    assert len(d) == 3 and k[3] not in d and d.refused == 1
    d.add(k[0], 1, 200)  # a new holder of a listed key: no new entry
    assert d.holder(k[0]) == (1, 200) and d.refused == 1
    d.remove(k[1], 0)
    d.add(k[4], 2, 300)
    assert d.holder(k[4]) == (2, 300) and len(d) == 3
    assert d.drop_peer(0) == 1  # k[2]
    d.add(k[3], 0, 100)
    assert d.holder(k[3]) == (0, 100) and d.refused == 1
