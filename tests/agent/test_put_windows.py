"""A `put_many`'s windows pipelined through a real agent (`kvpool.agent.putwindows`): the
next window's ALLOCs are at the agent while this window is copied, each window's COMMITs
go only after its own fence, results stay per key and in order, and a failure leaves the
windows before it stored and no lease open.

CPU tensors with a stream of the test's own stand in for a GPU's (as in test_tensors.py):
its fence is where a test looks at the agent, or fails, at a known point of the call."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
import torch

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.agent.putwindows import PutCall
from kvpool.agent.transport import Connection, ZeroCopyTransport
from kvpool.bench.local import LocalAgent

from .conftest import wait_until

WINDOW = 4


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    with LocalAgent("--no-lock", workdir=tmp_path_factory.mktemp("put-windows"),
                    dram="32Mi") as a:
        yield a


@pytest.fixture
def observer(agent: LocalAgent) -> Iterator[KVPoolClient]:
    with KVPoolClient(agent.socket_path) as c:
        yield c


class FenceStream:
    """A copy stream whose fences call `at_fence(n)` (n: 0 for the call's first window)
    when waited on, before the window's COMMITs can go; `fail_at` makes recording the
    fence of that window fail (a device error after its copies were issued)."""

    def __init__(self, at_fence: Callable[[int], None], fail_at: int = -1) -> None:
        self.at_fence = at_fence
        self.fail_at = fail_at
        self.fences = 0
        self.waits: list[int] = []

    def issue(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def record(self) -> FenceStream:
        if self.fences == self.fail_at:
            self.fail_at = -1
            raise RuntimeError("the device could not record the event")
        return self

    def wait(self) -> None:
        self.waits.append(self.fences)
        self.at_fence(self.fences)
        self.fences += 1


def chunks(n: int, size: int = 4096) -> list[torch.Tensor]:
    return [torch.full((size,), i, dtype=torch.uint8) for i in range(n)]


def fresh_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def write_leases(c: KVPoolClient) -> int:
    held: int = c.stats()["leases"]["write"]
    return held


def leases_reaching(c: KVPoolClient, n: int, timeout: float = 10.0) -> int:
    """The agent's write leases once they are `n` (the agent answers requests already
    sent), or as many as it holds after `timeout`: a count to assert on afterwards, where
    an assertion would be swallowed (a failed window's settle suppresses its stream's
    errors)."""
    deadline = time.monotonic() + timeout
    while (held := write_leases(c)) != n and time.monotonic() < deadline:
        time.sleep(0.02)
    return held


def test_the_next_windows_allocs_reach_the_agent_before_this_windows_commits_go(
        agent: LocalAgent, observer: KVPoolClient) -> None:
    """At each window's fence (its COMMITs not sent yet, so not answered) the agent holds
    the leases of the next window too: its ALLOCs went out before this window's copies."""
    keys, data = fresh_keys(3 * WINDOW), chunks(3 * WINDOW)

    def at_fence(n: int) -> None:
        held = 2 * WINDOW if n < 2 else WINDOW  # the last window has none after it
        assert leases_reaching(observer, held) == held
        assert observer.lookup(keys) == n * WINDOW  # only the windows before are stored

    stream = FenceStream(at_fence)
    with KVPoolClient(agent.socket_path, batch_window=WINDOW) as c:
        assert c.put_many(keys, data, stream=stream) == [True] * len(keys)
    assert stream.waits == [0, 1, 2]
    assert observer.lookup(keys) == len(keys)
    assert write_leases(observer) == 0


def test_a_window_that_fails_while_the_one_before_commits_leaves_that_one_stored_and_no_lease(
        agent: LocalAgent, observer: KVPoolClient) -> None:
    """Window 1's fence fails with window 0's COMMITs and window 2's ALLOCs in flight: the
    error reaches the caller once window 1's copies were waited for with every lease still
    open, window 0 is stored, windows 1 and 2 are ABORTed, and the connection goes on."""
    keys, data = fresh_keys(3 * WINDOW), chunks(3 * WINDOW)
    settled: list[int] = []

    def at_fence(n: int) -> None:
        if n == 1:  # the failed fence's settle: nothing ABORTed while copies may run
            settled.append(leases_reaching(observer, 2 * WINDOW))

    stream = FenceStream(at_fence, fail_at=1)
    with KVPoolClient(agent.socket_path, batch_window=WINDOW) as c:
        with pytest.raises(RuntimeError, match="could not record"):
            c.put_many(keys, data, stream=stream)
        assert stream.waits == [0, 1]
        assert settled == [2 * WINDOW]  # windows 1 and 2 open then
        wait_until(lambda: write_leases(observer) == 0, what="the ABORTs")
        assert [observer.lookup([k]) for k in keys] == [1] * WINDOW + [0] * 2 * WINDOW
        # The replies owed were all read: the same connection puts the rest.
        assert c.put_many(keys, data) == [False] * WINDOW + [True] * 2 * WINDOW
        out = [torch.empty_like(t) for t in data]
        assert c.get_many_into(keys, lambda i, n, m: out[i]) == [4096] * len(keys)
        assert all(torch.equal(a, b) for a, b in zip(data, out, strict=True))
    assert write_leases(observer) == 0


