"""Tenant isolation through a real agent: the socket, not the client, decides the tenant.

An agent started with tenants serves each on its own socket (`tenants/<name>/agent.sock`)
from its own arena, NVMe directory and shared prefix. These tests send one tenant's exact
keys through another tenant's socket, at every tier, and check they are misses.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import tenant_socket_path
from kvpool.bench.local import LocalAgent

from .conftest import scrape, wait_until

CHUNK = 64 * 1024
TENANTS = ("team-a", "team-b")


class TenantAgent(LocalAgent):
    """A LocalAgent serving tenants; it is up once the last tenant's socket answers."""

    def __init__(self, workdir: Path, *args: str, dram: str) -> None:
        super().__init__(*args, *(f"--tenant={t}" for t in TENANTS), workdir=workdir, dram=dram)
        self.pool_socket = self.socket_path
        self.socket_path = tenant_socket_path(self.pool_socket, TENANTS[-1])

    def socket_of(self, tenant: str) -> Path:
        return tenant_socket_path(self.pool_socket, tenant)

    def arena_of(self, tenant: str) -> Path:
        return self.arena_path.parent / "tenants" / tenant / self.arena_path.name

    def stop(self, remove_arena: bool = True) -> None:
        super().stop(remove_arena)
        if remove_arena:  # the tenants' arenas live beside the pool's, one directory each
            for tenant in TENANTS:
                arena = self.arena_of(tenant)
                for suffix in (".journal", ".stores", ".lock"):
                    arena.with_suffix(suffix).unlink(missing_ok=True)
                arena.unlink(missing_ok=True)
                for d in (arena.parent, arena.parent.parent):
                    with contextlib.suppress(OSError):  # another test's tenants live there
                        d.rmdir()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[TenantAgent]:
    # DRAM fits 8 chunks per tenant, NVMe 16: the test pushes chunks down through every tier.
    # A generous lookup budget: a shared-tier LOOKUP slowed by a loaded machine is a miss,
    # which is right for an engine but not what these tests are about.
    cfg = tmp_path / "agent.yaml"
    (tmp_path / "shared").mkdir()
    cfg.write_text(yaml.safe_dump({"tiers": {"shared": {
        "url": (tmp_path / "shared").as_uri(), "lookupBudget": "5s"}}}))
    with TenantAgent(tmp_path, "--no-lock", "--nvme-dir", str(tmp_path / "nvme"),
                     "--nvme", str(2 * 16 * (CHUNK + 4096)), "--config", str(cfg),
                     dram=str(2 * 8 * CHUNK)) as a:
        yield a


def chunk(i: int) -> tuple[bytes, bytes]:
    key = i.to_bytes(4, "little") * 4
    return key, bytes([i % 251 + 1]) * CHUNK


def prefetched(agent: TenantAgent) -> float:
    """Chunks loaded ahead into DRAM so far, from any tier."""
    return sum(v for series, v in scrape(agent).items()
               if series.startswith("kvpool_tier_prefetches_total{"))


