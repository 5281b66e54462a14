"""A batch's first chunk on its way before the rest of the batch is prepared, on both sides
(docs/cross-node.md, "Reads in batches"): the holder sends the first reply of a batch of
FETCHes before it takes the sources of the others, and the reading agent sends a client's
first FETCH, a batch of its own, before it reserves the extents of the rest of its batch,
where the peer has a second connection for them. Orders on real connections: a holder
whose second source cannot be opened until the test lets it still sends the first chunk;
a peer that holds its replies until it has seen every FETCH of the batch
sees them arrive on another connection (every second one on each of two more, where the
reader has them spare); and since a corrupt first chunk no longer shares a
connection with the rest of its batch, the rest, answered once the peer is suspect, is
dropped at its landing."""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvpool.agent import checksums
from kvpool.agent.client import KVPoolClient
from kvpool.agent.peers import wire
from kvpool.bench.local import LocalAgent
from kvpool.bench.scripted_peer import ScriptedPeer, chunk_reply, next_request, recv_exact

from ..agent.test_nvme import settle
from .conftest import metric, wait_until
from .nodes import Network, peer_agent, served_by
from .test_peer_reads import nvme_file, seen_as
from .test_peer_security import authenticated

KiB = 1 << 10


def read_reply(s: socket.socket) -> tuple[wire.ReplyHead, bytes]:
    """One FETCH reply: its head and its chunk bytes (none when ABSENT)."""
    head = wire.reply_head(recv_exact(s, wire.REPLY.size))
    recv_exact(s, head.meta_len + head.tenant_len)
    return head, recv_exact(s, head.size) if head.status == wire.OK else b""


def sends_batches(agent: LocalAgent) -> bool:
    """The agent's compiled send path is open: a batch of FETCHes goes through a batch
    sender (`_fetch_batch`), not a reply at a time."""
    return "peer replies are sent in batches by a compiled call" in agent.log()


