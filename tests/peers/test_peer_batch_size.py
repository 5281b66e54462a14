"""A client's batch of peer reads asks for no more than its link lands in time, its own
chunk counted (docs/cross-node.md, "Slow links"): on a link not measured yet, a batch is
8 MiB, the chunk the client asked for and those after it in its LOOKUP together."""

from __future__ import annotations

import os
import select
import socket
import threading
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.peers.linkrate import MIN_BATCH_BYTES
from kvpool.bench.scripted_peer import ScriptedPeer, chunk_reply

from .nodes import Network, served_by
from .test_peer_reads import seen_as

MiB = 1 << 20


class BatchesPeer(ScriptedPeer):
    """A peer that announces `chunks` and answers FETCHes at once; `batches`: the keys of
    each run of FETCHes a connection sent before it waited for their replies (a batch's
    FETCHes come in one write)."""

    def __init__(self, host: str, secret: bytes, chunks: dict[bytes, bytes]) -> None:
        self.chunks = chunks
        self.batches: list[list[bytes]] = []
        self.lock = threading.Lock()
        super().__init__(host, secret)

    def speak(self, conn: socket.socket) -> None:
        owed: list[tuple[int, bytes]] = []
        for rid, key in self.fetches(conn, self.chunks):
            owed.append((rid, key))
            if select.select([conn], [], [], 0.05)[0]:
                continue  # a request more already in: the same batch
            with self.lock:
                self.batches.append([k for _, k in owed])
            for r, k in owed:
                conn.sendall(chunk_reply(r, self.chunks[k]))
            owed.clear()


def test_a_clients_first_batch_on_a_link_not_measured_yet_counts_its_own_chunk(
        net: Network, tmp_path: Path, secret: Path) -> None:
    chunks = {os.urandom(16): os.urandom(4 * MiB) for _ in range(6)}
    keys = list(chunks)
    peer = BatchesPeer(net.host, secret.read_bytes().strip(), chunks)
    with ExitStack() as stack:
        # One connection: the batch is one write on it (no first FETCH alone, no stripes).
        _, client = served_by(stack, net, tmp_path / "node1", secret, peer, connections=1)
        seen_as(client, keys, ["peer"] * len(keys))
        assert client.get(keys[0]) == chunks[keys[0]]
        first = peer.batches[0]
        # The asked-for chunk and one after it: 8 MiB (without its own chunk counted, two
        # after it, 12 MiB, on a link the reader knows nothing of yet).
        assert first == keys[:2]
        assert sum(len(chunks[k]) for k in first) <= MIN_BATCH_BYTES
        for k, d in chunks.items():
            assert client.get(k) == d
