"""Warm restart: an agent SIGKILLed during a burst of writes comes back with its DRAM tier.

Writers are separate client processes that log each key before its put ("try") and after the
put returned ("ok"). Every acknowledged chunk must come back with its bytes; a chunk whose put
had not returned may come back or not, but never with other bytes. Chunk bytes derive from
their key, so any chunk can be checked without keeping a copy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import scrape, wait_until

KiB = 1 << 10
EVICTIONS = "kvpool_tier_evictions_total"
DAMAGED = 'kvpool_integrity_failures_total{pool="default",tier="dram"}'

WRITER = """
import hashlib, os, sys, time
from kvpool.agent.client import KVPoolClient

socket_path, log_path, mode, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
go = sys.argv[5] if len(sys.argv) > 5 else None

def data_for(key):
    size = 4096 * (1 + key[0] % 8) - key[1]  # 3.8-32 KiB, rarely page-aligned
    return (key * (size // 16 + 1))[:size]

# No reconnect: this writer's burst ends when the agent dies.
with KVPoolClient(socket_path, mode=mode, reconnect_timeout=0) as c, \\
        open(log_path, "a", buffering=1) as log:
    if go is not None:  # connected: the burst starts once the file `go` is there
        log.write("ready\\n")
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.005)
    for _ in range(count):
        key = os.urandom(16)
        log.write(f"try {key.hex()}\\n")
        c.put(key, data_for(key))
        log.write(f"ok {key.hex()}\\n")
"""


def data_for(key: bytes) -> bytes:
    """The writer's bytes for a key (same function as in WRITER)."""
    size = 4096 * (1 + key[0] % 8) - key[1]
    return (key * (size // 16 + 1))[:size]


def read_log(path: Path) -> tuple[set[bytes], set[bytes]]:
    """(tried, acknowledged) keys of one writer."""
    tried: set[bytes] = set()
    acked: set[bytes] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            word, _, hexkey = line.partition(" ")
            if len(hexkey) != 32:
                continue  # a line cut by the writer's own death
            (acked if word == "ok" else tried).add(bytes.fromhex(hexkey))
    return tried | acked, acked


def start_writer(agent: LocalAgent, log: Path, mode: str, go: Path) -> subprocess.Popen[bytes]:
    # 4000 chunks of at most 32 KiB fit in the 256 MiB arena: nothing is ever evicted.
    return subprocess.Popen([sys.executable, "-c", WRITER, str(agent.socket_path), str(log),
                             mode, "4000", str(go)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def ready(log: Path) -> bool:
    return log.exists() and log.read_text().startswith("ready")


@pytest.fixture
def agent(tmp_path: Path) -> LocalAgent:
    return LocalAgent("--no-lock", workdir=tmp_path, dram="256Mi")


def test_sigkill_during_writes_keeps_every_acknowledged_chunk_and_serves_nothing_wrong(
        agent: LocalAgent, tmp_path: Path) -> None:
    agent.start()
    try:
        with KVPoolClient(agent.socket_path) as c:
            deleted = os.urandom(16)
            c.put(deleted, data_for(deleted))
            assert c.delete(deleted)
        logs = {mode: tmp_path / f"writer-{mode}.log" for mode in ("zero_copy", "inline")}
        go = tmp_path / "go"
        writers = [start_writer(agent, log, mode, go) for mode, log in logs.items()]
        # Both bursts start together: a zero-copy writer started first (the other still
        # importing, on a loaded machine) once put all its 4000 chunks before the other
        # had 50, and the kill met it done.
        wait_until(lambda: all(ready(log) for log in logs.values()), timeout=60,
                   what="both writers connected")
        go.touch()
        wait_until(lambda: all(len(read_log(log)[1]) >= 50 for log in logs.values()),
                   timeout=60, what="both writers to have 50 chunks acknowledged")
        agent.kill()  # SIGKILL, mid-burst
        for w in writers:
            w.wait(timeout=60)
        assert all(w.returncode != 0 for w in writers), "a writer finished before the kill"
        assert all(w.poll() is not None for w in writers)

        agent.start()  # same socket, same arena, same journal
        tried: set[bytes] = set()
        acked: set[bytes] = set()
        for log in logs.values():
            t, a = read_log(log)
            tried |= t
            acked |= a
        assert scrape(agent)[f'{EVICTIONS}{{pool="default",reason="capacity",tier="dram"}}'] == 0
        with KVPoolClient(agent.socket_path) as c:
            lost = [k.hex() for k in acked if c.get(k, verify=True) != data_for(k)]
            assert not lost, f"{len(lost)} of {len(acked)} acknowledged chunks lost or wrong"
            for k in tried - acked:  # put in flight at the kill: all or nothing
                got = c.get(k)
                assert got is None or got == data_for(k), f"{k.hex()} served other bytes"
            assert c.get(deleted) is None
            assert c.get(os.urandom(16)) is None
            served = c.stats()["tiers"]["dram"]["chunks"]
            assert len(acked) <= served <= len(tried)  # nothing that was never written
        # Damaged chunks (none expected: even an unanswered put was whole) are counted.
        assert scrape(agent)[DAMAGED] <= len(tried - acked)
        assert "warm restart" in agent.log()
    finally:
        agent.stop()


def test_a_client_opened_before_the_kill_reconnects_by_itself(agent: LocalAgent) -> None:
    agent.start()
    try:
        before = os.urandom(16)
        client = KVPoolClient(agent.socket_path, reconnect_timeout=60)
        assert client.put(before, data_for(before))
        agent.kill()

        # A call made while the agent is down retries HELLO with backoff until it is back.
        got: list[bytes | None] = []
        call = threading.Thread(target=lambda: got.append(client.get(before, verify=True)))
        call.start()
        agent.start()
        call.join(timeout=90)
        assert not call.is_alive(), "the client did not come back"
        assert got == [data_for(before)]

        # It mapped the restarted agent's arena: zero-copy writes land where others read.
        after = os.urandom(16)
        assert client.put(after, data_for(after))
        with KVPoolClient(agent.socket_path) as other:
            assert other.get(after, verify=True) == data_for(after)
        assert client.lookup([before, after]) == 2
        client.close()
    finally:
        agent.stop()


def test_a_warm_restart_of_a_fragmented_arena_keeps_every_chunk(tmp_path: Path) -> None:
    """32,768 one-page chunks, each beside a hole (every other chunk of 65,536 deleted),
    all come back after a SIGKILL. Recovery reserves each chunk's pages by bisection, in
    arena order: it used to scan every free run per chunk, quadratic, minutes here for
    this many (the start-up timeout is a hang guard, far above what recovery takes now)."""
    from kvpool.agent import protocol as p

    from .conftest import RawConn

    page = 4096
    agent = LocalAgent("--no-lock", workdir=tmp_path, dram="320Mi", start_timeout=120)
    agent.start()
    try:
        keys = [os.urandom(16) for _ in range(65536)]
        with KVPoolClient(agent.socket_path) as c:
            for i in range(0, len(keys), 512):
                window = keys[i : i + 512]
                assert all(r is True for r in c.put_many(window,
                                                         [k * (page // 16) for k in window]))
        raw = RawConn(agent.socket_path)
        try:
            doomed = keys[::2]
            for i in range(0, len(doomed), 512):
                window = doomed[i : i + 512]
                raw.send(b"".join(p.encode(p.Delete(j, k)) for j, k in enumerate(window)))
                assert all(isinstance(raw.reply(), p.DeleteReply) for _ in window)
        finally:
            raw.close()
        kept = keys[1::2]
        agent.kill()
        agent.start()
        with KVPoolClient(agent.socket_path) as c:
            assert c.stats()["tiers"]["dram"]["chunks"] == len(kept)
            assert c.lookup(kept[:1024]) == 1024
            for k in kept[::4096]:
                assert c.get(k) == k * (page // 16)
        assert f"{len(kept)} chunks kept" in agent.log()
    finally:
        agent.stop()
