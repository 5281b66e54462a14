"""A chunk on its way from DRAM to NVMe is served to peers, from its in-flight copy; its
peers hear of a demotion once (the chunk announced), not again when it lands, and hear
that a chunk whose demotion failed is gone.

A demotion takes the chunk out of DRAM's index at once and into NVMe's only once its file
has landed, written by the store's background pool. Meanwhile the holder still announces
the chunk (a demotion is no change for the directory) and serves local reads from the
in-flight copy; a peer's FETCH was answered ABSENT, and the reader fell back to G4 or a
miss (about one read in 700 under DRAM pressure). A DELETE is final there too: a deleted
chunk in flight is not served.

The window is held open as in tests/shared/test_delete_races.py: the holder's shared tier
is an S3 server (moto's, on the namespaces' bridge) that holds DELETE requests, and shared
deletes of other keys keep every thread of the background pool busy, so the demotions'
NVMe writes wait until the test frees them. Real agents on separate network namespaces,
nothing of the agent replaced.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.agent.peers import wire
from kvpool.bench.scripted_peer import recv_exact

from ..agent.test_nvme import fill_filesystem, settle, small_tmpfs
from ..shared.conftest import REGION, StallingMoto, s3_client
from ..shared.test_delete_races import demoting, hold_background_pool
from .conftest import metric, wait_until
from .nodes import Network, peer_agent
from .test_peer_security import authenticated

KiB = 1 << 10
CHUNK = 64 * KiB
BUCKET = "kvpool-peer-demotion"


@pytest.fixture
def bridge_moto(net: Network, monkeypatch: pytest.MonkeyPatch) -> Iterator[StallingMoto]:
    """A stalling S3 server on the bridge's root address, which every node reaches; dummy
    credentials for the agents (and nothing read from the machine's own AWS files)."""
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": REGION, "AWS_CONFIG_FILE": os.devnull,
                       "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                       "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(var, value)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = StallingMoto(net.host)
    s3_client(server.endpoint).create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


def nvme_file(workdir: Path, key: bytes) -> Path:
    h = key.hex()
    return workdir / "nvme" / h[:2] / f"{h}.kvc"


def test_a_chunk_being_demoted_is_served_to_peers_from_its_in_flight_copy_unless_deleted(
        net: Network, tmp_path: Path, secret: Path, bridge_moto: StallingMoto) -> None:
    s3 = bridge_moto
    holder_dir = tmp_path / "node0"
    with ExitStack() as stack:
        # 4 MiB of DRAM, LRU: the oldest chunks are the first demoted. Its 63rd chunk
        # takes it past the high watermark (98 %) and three go down at once (to 95 %),
        # with a page left free: no PUT waits for a held demotion to land.
        a = stack.enter_context(peer_agent(
            net, 0, holder_dir, secret, dram="4Mi", prefetch=False, lru=True,
            shared_tier={"url": f"s3://{BUCKET}/pool", "endpointUrl": s3.endpoint,
                         "requestTimeout": "60s"}))
        ca = stack.enter_context(KVPoolClient(a.socket_path, timeout=20))
        # Node 1 follows node 0 from the start (it hears of the chunks as they are put);
        # neither reader has a shared tier: a chunk node 0 does not serve is a miss.
        b = stack.enter_context(peer_agent(net, 1, tmp_path / "node1", secret, nvme=False,
                                           prefetch=False))
        cb = stack.enter_context(KVPoolClient(b.socket_path))
        wait_until(lambda: metric(b, "kvpool_peer_up") >= 1, "node 1 following node 0")
        early, late, deleted = (os.urandom(16) for _ in range(3))
        data = {k: os.urandom(CHUNK) for k in (early, late, deleted)}
        for k in (early, late, deleted):
            assert ca.put(k, data[k])
        wait_until(lambda: cb.lookup_tiers([early, late, deleted]) == ["peer"] * 3,
                   "node 1 to hear of the chunks")
        hold_background_pool(a, s3)
        # Fillers until the three oldest chunks are on their way to NVMe (no LOOKUP of
        # them on node 0: they must stay the oldest). Their writes wait for the pool.
        while demoting(ca) < 3:
            filler = os.urandom(16)
            assert ca.put(filler, os.urandom(CHUNK))
        assert ca.lookup_tiers([early, late, deleted]) == ["nvme"] * 3
        assert not any(nvme_file(holder_dir, k).exists() for k in data)
        # Node 2 starts now: the inventory it is sent names the chunks in flight.
        c = stack.enter_context(peer_agent(net, 2, tmp_path / "node2", secret, nvme=False,
                                           prefetch=False))
        cc = stack.enter_context(KVPoolClient(c.socket_path))
        wait_until(lambda: cc.lookup_tiers([late]) == ["peer"],
                   "node 2 to find the chunk in flight in node 0's inventory")
        # Node 1 still lists the chunks in flight (a demotion is no change), and reads
        # one (the LOOKUP just before the read names it alone: nothing is read ahead).
        assert cb.lookup_tiers([early, late, deleted]) == ["peer"] * 3
        assert cb.lookup_tiers([early]) == ["peer"]
        assert cb.get(early) == data[early]
        assert cc.get(late) == data[late]
        # A DELETE on node 0 of a chunk it holds only in flight is final: its peers hear
        # it is gone, and nothing of it is served.
        assert ca.delete(deleted)
        wait_until(lambda: cb.lookup_tiers([deleted]) == [], "node 1 to hear of the delete")
        assert cb.get(deleted) is None
        # All of it while the demotions were still held: the bytes came from the
        # in-flight copies, not from files.
        assert demoting(ca) >= 3 and s3.held
        assert not any(nvme_file(holder_dir, k).exists() for k in data)
        assert metric(a, "kvpool_peer_requests_total", direction="served", result="ok") == 2
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="ok") == 1
        assert metric(c, "kvpool_peer_requests_total", direction="read", result="ok") == 1
        s3.free()
        wait_until(lambda: not demoting(ca) and s3.held == 0, "the demotions to land")
        assert ca.lookup_tiers([early, late]) == ["nvme"] * 2
        assert ca.lookup([deleted]) == 0 and not nvme_file(holder_dir, deleted).exists()


