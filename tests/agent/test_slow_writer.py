"""A slow writer whose write lease expired never overwrites another client's chunk.

An engine stalled by its GPU can copy into its ALLOC's extents long after its write lease
expired. Those pages used to be freed at expiry and handed to the next ALLOC, so the late
copy landed in another client's committed chunk, which then read the slow writer's bytes.
"""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import RawConn, used_bytes, wait_until

MiB = 1 << 20


class SlowWriter(RawConn):
    """A zero-copy writer by hand: it maps the arena and copies whenever it likes."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, hello=False)
        self.send(p.encode(p.Hello(0, p.PROTOCOL_VERSION)))
        msg, fds, _, _ = socket.recv_fds(self.sock, 65536, 1)
        reply = p.reply_decoder.decode(msg[p.HEADER.size:])
        assert isinstance(reply, p.HelloReply) and len(fds) == 1
        self.arena = mmap.mmap(fds[0], reply.arena_bytes, flags=mmap.MAP_SHARED)
        os.close(fds[0])

    def copy(self, extents: p.Extents, data: bytes) -> None:
        pos = 0
        for offset, n in extents:
            self.arena[offset : offset + n] = data[pos : pos + n]
            pos += n

    def close(self) -> None:
        self.arena.close()
        super().close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[LocalAgent]:
    config = tmp_path / "agent.yaml"
    config.write_text("writeLeaseTimeout: 1s\n")
    with LocalAgent("--no-lock", "--config", str(config), workdir=tmp_path, dram="8Mi") as a:
        yield a


def test_a_late_copy_after_the_write_lease_expired_never_lands_in_another_chunk(
        agent: LocalAgent) -> None:
    slow = SlowWriter(agent.socket_path)
    try:
        grant = slow.call(p.Alloc(1, b"\x01" * 16, MiB))
        assert isinstance(grant, p.AllocReply) and grant.lease
        with KVPoolClient(agent.socket_path) as c:
            wait_until(lambda: c.stats()["leases"]["write"] == 0, "the write lease to expire")
            # Meanwhile another client stores chunks of the same size: it must never be
            # given the slow writer's pages.
            theirs = {bytes([i]) * 16: bytes([i]) * MiB for i in range(2, 5)}
            for key, data in theirs.items():
                assert c.put(key, data)
            # The slow writer finishes its copy at last; its COMMIT is too late.
            slow.copy(grant.extents, b"\xee" * MiB)
            late = slow.call(p.Commit(2, grant.lease, p.checksum(b"\xee" * MiB)))
            assert isinstance(late, p.ErrorReply) and late.code == p.ErrorCode.UNKNOWN_LEASE
            for key, data in theirs.items():
                assert c.get(key, verify=True) == data  # zero-copy
            with KVPoolClient(agent.socket_path, mode="inline") as inline:
                assert all(inline.get(k) == d for k, d in theirs.items())
            assert c.lookup([b"\x01" * 16]) == 0
    finally:
        slow.close()
    # Once the slow writer's connection is gone, its pages are free again.
    with KVPoolClient(agent.socket_path) as c:
        wait_until(lambda: used_bytes(c) == 3 * MiB, "the fenced pages to be freed")