def test_results_stay_per_key_and_in_order_across_windows(
        agent: LocalAgent, observer: KVPoolClient) -> None:
    """Refused chunks and keys stored before, in several windows: each key's own result."""
    keys = fresh_keys(11)
    with KVPoolClient(agent.socket_path, batch_window=WINDOW) as c:
        assert c.hello is not None
        assert c.put_many([keys[2], keys[9]], [b"old" * 10, b"old" * 10]) == [True, True]
        too_big = bytes(c.hello.max_chunk_bytes + 1)
        data = [bytes([i]) * (100 + i) for i in range(11)]
        data[5] = data[8] = too_big
        results = c.put_many(keys, data)
        expected: list[object] = [True] * 11
        expected[2] = expected[9] = False
        for i, r in enumerate(results):
            if i in (5, 8):
                assert isinstance(r, p.ProtocolError) and r.code == p.ErrorCode.BAD_ARGUMENT
            else:
                assert r is expected[i], (i, r)
        for i, k in enumerate(keys):
            if i in (2, 9):
                assert c.get(k) == b"old" * 10
            elif i not in (5, 8):
                assert c.get(k) == data[i]
    assert write_leases(observer) == 0


def test_windows_too_large_to_hold_leases_together_go_one_after_the_other(
        agent: LocalAgent, observer: KVPoolClient) -> None:
    """Two windows of 10 MiB take more than the agent lets one connection hold uncommitted
    (half its 32 MiB): the next window's ALLOCs wait for this window's COMMITs, and every
    chunk is stored (none refused for room the window before still held)."""
    keys, data = fresh_keys(3 * WINDOW), chunks(3 * WINDOW, size=(5 << 20) // 2)

    def at_fence(n: int) -> None:
        assert write_leases(observer) == WINDOW

    stream = FenceStream(at_fence)
    with KVPoolClient(agent.socket_path, batch_window=WINDOW) as c:
        assert c.put_many(keys, data, stream=stream) == [True] * len(keys)
    assert stream.waits == [0, 1, 2]
    assert write_leases(observer) == 0


def test_a_put_whose_agent_restarts_mid_call_goes_on_from_the_first_window_not_done(
        agent: LocalAgent, observer: KVPoolClient) -> None:
    """The agent dies at window 1's fence, after it committed window 0 and granted window
    2's leases (window 0's COMMIT replies not read yet): the client reconnects, puts from
    window 0 again (found stored: False, nothing lost) and every chunk is stored."""
    keys, data = fresh_keys(3 * WINDOW), chunks(3 * WINDOW)

    def at_fence(n: int) -> None:
        if n == 1:
            assert leases_reaching(observer, 2 * WINDOW) == 2 * WINDOW
            agent.kill()
            agent.start()

    stream = FenceStream(at_fence)
    with KVPoolClient(agent.socket_path, batch_window=WINDOW, reconnect_timeout=60) as c:
        assert c.put_many(keys, data, stream=stream) == [False] * WINDOW + [True] * 2 * WINDOW
        out = [torch.empty_like(t) for t in data]
        assert c.get_many_into(keys, lambda i, n, m: out[i]) == [4096] * len(keys)
        assert all(torch.equal(a, b) for a, b in zip(data, out, strict=True))
    assert write_leases(observer) == 0


class ScriptedAgent(threading.Thread):
    """The agent's side of a socket, scripted: ALLOCs granted one after the other in the
    arena, COMMITs stored but for the keys in `refuse` (BAD_ARGUMENT, as an agent answers
    one it cannot take, the lease left open), ABORTs answered; each request logged as it
    arrives, in order (op, key or lease)."""

    def __init__(self, sock: socket.socket, refuse: set[bytes]) -> None:
        super().__init__(daemon=True)
        self.sock, self.refuse = sock, refuse
        self.log: list[tuple[str, object]] = []
        self.leases: dict[int, tuple[bytes, int]] = {}
        """Lease -> (key, arena offset)."""

    def run(self) -> None:
        buf, ids, offset = b"", itertools.count(1), 0
        while data := self.sock.recv(1 << 16):
            buf += data
            out = []
            while len(buf) >= 4 and len(buf) >= 4 + p.HEADER.unpack_from(buf)[0]:
                n = p.HEADER.unpack_from(buf)[0]
                req, buf = p.request_decoder.decode(buf[4 : 4 + n]), buf[4 + n :]
                reply: p.Reply
                if isinstance(req, p.Alloc):
                    lease = next(ids)
                    self.leases[lease] = (req.key, offset)
                    self.log.append(("alloc", req.key))
                    reply = p.AllocReply(req.rid, lease, [(offset, req.size)])
                    offset += -(-req.size // 4096) * 4096
                elif isinstance(req, p.Commit):
                    key = self.leases[req.lease][0]
                    self.log.append(("commit", key))
                    reply = p.ErrorReply(req.rid, p.ErrorCode.BAD_ARGUMENT, "refused") \
                        if key in self.refuse else p.CommitReply(req.rid)
                else:
                    assert isinstance(req, p.Abort), req
                    self.log.append(("abort", req.lease))
                    reply = p.AbortReply(req.rid)
                out.append(p.encode(reply))
            try:
                self.sock.sendall(b"".join(out))
            except (BrokenPipeError, ConnectionResetError):
                return  # the client closed: what it told as it closed needs no answer


def test_a_refused_commit_is_aborted_once_no_reply_is_owed_and_the_connection_stays_in_step(
        ) -> None:
    """Against a scripted agent, on the client's own connection: window 1's ALLOCs arrive
    before window 0's COMMITs; a refused COMMIT is that key's result alone, and its lease
    is ABORTed after every other request of the call (a cast sent while replies are owed
    would have its reply read in their place); the next call's replies are its own."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.memfd_create("arena")
    os.ftruncate(fd, 1 << 20)
    keys = [bytes([k]) * 16 for k in range(6)]
    agent = ScriptedAgent(theirs, refuse={keys[3]})
    agent.start()
    t = ZeroCopyTransport(Connection(ours, itertools.count(1)), fd, 1 << 20)
    try:
        data = [memoryview(bytes([k]) * (100 + k)) for k in range(6)]
        call = PutCall(keys, [d.nbytes for d in data], [b""] * 6, [False] * 6)
        t.put_windows(call, data, batch_window=2, max_leases=64)
        assert call.done == 6
        assert [r is True for r in call.results] == [True, True, True, False, True, True]
        assert isinstance(call.results[3], p.ProtocolError)
        assert call.results[3].code == p.ErrorCode.BAD_ARGUMENT
        ops = [op for op, _ in agent.log]
        assert ops.index("commit") > 3  # windows 0 and 1's ALLOCs came first
        refused = next(lease for lease, (k, _) in agent.leases.items() if k == keys[3])
        # The ABORT is a cast: sent before the call returns, taken by the agent's thread
        # whenever it runs.
        wait_until(lambda: agent.log[-1][0] == "abort", "the refused lease's ABORT")
        ops = [op for op, _ in agent.log]
        assert agent.log[-1] == ("abort", refused) and ops.count("abort") == 1
        arena = mmap.mmap(fd, 1 << 20)
        for key, at in agent.leases.values():
            assert arena[at : at + 100 + key[0]] == bytes(data[key[0]])  # copied into it
        arena.close()

        more = [os.urandom(16) for _ in range(3)]
        again = PutCall(more, [10] * 3, [b""] * 3, [False] * 3)
        t.put_windows(again, [memoryview(b"x" * 10)] * 3, batch_window=2, max_leases=64)
        assert again.results == [True] * 3
    finally:
        t.close()
        agent.join(timeout=10)  # (it reads what the close wrote, then the end)
        theirs.close()
        os.close(fd)


class TimeoutsCounted(socket.socket):
    """A client socket that counts the reads that timed out."""

    timeouts = 0

    def recv_into(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return super().recv_into(*args, **kwargs)
        except TimeoutError:
            self.timeouts += 1
            raise


def test_an_agent_that_stops_answering_costs_a_put_one_timeout_then_its_connection() -> None:
    """An agent that takes the ALLOCs and never answers (stopped, hung): the put fails after
    one read timed out, its connection closed (the agent ends a closed connection's leases
    itself), not after a second timeout spent reading the replies owed, which a stream
    left mid-frame by a timeout could not give in step anyway."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sock = TimeoutsCounted(fileno=ours.detach())
    sock.settimeout(0.2)
    fd = os.memfd_create("arena")
    os.ftruncate(fd, 1 << 20)
    conn = Connection(sock, itertools.count(1))
    t = ZeroCopyTransport(conn, fd, 1 << 20)
    try:
        keys = [bytes([k]) * 16 for k in range(4)]
        data = [memoryview(b"x" * 100)] * 4
        call = PutCall(keys, [100] * 4, [b""] * 4, [False] * 4)
        with pytest.raises(TimeoutError):
            t.put_windows(call, data, batch_window=2, max_leases=64)
        assert sock.timeouts == 1
        assert conn.closed
        assert call.done == 0
    finally:
        t.close()
        theirs.close()
        os.close(fd)
