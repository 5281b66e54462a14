"""ACQUIREs of chunks a peer read is bringing, held by the connection until each chunk lands
and answered from the landing, the requests after them answered in turn (`Connection._hold`;
docs/cross-node.md, "Reads in batches"). On a real agent with a scripted peer whose replies
the test lets go one by one: the replies keep the requests' order, whatever answers them
(a held ACQUIRE's landing, a quick RELEASE, the task's LOOKUP); a held ACQUIRE whose chunk
fails its checksum is a miss, the requests after it answered still; and a client gone
while its ACQUIRE is held leaves no lease behind."""

from __future__ import annotations

import os
import socket
import threading
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent import checksums
from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.scripted_peer import ScriptedPeer, chunk_reply

from ..agent.conftest import RawConn
from .conftest import wait_until
from .nodes import Network, served_by
from .test_peer_reads import seen_as

KiB = 1 << 10


class GatedPeer(ScriptedPeer):
    """A peer that announces `chunks` and answers each FETCH in order on its connection,
    the reply to a key of `gates` only once its event is set; a key of `corrupt` with a
    checksum its bytes fail."""

    def __init__(self, host: str, secret: bytes, chunks: dict[bytes, bytes],
                 gated: list[bytes], corrupt: frozenset[bytes] = frozenset()) -> None:
        self.chunks, self.corrupt = chunks, corrupt
        self.gates = {k: threading.Event() for k in gated}
        super().__init__(host, secret)

    def speak(self, conn: socket.socket) -> None:
        for rid, key in self.fetches(conn, self.chunks):
            gate = self.gates.get(key)
            if gate is not None:
                gate.wait(30)
            data = self.chunks[key]
            bad = checksums.compute(checksums.XXH3, [data]) ^ 1 if key in self.corrupt else None
            conn.sendall(chunk_reply(rid, data, bad))


def scene(stack: ExitStack, net: Network, tmp_path: Path, secret: Path, gated: int,
          corrupt: frozenset[int] = frozenset(), **peers: str
          ) -> tuple[GatedPeer, list[bytes], KVPoolClient, RawConn]:
    """Four chunks of 64 KiB a scripted peer holds (the replies to the first `gated` held,
    `corrupt` ones failing their checksum), found in the peer tier by one LOOKUP (a read of
    the first reads the others in its batch), and a raw connection to the reading agent
    (`peers` added to its peers section)."""
    chunks = {os.urandom(16): os.urandom(64 * KiB) for _ in range(4)}
    keys = list(chunks)
    peer = GatedPeer(net.host, secret.read_bytes().strip(), chunks, keys[:gated],
                     frozenset(keys[i] for i in corrupt))
    agent, client = served_by(stack, net, tmp_path / "node1", secret, peer, **peers)
    seen_as(client, keys, ["peer"] * len(keys))
    raw = RawConn(agent.socket_path)
    stack.callback(raw.sock.close)
    return peer, keys, client, raw


def granted(reply: p.Reply, rid: int, data: bytes) -> int:
    """The lease of an ACQUIRE's reply that grants `data` (its size and checksum)."""
    assert isinstance(reply, p.AcquireReply), reply
    assert reply.rid == rid
    assert reply.size == len(data)
    assert reply.checksum == checksums.compute(checksums.XXH3, [data])
    return reply.lease


