"""Pipelined peer reads: a read takes the peer chunks that follow it in its LOOKUP in the
same batch, and a batch's FETCHes go out together on one connection, its replies read in
order (docs/cross-node.md, "Reads in batches")."""

from __future__ import annotations

import os
import signal
import socket
import time
from contextlib import ExitStack, suppress
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.agent.peers import wire
from kvpool.bench.local import LocalAgent
from kvpool.bench.scripted_peer import ScriptedPeer, chunk_reply, next_request, recv_exact

from .conftest import metric, wait_until
from .nodes import Network, served_by
from .test_peer_reads import seen_as, start
from .test_peer_security import authenticated


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
    holds back its replies to a burst of requests (FETCHes, answered with the chunk; PUSH
    offers, answered `held`) until `batch` of them have arrived on the connection (or a few
    seconds pass): a side that waited for each reply before sending its next request would
    get its first reply only after that wait. `before_first_reply` says, per burst, its op
    and how many requests had come."""

    def __init__(self, host: str, secret: bytes, chunks: dict[bytes, bytes], batch: int) -> None:
        self.chunks, self.batch = chunks, batch
        self.before_first_reply: list[tuple[int, int]] = []
        super().__init__(host, secret)

    def speak(self, conn: socket.socket) -> None:
        while True:
            first = self._request(conn)
            if first[0] == wire.OP_SUBSCRIBE:
                self.stream_inventory(conn, {k: len(d) for k, d in self.chunks.items()})
                return
            pending = [first]
            conn.settimeout(5)
            with suppress(TimeoutError):
                while len(pending) < self.batch:
                    pending.append(self._request(conn))
            conn.settimeout(None)
            self.before_first_reply.append((first[0], len(pending)))
            for op, rid, key in pending:
                if op == wire.OP_PUSH:
                    conn.sendall(wire.encode_push_reply(wire.PUSH_HELD, rid))
                    continue
                conn.sendall(chunk_reply(rid, self.chunks[key]))

    @staticmethod
    def _request(conn: socket.socket) -> tuple[int, int, bytes]:
        op, rid, key = next_request(conn)
        if op == wire.OP_PUSH:
            recv_exact(conn, wire.PUSH.size)
        return op, rid, key


def test_a_batch_goes_out_in_one_write_and_its_replies_are_read_in_order(
        net: Network, tmp_path: Path, secret: Path) -> None:
    chunks = {os.urandom(16): os.urandom(32 << 10) for _ in range(6)}
    keys = list(chunks)
    peer = HoldingPeer(net.host, secret.read_bytes().strip(), chunks, batch=len(keys))
    with ExitStack() as stack:
        agent, client = served_by(stack, net, tmp_path / "node1", secret, peer, connections=1)
        seen_as(client, keys, ["peer"] * len(keys))
        assert client.get(keys[0]) == chunks[keys[0]]
        # Every FETCH of the batch was in before the peer's first reply.
        assert peer.before_first_reply == [(wire.OP_FETCH, len(keys))]
        for k, d in chunks.items():
            assert client.get(k) == d
        assert metric(agent, "kvpool_peer_requests_total", direction="read",
                      result="ok") == len(keys)


def test_a_windows_pushes_go_out_in_one_batch_and_a_batch_of_offers_is_read_in_one(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """Hand-offs in batches (docs/cross-node.md#hand-off): the pushes of one put_many go to
    the node it names as one write of PUSH offers, and a receiver given a batch of offers
    reads their chunks from the sender as one pipelined batch of FETCHes."""
    pushed = {os.urandom(16): os.urandom(32 << 10) for _ in range(6)}
    peer = HoldingPeer(net.host, secret.read_bytes().strip(), pushed, batch=len(pushed))
    with ExitStack() as stack:
        agent, client = served_by(stack, net, tmp_path / "node1", secret, peer)
        wait_until(lambda: metric(agent, "kvpool_peer_up") == 1, "the scripted peer followed")
        # The agent as the sender: every offer of the window was in before the receiver's
        # first answer (one worker offering a chunk at a time got its answer after the
        # receiver's wait, with one offer in).
        keys = [os.urandom(16) for _ in range(6)]
        assert client.put_many(keys, [os.urandom(16 << 10) for _ in keys],
                               to=f"{net.host}:{peer.port}") == [True] * 6
        wait_until(lambda: metric(agent, "kvpool_peer_pushes_total", direction="sent",
                                  result="held") == 6, "the six offers answered")
        assert peer.before_first_reply == [(wire.OP_PUSH, 6)]
        # The agent as the receiver: six offers in one write from the peer it follows; it
        # takes them together, its FETCHes all reach the sender before the first reply, and
        # it answers each, in order, once its chunk is stored and pinned.
        with authenticated(net.nodes[1].addr, secret, peer.agent_id) as s:
            s.sendall(b"".join(wire.encode_request(wire.OP_PUSH, rid, k, "")
                               + wire.PUSH.pack(len(d))
                               for rid, (k, d) in enumerate(pushed.items(), 1)))
            for rid in range(1, len(pushed) + 1):
                status, mlen, got = wire.push_reply_head(
                    recv_exact(s, wire.PUSH_REPLY.size))
                assert (status, got, recv_exact(s, mlen)) == (wire.PUSH_STORED, rid, b"")
        assert peer.before_first_reply[1:] == [(wire.OP_FETCH, 6)]
        assert client.lookup_tiers(list(pushed)) == ["dram"] * 6
        for k, d in pushed.items():
            assert client.get(k) == d
        assert metric(agent, "kvpool_peer_handoff_pins_total", end="read") == 6


def _run_served_by_a_scripted_peer(stack: ExitStack, net: Network, tmp_path: Path,
                                   secret: Path, chunks: dict[bytes, bytes]
                                   ) -> tuple[LocalAgent, KVPoolClient]:
    """One agent (its DRAM the default 32 MiB, no prefetch: only the client's reads read)
    whose only peer is a scripted one holding `chunks` and answering each FETCH at once;
    the client's LOOKUP of the run has found them all in the peer tier."""
    peer = HoldingPeer(net.host, secret.read_bytes().strip(), chunks, batch=1)
    agent, client = served_by(stack, net, tmp_path / "node1", secret, peer)
    seen_as(client, list(chunks), ["peer"] * len(chunks))
    return agent, client


def test_a_run_longer_than_a_batch_is_read_ahead_batch_after_batch(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """Peer reads pipelined across batches (docs/cross-node.md, "Reads in batches"): a
    client's read of a run's first chunk takes the batch after it too, and each batch's
    first chunk landing sends the next: the client's one read brings the whole run of 100
    (four batches of at most 32), where the batch alone brought 32."""
    chunks = {os.urandom(16): os.urandom(4 << 10) for _ in range(100)}
    keys = list(chunks)
    with ExitStack() as stack:
        agent, client = _run_served_by_a_scripted_peer(stack, net, tmp_path, secret, chunks)
        assert client.get(keys[0]) == chunks[keys[0]]
        wait_until(lambda: metric(agent, "kvpool_peer_requests_total", direction="read",
                                  result="ok") == len(keys), "the run read ahead")
        assert client.lookup_tiers(keys) == ["dram"] * len(keys)
        for k, d in chunks.items():  # verified on arrival, and the bytes the peer holds
            assert client.get(k) == d
        assert metric(agent, "kvpool_peer_requests_total", direction="read",
                      result="ok") == len(keys)


def test_a_read_ahead_evicts_nothing_and_stops_where_dram_is_full(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """What a client has not asked for yet goes only into free room below DRAM's high
    watermark: a run of 50 MiB (512 KiB chunks) into 32 MiB of DRAM. The client's read
    of the first chunk takes its batch (16 MiB, room made as any read's); the batch read
    ahead stops where the watermark is, the chain with it; nothing is evicted for it.
    The client's own reads then bring the rest, every byte checked."""
    chunks = {os.urandom(16): os.urandom(512 << 10) for _ in range(100)}
    keys = list(chunks)
    with ExitStack() as stack:
        agent, client = _run_served_by_a_scripted_peer(stack, net, tmp_path, secret, chunks)

        def read_ok() -> float:
            return metric(agent, "kvpool_peer_requests_total", direction="read", result="ok")

        assert client.get(keys[0]) == chunks[keys[0]]
        wait_until(lambda: read_ok() > 32, "the next batch read ahead")
        wait_until(lambda: read_ok() == client.stats()["tiers"]["dram"]["chunks"],
                   "the reads under way landed")
        time.sleep(0.5)  # (a read ahead past the watermark would be in by now)
        held = client.stats()["tiers"]["dram"]["chunks"]
        assert 32 < held < 64 and read_ok() == held
        assert held * (512 << 10) <= 0.98 * (32 << 20)
        assert metric(agent, "kvpool_tier_evictions_total") == 0
        for k, d in chunks.items():
            assert client.get(k) == d
        assert read_ok() == len(keys)


def test_a_window_of_peer_chunks_larger_than_dram_gets_each_its_own_bytes(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """A window of 64 ACQUIREs of 512 KiB peer chunks (32 MiB) into 32 MiB of DRAM: as
    chunks land past the high watermark, the watermark evicts some before the ACQUIRE
    that waited for them takes its lease, and other reads reuse their extents. Each read
    then leases the chunk DRAM holds for its key (read again if it went), never the one
    evicted: every chunk read is its own key's bytes (before, some of these reads got a
    neighbour's chunk, bytes and checksum both: the client's check could not tell)."""
    chunks = {os.urandom(16): os.urandom(512 << 10) for _ in range(64)}
    keys = list(chunks)
    data = list(chunks.values())
    with ExitStack() as stack:
        _, client = _run_served_by_a_scripted_peer(stack, net, tmp_path, secret, chunks)
        bufs = [bytearray(512 << 10) for _ in keys]
        got = client.get_many_into(keys, lambda i, n, meta: bufs[i])
        assert [i for i in range(len(keys)) if got[i] and bufs[i] != data[i]] == []
        assert got.count(len(data[0])) > 32  # (most of them read: the case is exercised)


def test_a_windows_chunk_is_copied_while_a_later_one_is_still_read_from_a_peer(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """A window's replies are not held back for a chunk read from below: the agent sends
    the replies it holds before an ACQUIRE that waits for a peer, and the client copies
    the chunks it has while the next is read. Here the peer is stopped until the client
    copies the window's first chunk (its target resumes the peer); were that copy made
    only once the peer's chunk is in, the peer's read would run out its timeout first and
    the chunk would be a miss."""
    with ExitStack() as stack:
        (a, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False,
                                 prefetch=False, timeout="5s")
        mine, theirs = os.urandom(16), os.urandom(16)
        data = {mine: os.urandom(256 << 10), theirs: os.urandom(512 << 10)}
        assert cb.put(mine, data[mine]) and ca.put(theirs, data[theirs])
        seen_as(cb, [mine, theirs], ["dram", "peer"])
        assert a.proc is not None
        bufs = [bytearray(len(data[k])) for k in (mine, theirs)]
        copied: list[int] = []

        def target(i: int, size: int, meta: bytes) -> bytearray:
            if i == 0:  # the first chunk's copy: the peer answers from now on
                os.kill(a.proc.pid, signal.SIGCONT)
            copied.append(i)
            return bufs[i]

        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            got = cb.get_many_into([mine, theirs], target)
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        assert got == [len(data[mine]), len(data[theirs])]
        assert bufs == [data[mine], data[theirs]]
        assert copied == [0, 1]
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="timeout") == 0


def test_the_chunks_of_a_batch_read_from_a_peer_are_journaled_and_back_after_a_restart(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """The chunks a drain of read results brings land together, journaled in one write
    (`PeerReads._land`): a warm restart of the reader (SIGKILL) finds each of them in its
    own DRAM again, its bytes whole, with the peer that served them gone."""
    with ExitStack() as stack:
        (a, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False,
                                 prefetch=False, extra={"connections": 1})
        chunks = {os.urandom(16): os.urandom(64 << 10) for _ in range(16)}
        keys = list(chunks)
        for k, d in chunks.items():
            assert ca.put(k, d)
        seen_as(cb, keys, ["peer"] * 16)
        assert cb.get(keys[0]) == chunks[keys[0]]
        wait_until(lambda: cb.lookup_tiers(keys) == ["dram"] * 16, "the batch's chunks")
        cb.close()
        b.kill()  # SIGKILL: only the journal speaks for them
        a.kill()  # nothing can be read from the peer any more
        b.start()
        with KVPoolClient(b.socket_path) as again:
            assert again.lookup_tiers(keys) == ["dram"] * 16
            for k, d in chunks.items():
                assert again.get(k) == d
