"""Only holders of the pool's secret exchange chunks: a connection that cannot prove it is
refused before anything else is read, counted and logged; fuzzed frames, before or after
the handshake, close the connection and leave the agent serving, with nothing leaked."""

from __future__ import annotations

import os
import random
import socket
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.peers import auth, wire
from kvpool.bench.local import LocalAgent

from .conftest import metric, wait_until
from .nodes import PEER_PORT, Network, peer_agent
from .test_peer_reads import seen_as, start


def recv_all(s: socket.socket) -> bytes:
    """What the server sends until it closes (bounded by the socket's timeout)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def authenticated(host: str, secret: Path, my_id: bytes | None = None,
                  rcvbuf: int | None = None) -> socket.socket:
    """A connection to the agent at `host` that proved the pool's secret as the agent whose
    id is `my_id` (by default a new one); `rcvbuf`: its receive buffer, set before it
    connects (the window it offers)."""
    s = socket.socket()
    s.settimeout(30)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, PEER_PORT))
    mine, my_id = auth.nonce(), my_id or os.urandom(16)
    s.sendall(auth.hello(my_id, mine))
    theirs = b""
    while len(theirs) < wire.HELLO.size + wire.PROOF_BYTES:
        theirs += s.recv(wire.HELLO.size + wire.PROOF_BYTES - len(theirs))
    server_id, server_nonce = auth.parse_hello(theirs[: wire.HELLO.size])
    key = auth.read_secret(secret)
    auth.check(auth.proof(key, b"server", mine, server_nonce, my_id, server_id),
               theirs[wire.HELLO.size :])
    s.sendall(auth.proof(key, b"client", mine, server_nonce, my_id, server_id))
    assert s.recv(1) == wire.ACCEPTED
    return s


def held_files_and_sockets_from(agent: LocalAgent, address: str) -> tuple[int, int]:
    """The agent's descriptors that are not sockets (chunk files, the arena...), and its
    TCP sockets whose other end is at `address`. (All its descriptors would also count its
    pool of connections to the other nodes, which may grow or be renewed meanwhile.)"""
    assert agent.proc is not None
    pid = agent.proc.pid
    inodes, files = set(), 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed while listed
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
        else:
            files += 1
    # /proc/PID/net/tcp is the table of the agent's own network namespace; addresses are
    # little-endian hex, as the kernel stores them.
    peer = socket.inet_aton(address)[::-1].hex().upper()
    with open(f"/proc/{pid}/net/tcp") as table:
        next(table)
        sockets = sum(1 for row in map(str.split, table)
                      if row[2].split(":")[0] == peer and row[9] in inodes)
    return files, sockets


def test_a_connection_without_the_pools_secret_is_refused_counted_and_logged(
        net: Network, tmp_path: Path, secret: Path) -> None:
    other = tmp_path / "other-secret"
    other.write_text(os.urandom(32).hex())
    with ExitStack() as stack:
        (a, ca), (_b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False)
        # Node 2 runs an agent of another pool secret.
        c = stack.enter_context(peer_agent(net, 2, tmp_path / "node2", other, nvme=False))
        from kvpool.agent.client import KVPoolClient
        cc = stack.enter_context(KVPoolClient(c.socket_path))
        key = os.urandom(16)
        assert ca.put(key, b"x" * 4096)
        seen_as(cb, [key], ["peer"])
        host = net.nodes[0].addr
        # Not a peer at all.
        with socket.create_connection((host, PEER_PORT), timeout=30) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(100))
            assert recv_all(s) == b""
        # A peer's HELLO, then a proof made with the wrong secret.
        with socket.create_connection((host, PEER_PORT), timeout=30) as s:
            mine, my_id = auth.nonce(), os.urandom(16)
            s.sendall(auth.hello(my_id, mine))
            theirs = s.recv(wire.HELLO.size + wire.PROOF_BYTES, socket.MSG_WAITALL)
            server_id, server_nonce = auth.parse_hello(theirs[: wire.HELLO.size])
            s.sendall(auth.proof(b"not the pool's secret", b"client", mine, server_nonce,
                                 my_id, server_id))
            s.sendall(wire.encode_request(wire.OP_FETCH, 1, key, ""))
            assert recv_all(s) == b""  # closed: no ACCEPTED, no chunk
        wait_until(lambda: metric(a, "kvpool_peer_auth_failures_total") >= 3,
                   "node 0 to count both refusals and node 2's attempt")
        wait_until(lambda: metric(c, "kvpool_peer_auth_failures_total") >= 1,
                   "node 2 to refuse node 0's proof")
        assert cc.lookup_tiers([key]) == []  # node 2 never learnt what node 0 holds
        assert metric(c, "kvpool_peer_directory_entries") == 0
        assert cc.get(key) is None
        assert "peer connection from" in a.log() and "refused" in a.log()


def test_fuzzed_peer_frames_close_the_connection_and_leave_the_agent_whole(
        net: Network, tmp_path: Path, secret: Path) -> None:
    rng = random.Random(29)
    with ExitStack() as stack:
        (a, ca), (_b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False)
        key, data = os.urandom(16), os.urandom(1 << 16)
        assert ca.put(key, data)
        seen_as(cb, [key], ["peer"])
        assert cb.get(key) == data  # node 1 keeps a connection for reads from now on
        host = net.nodes[0].addr
        files, _ = held_files_and_sockets_from(a, host)
        me = ""
        frames = 0
        for i in range(60):
            before_auth = i % 3 == 0
            s = (socket.create_connection((host, PEER_PORT), timeout=30) if before_auth
                 else authenticated(host, secret))
            me = s.getsockname()[0]
            if i == 1:  # the count sees a connection the agent holds
                assert held_files_and_sockets_from(a, me)[1] == 1
            with s:
                try:
                    for _ in range(rng.randint(1, 5)):
                        frame = bytearray(wire.encode_request(
                            rng.choice([wire.OP_FETCH, wire.OP_SUBSCRIBE, 0, 3, 255]),
                            rng.getrandbits(32), rng.choice([key, os.urandom(16)]),
                            rng.choice(["", "t", "x" * 300])))
                        for _ in range(rng.randint(0, 4)):  # flip some bytes
                            frame[rng.randrange(len(frame))] = rng.getrandbits(8)
                        frame += rng.randbytes(rng.randint(0, 64))
                        s.sendall(bytes(frame))
                        frames += 1
                    s.shutdown(socket.SHUT_WR)
                    while s.recv(1 << 20):  # whatever it answers, until it closes
                        pass
                except OSError:
                    pass  # closed on us mid-send: the protocol error it should be
        assert frames >= 60
        # The agent still serves its clients and its peers, and holds nothing for them.
        assert ca.get(key) == data
        k2 = os.urandom(16)
        assert ca.put(k2, data)
        seen_as(cb, [k2], ["peer"])
        assert cb.get(k2) == data
        # Nothing of the fuzzer's connections stays: no socket to it, no file opened for it.
        wait_until(lambda: held_files_and_sockets_from(a, me) <= (files, 0),
                   "node 0's descriptors for the fuzzer closed")
        # (A served chunk's lease ends once its reader acknowledged the last byte.)
        wait_until(lambda: ca.stats()["leases"] == {"read": 0, "write": 0},
                   "node 0's leases all ended")