def test_held_acquires_and_the_requests_after_them_are_answered_in_order(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        peer, keys, client, raw = scene(stack, net, tmp_path, secret, gated=4)
        k0, k1, k2, k3 = keys
        data = peer.chunks
        # One write: the first ACQUIRE starts the batch; the second is held for its chunk,
        # a quick RELEASE and a LOOKUP (the task's) behind it, then a third held ACQUIRE.
        raw.send(b"".join(p.encode(r) for r in [
            p.Acquire(1, k0), p.Acquire(2, k1), p.Release(3, 999_999), p.Lookup(4, [k3]),
            p.Acquire(5, k2)]))
        peer.gates[k0].set()
        leases = [granted(raw.reply(), 1, data[k0])]
        peer.gates[k1].set()
        leases.append(granted(raw.reply(), 2, data[k1]))
        unknown = raw.reply()
        assert isinstance(unknown, p.ErrorReply) and unknown.rid == 3
        assert unknown.code == p.ErrorCode.UNKNOWN_LEASE
        lookup = raw.reply()
        assert isinstance(lookup, p.LookupReply) and lookup.rid == 4 and lookup.count == 1
        peer.gates[k2].set()
        leases.append(granted(raw.reply(), 5, data[k2]))
        # Frames that come while the connection waits: an ACQUIRE of a chunk still on its
        # way is held as it arrives, the ACQUIRE after it (of a chunk in DRAM) behind it.
        raw.send(p.encode(p.Acquire(6, k3)) + p.encode(p.Acquire(7, k0)))
        peer.gates[k3].set()
        leases.append(granted(raw.reply(), 6, data[k3]))
        leases.append(granted(raw.reply(), 7, data[k0]))
        for rid, lease in enumerate(leases, 10):
            assert isinstance(raw.call(p.Release(rid, lease)), p.ReleaseReply)
        assert client.stats()["leases"]["read"] == 0


def test_a_held_acquire_whose_chunk_fails_its_checksum_is_a_miss_and_those_after_it_answered(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        peer, keys, client, raw = scene(stack, net, tmp_path, secret, gated=2,
                                        corrupt=frozenset({1}))
        k0, k1, k2, _ = keys
        raw.send(b"".join(p.encode(r) for r in [
            p.Acquire(1, k0), p.Acquire(2, k1), p.Release(3, 999_999), p.Acquire(4, k2)]))
        peer.gates[k0].set()
        first = granted(raw.reply(), 1, peer.chunks[k0])
        peer.gates[k1].set()
        missed = raw.reply()
        assert isinstance(missed, p.ErrorReply) and missed.rid == 2
        assert missed.code == p.ErrorCode.NOT_FOUND
        unknown = raw.reply()
        assert isinstance(unknown, p.ErrorReply) and unknown.rid == 3
        third = raw.reply()
        # (the peer is suspect after the bad chunk: the rest of its batch may be dropped)
        assert isinstance(third, p.AcquireReply | p.ErrorReply) and third.rid == 4
        if isinstance(third, p.AcquireReply):
            granted(third, 4, peer.chunks[k2])
            assert isinstance(raw.call(p.Release(6, third.lease)), p.ReleaseReply)
        assert isinstance(raw.call(p.Release(5, first)), p.ReleaseReply)
        assert client.stats()["leases"]["read"] == 0
        assert client.get(k1) is None


def test_a_client_gone_while_its_acquire_is_held_leaves_no_lease_behind(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """Its connection ends at once, its leases with it, not once the held chunk's read
    settles (a peer read's timeout later: a minute here); the read lands all the same."""
    with ExitStack() as stack:
        peer, keys, client, raw = scene(stack, net, tmp_path, secret, gated=2,
                                        timeout="60s")
        k0, k1, _, _ = keys
        raw.send(p.encode(p.Acquire(1, k0)) + p.encode(p.Acquire(2, k1)))
        peer.gates[k0].set()
        granted(raw.reply(), 1, peer.chunks[k0])
        assert client.stats()["leases"]["read"] == 1
        raw.sock.close()  # its ACQUIRE of k1 is held: the peer holds k1's reply back
        wait_until(lambda: client.stats()["leases"]["read"] == 0,
                   "the gone client's lease on k0 released")
        peer.gates[k1].set()
        wait_until(lambda: client.lookup_tiers([k1]) == ["dram"], "k1 landed")
        assert client.stats()["leases"]["read"] == 0
        assert client.get(k1) == peer.chunks[k1]