def hello(path: Path, tenant: str) -> tuple[p.Reply, list[int]]:
    """HELLO by hand: the agent's reply and the fds it passed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(path))
        s.sendall(p.encode(p.Hello(1, p.PROTOCOL_VERSION, "test", tenant)))
        msg, fds, _, _ = socket.recv_fds(s, 64 * 1024, 1)
        return p.reply_decoder.decode(msg[p.HEADER.size:]), fds


def test_a_tenant_never_sees_another_tenants_chunks_in_any_tier(agent: TenantAgent,
                                                                  tmp_path: Path) -> None:
    keys = [chunk(i)[0] for i in range(40)]
    with KVPoolClient(agent.socket_of("team-a")) as a, \
            KVPoolClient(agent.socket_of("team-b")) as b:
        for i in range(40):
            key, data = chunk(i)
            assert a.put(key, data)

        def written_through() -> bool:
            queue = a.stats()["tiers"]["shared"]["queue"]
            return bool(queue["pending"] == 0 and queue["in_flight"] == 0
                        and queue["written"] >= 40)

        wait_until(written_through, "team-a's chunks written to the shared tier")
        # The whole prefix at once: the shared tier carries it past the keys only it holds,
        # and each key is reported in the tier it is really in, not all as "shared".
        whole = a.lookup_tiers(keys)
        assert len(whole) == 40 and {"dram", "nvme", "shared"} == set(whole), whole
        # That LOOKUP loads the first keys below DRAM ahead; the lookups below see them
        # once those prefetches have landed (each into a full DRAM waits for the chunk
        # it evicts to reach NVMe), not whichever of them a fast client outruns.
        lookahead = 4  # prefetch.lookaheadChunks' default
        wait_until(lambda: prefetched(agent) >= lookahead, "the LOOKUP's prefetches landed")
        tiers_a = [a.lookup_tiers([k]) for k in keys]
        assert all(len(t) == 1 for t in tiers_a)
        assert {"dram", "nvme", "shared"} == {t[0] for t in tiers_a}, tiers_a  # all hold some

        # team-b sends team-a's exact keys: misses everywhere, LOOKUP, GET and zero-copy read.
        assert b.lookup(keys) == 0
        assert all(b.get(k) is None for k in keys)
        out = bytearray(CHUNK)
        assert all(b.get_into(k, out) == 0 for k in keys[:3])
        # The same key written by team-b is team-b's own chunk, with its own bytes.
        assert b.put(keys[0], b"\xee" * CHUNK)
        assert b.get(keys[0]) == b"\xee" * CHUNK
        assert a.get(keys[0]) == chunk(0)[1]
        assert a.get(keys[-1]) == chunk(39)[1]

        # STATS of a tenant counts its own chunks only.
        stats_b = b.stats()
        assert stats_b["tenant"] == "team-b"
        assert stats_b["tiers"]["dram"]["chunks"] == 1
        assert a.stats()["tenant"] == "team-a"

    # On disk, each tenant's chunks are under its own directory of each tier.
    shared_a = list((tmp_path / "shared" / "tenants" / "team-a").rglob("*.kvc"))
    assert len(shared_a) == 40
    assert not list((tmp_path / "shared").glob("??/*.kvc"))  # nothing at the pool's root

    samples = scrape(agent)
    assert samples['kvpool_tier_chunks{pool="default",tenant="team-b",tier="dram"}'] == 1.0


def test_a_tenants_stats_count_its_own_lookups_only(agent: TenantAgent) -> None:
    """STATS shows a tenant its own space: another tenant's hits and misses never show in
    it, while /metrics counts every tenant's lookups."""
    key, data = chunk(7)
    with KVPoolClient(agent.socket_of("team-a")) as a, \
            KVPoolClient(agent.socket_of("team-b")) as b:
        assert a.put(key, data)
        for _ in range(50):
            assert a.lookup([key]) == 1
        assert a.lookup([chunk(8)[0]]) == 0
        tiers_a = a.stats()["tiers"]
        assert tiers_a["dram"]["hits"] >= 50 and tiers_a["dram"]["misses"] >= 1
        tiers_b = b.stats()["tiers"]
        assert {t: (row["hits"], row["misses"]) for t, row in tiers_b.items()} == \
            dict.fromkeys(tiers_b, (0, 0)), tiers_b
        assert b.lookup([key]) == 0  # team-b's own miss is counted in team-b's STATS
        tiers_b = b.stats()["tiers"]
        assert (tiers_b["dram"]["hits"], tiers_b["dram"]["misses"]) == (0, 1)
        hits_a = a.stats()["tiers"]["dram"]["hits"]
    samples = scrape(agent)
    assert samples['kvpool_tier_hits_total{pool="default",tier="dram"}'] == hits_a


def test_the_socket_decides_the_tenant_not_the_client(agent: TenantAgent) -> None:
    reply, fds = hello(agent.socket_of("team-a"), "team-b")
    assert not fds
    assert isinstance(reply, p.ErrorReply)
    assert reply.code == p.ErrorCode.TENANT_MISMATCH
    assert "team-a" in reply.message and "team-b" in reply.message
    assert "no tenant space" not in reply.message  # team-b has one, on another socket

    # A tenant the agent has no space of is said to be missing, not just another's.
    reply, fds = hello(agent.socket_of("team-a"), "team-c")
    assert not fds
    assert isinstance(reply, p.ErrorReply)
    assert reply.code == p.ErrorCode.TENANT_MISMATCH
    assert reply.message.startswith("no tenant space 'team-c' on this agent"), reply.message
    assert "team-a, team-b" in reply.message

    # A client that names no tenant gets the socket's, and says so at HELLO.
    with KVPoolClient(agent.socket_of("team-b"), tenant="") as b:
        assert b.hello is not None and b.hello.tenant == "team-b"


def test_each_tenant_maps_its_own_arena_file_with_owner_only_permissions(
        agent: TenantAgent) -> None:
    inodes = set()
    for tenant in TENANTS:
        reply, fds = hello(agent.socket_of(tenant), tenant)
        assert isinstance(reply, p.HelloReply) and len(fds) == 1
        try:
            st = os.fstat(fds[0])
        finally:
            os.close(fds[0])
        inodes.add((st.st_dev, st.st_ino))
        assert stat.S_IMODE(st.st_mode) == 0o600
        arena = agent.arena_of(tenant)
        assert (arena.stat().st_dev, arena.stat().st_ino) == (st.st_dev, st.st_ino)
        sock = agent.socket_of(tenant)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o750
    assert len(inodes) == len(TENANTS)
    # No pool-wide socket: a client reaches the agent only through its tenant's directory.
    assert not agent.pool_socket.exists()
