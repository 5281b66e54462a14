"""Bad input gets a documented error or a closed connection; the agent stays up,
other clients are unaffected, no arena bytes leak, no half-written chunk shows."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import RawConn, scrape, used_bytes, wait_until

DROP_AFTER = 3
"""This module's agents' `sendTimeout` and `frameTimeout`, in seconds (10 by default): a
client that stops reading is dropped after the one, as with the default, sooner."""


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[LocalAgent]:
    config = tmp_path / "agent.yaml"
    config.write_text(f"sendTimeout: {DROP_AFTER}s\nframeTimeout: {DROP_AFTER}s\n")
    with LocalAgent("--no-lock", "--config", str(config), workdir=tmp_path, dram="32Mi") as a:
        yield a


@pytest.fixture
def bystander(agent: LocalAgent, client: KVPoolClient) -> bytes:
    """A chunk stored by a well-behaved client before the bad input arrives."""
    k = os.urandom(16)
    client.put(k, b"bystander" * 1000)
    return k


def assert_unharmed(agent: LocalAgent, client: KVPoolClient, k: bytes, baseline: int) -> None:
    assert agent.proc is not None and agent.proc.poll() is None, "agent died"
    assert client.get(k) == b"bystander" * 1000
    wait_until(lambda: used_bytes(client) == baseline, what="arena bytes back to baseline")


def error_of(reply: p.Reply) -> p.ErrorCode:
    assert isinstance(reply, p.ErrorReply), reply
    return p.ErrorCode(reply.code)


def test_malformed_body_gets_bad_frame_and_close(agent, client, bystander) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    raw.send(struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
    assert error_of(raw.reply()) == p.ErrorCode.BAD_FRAME
    assert raw.closed_by_peer()
    assert_unharmed(agent, client, bystander, base)


def test_wrongly_typed_fields_get_bad_frame(agent, client, bystander) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    body = b"\x93\x03\x01\xa3abc"  # ALLOC with a string where the key and size go
    raw.send(struct.pack("<I", len(body)) + body)
    assert error_of(raw.reply()) == p.ErrorCode.BAD_FRAME
    assert raw.closed_by_peer()
    assert_unharmed(agent, client, bystander, base)


def test_truncated_frame_closes_only_that_connection(agent, client, bystander) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    frame = p.encode(p.Alloc(1, os.urandom(16), 4096))
    raw.send(frame[: len(frame) - 3])
    raw.sock.shutdown(1)  # the client goes away mid-frame
    assert raw.closed_by_peer()
    assert_unharmed(agent, client, bystander, base)


def test_frame_over_the_limit_is_refused(agent, client, bystander) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    raw.send(struct.pack("<I", 2**31))
    assert error_of(raw.reply()) == p.ErrorCode.FRAME_TOO_LARGE
    assert raw.closed_by_peer()
    assert_unharmed(agent, client, bystander, base)


def test_unknown_op_is_refused(agent, client, bystander) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    body = b"\x92\x63\x01"  # op 99
    raw.send(struct.pack("<I", len(body)) + body)
    assert error_of(raw.reply()) == p.ErrorCode.UNKNOWN_OP
    assert_unharmed(agent, client, bystander, base)
    assert scrape(agent)['kvpool_ops_total{op="unknown",pool="default",result="unknown_op"}'] == 1


def test_requests_before_hello_are_refused(agent) -> None:
    raw = RawConn(agent.socket_path, hello=False)
    assert error_of(raw.call(p.Lookup(1, []))) == p.ErrorCode.HELLO_REQUIRED


def test_wrong_protocol_version(agent) -> None:
    raw = RawConn(agent.socket_path, hello=False)
    assert error_of(raw.call(p.Hello(1, 999))) == p.ErrorCode.VERSION_MISMATCH


@pytest.mark.parametrize("req", [
    p.Lookup(1, [b"short"]), p.Alloc(1, b"x" * 17, 10), p.Acquire(1, b""), p.Get(1, b"k"),
    p.Delete(1, b"k" * 15), p.Pin(1, b"k"),
])
def test_wrong_key_length_is_bad_key(agent, client, bystander, req) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    assert error_of(raw.call(req)) == p.ErrorCode.BAD_KEY
    assert isinstance(raw.call(p.Stats(2)), p.StatsReply)  # connection still usable
    assert_unharmed(agent, client, bystander, base)


@pytest.mark.parametrize("size", [0, -1, 1 << 40])
def test_bad_sizes_are_bad_argument(agent, size) -> None:
    raw = RawConn(agent.socket_path)
    assert error_of(raw.call(p.Alloc(1, os.urandom(16), size))) == p.ErrorCode.BAD_ARGUMENT


def test_commit_without_alloc_and_double_release(agent, client, bystander) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    assert error_of(raw.call(p.Commit(1, 12345, 0))) == p.ErrorCode.UNKNOWN_LEASE
    lease = raw.call(p.Acquire(2, bystander))
    assert isinstance(lease, p.AcquireReply)
    assert isinstance(raw.call(p.Release(3, lease.lease)), p.ReleaseReply)
    assert error_of(raw.call(p.Release(4, lease.lease))) == p.ErrorCode.UNKNOWN_LEASE
    assert_unharmed(agent, client, bystander, base)


def test_a_hand_off_hint_past_a_node_names_length_is_bad_argument_and_stores_nothing(
        agent, client, bystander) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    k, data, long = os.urandom(16), b"data", "n" * (p.MAX_NODE_BYTES + 1)
    put = p.Put(1, k, data, p.checksum(data), to=long)
    assert error_of(raw.call(put)) == p.ErrorCode.BAD_ARGUMENT
    assert error_of(raw.call(p.Alloc(2, k, 4, to=long))) == p.ErrorCode.BAD_ARGUMENT
    lease = raw.call(p.Alloc(3, k, 4))
    assert isinstance(lease, p.AllocReply)
    commit = p.Commit(4, lease.lease, p.checksum(b"\0" * 4), to=long)
    assert error_of(raw.call(commit)) == p.ErrorCode.BAD_ARGUMENT
    assert client.lookup([k]) == 0
    # The lease stayed open: the COMMIT without the hint stores it.
    assert isinstance(raw.call(p.Commit(5, lease.lease, p.checksum(b"\0" * 4))), p.CommitReply)
    assert client.lookup([k]) == 1
    client.delete(k)
    assert_unharmed(agent, client, bystander, base)


def test_inline_put_with_wrong_checksum_stores_nothing(agent, client) -> None:
    raw = RawConn(agent.socket_path)
    k = os.urandom(16)
    assert error_of(raw.call(p.Put(1, k, b"data", 42))) == p.ErrorCode.CHECKSUM_MISMATCH
    assert client.get(k) is None


def test_uncommitted_write_is_invisible_and_freed_when_the_client_dies(
        agent, client, bystander) -> None:
    base = used_bytes(client)
    k = os.urandom(16)
    # A real client process: ALLOC, half a copy into the arena, then SIGKILL.
    script = textwrap.dedent(f"""
        import os, sys
        from kvpool.agent import protocol as p
        from kvpool.agent.client import KVPoolClient
        c = KVPoolClient({str(agent.socket_path)!r})
        a = c._call(p.Alloc(99, bytes.fromhex({k.hex()!r}), 1 << 20))
        off = a.extents[0][0]
        c._arena[off:off + 4096] = b"h" * 4096
        print("allocated", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"allocated"
    assert used_bytes(client) >= base + (1 << 20)
    assert client.lookup([k]) == 0 and client.get(k) is None  # never visible half-written
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert_unharmed(agent, client, bystander, base)
    assert client.get(k) is None


def test_client_killed_holding_read_leases_releases_them(agent, client, bystander) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    for rid in range(5):
        assert isinstance(raw.call(p.Acquire(rid, bystander)), p.AcquireReply)
    assert client.stats()["leases"]["read"] == 5
    raw.close()
    wait_until(lambda: client.stats()["leases"]["read"] == 0, what="read leases released")
    assert_unharmed(agent, client, bystander, base)


def test_client_that_never_reads_replies_is_dropped(agent, client, bystander) -> None:
    base = used_bytes(client)
    raw = RawConn(agent.socket_path)
    raw.sock.setblocking(False)
    stats = p.encode(p.Stats(1))
    # Flood requests without reading until the agent stops taking them: it is stuck
    # sending replies nobody reads. A send refused for a moment is not enough (the agent
    # may still be catching up and find room for its replies), so go on until sends have
    # been refused for a while, or the agent has already hung up.
    stalled_since: float | None = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            raw.sock.send(stats)
            stalled_since = None
        except BlockingIOError:
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > 2:
                break
            time.sleep(0.01)
        except OSError:
            break  # dropped already
    assert stalled_since is not None or time.monotonic() < deadline, "socket never filled"
    # Meanwhile other clients are served.
    assert client.get(bystander) == b"bystander" * 1000
    raw.sock.setblocking(True)
    raw.sock.settimeout(60)
    wait_until(lambda: client.stats()["clients"] == 1, timeout=60,
               what="the non-reading client to be dropped")
    assert_unharmed(agent, client, bystander, base)


def test_idle_write_lease_expires(tmp_path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("writeLeaseTimeout: 1s\n")
    with LocalAgent("--no-lock", "--config", str(cfg), workdir=tmp_path) as agent, \
            KVPoolClient(agent.socket_path) as c:
        base = used_bytes(c)
        raw = RawConn(agent.socket_path)
        a = raw.call(p.Alloc(1, os.urandom(16), 100_000))
        assert isinstance(a, p.AllocReply)
        wait_until(lambda: c.stats()["leases"]["write"] == 0,
                   what="the idle write lease to expire")
        assert error_of(raw.call(p.Commit(2, a.lease, 0))) == p.ErrorCode.UNKNOWN_LEASE
        # Its pages are fenced while its writer may still copy into them (issue 17 item 5,
        # tests/agent/test_slow_writer.py), and free once its connection closes.
        assert used_bytes(c) > base
        raw.close()
        wait_until(lambda: used_bytes(c) == base, what="the expired lease's pages to be freed")


def rss_bytes(agent: LocalAgent) -> int:
    assert agent.proc is not None
    with open(f"/proc/{agent.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_idle_connections_hold_no_memory_of_a_large_rejected_frame(agent, client) -> None:
    """A connection's receive buffer grows for a large frame and goes back once the frame
    is handled: idle connections, each after one rejected 32 MiB PUT, hold none of it."""
    frames = 4
    size = 32 << 20
    before = rss_bytes(agent)
    conns = [RawConn(agent.socket_path) for _ in range(frames)]
    try:
        for raw in conns:
            data = b"\x01" * size
            reply = raw.call(p.Put(1, b"bad key", data, p.checksum(data, b""), b""))
            assert error_of(reply) == p.ErrorCode.BAD_KEY
        # All of them idle now, still open: the buffers they grew are given back (within
        # a housekeeping round).
        wait_until(lambda: rss_bytes(agent) - before < size,
                   f"{frames} idle connections to hold less than one frame's bytes")
        for raw in conns:  # and each still works
            assert isinstance(raw.call(p.Stats(2)), p.StatsReply)
    finally:
        for raw in conns:
            raw.close()
