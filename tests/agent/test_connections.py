"""Accepting clients when file descriptors run out, through a real agent process.

The agent's descriptor limit is lowered from outside (`prlimit` on its pid, soft limit
only), so the agent runs out of descriptors for real: accept() fails with EMFILE.
"""

from __future__ import annotations

import http.client
import os
import resource
import select
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, closing, suppress
from pathlib import Path

import pytest

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import scrape, wait_until
from .test_tenants import TenantAgent


def open_fds(agent: LocalAgent) -> int:
    assert agent.proc is not None
    return len(os.listdir(f"/proc/{agent.proc.pid}/fd"))


def set_fd_limit(agent: LocalAgent, soft: int) -> None:
    """Lower (or raise back) the agent's soft descriptor limit; the hard one stays."""
    assert agent.proc is not None
    _, hard = resource.prlimit(agent.proc.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(agent.proc.pid, resource.RLIMIT_NOFILE, (soft, hard))


def ready(http_conn: http.client.HTTPConnection) -> int:
    """/readyz over a connection opened beforehand (an agent out of descriptors cannot
    accept a new one)."""
    http_conn.request("GET", "/readyz")
    reply = http_conn.getresponse()
    reply.read()
    return reply.status


def hello(path: Path) -> socket.socket:
    """Connect and send HELLO, without waiting for the reply."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(path))
    with suppress(BrokenPipeError):  # refused unread: the refusal is still there to read
        s.sendall(p.encode(p.Hello(1, p.PROTOCOL_VERSION, "test", "")))
    return s


def hello_reply(s: socket.socket) -> p.Reply:
    msg, fds, _, _ = socket.recv_fds(s, 64 * 1024, 1)
    for fd in fds:
        os.close(fd)
    assert msg, "the agent closed the connection without a reply"
    return p.reply_decoder.decode(msg[p.HEADER.size:])


@pytest.fixture
def http_conn(agent: LocalAgent) -> Iterator[http.client.HTTPConnection]:
    with closing(http.client.HTTPConnection("127.0.0.1", agent.metrics_port, timeout=30)) as c:
        yield c


def test_running_out_of_fds_pauses_accepting_and_readiness_until_fds_return(
        agent: LocalAgent, http_conn: http.client.HTTPConnection) -> None:
    assert ready(http_conn) == 200
    with ExitStack() as stack:
        clients = [stack.enter_context(KVPoolClient(agent.socket_path)) for _ in range(12)]
        set_fd_limit(agent, open_fds(agent) - 2)  # not one descriptor left
        late = stack.enter_context(closing(hello(agent.socket_path)))
        wait_until(lambda: ready(http_conn) == 503, "readiness to report the stall")
        for c in clients[:6]:  # their connections end: descriptors come free
            c.close()
        reply = hello_reply(late)
        assert isinstance(reply, p.HelloReply), reply
        wait_until(lambda: ready(http_conn) == 200, "readiness to come back")
    with KVPoolClient(agent.socket_path) as c:
        key, data = b"k" * 16, b"after the stall" * 100
        assert c.put(key, data)
        assert c.get(key) == data


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[TenantAgent]:
    with TenantAgent(tmp_path, "--no-lock", dram="4Mi") as a:
        yield a


def test_one_tenants_connection_flood_leaves_the_other_tenant_served(
        tenants: TenantAgent) -> None:
    limit = open_fds(tenants) + 100
    set_fd_limit(tenants, limit)
    with ExitStack() as stack:
        flood = [stack.enter_context(closing(hello(tenants.socket_of("team-a"))))
                 for _ in range(limit)]
        replies = [hello_reply(s) for s in flood]
        served = [r for r in replies if isinstance(r, p.HelloReply)]
        refused = [r for r in replies if isinstance(r, p.ErrorReply)]
        assert served and refused and len(served) + len(refused) == limit
        assert {r.code for r in refused} == {p.ErrorCode.TOO_MANY_CONNECTIONS}
        # team-b's share is untouched by team-a's flood.
        with KVPoolClient(tenants.socket_of("team-b")) as b:
            key, data = b"b" * 16, b"team-b" * 1000
            assert b.put(key, data)
            assert b.get(key) == data
        # A client refused the same way gets the agent's reason even when the agent has
        # closed before the client's HELLO went out (it does not read it): the client's
        # connect is held until the refusal has arrived, so its HELLO meets a closed socket.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(socket.socket, "connect", connect_then_wait_for_the_agent)
            with pytest.raises(p.ProtocolError) as refusal:
                KVPoolClient(tenants.socket_of("team-a")).close()
        assert refusal.value.code == p.ErrorCode.TOO_MANY_CONNECTIONS
    refused_total = scrape(tenants)['kvpool_connections_refused_total{pool="default"}']
    assert refused_total == len(refused) + 1


_connect = socket.socket.connect


def connect_then_wait_for_the_agent(s: socket.socket, address: str) -> None:
    """socket.connect, returning once the agent has written to (and closed) the socket."""
    _connect(s, address)
    readable, _, _ = select.select([s], [], [], 30)
    assert readable, "the agent neither answered nor closed the connection"
    time.sleep(0.05)  # the close follows the refusal's write


def test_once_its_socket_takes_a_connection_the_whole_agent_is_up(tmp_path: Path) -> None:
    """The socket listens only once the metrics endpoint does, so whoever can connect (a
    client, a start-up probe, a test counting the agent's descriptors) finds the whole
    agent up. Before, the HTTP listener opened just after the socket did: the soak's
    count of an idle agent's descriptors sometimes missed it, and failed at the end."""
    agent = LocalAgent("--no-lock", workdir=tmp_path, dram="16Mi")
    agent.proc = subprocess.Popen([sys.executable, "-m", "kvpool.agent", "agent", *agent.args],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:  # a probe as tight as a client's retry loop can be
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(str(agent.socket_path))
                    break
                except OSError:
                    pass
            assert agent.proc.poll() is None, "the agent exited"
            assert time.monotonic() < deadline, "the agent's socket never took a connection"
            time.sleep(0.0002)
        with urllib.request.urlopen(agent.metrics_url + "/healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        agent.stop()
