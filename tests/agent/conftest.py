"""Fixtures that start real agent processes and talk to them over real sockets."""

from __future__ import annotations

import contextlib
import resource
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from ..support import scrape as scrape  # re-exported for the tests
from ..support import wait_until as wait_until

FUZZ_PROFILE = "kvpool-fuzz"
"""`pytest tests/agent -m fuzz --hypothesis-profile=kvpool-fuzz`: the protocol fuzz tests with
many more examples and longer op sequences (docs/testing.md). Without it they run the bounded
number of examples CI runs. Registered here, not in the tests, because Hypothesis loads the
profile when pytest starts, before it imports any test module."""

settings.register_profile(
    FUZZ_PROFILE,
    max_examples=20_000,
    stateful_step_count=200,
    deadline=None,
    # Every example talks to a real agent process: slow by Hypothesis' standards, on purpose.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[LocalAgent]:
    with LocalAgent("--no-lock", workdir=tmp_path, dram="32Mi") as a:
        yield a


def module_agent(name: str = "agent") -> Any:
    """A fixture `name` (assign it to that name in the test module): one agent (32 MiB of
    DRAM) for all the module's tests, each with its own keys and every lease released;
    an agent's start is most of what such a test costs."""

    @pytest.fixture(scope="module", name=name)
    def started(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
        workdir = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
        with LocalAgent("--no-lock", workdir=workdir, dram="32Mi") as a:
            yield a

    return started


@pytest.fixture
def client(agent: LocalAgent) -> Iterator[KVPoolClient]:
    with KVPoolClient(agent.socket_path) as c:
        yield c


JOURNAL_LIMIT = 2 << 20
"""Bytes `journal_capped` lets its agent's files grow to: its arena's size."""


@contextlib.contextmanager
def journal_capped(workdir: Path) -> Iterator[LocalAgent]:
    """An agent (2 MiB arena, metadata up to 16 KiB) whose commit journal cannot grow past
    `JOURNAL_LIMIT`: RLIMIT_FSIZE, which the agent inherits, stands in for a full tmpfs.
    Chunks of one page with 16,000 bytes of metadata fill the journal long before the
    arena. A restart (`start`) runs without the limit."""
    config = workdir / "agent.yaml"
    config.write_text("maxMetaBytes: 16384\n")
    agent = LocalAgent("--no-lock", "--config", str(config), workdir=workdir, dram="2Mi")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (JOURNAL_LIMIT, hard))
    try:
        agent.start()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        yield agent
    finally:
        agent.stop()


def used_bytes(client: KVPoolClient) -> int:
    used: int = client.stats()["tiers"]["dram"]["used_bytes"]
    return used


class RawConn:
    """A bare socket speaking frames by hand, for sending what a real client never would."""

    def __init__(self, path: Path, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.sock.connect(str(path))
        if hello:
            self.send(p.encode(p.Hello(0, p.PROTOCOL_VERSION)))
            msg, fds, _, _ = socket.recv_fds(self.sock, 65536, 1)
            for fd in fds:
                import os

                os.close(fd)
            assert msg, "no HELLO reply"

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def call(self, req: p.Request) -> p.Reply:
        self.send(p.encode(req))
        return self.reply()

    def reply(self) -> p.Reply:
        head = self._exact(4)
        (n,) = p.HEADER.unpack(head)
        reply: p.Reply = p.reply_decoder.decode(self._exact(n))
        return reply

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed by agent")
            buf += chunk
        return buf

    def closed_by_peer(self) -> bool:
        """True once the agent has closed this connection (reads EOF)."""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True

    def close(self) -> None:
        self.sock.close()
