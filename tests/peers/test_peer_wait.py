"""WAIT: a client waits for peer chunks to land in DRAM and reads them without a lease
(docs/protocol.md, "Waiting for peer chunks"). On a real agent with a scripted peer whose
replies the test lets go one by one: a WAIT starts the reads of the keys a peer holds and
is answered once one has landed, the requests after it in order; a key whose read fails is
answered as not coming; and a lease-free client reads a window of a real peer's chunks
through WAITs, with their bytes, without an ACQUIRE or a lease."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient

from .conftest import metric, wait_until
from .nodes import Network
from .test_peer_held_acquire import GatedPeer, scene
from .test_peer_reads import seen_as, start

DRAM, PEER, NOT_COMING = 2, 5, 0


def fetched(peer: GatedPeer) -> list[bytes]:
    """The keys `peer` is asked for from now on, in the order its connections read them
    (each reads its next FETCH once it answered the one before)."""
    asked: list[bytes] = []
    fetches = peer.fetches

    def counted(conn: Any, chunks: Any) -> Any:
        for rid, key in fetches(conn, chunks):
            asked.append(key)
            yield rid, key
    peer.fetches = counted  # type: ignore[method-assign]
    return asked


def waited(reply: p.Reply, rid: int) -> list[int]:
    assert isinstance(reply, p.WaitReply), reply
    assert reply.rid == rid
    return list(reply.tiers)


def test_a_wait_is_answered_once_a_chunk_lands_and_the_requests_after_it_in_order(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        peer, keys, client, raw = scene(stack, net, tmp_path, secret, gated=4)
        k0, k1, k2, k3 = keys
        # Nothing read yet: the WAIT starts the batch (the four keys its LOOKUP found) and
        # is held; the LOOKUP behind it waits for its answer, which names the keys up to
        # the first still coming.
        raw.send(p.encode(p.Wait(1, keys)) + p.encode(p.Lookup(2, [k3])))
        peer.gates[k0].set()
        assert waited(raw.reply(), 1) == [DRAM, PEER]
        lookup = raw.reply()
        assert isinstance(lookup, p.LookupReply) and lookup.rid == 2 and lookup.count == 1
        # A WAIT with a key in DRAM before the first coming is answered at once; one whose
        # first key is still on its way is held until it lands.
        absent = os.urandom(16)
        assert waited(raw.call(p.Wait(3, [absent, k0, k1, k2])), 3) == [NOT_COMING, DRAM, PEER]
        raw.send(p.encode(p.Wait(4, [k1, k2, k3])) + p.encode(p.Release(5, 999_999)))
        peer.gates[k1].set()
        assert waited(raw.reply(), 4) == [DRAM, PEER]
        unknown = raw.reply()
        assert isinstance(unknown, p.ErrorReply) and unknown.rid == 5
        for k in (k2, k3):
            peer.gates[k].set()
        wait_until(lambda: client.lookup_tiers(keys) == ["dram"] * 4, "the batch landed")
        assert waited(raw.call(p.Wait(6, keys)), 6) == [DRAM] * 4
        # Keys no tier holds, and no keys: answered at once. WAIT opens no lease.
        assert waited(raw.call(p.Wait(7, [absent])), 7) == [NOT_COMING]
        assert waited(raw.call(p.Wait(8, [])), 8) == []
        assert client.stats()["leases"]["read"] == 0


def test_a_wait_reads_the_keys_after_its_first_in_its_batch_where_no_lookup_names_them(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """Keys asked in an order no LOOKUP gave (here the LOOKUP's, reversed): the batch a
    WAIT starts takes the keys after its first from the WAIT itself, not that key alone
    (each WAIT would then wait for one chunk's read: a round trip a chunk)."""
    with ExitStack() as stack:
        peer, keys, client, raw = scene(stack, net, tmp_path, secret, gated=4)
        asked = fetched(peer)
        backwards = keys[::-1]
        raw.send(p.encode(p.Wait(1, backwards)))
        # The batch's first read goes alone on one connection, the rest together on a
        # second: the peer is asked for the first two keys before it answers any.
        wait_until(lambda: len(asked) >= 2, "the batch's reads at the peer")
        assert asked[:2] == backwards[:2] or asked[:2] == backwards[1::-1]
        for gate in peer.gates.values():
            gate.set()
        assert waited(raw.reply(), 1)[0] == DRAM
        wait_until(lambda: client.lookup_tiers(keys) == ["dram"] * 4, "the batch landed")
        assert sorted(asked) == sorted(keys)  # one batch: each key asked for once


def test_a_wait_whose_chunk_fails_its_checksum_answers_it_as_not_coming(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        peer, keys, client, raw = scene(stack, net, tmp_path, secret, gated=1,
                                        corrupt=frozenset({0}))
        k0 = keys[0]
        raw.send(p.encode(p.Wait(1, [k0])))
        peer.gates[k0].set()
        assert waited(raw.reply(), 1) == [NOT_COMING]  # a miss, never its bytes
        assert client.get(k0) is None
        assert isinstance(raw.call(p.Wait(2, [])), p.WaitReply)  # the connection goes on


def test_a_wait_for_a_stopped_peer_is_answered_after_one_timeout_with_nothing_coming(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """The peer never answers: the WAIT's reads time out once (`peers.timeout`) and it is
    answered with no key coming; the reads it saw fail are not made again for it (each
    would cost another timeout), and the keys are misses after, never wrong bytes."""
    with ExitStack() as stack:
        peer, keys, client, raw = scene(stack, net, tmp_path, secret, gated=4, timeout="1s")
        asked = fetched(peer)
        assert waited(raw.call(p.Wait(1, keys)), 1) == [NOT_COMING] * 4
        # Each key asked of the peer once at most (the batch the WAIT started; the
        # peer reads a connection's next FETCH only once it answered the one before).
        assert asked and set(asked) <= set(keys) and len(asked) == len(set(asked))
        # The peer is slow meanwhile (5 s): a new WAIT does not read from it.
        assert waited(raw.call(p.Wait(2, keys)), 2) == [NOT_COMING] * 4
        assert len(asked) == len(set(asked))
        assert client.stats()["leases"]["read"] == 0
        for gate in peer.gates.values():
            gate.set()  # (the peer's threads end)


def test_a_lease_free_client_reads_a_window_of_peer_chunks_through_waits_without_a_lease(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        (_, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False,
                                 prefetch=False)
        reader = stack.enter_context(KVPoolClient(b.socket_path, lease_free=True))
        assert reader.hello is not None and reader.hello.peers
        keys = [os.urandom(16) for _ in range(40)]
        data = [os.urandom(64 << 10) for _ in keys]
        ca.put_many(keys, data)
        seen_as(cb, keys, ["peer"] * len(keys))
        acquires = metric(b, "kvpool_ops_total", op="acquire")
        bufs = [bytearray(64 << 10) for _ in keys]
        assert reader.lookup_tiers(keys) == ["peer"] * len(keys)
        assert reader.get_many_into(keys, lambda i, n, meta: bufs[i]) == [64 << 10] * 40
        assert bufs == data
        assert reader.reads_without_lease == len(keys)
        assert metric(b, "kvpool_ops_total", op="wait", result="ok") >= 1
        assert metric(b, "kvpool_ops_total", op="acquire") == acquires
        assert cb.stats()["leases"]["read"] == 0
        # The agent heard of the reads (READ, with the client's next call): each counted
        # as a DRAM read.
        reader.stats()
        wait_until(lambda: metric(b, "kvpool_tier_read_bytes_total", tier="dram")
                   >= 40 * (64 << 10), "the reads told")
        # A client without lease-free reads takes the same chunks under leases, as before.
        other = stack.enter_context(KVPoolClient(b.socket_path, lease_free=False))
        out = [bytearray(64 << 10) for _ in keys]
        assert other.get_many_into(keys, lambda i, n, meta: out[i]) == [64 << 10] * 40
        assert out == data and other.reads_without_lease == 0
        assert metric(b, "kvpool_ops_total", op="acquire") == acquires + len(keys)