class Subscriber:
    """The test process subscribed to an agent's inventory as a peer would be: the ADDs and
    REMOVEs it hears, per key, in order."""

    def __init__(self, host: str, secret: Path) -> None:
        self.sock = authenticated(host, secret)
        self.sock.sendall(wire.encode_request(wire.OP_SUBSCRIBE, 0, bytes(16), ""))
        self.heard: dict[bytes, list[int]] = {}
        self.heartbeats = 0
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        with suppress(OSError, wire.WireError):
            while True:
                msg, tlen, count, _ = wire.stream_head(recv_exact(self.sock, wire.STREAM.size))
                recv_exact(self.sock, tlen)
                body = recv_exact(self.sock, count * wire.RECORD.size)
                if msg in (wire.ADD, wire.REMOVE):
                    for key, _ in wire.records(body):
                        self.heard.setdefault(key, []).append(msg)
                elif msg == wire.HEARTBEAT:
                    self.heartbeats += 1

    def caught_up(self) -> None:
        """Wait for a heartbeat sent after now: every change the agent made before it has
        been heard (a stream sends its changes in order, a heartbeat when it has none)."""
        seen = self.heartbeats
        wait_until(lambda: self.heartbeats >= seen + 2, "a heartbeat after the changes")

    def close(self) -> None:
        self.sock.close()


def test_peers_hear_a_landed_demotion_once_and_a_failed_one_as_the_chunk_gone(
        net: Network, tmp_path: Path, secret: Path) -> None:
    size = 64 * KiB
    workdir = tmp_path / "node0"
    workdir.mkdir()
    with ExitStack() as stack:
        # Node 0's NVMe directory is a real 4 MiB file system (its tier is configured
        # larger): demotions land until the test fills the disk, then fail.
        nvme_dir = stack.enter_context(small_tmpfs(workdir / "nvme", "4m"))
        a = stack.enter_context(peer_agent(net, 0, workdir, secret, dram="2Mi",
                                           prefetch=False, lru=True))
        ca = stack.enter_context(KVPoolClient(a.socket_path))
        peer = Subscriber(net.nodes[0].addr, secret)
        stack.callback(peer.close)
        # 48 chunks through 2 MiB of DRAM: the oldest go down to NVMe and land. Each was
        # announced once, when it was put; a demotion, landed, is no change for peers.
        first = [os.urandom(16) for _ in range(48)]
        for k in first:
            assert ca.put(k, os.urandom(size))
        settle(ca)
        peer.caught_up()
        landed = [k for k in first if ca.lookup_tiers([k]) == ["nvme"]]
        assert len(landed) >= 8, ca.lookup_tiers(first)
        assert {k: peer.heard.get(k) for k in first} == {k: [wire.ADD] for k in first}
        # The disk fills up behind the agent's back: the next demotions fail, the chunks
        # are dropped, and peers hear each one is gone (the directory must not send them
        # to a holder that answers ABSENT).
        fill_filesystem(nvme_dir / "filler")
        more = [os.urandom(16) for _ in range(24)]
        for k in more:
            assert ca.put(k, os.urandom(size))
        settle(ca)
        peer.caught_up()
        assert metric(a, "kvpool_tier_errors_total", tier="nvme", kind="full") > 0
        gone = [k for k in first + more if ca.lookup_tiers([k]) == []]
        assert gone
        assert {k: peer.heard.get(k) for k in first + more} == {
            k: [wire.ADD, wire.REMOVE] if k in gone else [wire.ADD] for k in first + more}
