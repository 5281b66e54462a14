"""The arena fd a client gets at HELLO cannot take the agent (or another tenant) down.

Every client holds a writable fd of its space's arena file. These tests resize it from the
client side, as a faulty or hostile client would, and check that the agent keeps serving:
every tenant whose arena was not touched keeps every chunk, and the resized tenant's arena
is put back to its size (its lost bytes are misses, never data).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent import protocol as p
from kvpool.agent.arena import Arena
from kvpool.agent.client import KVPoolClient

from .conftest import RawConn
from .test_tenants import CHUNK, TenantAgent, chunk, hello


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[TenantAgent]:
    with TenantAgent(tmp_path, "--no-lock", dram=str(2 * 16 * CHUNK)) as a:
        yield a


def truncate_arena_of(agent: TenantAgent, tenant: str, size: int) -> None:
    """Resize a tenant's arena through the fd its HELLO hands out, as a client could."""
    reply, fds = hello(agent.socket_of(tenant), tenant)
    assert isinstance(reply, p.HelloReply) and len(fds) == 1
    try:
        os.ftruncate(fds[0], size)
    finally:
        os.close(fds[0])


@pytest.mark.parametrize("size", [0, 4096], ids=["to-zero", "to-one-page"])
def test_a_client_shrinking_its_arena_fd_costs_only_its_own_tenants_bytes(
        agent: TenantAgent, size: int) -> None:
    with KVPoolClient(agent.socket_of("team-a")) as a, \
            KVPoolClient(agent.socket_of("team-b")) as b:
        for i in range(8):
            key, data = chunk(i)
            assert a.put(key, data)
            assert b.put(key, data)
    truncate_arena_of(agent, "team-a", size)

    # The agent's next touch of team-a's arena (an inline GET reads it) used to be SIGBUS.
    raw = RawConn(agent.socket_of("team-a"))
    try:
        for i in range(1, 8):
            reply = raw.call(p.Get(i, chunk(i)[0]))
            # The bytes past the new end are gone: a miss, never zeros passed off as data.
            assert isinstance(reply, p.ErrorReply), reply
            assert reply.code == p.ErrorCode.NOT_FOUND
    finally:
        raw.close()
    assert agent.proc is not None and agent.proc.poll() is None, agent.log()
    assert agent.arena_of("team-a").stat().st_size == 2 * 8 * CHUNK

    # team-b lost nothing, through zero-copy and inline reads.
    with KVPoolClient(agent.socket_of("team-b")) as b:
        for i in range(8):
            key, data = chunk(i)
            assert b.get(key, verify=True) == data
            out = bytearray(CHUNK)
            assert b.get_into(key, out, verify=True) == CHUNK and out == data
    # team-a works again: a new client maps the restored arena and writes and reads it.
    with KVPoolClient(agent.socket_of("team-a")) as a:
        key, data = chunk(100)
        assert a.put(key, data)
        assert a.get(key, verify=True) == data
    assert "resized" in agent.log()


def test_a_client_growing_its_arena_fd_is_put_back(agent: TenantAgent) -> None:
    truncate_arena_of(agent, "team-a", 1 << 30)
    with KVPoolClient(agent.socket_of("team-a")) as a:
        key, data = chunk(1)
        assert a.put(key, data)
        assert a.get(key, verify=True) == data
    assert agent.arena_of("team-a").stat().st_size == 2 * 8 * CHUNK


def test_a_peer_reads_write_into_an_arena_a_client_shrank_puts_it_back_and_lands(
        tmp_path: Path) -> None:
    """A peer read writes each piece it received into the arena's mapping through the
    kernel (`Arena.write_run`: process_vm_writev, not pwrite). A page past a file a client
    shrank is an error code there, not SIGBUS: the arena is put back to its size and the
    piece lands whole."""
    size, piece = 4 * CHUNK, os.urandom(CHUNK)
    arena = Arena(tmp_path / "arena", size, lock=False)
    try:
        assert arena.mapped_writes  # allowed here, as under the runtimes' default seccomp
        client_fd = os.open(tmp_path / "arena", os.O_RDWR)
        try:
            os.ftruncate(client_fd, CHUNK)  # the piece's page is past the end now
        finally:
            os.close(client_fd)
        arena.write_run(2 * CHUNK + 4096, memoryview(piece))
        assert os.fstat(arena.fd).st_size == size and arena.resizes == 1
        assert os.pread(arena.fd, CHUNK, 2 * CHUNK + 4096) == piece
    finally:
        arena.close()
