"""A FETCH reply sender's test bench: a real TCP connection from a plain blocking socket
(the reading side, with a small receive buffer) to an asyncio server, whose side is the
stream writer a sender sends on (its send buffer small too), and a chunk file open; all
of it closed on the way out, whatever the test did."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

BUFFER = 16 << 10
"""Both sockets' buffers: a chunk of a few MiB mostly waits for room."""


@contextlib.asynccontextmanager
async def served(path: Path) -> AsyncIterator[tuple[asyncio.StreamWriter, socket.socket, int]]:
    """(the server's writer, the reading socket, a read-only descriptor of `path`)."""
    accepted: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

    def on_accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer)

    server = await asyncio.start_server(on_accept, "127.0.0.1", 0)
    reader = socket.socket()
    try:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
        reader.connect(("127.0.0.1", server.sockets[0].getsockname()[1]))
        writer = await accepted
        try:
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                       BUFFER)
            fd = os.open(path, os.O_RDONLY)
            try:
                yield writer, reader, fd
            finally:
                os.close(fd)
        finally:
            writer.close()
    finally:
        reader.close()
        server.close()


def take(sock: socket.socket, n: int, step: int = 4096) -> bytes:
    """The next `n` bytes from the reading socket, `step` at most at a time (a slow reader:
    the sender waits for room in between); fails where the connection closes first."""
    received = bytearray()
    while len(received) < n:
        more = sock.recv(min(step, n - len(received)))
        assert more, "the connection closed mid-reply"
        received += more
    return bytes(received)


def segments_out(sock: socket.socket) -> int:
    """TCP segments the socket has sent (Linux's `tcp_info.tcpi_segs_out`)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return int(struct.unpack_from("I", info, 136)[0])
