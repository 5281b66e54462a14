"""The raw TCP baseline of the peer part: the same bytes between the same namespaces, with
nothing but the kernel's TCP in the way.

`python -m kvpool.bench.rawtcp send HOST` listens on HOST (port 0) and prints the port;
it streams what each connection asks for from one buffer in memory (`sendall`).
`python -m kvpool.bench.rawtcp recv HOST PORT SIZE COUNT` asks for COUNT chunks of SIZE
bytes and receives each with `recv_into` into a buffer of its own (what a reader that
keeps the chunks must do); it prints the seconds from the request to the last byte, then
the CPU seconds (user + system) its receiving thread spent meanwhile.
Both sockets take the kernel's default buffer sizes, as the agents' do.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time

ASK = struct.Struct("<QQ")
"""chunk size, chunk count."""


def _serve(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = _recv_exact(conn, ASK.size)
            if head is None:
                return
            size, count = ASK.unpack(head)
            data = memoryview(bytearray(b"\x5a" * size))
            for _ in range(count):
                conn.sendall(data)


def send(host: str) -> None:
    server = socket.create_server((host, 0))
    print(server.getsockname()[1], flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve, args=(conn,), daemon=True).start()


def receive(host: str, port: int, size: int, count: int) -> tuple[float, float]:
    """Seconds to receive `count` chunks of `size` bytes, each into its own buffer, and the
    CPU seconds the receiving thread spent meanwhile."""
    bufs = [memoryview(bytearray(size)) for _ in range(count)]
    for b in bufs:  # touched first: the agents' arena pages are resident too
        b[::4096] = b"\x01" * len(b[::4096])
    with socket.create_connection((host, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(ASK.pack(size, 1))  # a warm-up chunk: the connection's window opens
        _fill(s, bufs[0])
        start, cpu = time.perf_counter(), time.thread_time()
        s.sendall(ASK.pack(size, count))
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
    elif argv[:1] == ["recv"] and len(argv) == 5:
        print(*receive(argv[1], int(argv[2]), int(argv[3]), int(argv[4])), flush=True)
    else:
        sys.exit("usage: python -m kvpool.bench.rawtcp send HOST | recv HOST PORT SIZE COUNT")


if __name__ == "__main__":
    main(sys.argv[1:])
