"""The raw TCP baseline of the peer part: the same bytes between the same namespaces, with
nothing but the kernel's TCP in the way.

`python -m kvpool.bench.rawtcp send HOST` listens on HOST (port 0) and prints the port;
it streams what each connection asks for from one buffer in memory (`sendall`), or, asked
for `sendfile`, with `sendfile` from a shared-memory file (a memfd), as a holding agent
sends chunks from its arena: no copy on the sender, the bytes going out as page-sized
pieces of the file's pages (on a veth link the receiver then copies them a page at a
time, docs/benchmarks.md, "A 1 MiB window's batches in order").
`python -m kvpool.bench.rawtcp recv HOST PORT SIZE COUNT [sendfile]` asks for COUNT chunks
of SIZE bytes and receives each with `recv_into` into a buffer of its own (what a reader
that keeps the chunks must do); it prints the seconds from the request to the last byte,
then the CPU seconds (user + system) its receiving thread spent meanwhile.
Both sockets take the kernel's default buffer sizes, as the agents' do.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

ASK = struct.Struct("<QQQ")
"""chunk size, chunk count, flags (`BY_FILE`, `WARM_UP`)."""
BY_FILE = 1
"""Send the chunks by `sendfile`, each from its own range of a shared-memory file (as a
holding agent's chunks are each their own arena pages, not one buffer sent again)."""
WARM_UP = 2
"""Send one chunk only (the connection's window opens), the file made for the count."""


def _serve(conn: socket.socket) -> None:
    fd, made = -1, (0, 0)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = _recv_exact(conn, ASK.size)
                if head is None:
                    return
                size, count, flags = ASK.unpack(head)
                data = memoryview(bytearray(b"\x5a" * size))
                sends = 1 if flags & WARM_UP else count
                if not flags & BY_FILE:
                    for _ in range(sends):
                        conn.sendall(data)
                    continue
                if made != (size, count):  # made at the warm-up, before the timed ask
                    if fd < 0:
                        fd = os.memfd_create("kvpool-rawtcp")
                    for i in range(count):
                        os.pwrite(fd, data, i * size)
                    made = (size, count)
                for i in range(sends):
                    sent = 0
                    while sent < size:
                        sent += os.sendfile(conn.fileno(), fd, i * size + sent, size - sent)
        finally:
            if fd >= 0:
                os.close(fd)


def send(host: str) -> None:
    server = socket.create_server((host, 0))
    print(server.getsockname()[1], flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve, args=(conn,), daemon=True).start()


def receive(host: str, port: int, size: int, count: int,
            sendfile: bool = False) -> tuple[float, float]:
    """Seconds to receive `count` chunks of `size` bytes, each into its own buffer, and the
    CPU seconds the receiving thread spent meanwhile; `sendfile`: the sender sends them by
    `sendfile` from a shared-memory file."""
    bufs = [memoryview(bytearray(size)) for _ in range(count)]
    for b in bufs:  # touched first: the agents' arena pages are resident too
        b[::4096] = b"\x01" * len(b[::4096])
    with socket.create_connection((host, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        flags = BY_FILE if sendfile else 0
        s.sendall(ASK.pack(size, count, flags | WARM_UP))  # the connection's window opens
        _fill(s, bufs[0])
        start, cpu = time.perf_counter(), time.thread_time()
        s.sendall(ASK.pack(size, count, flags))
        for b in bufs:
            _fill(s, b)
        return time.perf_counter() - start, time.thread_time() - cpu


def _fill(s: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = s.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the sender closed the connection")
        got += n


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def main(argv: list[str]) -> None:
    if argv[:1] == ["send"] and len(argv) == 2:
        send(argv[1])
    elif argv[:1] == ["recv"] and (len(argv) == 5 or argv[5:] == ["sendfile"]):
        print(*receive(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), len(argv) == 6),
              flush=True)
    else:
        sys.exit("usage: python -m kvpool.bench.rawtcp send HOST | "
                 "recv HOST PORT SIZE COUNT [sendfile]")


if __name__ == "__main__":
    main(sys.argv[1:])
