"""A DELETE is final even when the chunk is on its way between tiers at that moment.

Two moves the store decides on the loop run later in its background pool: a demotion's
NVMe write, and the upload to G4 of a chunk evicted from NVMe (`onEvict: demote` into a
shared tier without write-through). A DELETE acknowledged before the move ran must win
over it. Before, the demoted chunk's file was indexed as it landed and stayed so until the
end of its write batch: a read meanwhile served the deleted chunk and brought it back into
DRAM for good (an 8-client soak saw it once in four runs). And the evicted chunk's upload
replaced the shared delete still pending, so the object came back in G4 and was served
from there.

An NVMe file of a deleted chunk goes before the DELETE is answered: removed by the pool
later, it outlived an agent killed meanwhile, and the restarted agent served the chunk.

To hold the moves back until the DELETE has been acknowledged, the pool's threads are
kept busy by shared deletes of other keys that the S3 server holds (`StallingMoto`):
a real agent, real S3 requests, nothing of the agent replaced.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import yaml

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.store import IO_THREADS
from kvpool.bench.local import LocalAgent

from ..agent.conftest import RawConn
from ..support import wait_until
from .conftest import StallingMoto, s3_client

KiB = 1 << 10
CHUNK = 256 * KiB
BUCKET = "kvpool-delete-races"


def data_of(key: bytes) -> bytes:
    return key * (CHUNK // len(key))


def start_agent(tmp_path: Path, s3: StallingMoto, policy: dict[str, Any], *,
                nvme: str, dram: str = "32Mi") -> LocalAgent:
    s3_client(s3.endpoint).create_bucket(Bucket=BUCKET)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"pool": "delete-races", "tiers": {
        "nvme": {"path": str(tmp_path / "nvme"), "size": nvme},
        # Longer than the test holds a request: a held DELETE is slow, not failed.
        "shared": {"url": f"s3://{BUCKET}/pool", "endpointUrl": s3.endpoint,
                   "requestTimeout": "60s"},
    }}))
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(
        {"prefetch": {"enabled": False}, **policy}))
    return LocalAgent("--no-lock", "--config", str(cfg), "--policy",
                      str(tmp_path / "policy.yaml"), workdir=tmp_path, dram=dram)


def uploads_done(c: KVPoolClient) -> bool:
    queue = c.stats()["tiers"]["shared"]["queue"]
    return bool(queue["pending"] == 0 and queue["in_flight"] == 0)


def hold_background_pool(agent: LocalAgent, s3: StallingMoto) -> None:
    """Every thread of the agent's background pool busy with a shared delete the store
    holds: what the store hands the pool from now on waits until `s3.free()`. (A DELETE
    goes to the store whether or not the agent holds the key.) The DELETEs go in one
    write: the agent takes them all before its housekeeping retries any (a retry that
    finds the key's delete running waits for it, and would take a thread of its own)."""
    s3.hold()
    conn = RawConn(agent.socket_path)
    try:
        conn.send(b"".join(p.encode(p.Delete(rid, os.urandom(16)))
                           for rid in range(1, IO_THREADS + 1)))
        for _ in range(IO_THREADS):
            reply = conn.reply()
            assert isinstance(reply, p.DeleteReply) and not reply.existed
    finally:
        conn.close()
    wait_until(lambda: s3.held == IO_THREADS, "the deletes to wait in the store")


class Reader:
    """Another client reading `key` over and over: every answer it gets is kept."""

    def __init__(self, agent: LocalAgent, key: bytes) -> None:
        self.key, self.got, self.reads = key, 0, 0
        self._stop = threading.Event()
        self._client = KVPoolClient(agent.socket_path)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            data = self._client.get(self.key)
            self.reads += 1
            if data is not None:
                self.got += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._client.close()


def no_room_in_nvme(c: KVPoolClient) -> bool:
    """Whether NVMe's next chunk file needs an eviction first."""
    nvme = c.stats()["tiers"]["nvme"]
    if not nvme["chunks"]:
        return False
    file_bytes = nvme["used_bytes"] // nvme["chunks"]  # all chunks are of one size
    return bool(nvme["capacity_bytes"] - nvme["used_bytes"] < file_bytes)


def demoting(c: KVPoolClient) -> int:
    """Chunks on their way from DRAM to NVMe."""
    n: int = c.stats()["tiers"]["nvme"]["inflight"]
    return n


def settled(c: KVPoolClient, s3: StallingMoto) -> bool:
    nvme = c.stats()["tiers"]["nvme"]
    return s3.held == 0 and not nvme["inflight"] and not nvme["removing"] and uploads_done(c)


def test_a_delete_of_a_chunk_on_its_way_to_nvme_is_final(
        tmp_path: Path, stalling_moto: StallingMoto) -> None:
    s3 = stalling_moto
    # One PUT past the high watermark demotes a third of the arena at once, oldest first:
    # the deleted chunk heads a write batch of 60-odd files.
    policy = {"tiers": {"dram": {"eviction": "lru", "highWatermark": 0.9, "lowWatermark": 0.4}}}
    with start_agent(tmp_path, s3, policy, nvme="256Mi") as agent, \
            KVPoolClient(agent.socket_path, timeout=20, reconnect_timeout=0) as c:
        hold_background_pool(agent, s3)
        key = os.urandom(16)
        assert c.put(key, data_of(key))
        while not demoting(c):  # (no LOOKUP of the key: it must stay the oldest)
            filler = os.urandom(16)
            assert c.put(filler, data_of(filler))
        assert c.lookup_tiers([key]) == ["nvme"]  # on its way there: its write waits
        assert demoting(c) > 1
        assert c.delete(key)
        reader = Reader(agent, key)
        wait_until(lambda: reader.reads > 0, "the reader")
        s3.free()  # the batch and the deletes run now
        wait_until(lambda: settled(c, s3), "the demotions and deletes to land")
        reader.stop()
        assert not reader.got, f"a deleted chunk read {reader.got} times"
        assert c.lookup([key]) == 0 and c.get(key) is None, \
            f"a deleted chunk back in {c.lookup_tiers([key])}"


def test_a_delete_of_a_chunk_on_its_way_from_nvme_to_the_shared_tier_is_final(
        tmp_path: Path, stalling_moto: StallingMoto) -> None:
    s3 = stalling_moto
    # No write-through: a chunk reaches G4 when NVMe evicts it, its file read and uploaded
    # by the pool's file removals. NVMe evicts only for room (no watermark below full).
    # Past 15 of its 16 chunks DRAM demotes one: a PUT always has room without waiting for
    # a demotion to land (held back by the pool, one would wait for good).
    policy = {"tiers": {"dram": {"eviction": "lru", "highWatermark": 0.9,
                                 "lowWatermark": 0.875},
                        "shared": {"writeThrough": False},
                        "nvme": {"eviction": "lru", "highWatermark": 1.0,
                                 "lowWatermark": 0.99}}}
    with start_agent(tmp_path, s3, policy, nvme="4Mi", dram="4Mi") as agent, \
            KVPoolClient(agent.socket_path, timeout=20, reconnect_timeout=0) as c:
        key = os.urandom(16)  # the oldest chunk: the first to leave DRAM, then NVMe
        assert c.put(key, data_of(key))
        while not no_room_in_nvme(c):  # (no LOOKUP of the key: it must stay the oldest)
            filler = os.urandom(16)
            assert c.put(filler, data_of(filler))
            wait_until(lambda: settled(c, s3), "the demotions to land")
        nvme_file = tmp_path / "nvme" / key.hex()[:2] / f"{key.hex()}.kvc"
        assert nvme_file.exists()  # (a LOOKUP would make it the newest)
        hold_background_pool(agent, s3)
        while not c.stats()["tiers"]["nvme"]["removing"]:  # a demotion makes room
            filler = os.urandom(16)
            assert c.put(filler, data_of(filler))
        # NVMe evicted the key: its file waits to be read and uploaded, then removed.
        assert c.lookup_tiers([key]) == []
        assert not c.delete(key)  # in neither DRAM nor NVMe any more
        s3.free()
        wait_until(lambda: settled(c, s3), "the uploads and deletes to land")
        assert c.lookup([key]) == 0 and c.get(key) is None, \
            f"a deleted chunk back in {c.lookup_tiers([key])}"


def test_a_deleted_nvme_chunk_stays_deleted_through_a_sigkill(
        tmp_path: Path, stalling_moto: StallingMoto) -> None:
    """The DELETE of a chunk in NVMe is answered, the background pool is busy, and the
    agent is killed: its restart finds no file of the chunk (before, the file went only
    when the pool got to it, and the restarted agent indexed it and served it)."""
    s3 = stalling_moto
    policy = {"tiers": {"dram": {"eviction": "lru"}}}
    agent = start_agent(tmp_path, s3, policy, nvme="64Mi", dram="4Mi")
    with agent:
        with KVPoolClient(agent.socket_path, timeout=20, reconnect_timeout=0) as c:
            key = os.urandom(16)  # the oldest chunk: the first to leave DRAM
            assert c.put(key, data_of(key))
            while not demoting(c):
                filler = os.urandom(16)
                assert c.put(filler, data_of(filler))
            wait_until(lambda: settled(c, s3), "the demotions to land")
            assert c.lookup_tiers([key]) == ["nvme"]
            hold_background_pool(agent, s3)
            assert c.delete(key)
        agent.kill()
        s3.free()
        agent.start()
        with KVPoolClient(agent.socket_path, timeout=20) as c:
            assert c.lookup([key]) == 0 and c.get(key) is None, \
                f"a deleted chunk back in {c.lookup_tiers([key])} after a restart"

