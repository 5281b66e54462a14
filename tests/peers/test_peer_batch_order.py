"""A run of peer chunks' batches landing in order (docs/cross-node.md, "Reads in batches"):
the batch after a batch goes out once the batch's last `AHEAD_LEAD` bytes are what is left
to land, counted in whatever order its chunks land, not at its first chunk, so its bytes
follow the batch's on the link instead of sharing it from the start; and only once the
batch before has landed whole, so a run has at most two batches in flight. The order seen
by a scripted peer on real connections (a batch striped over two connections:
test_peer_batch_start.py)."""

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


def replies_before(events: list[tuple[str, bytes]], keys: list[bytes], at: int) -> int:
    return sum(1 for e, k in events[:at] if e == "reply" and k in keys)


def first_fetch(events: list[tuple[str, bytes]], keys: list[bytes]) -> int:
    return min(events.index(("fetch", k)) for k in keys)


def read_all(stack: ExitStack, net: Network, tmp_path: Path, secret: Path,
             peer: WatchingPeer) -> list[tuple[str, bytes]]:
    """Node 1 reads every chunk of `peer`, in order, each once from it; what the peer
    saw."""
    keys = list(peer.chunks)
    _, client = served_by(stack, net, tmp_path / "node1", secret, peer, connections=4)
    seen_as(client, keys, ["peer"] * len(keys))
    for k in keys:
        assert client.get(k) == peer.chunks[k]
    with peer.cond:
        events = list(peer.events)
    assert sorted(k for e, k in events if e == "fetch") == sorted(keys)
    return events


def test_the_batch_after_goes_out_once_the_last_bytes_of_the_batch_are_left_to_land(
        net: Network, tmp_path: Path, secret: Path) -> None:
    # 64 chunks of 256 KiB: the client's read takes the first 32 (the first alone, the
    # others every second one on each of two connections); the batch of the other 32
    # goes out once 16 of them have landed, the batch's last AHEAD_LEAD bytes left. The
    # peer holds chunk 1 (ahead of the odd chunks on its connection) until the batch
    # after comes: the 16 that land are chunk 0 and the even ones. (Before, the batch
    # after went at the landing of chunk 15, the one with AHEAD_LEAD after it, behind
    # the held chunk on its connection: it waited for the hold to give up.)
    size = 256 * KiB
    ahead = 32 - AHEAD_LEAD // size
    assert ahead == 16
    chunks = {os.urandom(16): os.urandom(size) for _ in range(64)}
    keys = list(chunks)
    peer = WatchingPeer(net.host, secret.read_bytes().strip(), chunks, keys[1], set(keys[32:]))
    with ExitStack() as stack:
        events = read_all(stack, net, tmp_path, secret, peer)
    after = first_fetch(events, keys[32:])
    assert replies_before(events, keys[:32], after) == ahead
    assert events.index(("reply", keys[1])) > after  # not waited for
    # (and every chunk of the batch before was sent for by then)
    assert all(events.index(("fetch", k)) < after for k in keys[:32])


def test_a_runs_third_batch_waits_for_the_first_to_land_whole(
        net: Network, tmp_path: Path, secret: Path) -> None:
    # 96 chunks of 256 KiB, three batches of 32. The peer holds the first batch's last
    # chunk until the third batch is sent for. The second batch goes out as the first's
    # other chunks land, and lands whole; the third goes out only once the first's held
    # chunk is in (the hold gave up), not as the second's chunks land: a run has at most
    # two batches in flight. (Before, the third went out as the second landed, and on a
    # slow link a run's batches piled up on it, each taking a share, until the oldest's
    # tail timed out.)
    size = 256 * KiB
    chunks = {os.urandom(16): os.urandom(size) for _ in range(96)}
    keys = list(chunks)
    peer = WatchingPeer(net.host, secret.read_bytes().strip(), chunks, keys[31],
                        set(keys[64:]))
    with ExitStack() as stack:
        events = read_all(stack, net, tmp_path, secret, peer)
    second, third = first_fetch(events, keys[32:64]), first_fetch(events, keys[64:])
    held = events.index(("reply", keys[31]))
    assert second < held < third
    assert replies_before(events, keys[32:64], held) == 32  # the second, whole meanwhile
