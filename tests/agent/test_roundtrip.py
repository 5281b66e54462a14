"""A real agent process: zero-copy and inline puts and gets through the socket."""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import scrape, used_bytes


def key() -> bytes:
    return os.urandom(16)


@pytest.mark.parametrize("mode", ["zero_copy", "inline"])
def test_put_get_round_trip(agent: LocalAgent, mode: Any) -> None:
    with KVPoolClient(agent.socket_path, mode=mode) as c:
        k, data = key(), os.urandom(300_001)
        assert c.put(k, data) is True
        assert c.get(k) == data
        out = bytearray(400_000)
        assert c.get_into(k, out) == len(data) and out[: len(data)] == data
        assert c.contains(k) and not c.contains(key())
        assert c.get(key()) is None and c.get_into(key(), out) == 0


def test_zero_copy_and_inline_see_the_same_chunks(agent: LocalAgent) -> None:
    with KVPoolClient(agent.socket_path) as zc, \
            KVPoolClient(agent.socket_path, mode="inline") as il:
        a, b = key(), key()
        zc.put(a, b"written through the arena")
        il.put(b, b"written inline")
        assert il.get(a) == b"written through the arena"
        assert zc.get(b) == b"written inline"


def test_reput_of_an_existing_key_is_deduplicated(client: KVPoolClient) -> None:
    k = key()
    assert client.put(k, b"x" * 10_000) is True
    before = used_bytes(client)
    assert client.put(k, b"y" * 10_000) is False
    assert used_bytes(client) == before
    assert client.get(k) == b"x" * 10_000


def test_numpy_arrays_go_in_and_come_out(client: KVPoolClient) -> None:
    kv = np.arange(2 * 4 * 8 * 16, dtype=np.float16).reshape(2, 4, 8, 16)
    k = key()
    client.put(k, kv)
    out = np.empty_like(kv)
    assert client.get_into(k, out) == kv.nbytes
    assert np.array_equal(out, kv)


def test_metadata_travels_with_the_chunk(client: KVPoolClient) -> None:
    k = key()
    client.put(k, b"bytes", meta=b'{"shape":[5]}')
    assert client.get_with_meta(k, verify=True) == (b"bytes", b'{"shape":[5]}')


def test_lookup_returns_the_longest_present_prefix(client: KVPoolClient) -> None:
    keys = [key() for _ in range(6)]
    for k in keys[:3] + keys[4:]:
        client.put(k, b"chunk")
    assert client.lookup(keys) == 3
    assert client.lookup_tiers(keys) == ["dram"] * 3
    assert client.lookup([]) == 0


def test_delete_and_pin(client: KVPoolClient) -> None:
    k = key()
    client.put(k, b"abc")
    client.pin(k)
    assert client.stats()["pins"] == 1
    assert client.delete(k) is True and client.delete(k) is False
    assert client.get(k) is None and client.stats()["pins"] == 0


class _CountingSocket:
    """Counts bytes through a client's socket (instrumentation, not a stand-in)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sent, self.received = sock, 0, 0

    def sendall(self, data: bytes) -> None:
        self.sent += len(data)
        self.sock.sendall(data)

    def recv_into(self, buf: Any, n: int = 0) -> int:
        got = self.sock.recv_into(buf, n)
        self.received += got
        return got

    def close(self) -> None:
        self.sock.close()


def test_16mib_zero_copy_round_trip_sends_under_4kib_over_the_socket(
        agent: LocalAgent) -> None:
    with KVPoolClient(agent.socket_path) as c:
        conn = c._live().conn
        assert conn.sock is not None
        counter = _CountingSocket(conn.sock)
        conn.sock = counter  # type: ignore[assignment]
        k, data = key(), os.urandom(16 << 20)
        c.put(k, data)
        out = bytearray(16 << 20)
        assert c.get_into(k, out) == len(data) and out == data
        c.lookup([k])  # flushes the pipelined RELEASE reply
        assert counter.sent + counter.received < 4096, (counter.sent, counter.received)


def test_metrics_and_health_endpoints(agent: LocalAgent, client: KVPoolClient) -> None:
    import urllib.request

    client.put(key(), b"z" * 5000)
    client.lookup([key()])
    m = scrape(agent)
    assert m['kvpool_tier_chunks{pool="default",tier="dram"}'] == 1
    assert m['kvpool_tier_misses_total{pool="default",tier="dram"}'] == 1
    assert m['kvpool_tier_capacity_bytes{pool="default",tier="dram"}'] == 32 << 20
    assert m['kvpool_clients{pool="default"}'] == 1
    assert m['kvpool_ops_total{op="alloc",pool="default",result="ok"}'] == 1
    assert m['kvpool_op_duration_seconds_count{op="lookup",pool="default"}'] == 1
    assert 'kvpool_dram_locked_bytes{pool="default"}' in m
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(agent.metrics_url + path, timeout=5) as r:
            assert r.status == 200