def release(fifo: Path) -> bool:
    """Let an `open` of `fifo` for reading through (a writer opens it and closes it at
    once: the reader then finds no chunk file, and the chunk is answered ABSENT); False
    while nobody has it open for reading yet."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return False
        raise
    os.close(fd)
    return True


def test_the_first_reply_of_a_batch_leaves_before_the_holder_takes_the_other_sources(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        holder = stack.enter_context(peer_agent(net, 0, tmp_path / "node0", secret,
                                                dram="2Mi", prefetch=False, lru=True))
        ch = stack.enter_context(KVPoolClient(holder.socket_path))
        # 48 chunks through 2 MiB of DRAM: the oldest go down to NVMe files, the last
        # stays in DRAM.
        chunks = {os.urandom(16): os.urandom(64 * KiB) for _ in range(48)}
        for k, d in chunks.items():
            assert ch.put(k, d)
        settle(ch)
        keys = list(chunks)
        in_dram, on_nvme = keys[-1], keys[0]
        assert ch.lookup_tiers([in_dram]) == ["dram"]
        assert ch.lookup_tiers([on_nvme]) == ["nvme"]
        s = stack.enter_context(authenticated(net.nodes[0].addr, secret))
        # Until the holder's compiled send path is open, each FETCH is answered on its own.
        wait_until(lambda: sends_batches(holder), "the holder's send kernel")
        # The NVMe chunk's file becomes a FIFO: the holder's open of it, for the batch's
        # second source, waits until the test opens its other end.
        fifo = nvme_file(holder, on_nvme)
        fifo.unlink()
        os.mkfifo(fifo)
        stack.callback(lambda: release(fifo))  # never leave the holder's thread stuck
        s.sendall(wire.encode_request(wire.OP_FETCH, 1000, in_dram, "")
                  + wire.encode_request(wire.OP_FETCH, 1001, on_nvme, ""))
        # The first chunk arrives, whole, while the second source is not taken yet
        # (without the change the holder took both before sending either: this read
        # would wait until the socket's timeout).
        head, data = read_reply(s)
        assert (head.status, head.rid, data) == (wire.OK, 1000, chunks[in_dram])
        wait_until(lambda: release(fifo), "the holder's open of the second chunk's file")
        head, data = read_reply(s)
        assert (head.status, head.rid) == (wire.ABSENT, 1001)


class HoldingPeer(ScriptedPeer):
    """A peer that announces `chunks` and answers the FETCHes of each connection in order,
    but only once it has seen a FETCH of every chunk, on any connection (or `HOLD` seconds
    passed): it reads the requests a connection has sent before it waits, so no batch of
    reads ends before every FETCH came. `keys_on`: the keys FETCHed, per connection."""

    HOLD = 20.0

    def __init__(self, host: str, secret: bytes, chunks: dict[bytes, bytes]) -> None:
        self.chunks = chunks
        self.keys_on: list[list[bytes]] = []
        self.seen: set[bytes] = set()
        self.cond = threading.Condition()
        super().__init__(host, secret)

    def speak(self, conn: socket.socket) -> None:
        mine: list[bytes] = []
        owed: list[tuple[int, bytes]] = []
        for rid, key in self.fetches(conn, self.chunks):
            with self.cond:
                if not mine:
                    self.keys_on.append(mine)
                mine.append(key)
                self.seen.add(key)
                self.cond.notify_all()
            owed.append((rid, key))
            if select.select([conn], [], [], 0.05)[0]:
                continue  # a request more already in (a batch's FETCHes come in one write)
            with self.cond:
                self.cond.wait_for(lambda: self.seen >= set(self.chunks), self.HOLD)
            for r, k in owed:
                conn.sendall(chunk_reply(r, self.chunks[k]))
            owed.clear()


@pytest.mark.parametrize("connections", [2, 4])
def test_a_clients_first_fetch_goes_alone_before_the_rest_of_its_batch(
        net: Network, tmp_path: Path, secret: Path, connections: int) -> None:
    chunks = {os.urandom(16): os.urandom(32 * KiB) for _ in range(6)}
    keys = list(chunks)
    peer = HoldingPeer(net.host, secret.read_bytes().strip(), chunks)
    with ExitStack() as stack:
        _, client = served_by(stack, net, tmp_path / "node1", secret, peer,
                              connections=connections)
        seen_as(client, keys, ["peer"] * len(keys))
        assert client.get(keys[0]) == chunks[keys[0]]
        # The first FETCH went alone on one connection; the other five, sent while the
        # peer held its replies, together on the second one (without the change all
        # six went in one write on one connection); with two more connections spare,
        # every second one on each of them (docs/cross-node.md: their chunks land in
        # the batch's order; without that, all five on one).
        rest = [keys[1:]] if connections == 2 else [keys[2::2], keys[1::2]]
        assert sorted(peer.keys_on, key=len) == [[keys[0]], *rest]
        for k, d in chunks.items():
            assert client.get(k) == d


class CorruptFirstPeer(ScriptedPeer):
    """A peer that announces `chunks`, answers a FETCH of `first` with bytes that fail
    their checksum once another connection has asked for the rest (before it, a reader
    that took the corrupt reply first would ask nothing more of a suspect peer), and holds
    its replies on every other connection until the reader has closed the connection of
    that corrupt reply (it has the chunk checked by then, and the peer marked suspect)."""

    def __init__(self, host: str, secret: bytes, chunks: dict[bytes, bytes],
                 first: bytes) -> None:
        self.chunks, self.first = chunks, first
        self.asked = threading.Event()
        self.dropped = threading.Event()
        super().__init__(host, secret)

    def speak(self, conn: socket.socket) -> None:
        op, rid, key = next_request(conn)
        if op == wire.OP_SUBSCRIBE:
            self.stream_inventory(conn, {k: len(d) for k, d in self.chunks.items()})
            return
        while True:
            data = self.chunks[key]
            checksum = checksums.compute(checksums.XXH3, [data])
            if key == self.first:
                self.asked.wait(HoldingPeer.HOLD)
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            else:
                self.asked.set()
                self.dropped.wait(HoldingPeer.HOLD)
            conn.sendall(chunk_reply(rid, data, checksum))
            try:
                op, rid, key = next_request(conn)
            except ConnectionError:
                if key == self.first:
                    self.dropped.set()
                raise


def test_chunks_of_a_batch_that_land_after_its_first_failed_its_checksum_are_dropped(
        net: Network, tmp_path: Path, secret: Path) -> None:
    chunks = {os.urandom(16): os.urandom(32 * KiB) for _ in range(6)}
    keys = list(chunks)
    peer = CorruptFirstPeer(net.host, secret.read_bytes().strip(), chunks, keys[0])
    with ExitStack() as stack:
        agent, client = served_by(stack, net, tmp_path / "node1", secret, peer, connections=2)
        seen_as(client, keys, ["peer"] * len(keys))
        assert client.get(keys[0]) is None  # a miss: no shared tier behind
        # The other five, on the second connection, came in only once the peer was
        # suspect: each is dropped (a read error), none lands (without the check they
        # landed, verified against the checksums the suspect peer sent with them).
        wait_until(lambda: metric(agent, "kvpool_peer_requests_total", direction="read",
                                  result="error") == 5, "the rest of the batch dropped")
        assert peer.dropped.is_set()
        assert metric(agent, "kvpool_peer_requests_total", direction="read", result="ok") == 0
        assert metric(agent, "kvpool_peer_requests_total", direction="read",
                      result="corrupt") == 1
        assert client.stats()["tiers"]["dram"]["chunks"] == 0
