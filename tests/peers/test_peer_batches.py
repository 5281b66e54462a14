"""Pipelined peer reads: a read takes the peer chunks that follow it in its LOOKUP in the
same batch, and a batch's FETCHes go out together on one connection, its replies read in
order (docs/cross-node.md, "Reads in batches")."""

from __future__ import annotations

import os
import socket
import time
from contextlib import ExitStack, suppress
from pathlib import Path

from kvpool.agent import checksums
from kvpool.agent.client import KVPoolClient
from kvpool.agent.peers import wire
from kvpool.bench.scripted_peer import ScriptedPeer, recv_exact

from .conftest import metric, wait_until
from .nodes import Network, peer_agent
from .test_peer_reads import seen_as, start


def test_a_read_takes_the_peer_chunks_after_it_in_its_lookup_in_one_batch(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        # One connection to each peer, and no prefetch: only the test's read reads.
        (a, ca), (b, cb), _ = start(stack, net, tmp_path, secret, nvme=False, prefetch=False,
                                    extra={"connections": 1})
        chunks = {os.urandom(16): os.urandom(64 << 10) for _ in range(8)}
        keys = list(chunks)
        for k, d in chunks.items():
            assert ca.put(k, d)
        seen_as(cb, keys, ["peer"] * 8)
        assert cb.get(keys[0]) == chunks[keys[0]]
        # The first read brought the seven after it (what the client reads next; they
        # land after it, each as its reply is in)...
        wait_until(lambda: cb.lookup_tiers(keys) == ["dram"] * 8, "the batch's other chunks")
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="ok") == 8
        assert metric(a, "kvpool_peer_requests_total", direction="served", result="ok") == 8
        # ...verified, byte for byte, and they are local reads now.
        for k, d in chunks.items():
            assert cb.get(k) == d
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="ok") == 8


def test_a_lookups_prefetch_reads_only_its_lookahead_from_a_peer(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        # policy.prefetch on (the default): a LOOKUP loads its first lookaheadChunks (4)
        # ahead; a read's batch would take the rest of the prompt, a prefetch does not.
        (_, ca), (b, cb), _ = start(stack, net, tmp_path, secret, nvme=False,
                                    extra={"connections": 1})
        keys = [os.urandom(16) for _ in range(8)]
        for k in keys:
            assert ca.put(k, os.urandom(64 << 10))
        # One LOOKUP only (each LOOKUP prefetches the next four below DRAM).
        wait_until(lambda: cb.stats()["tiers"]["peer"]["chunks"] == 8, "the directory")
        assert cb.lookup_tiers(keys) == ["peer"] * 8
        wait_until(lambda: cb.stats()["tiers"]["dram"]["chunks"] == 4, "the prefetch")
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="ok") == 4
        assert cb.lookup_tiers(keys) == ["dram"] * 4 + ["peer"] * 4


class HoldingPeer(ScriptedPeer):
    """A peer that speaks the protocol, announces `chunks` and serves them from memory, but
    answers no FETCH until `batch` of them have arrived (or a few seconds pass): a reader
    that waited for each reply before sending the next request would get its first reply
    only after that wait, and `before_first_reply` says how many had come."""

    def __init__(self, host: str, secret: bytes, chunks: dict[bytes, bytes], batch: int) -> None:
        self.chunks, self.batch = chunks, batch
        self.before_first_reply: list[int] = []
        super().__init__(host, secret)

    def speak(self, conn: socket.socket) -> None:
        op, rid, tlen, key = wire.request_head(recv_exact(conn, wire.REQUEST.size))
        recv_exact(conn, tlen)
        if op == wire.OP_SUBSCRIBE:
            conn.sendall(wire.encode_stream(wire.BEGIN) + wire.encode_stream(
                wire.ADD, "", [(k, len(d)) for k, d in self.chunks.items()])
                + wire.encode_stream(wire.SYNCED))
            while not self.closed:
                time.sleep(0.2)
                conn.sendall(wire.encode_stream(wire.HEARTBEAT, sent_at=time.time()))
            return
        pending = [(rid, key)]
        conn.settimeout(5)
        with suppress(TimeoutError):
            while len(pending) < self.batch:
                _, rid, tlen, key = wire.request_head(recv_exact(conn, wire.REQUEST.size))
                recv_exact(conn, tlen)
                pending.append((rid, key))
        self.before_first_reply.append(len(pending))
        conn.settimeout(None)
        while True:
            for rid, key in pending:
                data = self.chunks[key]
                conn.sendall(wire.encode_reply(
                    wire.OK, rid, kind=checksums.XXH3, size=len(data),
                    checksum=checksums.compute(checksums.XXH3, [data])) + data)
            _, rid, tlen, key = wire.request_head(recv_exact(conn, wire.REQUEST.size))
            recv_exact(conn, tlen)
            pending = [(rid, key)]


def test_a_batch_goes_out_in_one_write_and_its_replies_are_read_in_order(
        net: Network, tmp_path: Path, secret: Path) -> None:
    chunks = {os.urandom(16): os.urandom(32 << 10) for _ in range(6)}
    keys = list(chunks)
    peer = HoldingPeer(net.host, secret.read_bytes().strip(), chunks, batch=len(keys))
    with ExitStack() as stack:
        stack.callback(peer.close)
        agent = stack.enter_context(peer_agent(
            net, 1, tmp_path / "node1", secret, nvme=False, prefetch=False,
            extra={"connections": 1, "addresses": [f"{net.host}:{peer.port}"]}))
        client = stack.enter_context(KVPoolClient(agent.socket_path))
        seen_as(client, keys, ["peer"] * len(keys))
        assert client.get(keys[0]) == chunks[keys[0]]
        # Every FETCH of the batch was in before the peer's first reply.
        assert peer.before_first_reply == [len(keys)]
        for k, d in chunks.items():
            assert client.get(k) == d
        assert metric(agent, "kvpool_peer_requests_total", direction="read",
                      result="ok") == len(keys)
