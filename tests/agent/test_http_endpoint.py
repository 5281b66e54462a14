"""The agent's HTTP endpoint (`server/http.py`) against a real agent process: GET and HEAD of
/metrics, /healthz and /readyz; persistent connections (several requests on one, as a
scraper or a probe keeps it); and what a buggy or hostile client gets: 404, 405, a
request that is not HTTP answered 400 and closed, a head past the limit closed; the agent
answers the next client all the same."""

from __future__ import annotations

import http.client
import socket
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from kvpool.agent.server.http import MAX_HEAD
from kvpool.bench.local import LocalAgent

from .conftest import module_agent

agent = module_agent()


def connection(agent: LocalAgent) -> http.client.HTTPConnection:
    url = urlsplit(agent.metrics_url)
    assert url.hostname is not None and url.port is not None
    return http.client.HTTPConnection(url.hostname, url.port, timeout=10)


def raw(agent: LocalAgent, data: bytes) -> bytes:
    """What the agent answers `data` sent on a fresh connection, until it closes it."""
    url = urlsplit(agent.metrics_url)
    assert url.hostname is not None and url.port is not None
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def test_three_paths_on_one_persistent_connection(agent: LocalAgent) -> None:
    conn = connection(agent)
    try:
        conn.request("GET", "/metrics")
        reply = conn.getresponse()
        body = reply.read()
        assert reply.status == 200
        assert reply.getheader("Content-Type") == CONTENT_TYPE_LATEST  # Prometheus text
        assert b'kvpool_tier_capacity_bytes{pool="default",tier="dram"}' in body
        for path, text in (("/healthz", b"ok\n"), ("/readyz", b"ready\n"),
                           ("/readyz?verbose=1", b"ready\n")):
            conn.request("GET", path)  # the same connection, kept open
            reply = conn.getresponse()
            assert (reply.status, reply.read()) == (200, text)
            assert reply.getheader("Connection") is None
        conn.request("HEAD", "/healthz")
        reply = conn.getresponse()
        assert reply.status == 200 and reply.getheader("Content-Length") == "3"
        assert reply.read() == b""
    finally:
        conn.close()


def test_an_unknown_path_or_method_is_refused_and_the_connection_stays(
        agent: LocalAgent) -> None:
    conn = connection(agent)
    try:
        conn.request("GET", "/nowhere")
        reply = conn.getresponse()
        assert reply.status == 404 and b"/metrics" in reply.read()
        conn.request("DELETE", "/metrics")
        reply = conn.getresponse()
        reply.read()
        assert reply.status == 405 and reply.getheader("Allow") == "GET, HEAD"
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_http_1_0_gets_its_answer_then_the_close(agent: LocalAgent) -> None:
    got = raw(agent, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Connection: close\r\n" in got and got.endswith(b"\r\n\r\nok\n")


def test_what_is_not_a_request_is_answered_400_and_closed(agent: LocalAgent) -> None:
    for junk in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS, say
                 b"GET\r\n\r\n",
                 b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
                 b"GET /metrics SPDY/3\r\n\r\n"):
        got = raw(agent, junk)
        assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n"), (junk, got)
        assert b"Connection: close\r\n" in got
    conn = connection(agent)
    conn.request("GET", "/healthz")
    assert conn.getresponse().status == 200
    conn.close()


def test_a_head_past_the_limit_is_closed_unanswered(agent: LocalAgent) -> None:
    head = b"GET /metrics HTTP/1.1\r\nX-Filler: " + b"a" * MAX_HEAD + b"\r\n\r\n"
    assert raw(agent, head) == b""
    conn = connection(agent)
    conn.request("GET", "/readyz")
    assert conn.getresponse().status == 200
    conn.close()
    assert agent.proc is not None and agent.proc.poll() is None
