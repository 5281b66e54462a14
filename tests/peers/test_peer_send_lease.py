"""A chunk served to a peer keeps its read lease until the peer acknowledged its bytes:
`sendfile` queues references to the arena's pages, so a DELETE and puts that reuse the
extent while the bytes wait in the holder's send queue must not change what the peer
receives. A peer on the holder's own kernel is handed the pages themselves, acknowledged
before it reads them: it gets the arena's bytes by copy."""

from __future__ import annotations

import os
import socket
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvpool.agent import checksums
from kvpool.agent.client import KVPoolClient
from kvpool.agent.peers import auth, wire
from kvpool.agent.peers.server import FETCH_BATCH_BYTES, ChunkSource

from .conftest import metric, wait_until
from .nodes import Network, in_ns
from .test_peer_reads import start
from .test_peer_security import authenticated

KiB = 1 << 10


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        more = s.recv(n - len(out))
        assert more, "the holder closed the connection mid-reply"
        out += more
    return out


def reply_after_rewrite(client: KVPoolClient, s: socket.socket, key: bytes, rid: int,
                        size: int) -> tuple[wire.ReplyHead, bytes, bytes]:
    """`key` deleted and a 2 MiB arena's worth of other chunks of `size` put (its extent
    rewritten), then the reply to FETCH `rid` of it read from `s`: (its head, its bytes, its
    metadata), the head an OK of `size` bytes."""
    assert client.delete(key)
    for _ in range(2 * (2 << 20) // size):
        assert client.put(os.urandom(16), os.urandom(size))
    head = wire.reply_head(recv_exact(s, wire.REPLY.size))
    assert (head.status, head.rid, head.size) == (wire.OK, rid, size)
    meta = recv_exact(s, head.meta_len)
    recv_exact(s, head.tenant_len)
    return head, recv_exact(s, size), meta


def test_a_chunk_deleted_and_its_extent_rewritten_while_its_bytes_wait_reaches_the_peer_whole(
        net: Network, tmp_path: Path, secret: Path) -> None:
    # The holder's sockets start with a 1 MiB send buffer (its listener's, which accepted
    # connections inherit): the whole reply goes into the send queue at once.
    in_ns(net.nodes[0], "sysctl", "-qw", "net.ipv4.tcp_wmem=4096 1048576 4194304")
    with ExitStack() as stack:
        ((a, ca),) = start(stack, net, tmp_path, secret, n=1, nvme=False, dram="2Mi",
                           prefetch=False)
        size = 32 * KiB
        # The arena full of chunks, K the last one in.
        for _ in range(2 * (2 << 20) // size):
            assert ca.put(os.urandom(16), os.urandom(size))
        stalled = os.urandom(16)
        assert ca.put(stalled, os.urandom(size))
        key, data, meta = os.urandom(16), os.urandom(size), b"k-meta"
        assert ca.put(key, data, meta)
        # A peer that asks for a chunk and never reads: after the bound its connection is
        # reset (which drops the holder's queued references to the pages), then the lease
        # ends.
        stuck = stack.enter_context(authenticated(net.nodes[0].addr, secret, rcvbuf=2 * KiB))
        stuck.sendall(wire.encode_request(wire.OP_FETCH, 1, stalled, ""))
        wait_until(lambda: metric(a, "kvpool_peer_requests_total", direction="served",
                                  result="ok") == 1, "the holder to have sent the chunk")
        # A peer whose receive window is tiny: the reply waits in the holder's send queue.
        s = authenticated(net.nodes[0].addr, secret, rcvbuf=2 * KiB)
        with s:
            s.sendall(wire.encode_request(wire.OP_FETCH, 7, key, ""))
            wait_until(lambda: metric(a, "kvpool_peer_requests_total", direction="served",
                                      result="ok") == 2, "the holder to have sent the chunk")
            # Sent, not acknowledged: the leases hold the chunks' pages.
            assert ca.stats()["leases"]["read"] == 2
            head, got, got_meta = reply_after_rewrite(ca, s, key, 7, size)
            assert checksums.compute(head.kind, [got], got_meta) == head.checksum
            assert (got, got_meta) == (data, meta)
        wait_until(lambda: ca.stats()["leases"] == {"read": 1, "write": 0},
                   "K's lease to end once its bytes were acknowledged")
        wait_until(lambda: ca.stats()["leases"] == {"read": 0, "write": 0},
                   "the stalled reader's lease to end after the bound")
        with pytest.raises(ConnectionResetError):
            recv_exact(stuck, 64 * KiB)


def test_a_peer_on_the_holders_kernel_reads_its_bytes_whole_after_they_are_acknowledged(
        net: Network, tmp_path: Path, secret: Path) -> None:
    # Network namespaces share one kernel: a reply's bytes that the reader has not read
    # yet sit in its receive queue, acknowledged. Sent by reference, they would still be
    # the arena's pages, and the DELETE and puts below would rewrite them.
    with ExitStack() as stack:
        ((a, ca),) = start(stack, net, tmp_path, secret, n=1, nvme=False, dram="2Mi",
                           prefetch=False)
        size = 32 * KiB
        key, data, meta = os.urandom(16), os.urandom(size), b"k-meta"
        assert ca.put(key, data, meta)
        wait_until(lambda: "sent in batches by a compiled call" in a.log(),
                   "the send kernel to be compiled")
        with authenticated(net.nodes[0].addr, secret, my_id=auth.new_agent_id()) as s:
            s.sendall(wire.encode_request(wire.OP_FETCH, 3, key, ""))
            wait_until(lambda: metric(a, "kvpool_peer_requests_total", direction="served",
                                      result="ok") == 1, "the holder to have sent the chunk")
            # Copied into the socket: nothing of the arena is referenced, no lease held.
            assert ca.stats()["leases"]["read"] == 0
            _, got, got_meta = reply_after_rewrite(ca, s, key, 3, size)
            assert (got, got_meta) == (data, meta)


def test_a_peer_that_stops_reading_a_pipelined_batch_holds_about_a_batchs_bytes(
        net: Network, tmp_path: Path, secret: Path) -> None:
    # FETCHes pipelined in one write are answered as a batch (their chunks leased, then
    # sent by a worker); a batch holds at most FETCH_BATCH_BYTES of chunks (and the next
    # one's lease), not every chunk asked for, while its reader takes nothing.
    with ExitStack() as stack:
        ((a, ca),) = start(stack, net, tmp_path, secret, n=1, nvme=False, dram="96Mi",
                           prefetch=False)
        size = 4 << 20
        keys = [os.urandom(16) for _ in range(12)]
        for key in keys:
            assert ca.put(key, os.urandom(size))
        wait_until(lambda: "sent in batches by a compiled call" in a.log(),
                   "the send kernel to be compiled")
        stuck = stack.enter_context(authenticated(net.nodes[0].addr, secret, rcvbuf=2 * KiB))
        stuck.sendall(b"".join(wire.encode_request(wire.OP_FETCH, i, key, "")
                               for i, key in enumerate(keys)))
        held = (FETCH_BATCH_BYTES // size) + 1
        wait_until(lambda: ca.stats()["leases"]["read"] >= held, "the batch's leases")
        # The worker waits for room; the FETCHes after the batch are not leased meanwhile.
        time.sleep(0.5)
        assert ca.stats()["leases"]["read"] == held
        # The agent serves other peers meanwhile.
        with authenticated(net.nodes[0].addr, secret) as other:
            other.sendall(wire.encode_request(wire.OP_FETCH, 99, keys[-1], ""))
            head = wire.reply_head(recv_exact(other, wire.REPLY.size))
            assert (head.status, head.rid, head.size) == (wire.OK, 99, size)
            recv_exact(other, head.meta_len + head.tenant_len + size)


def test_a_source_copied_for_the_loops_way_ends_its_lease_and_keeps_its_bytes(
        tmp_path: Path) -> None:
    # The event loop's way of a reply (before the send kernel is compiled, or with every
    # worker busy) has no send from the mapping: a reader on this kernel gets a copy.
    arena = tmp_path / "arena"
    arena.write_bytes(os.urandom(64 * KiB))
    whole = arena.read_bytes()
    released: list[bool] = []

    def source(ranges: list[tuple[int, int]]) -> ChunkSource:
        size = sum(n for _, n in ranges)
        return ChunkSource(size, 7, 1, b"m", "t", os.open(arena, os.O_RDONLY), ranges,
                           lambda: released.append(True), address=1 << 30)

    split = source([(4 * KiB, 8 * KiB), (32 * KiB, 4 * KiB)])
    assert not split.copy_to(local=False)  # a reader on another kernel: by reference
    assert split.copy_to(local=True)
    got = split.copied()
    assert got.data == whole[4 * KiB:12 * KiB] + whole[32 * KiB:36 * KiB]
    assert (got.size, got.checksum, got.kind, got.meta, got.tenant) == (12 * KiB, 7, 1, b"m", "t")
    assert released == [True]
    with pytest.raises(OSError):
        os.fstat(split.fd)  # its descriptor closed
    os.truncate(arena, 40 * KiB)  # a client shrank the arena under the read
    cut = source([(36 * KiB, 8 * KiB)])
    with pytest.raises(ConnectionError, match="short"):
        cut.copied()
    assert released == [True, True]
