"""A DELETE is final: no read under way when it arrives, and no shared-tier outage, brings
the chunk back. Real agents, real sockets, real NVMe files and a real shared directory."""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from ..support import shared_node
from .conftest import RawConn, wait_until

MiB = 1 << 20


def data_of(key: bytes) -> bytes:
    return key * (MiB // 16)


def test_a_delete_racing_an_nvme_read_is_final(tmp_path: Path) -> None:
    """Another connection's GET of an NVMe chunk is under way (a worker thread reads it)
    when the DELETE arrives: the delete wins, the read's copy is not put back into DRAM."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("tiers:\n  dram: {eviction: lru, highWatermark: 1.0, lowWatermark: 0.99}\n"
                      "prefetch: {enabled: false}\n")
    with LocalAgent("--no-lock", "--policy", str(policy), "--nvme-dir", str(tmp_path / "nvme"),
                    "--nvme", "256Mi", workdir=tmp_path, dram="4Mi") as agent, \
            KVPoolClient(agent.socket_path) as c:
        reader, deleter = RawConn(agent.socket_path), RawConn(agent.socket_path)
        try:
            for attempt in range(20):
                key = os.urandom(16)
                assert c.put(key, data_of(key))
                for _ in range(4):  # a 4 MiB arena: the key goes down to NVMe
                    filler = os.urandom(16)
                    assert c.put(filler, data_of(filler))
                wait_until(lambda: c.stats()["tiers"]["nvme"]["inflight"] == 0,
                           "the demotions to land")
                assert c.lookup_tiers([key]) == ["nvme"]
                reader.send(p.encode(p.Get(1, key)))
                deleter.send(p.encode(p.Delete(1, key)))
                deleted = deleter.reply()
                assert isinstance(deleted, p.DeleteReply) and deleted.existed
                reader.reply()  # the bytes, or a miss: the read came first or second
                assert c.lookup([key]) == 0, f"deleted key back after {attempt} attempts"
                assert c.get(key) is None
        finally:
            reader.close()
            deleter.close()


def node(stack: ExitStack, root: Path, name: str, mount: Path) -> LocalAgent:
    return shared_node(stack, root, name, mount, pool="delete-test")


def test_a_delete_during_a_shared_tier_outage_is_retried_until_the_object_is_gone(
        tmp_path: Path) -> None:
    """The shared directory is away when the DELETE comes: the agent answers it, keeps it,
    and deletes the object once the directory is back; another node never serves it."""
    mount = tmp_path / "mount"
    away = tmp_path / "away"
    key = os.urandom(16)
    with ExitStack() as stack:
        a, b = node(stack, tmp_path, "a", mount), node(stack, tmp_path, "b", mount)
        with KVPoolClient(a.socket_path) as ca, KVPoolClient(b.socket_path) as cb:
            assert ca.put(key, data_of(key))
            wait_until(lambda: ca.stats()["tiers"]["shared"]["queue"]["written"] == 1,
                       "the upload")
            objects = list(mount.rglob("*.kvc"))
            assert len(objects) == 1
            shutil.move(mount, away)  # the mount goes away
            assert ca.delete(key)
            wait_until(lambda: not ca.stats()["tiers"]["shared"]["healthy"], "the outage")
            shutil.move(away, mount)  # and comes back, with the object
            wait_until(lambda: not list(mount.rglob("*.kvc")), "the retried delete")
            assert ca.lookup([key]) == 0 and cb.lookup([key]) == 0
            assert ca.get(key) is None and cb.get(key) is None


def test_a_delete_pending_at_an_agent_restart_is_retried_by_the_restarted_agent(
        tmp_path: Path) -> None:
    """The shared directory is away when the DELETE comes, and the agent is SIGKILLed
    before it is back: the restarted agent still deletes the object (the pending delete
    is in its commit journal), and never serves the chunk from the store meanwhile."""
    mount = tmp_path / "mount"
    away = tmp_path / "away"
    key = os.urandom(16)
    with ExitStack() as stack:
        a = node(stack, tmp_path, "a", mount)
        with KVPoolClient(a.socket_path, reconnect_timeout=0) as c:
            assert c.put(key, data_of(key))
            wait_until(lambda: c.stats()["tiers"]["shared"]["queue"]["written"] == 1,
                       "the upload")
            shutil.move(mount, away)  # the mount goes away
            assert c.delete(key)
            wait_until(lambda: not c.stats()["tiers"]["shared"]["healthy"], "the outage")
        a.kill()
        shutil.move(away, mount)  # back, with the object, while no agent runs
        assert len(list(mount.rglob("*.kvc"))) == 1
        a.start()
        with KVPoolClient(a.socket_path) as c:
            assert c.lookup([key]) == 0 and c.get(key) is None
            wait_until(lambda: not list(mount.rglob("*.kvc")), "the retried delete")
