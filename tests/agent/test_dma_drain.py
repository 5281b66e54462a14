"""A client that copies by DMA and dies mid-copy: its leases drain before anything reuses them.

A GPU client's copies run on the device: when its process dies (or its connection drops)
in the middle of a window, the socket closes at once but the DMA already queued can still
write into its write leases' pages, or read its read leases' chunks. A lease taken with
`dma` therefore drains when its connection closes: the write is never committed, its pages
stay from reuse, and the read lease stays open (its chunk neither evicted nor freed), for
`writeLeaseTimeout`; then everything is released as for any closed connection.

The client here is a real process killed with SIGKILL between ALLOC (or ACQUIRE) and its
COMMIT (or RELEASE). The "device" is a process it forked that holds the arena mapping but
not the socket and keeps copying after the kill: what a GPU's DMA engine does for the
copies already queued (test scaffolding standing in for a CUDA device, which this machine
lacks).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import RawConn, used_bytes, wait_until
from .test_slow_writer import SlowWriter

MiB = 1 << 20
DRAIN_S = 4
"""writeLeaseTimeout here: how long a closed DMA connection's leases drain."""
DEVICE_S = 1.5
"""How long the "device" goes on copying after its process was killed (< DRAIN_S)."""

# A client process: HELLO, then ALLOC (or ACQUIRE) with dma, print the extents, fork the
# "device" (the mapping without the socket) and wait to be killed.
_CLIENT = textwrap.dedent("""
    import json, mmap, os, socket, sys, time
    from kvpool.agent import protocol as p

    path, op, key, size, seconds, done = sys.argv[1:7]
    key, size, seconds = bytes.fromhex(key), int(size), float(seconds)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(p.encode(p.Hello(0, p.PROTOCOL_VERSION)))
    msg, fds, _, _ = socket.recv_fds(sock, 65536, 1)
    hello = p.reply_decoder.decode(msg[p.HEADER.size:])
    arena = mmap.mmap(fds[0], hello.arena_bytes, flags=mmap.MAP_SHARED)
    req = p.Alloc(1, key, size, b"", True) if op == "write" else p.Acquire(1, key, True)
    sock.sendall(p.encode(req))
    head = sock.recv(4)
    (n,) = p.HEADER.unpack(head)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    reply = p.reply_decoder.decode(body)
    if os.fork() == 0:  # the device: keeps copying after its process is gone
        sock.close()
        print(json.dumps(reply.extents), flush=True)
        end = time.monotonic() + seconds
        os.kill(os.getppid(), 0)
        while time.monotonic() < end:
            for offset, length in reply.extents:
                if op == "write":
                    arena[offset : offset + length] = b"\\xee" * length
                else:
                    bytes(arena[offset : offset + length])
            time.sleep(0.005)
        open(done, "w").close()
        os._exit(0)
    time.sleep(600)
""")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[LocalAgent]:
    config = tmp_path / "agent.yaml"
    config.write_text(f"writeLeaseTimeout: {DRAIN_S}s\n")
    with LocalAgent("--no-lock", "--config", str(config), workdir=tmp_path, dram="8Mi") as a:
        yield a


