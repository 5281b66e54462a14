"""An agent stopped while a peer read is under way ends that read before its arena goes:
the worker receiving into the arena is no longer there when the arena is unmapped (bytes
landing after it were written into whatever the process mapped at those addresses next)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from contextlib import ExitStack
from pathlib import Path

from kvpool.bench.scripted_peer import ScriptedPeer, chunk_reply

from .conftest import wait_until
from .nodes import Network, served_by
from .test_peer_reads import seen_as

MiB = 1 << 20


class HalfwayPeer(ScriptedPeer):
    """A peer that announces `chunks` and answers a FETCH with the first half of its reply,
    then the rest once `go` is set."""

    def __init__(self, host: str, secret: bytes, chunks: dict[bytes, bytes]) -> None:
        self.chunks = chunks
        self.halfway = threading.Event()
        self.go = threading.Event()
        super().__init__(host, secret)

    def speak(self, conn: socket.socket) -> None:
        for rid, key in self.fetches(conn, self.chunks):
            reply = chunk_reply(rid, self.chunks[key])
            conn.sendall(reply[: len(reply) // 2])
            self.halfway.set()
            self.go.wait(60)
            with contextlib.suppress(OSError):
                conn.sendall(reply[len(reply) // 2 :])


def test_an_agent_stopped_mid_read_ends_the_read_before_its_arena_goes(
        net: Network, tmp_path: Path, secret: Path) -> None:
    key, data = os.urandom(16), os.urandom(4 * MiB)
    peer = HalfwayPeer(net.host, secret.read_bytes().strip(), {key: data})
    with ExitStack() as stack:
        stack.callback(peer.go.set)
        # Its reads time out after 60 s: only the stop ends this one.
        agent, client = served_by(stack, net, tmp_path / "node1", secret, peer,
                                  timeout="60s", connections=1)
        seen_as(client, [key], ["peer"])

        def read() -> None:
            with contextlib.suppress(Exception):  # the agent stops under it
                client.get(key)
        threading.Thread(target=read, daemon=True).start()
        wait_until(peer.halfway.is_set, "the peer to send half the chunk")
        assert agent.proc is not None
        agent.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "kvpool agent stopped" in agent.log(), "the agent to stop")
        peer.go.set()  # the rest of the reply, to an agent whose arena went
        assert agent.proc.wait(timeout=60) == 0
        log = agent.log()
        failed = log.find(f"read of {key.hex()} failed")
        assert 0 <= failed < log.index("kvpool agent stopped")
        assert "cannot be written" not in log and "still under way" not in log
