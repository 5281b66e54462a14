"""A run of peer chunks' batches landing in order (docs/cross-node.md, "Reads in batches"):
the batch after a batch goes out once the batch's last `AHEAD_LEAD` bytes are what is left
to land, not at its first chunk, so its bytes follow the batch's on the link instead of
sharing it from the start. The order seen by a scripted peer on real connections (a batch
striped over two connections: test_peer_batch_start.py)."""

from __future__ import annotations

import os
import queue
import socket
import threading
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.store.peerreads import AHEAD_LEAD
from kvpool.bench.scripted_peer import ScriptedPeer, chunk_reply

from .nodes import Network, served_by
from .test_peer_reads import seen_as

KiB = 1 << 10


class WatchingPeer(ScriptedPeer):
    """A peer that announces `chunks`, answers each FETCH in order on its connection and
    writes down (under a lock) each FETCH read and each reply sent, in the order they
    happen; it holds its reply to `held` until it has seen a FETCH of one of `wanted`, or
    `HOLD` seconds passed.

    Each connection's FETCHes are read (and written down) by a thread of their own as
    they arrive, not between replies: a connection busy sending its replies would
    otherwise write down FETCHes the agent sent long before, after those it sent since
    on another connection."""

    HOLD = 1.0

    def __init__(self, host: str, secret: bytes, chunks: dict[bytes, bytes], held: bytes,
                 wanted: set[bytes]) -> None:
        self.chunks, self.held, self.wanted = chunks, held, wanted
        self.events: list[tuple[str, bytes]] = []
        self.cond = threading.Condition()
        super().__init__(host, secret)

    def speak(self, conn: socket.socket) -> None:
        read: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(conn, read), daemon=True).start()
        while (fetch := read.get()) is not None:
            rid, key = fetch
            if key == self.held:
                with self.cond:
                    self.cond.wait_for(lambda: any(
                        e == "fetch" and k in self.wanted for e, k in self.events), self.HOLD)
            conn.sendall(chunk_reply(rid, self.chunks[key]))
            with self.cond:
                self.events.append(("reply", key))

    def _read(self, conn: socket.socket, read: queue.SimpleQueue[tuple[int, bytes] | None]
              ) -> None:
        try:
            for rid, key in self.fetches(conn, self.chunks):
                with self.cond:
                    self.events.append(("fetch", key))
                    self.cond.notify_all()
                read.put((rid, key))
        except OSError:
            pass  # the connection closed (ConnectionError is one)
        finally:
            read.put(None)


def test_the_batch_after_goes_out_once_the_last_bytes_of_the_batch_are_left_to_land(
        net: Network, tmp_path: Path, secret: Path) -> None:
    # 64 chunks of 256 KiB: the client's read takes the first 32 (the first alone, the
    # others every second one on each of two connections); the batch of the other 32
    # is sent when chunk 15 lands, the last with AHEAD_LEAD bytes (16 chunks) after it.
    size = 256 * KiB
    chain = 31 - AHEAD_LEAD // size
    assert chain == 15
    chunks = {os.urandom(16): os.urandom(size) for _ in range(64)}
    keys = list(chunks)
    # The peer holds chunk 1 (ahead of chunk `chain` on its connection) until the batch
    # after comes: before the change it came once chunk 0 had landed; now only once the
    # hold gave up and chunk `chain` landed.
    peer = WatchingPeer(net.host, secret.read_bytes().strip(), chunks, keys[1], set(keys[32:]))
    with ExitStack() as stack:
        _, client = served_by(stack, net, tmp_path / "node1", secret, peer, connections=4)
        seen_as(client, keys, ["peer"] * len(keys))
        for k in keys:
            assert client.get(k) == chunks[k]
        with peer.cond:
            events = list(peer.events)
        fetched = [k for e, k in events if e == "fetch"]
        assert sorted(fetched) == sorted(keys)  # each read once, from the peer
        first_after = min(events.index(("fetch", k)) for k in keys[32:])
        assert events.index(("reply", keys[chain])) < first_after
        # (and not sooner: every chunk of the batch before `chain` was sent for by then)
        assert all(events.index(("fetch", k)) < first_after for k in keys[:32])
