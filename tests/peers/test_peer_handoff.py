"""Hand-off across real nodes (network namespaces): a put hinted with the node that will
read it is pushed there after COMMIT and pinned until read or `peers.handoffTtl`; the
receiver's pin quota bounds what producers may pin; a push that cannot happen (a node
down, unknown, of another secret, a tenant or a sender the receiver lacks) is counted and
leaves the put stored where it was made, readable by key from every node."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.agent.peers import wire
from kvpool.bench.local import LocalAgent

from .conftest import metric, wait_until
from .nodes import Network, peer_agent
from .test_peer_reads import start
from .test_peer_security import authenticated

MiB = 1 << 20


def synced(agent: LocalAgent, peers: int) -> None:
    """The agent follows `peers` peers' inventories: it knows their node names."""
    wait_until(lambda: metric(agent, "kvpool_peer_up") == peers, f"{peers} peers followed")


def pushes(agent: LocalAgent, direction: str, result: str) -> float:
    return metric(agent, "kvpool_peer_pushes_total", direction=direction, result=result)


def handoffs_in_stats(client: KVPoolClient) -> tuple[int, int]:
    """The pinned hand-offs (chunks, arena bytes) STATS gives in the peer tier's row."""
    peer = client.stats()["tiers"]["peer"]
    return peer["handoff_pins"], peer["handoff_bytes"]


def stats_command(agent: LocalAgent) -> str:
    """What `kvpool stats` prints of the agent, whole lines."""
    run = subprocess.run([sys.executable, "-m", "kvpool.agent", "stats", "--socket",
                          str(agent.socket_path)], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "250"})
    assert run.returncode == 0, run.stderr
    return " ".join(run.stdout.split())


def fill(client: KVPoolClient, n: int) -> None:
    """Put `n` chunks of 1 MiB of the node's own: pressure on its arena (LRU: every chunk
    it held before goes, unless pinned)."""
    for _ in range(n):
        assert client.put(os.urandom(16), os.urandom(MiB))