def _killed_mid_copy(agent: LocalAgent, op: str, key: bytes, size: int,
                     done: Path) -> list[tuple[int, int]]:
    """Start a client process that takes a `dma` lease and forks its device, kill it with
    SIGKILL as soon as the device copies, and return the lease's extents."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, str(agent.socket_path), op, key.hex(), str(size),
         str(DEVICE_S), str(done)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    extents = [tuple(e) for e in json.loads(proc.stdout.readline())]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=20)
    return extents  # type: ignore[return-value]


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(x < y + m and y < x + n for x, n in a for y, m in b)


def _draining(c: KVPoolClient) -> dict[str, int]:
    d: dict[str, int] = c.stats()["draining"]
    return d


def test_a_dma_writer_killed_mid_copy_never_lands_in_another_chunk(
        agent: LocalAgent, tmp_path: Path) -> None:
    done = tmp_path / "device-done"
    theirs_key = b"\x01" * 16
    extents = _killed_mid_copy(agent, "write", theirs_key, MiB, done)
    with KVPoolClient(agent.socket_path) as c:
        # the connection is gone, the write ended (never committed), its pages draining
        wait_until(lambda: c.stats()["leases"]["write"] == 0, "the killed client's lease")
        assert _draining(c) == {"read_leases": 0, "bytes": MiB}
        assert c.lookup([theirs_key]) == 0
        # Meanwhile other chunks fill the arena while the device still writes 0xee into
        # the dead client's pages: no ALLOC is given them ...
        probe = RawConn(agent.socket_path)
        try:
            grant = probe.call(p.Alloc(1, b"\x02" * 16, MiB))
            assert isinstance(grant, p.AllocReply) and grant.lease
            assert not _overlap(grant.extents, extents)
            probe.call(p.Abort(2, grant.lease))
        finally:
            probe.close()
        ours = {bytes([i]) * 16: bytes([i]) * MiB for i in range(3, 9)}
        for key, data in ours.items():
            assert c.put(key, data)
        wait_until(done.exists, "the device to finish its copies", timeout=30)
        # ... so every chunk reads back as it was written, zero-copy and inline
        for key, data in ours.items():
            assert c.get(key, verify=True) == data
        with KVPoolClient(agent.socket_path, mode="inline") as inline:
            assert all(inline.get(k) == d for k, d in ours.items())
        # The drain ends: the pages are free again, nothing of the dead write is left.
        wait_until(lambda: _draining(c)["bytes"] == 0, "the drain to end", timeout=30)
        stored = sum(len(d) for k, d in ours.items() if c.lookup([k]))
        assert used_bytes(c) == stored
        assert c.stats()["leases"] == {"read": 0, "write": 0}


def test_a_dma_readers_chunk_is_neither_freed_nor_reused_while_its_lease_drains(
        agent: LocalAgent, tmp_path: Path) -> None:
    done = tmp_path / "device-done"
    key, data = b"\x0a" * 16, b"\x5a" * MiB
    with KVPoolClient(agent.socket_path) as c:
        assert c.put(key, data)
        extents = _killed_mid_copy(agent, "read", key, MiB, done)
        wait_until(lambda: _draining(c)["read_leases"] == 1, "the killed reader's drain")
        assert c.stats()["leases"]["read"] == 1  # still open: its chunk is protected
        # Deleting the chunk and filling the arena cannot free or reuse its pages meanwhile.
        assert c.delete(key)
        view = SlowWriter(agent.socket_path)  # a mapping of the arena, to look at the bytes
        try:
            for i in range(20, 27):
                assert c.put(bytes([i]) * 16, bytes([i]) * MiB)
            assert all(bytes(view.arena[o : o + n]) == data[:n] for o, n in extents)
            wait_until(done.exists, "the device to finish its copies", timeout=30)
            wait_until(lambda: c.stats()["leases"]["read"] == 0, "the drain to end",
                       timeout=30)
            assert _draining(c) == {"read_leases": 0, "bytes": 0}
            assert c.lookup([key]) == 0
            # its pages are free now: the next chunks may take them
            stored = sum(MiB for i in range(20, 27) if c.lookup([bytes([i]) * 16]))
            assert used_bytes(c) == stored
        finally:
            view.close()


def test_a_connection_without_dma_leases_still_frees_its_pages_at_close(
        agent: LocalAgent) -> None:
    raw = RawConn(agent.socket_path)
    grant = raw.call(p.Alloc(1, b"\x0b" * 16, MiB))
    assert isinstance(grant, p.AllocReply) and grant.lease
    raw.close()
    with KVPoolClient(agent.socket_path) as c:
        wait_until(lambda: c.stats()["leases"]["write"] == 0, "the write to be aborted")
        # aborted and freed in the same step as the close: no drain
        assert used_bytes(c) == 0
        assert _draining(c) == {"read_leases": 0, "bytes": 0}
