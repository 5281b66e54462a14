"""A peer of the pool scripted in Python, for the bench and the tests: it listens on a TCP
port, proves the pool's secret to each agent that connects (the server side of the peer
handshake, `kvpool.agent.peers.auth`), then hands the connection to `speak`, which a
subclass writes to play the part it needs (a peer that only announces, one that holds
its replies back...)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping

from kvpool.agent import checksums
from kvpool.agent.peers import auth, wire


def recv_exact(conn: socket.socket, n: int) -> bytes:
    """`n` bytes from `conn`; ConnectionError if it closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("closed")
        got += k
    return bytes(buf)


def next_request(conn: socket.socket) -> tuple[int, int, bytes]:
    """The next request on a peer connection, read up to its body: (op, rid, key)."""
    op, rid, tlen, key = wire.request_head(recv_exact(conn, wire.REQUEST.size))
    recv_exact(conn, tlen)
    return op, rid, key


def chunk_reply(rid: int, data: bytes, checksum: int | None = None) -> bytes:
    """A FETCH's reply carrying `data` as an XXH3 chunk (`checksum`, when given, in place
    of its own: a chunk whose bytes fail it)."""
    if checksum is None:
        checksum = checksums.compute(checksums.XXH3, [data])
    return wire.encode_reply(wire.OK, rid, kind=checksums.XXH3, size=len(data),
                             checksum=checksum) + data


class ScriptedPeer:
    """Accepts connections on `host` (a thread per connection) until `close`; each one
    that proves `secret` goes to `speak`. A connection that fails the handshake, breaks
    the wire format or closes is dropped quietly."""

    def __init__(self, host: str, secret: bytes) -> None:
        self.secret = secret
        self.agent_id = os.urandom(16)
        self.server = socket.create_server((host, 0))
        self.port: int = self.server.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.server.close()

    def speak(self, conn: socket.socket) -> None:
        """What the peer does on an accepted, authenticated connection."""
        raise NotImplementedError

    def stream_inventory(self, conn: socket.socket, sizes: Mapping[bytes, int]) -> None:
        """The answer to a SUBSCRIBE: an inventory of the keys of `sizes` (key: chunk
        bytes), then a heartbeat every 0.2 s until `close`."""
        conn.sendall(wire.encode_stream(wire.BEGIN)
                     + wire.encode_stream(wire.ADD, "", list(sizes.items()))
                     + wire.encode_stream(wire.SYNCED))
        while not self.closed:
            time.sleep(0.2)
            conn.sendall(wire.encode_stream(wire.HEARTBEAT, sent_at=time.time()))

    def fetches(self, conn: socket.socket, chunks: Mapping[bytes, bytes]
                ) -> Iterator[tuple[int, bytes]]:
        """The requests of a connection that FETCHes, (rid, key) one after the other until
        it closes (ConnectionError); a connection that SUBSCRIBEs instead is answered with
        an inventory of `chunks` (`stream_inventory`), and gives none."""
        op, rid, key = next_request(conn)
        if op == wire.OP_SUBSCRIBE:
            self.stream_inventory(conn, {k: len(d) for k, d in chunks.items()})
            return
        while True:
            yield rid, key
            op, rid, key = next_request(conn)

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, auth.AuthError, wire.WireError):
            client_id, client_nonce = auth.parse_hello(recv_exact(conn, wire.HELLO.size))
            mine = auth.nonce()
            conn.sendall(auth.hello(self.agent_id, mine) + auth.proof(
                self.secret, b"server", client_nonce, mine, client_id, self.agent_id))
            auth.check(auth.proof(self.secret, b"client", client_nonce, mine, client_id,
                                  self.agent_id), recv_exact(conn, wire.PROOF_BYTES))
            conn.sendall(wire.ACCEPTED)
            self.speak(conn)