def test_a_put_for_another_node_is_pushed_there_and_pinned_until_its_first_read(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        (a, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False, dram="8Mi",
                                 prefetch=False, named=True, lru=True)
        synced(a, 1)
        key, data = os.urandom(16), os.urandom(MiB)
        assert ca.put(key, data, b"meta", to="node1")  # stored here, whatever the push does
        wait_until(lambda: cb.lookup_tiers([key]) == ["dram"], "the push to land on node 1")
        # (Stored and pinned there before its answer reaches node 0.)
        wait_until(lambda: pushes(a, "sent", "ok") == 1, "node 0 to read the push's answer")
        assert pushes(b, "received", "ok") == 1
        assert metric(b, "kvpool_peer_requests_total", direction="read") == 1  # the push's
        # Node 1's agent restarts (killed, its arena kept: a warm restart) before the
        # consumer has read the chunk: the chunk and its pin are back, with what was left of
        # its TTL.
        b.kill(signal.SIGKILL)
        b.start()
        cb = stack.enter_context(KVPoolClient(b.socket_path))
        synced(b, 1)
        assert metric(b, "kvpool_peer_handoff_pinned_bytes") == MiB
        assert handoffs_in_stats(cb) == (1, MiB)
        assert "peer │ - │ - │" in (shown := stats_command(b)), shown
        assert "hand-offs pinned: 1 (1.0 MiB)" in shown, shown
        # Pinned: node 1's own puts fill its 8 MiB arena over and over; the pushed chunk
        # stays in its DRAM, unread.
        fill(cb, 12)
        assert cb.lookup_tiers([key]) == ["dram"]
        # The consumer reads it locally: no read from a peer on its path, the bytes and
        # metadata as put.
        assert cb.get_with_meta(key) == (data, b"meta")
        assert metric(b, "kvpool_peer_requests_total", direction="read") == 0
        assert metric(b, "kvpool_peer_handoff_pins_total", end="read") == 1
        assert metric(b, "kvpool_peer_handoff_pinned_bytes") == 0
        assert handoffs_in_stats(cb) == (0, 0)
        # Read once, it is an ordinary chunk: the next pressure evicts it (node 0 still
        # holds it, so node 1 counts it in the peer tier).
        fill(cb, 12)
        assert cb.lookup_tiers([key]) == ["peer"]
        # put_many hands a batch off the same way, and a put of a key node 0 holds already
        # (deduplicated) still pushes it: the reader is on node 1.
        keys = [os.urandom(16) for _ in range(3)]
        batch = [os.urandom(MiB // 4) for _ in keys]  # with `key`, within node 1's quota
        synced(a, 1)  # node 0 follows the restarted node 1 again
        assert ca.put_many(keys, batch, to="node1") == [True] * 3
        assert ca.put(key, data, b"meta", to="node1") is False
        wait_until(lambda: cb.lookup_tiers([*keys, key]) == ["dram"] * 4,
                   "the batch and the deduplicated put to land on node 1")
        wait_until(lambda: pushes(a, "sent", "ok") == 5, "node 0 to read their answers")
        for k in [*keys, key]:  # read: their pins end
            assert cb.get(k) is not None
        vllm_producer_saves_to_the_node_its_request_names(a, cb)


def vllm_producer_saves_to_the_node_its_request_names(a: LocalAgent,
                                                      cb: KVPoolClient) -> None:
    """A producer engine's worker side (vLLM's own engines run in test_peer_vllm.py): a
    save job carrying the node its request's `kv_transfer_params` named (the scheduler
    side's `push_target`, tests/integrations/test_vllm_handoff.py) lands there, in DRAM,
    byte for byte as the worker's KV blocks hold it."""
    import torch

    from kvpool.agent.integrations.vllm.jobs import SaveJob, StepJobs
    from kvpool.agent.integrations.vllm.settings import settings
    from kvpool.agent.integrations.vllm.worker import WorkerSide

    from ..integrations.test_vllm_settings import config

    worker = WorkerSide(settings(*config("kv_producer", {"socket": str(a.socket_path)})),
                        "org/model", (0, 0))
    try:
        layers = {f"l{i}": torch.randn(16, 32, 8, 128).to(torch.float16) for i in range(2)}
        worker.register(layers, 16)
        key = os.urandom(16)
        blocks = list(range(8))  # one chunk of 256 tokens: 8 blocks of 32 (1 MiB)
        job = SaveJob("r1", {(0, 0): [key]}, [blocks], [None], to="node1")
        worker.end_step(StepJobs(saves=[job]))
        worker.wait_for_saves({"r1"})
        wait_until(lambda: cb.lookup_tiers([key]) == ["dram"], "the save pushed to node 1")
        expected = b"".join(t[i].numpy().tobytes() for t in layers.values() for i in blocks)
        assert cb.get(key) == expected
    finally:
        worker.close()


def test_a_push_past_the_receivers_pin_quota_is_refused_and_the_put_still_stored(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        # Node 1 lets pushes pin a quarter of its arena: 2 MiB.
        (a, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False, dram="8Mi",
                                 prefetch=False, named=True, lru=True, extra={"handoffShare": 0.25})
        synced(a, 1)
        keys = [os.urandom(16) for _ in range(3)]
        # Three chunks of 1 MiB for node 1: two fit its quota, the third is refused there
        # (before any byte moved), and every put succeeds here.
        assert ca.put_many(keys, [os.urandom(MiB) for _ in keys], to="node1") == [True] * 3
        wait_until(lambda: pushes(a, "sent", "ok") + pushes(a, "sent", "refused") == 3,
                   "the three pushes to be answered")
        assert pushes(a, "sent", "refused") == 1 and pushes(b, "received", "refused") == 1
        assert metric(b, "kvpool_peer_handoff_pinned_bytes") == 2 * MiB
        assert metric(b, "kvpool_peer_requests_total", direction="read") == 2
        assert "pin quota" in a.log() and "pin quota" in b.log()
        wait_until(lambda: sorted(cb.lookup_tiers([k])[0] for k in keys)
                   == ["dram", "dram", "peer"], "the refused one to be node 0's (a pull by key)")
        for k in keys:
            assert cb.get(k) == ca.get(k)
        # Read, the pins are gone and the quota is free again.
        assert metric(b, "kvpool_peer_handoff_pinned_bytes") == 0
        late = os.urandom(16)
        assert ca.put(late, os.urandom(MiB), to="node1")
        wait_until(lambda: cb.lookup_tiers([late]) == ["dram"], "a push within the quota again")


def test_an_unread_push_expires_and_a_push_that_cannot_happen_is_counted_the_put_stored(
        net: Network, tmp_path: Path, secret: Path) -> None:
    other = tmp_path / "other-secret"
    other.write_text(os.urandom(32).hex())
    with ExitStack() as stack:
        # Node 1 pins what is pushed to it for 1 s unread; node 2 runs an agent of another
        # pool secret.
        (a, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False, dram="8Mi",
                                 prefetch=False, named=True, lru=True,
                                 extra={"handoffTtl": "1s"})
        c = stack.enter_context(peer_agent(net, 2, tmp_path / "node2", other, nvme=False,
                                           named=True))
        synced(a, 1)
        # Unread for its TTL, a pushed chunk's pin ends: an ordinary chunk, evictable.
        key = os.urandom(16)
        assert ca.put(key, os.urandom(MiB), to="node1")
        wait_until(lambda: pushes(b, "received", "ok") == 1, "the push to land on node 1")
        wait_until(lambda: metric(b, "kvpool_peer_handoff_pins_total", end="expired") == 1,
                   "its pin to expire unread")
        assert metric(b, "kvpool_peer_handoff_pinned_bytes") == 0
        assert metric(b, "kvpool_peer_handoff_pins_total", end="read") == 0
        fill(cb, 12)
        assert cb.lookup_tiers([key]) == ["peer"]  # evicted; node 0's copy is still there
        # Pushes that cannot happen: to a node that is down, to a name no peer has, to an
        # agent that does not prove the pool's secret. Each put succeeds, each push is
        # counted, and each chunk stays where it was put.
        foreign_node = f"{net.nodes[2].addr}:9410 refused: the pool secret's proof"
        wait_until(lambda: foreign_node in a.log(), "node 0 to have reached node 2")
        data = os.urandom(4096)
        down, nobody, foreign = os.urandom(16), os.urandom(16), os.urandom(16)
        b.kill(signal.SIGKILL)  # node 0 knew it by name
        synced(a, 0)
        assert ca.put(down, data, to="node1")
        assert ca.put(nobody, data, to="no-such-node")
        assert ca.put(foreign, data, to=net.nodes[2].addr)  # by address: its name is unknown
        wait_until(lambda: pushes(a, "sent", "unreachable") == 1, "the push to node 1 counted")
        wait_until(lambda: pushes(a, "sent", "unknown") == 1, "the unknown name counted")
        wait_until(lambda: pushes(a, "sent", "auth") == 1, "the push to node 2 refused")
        assert "no-such-node" in a.log()
        with KVPoolClient(c.socket_path) as cc:
            assert cc.lookup_tiers([foreign]) == []
        for k in (down, nobody, foreign):
            assert ca.get(k) == data
        # A push offer naming a tenant node 0 lacks, or from an agent it does not follow
        # (the pool's secret proven, but no peer of node 0's), is refused, nothing read.
        host = net.nodes[0].addr
        with authenticated(host, secret) as s:
            for rid, tenant in ((1, "no-such-tenant"), (2, "")):
                s.sendall(wire.encode_request(wire.OP_PUSH, rid, os.urandom(16), tenant)
                          + wire.PUSH.pack(4096))
                status, mlen, got = wire.push_reply_head(
                    s.recv(wire.PUSH_REPLY.size, socket.MSG_WAITALL))
                message = s.recv(mlen, socket.MSG_WAITALL).decode()
                assert (status, got) == (wire.PUSH_REFUSED, rid)
                assert ("tenant" if tenant else "not a peer") in message
        assert pushes(a, "received", "refused") == 2

