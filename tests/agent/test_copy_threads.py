"""A read window's copies into buffers on the process's copy threads (`copythreads`),
against a real agent: every chunk lands byte-exact, a damaged one is a miss while the rest
land, a chunk's read lease is held until its copy is done, and the number of threads
follows the cores or `$KVPOOL_COPY_THREADS`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.agent import copythreads
from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import module_agent

KiB = 1 << 10
MiB = 1 << 20


agent = module_agent()


@pytest.fixture
def copy_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process with 3 copy threads (a fresh pool, shut down after the test)."""
    monkeypatch.setenv(copythreads.ENV_COPY_THREADS, "3")
    monkeypatch.setattr(copythreads, "_pool", None)
    yield
    if copythreads._pool is not None:
        copythreads._pool.shutdown()


def _copy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvpool-copy")]


def test_a_window_copied_on_copy_threads_lands_every_chunk_byte_exact(
        agent: LocalAgent, copy_threads: None) -> None:
    # Chunks of several blocks, of one, and small ones (copied by the caller), more than
    # a window's first group, into buffers larger than some of them.
    sizes = [MiB, 2 * MiB + 3 * KiB, 300 * KiB, 4 * KiB, MiB, 700 * KiB, 100, MiB, 256 * KiB]
    keys = [os.urandom(16) for _ in sizes]
    data = [os.urandom(n) for n in sizes]
    outs = [bytearray(n + (i % 2) * 4096) for i, n in enumerate(sizes)]
    with KVPoolClient(agent.socket_path) as c:
        assert c.put_many(keys, data) == [True] * len(keys)
        assert c.get_many_into(keys, lambda i, n, m: outs[i]) == sizes
        assert [bytes(o[: len(d)]) for o, d in zip(outs, data, strict=True)] == data
        assert c.stats()["leases"]["read"] == 0
    assert _copy_threads(), "the chunks were not copied on copy threads"


def test_a_damaged_chunk_copied_on_a_copy_thread_is_a_miss_and_the_rest_land(
        agent: LocalAgent, copy_threads: None) -> None:
    size = 512 * KiB
    keys = [os.urandom(16) for _ in range(6)]
    data = [os.urandom(size) for _ in keys]
    outs = [bytearray(size) for _ in keys]
    with KVPoolClient(agent.socket_path) as c:
        assert c.put_many(keys, data) == [True] * len(keys)
        conn = c._live().conn
        lease = conn.call(p.Acquire(conn.rid(), keys[3]))
        assert isinstance(lease, p.AcquireReply)
        arena = c._arena
        assert arena is not None
        arena[lease.extents[0][0] + size - 5] ^= 0x10  # in the chunk's last block
        conn.cast(p.Release(conn.rid(), lease.lease))
        got = c.get_many_into(keys, lambda i, n, m: outs[i])
        assert got == [size, size, size, 0, size, size]
        assert [bytes(o) for i, o in enumerate(outs) if i != 3] == data[:3] + data[4:]
        # without verifying, the bytes are copied as they are
        assert c.get_many_into(keys, lambda i, n, m: outs[i], verify=False) == [size] * 6
        assert outs[3][size - 5] == data[3][size - 5] ^ 0x10
        assert c.stats()["leases"]["read"] == 0
    assert _copy_threads()


@pytest.mark.parametrize("torch_loaded", [False, True], ids=["plain", "torch loaded"])
def test_a_window_that_fails_ends_no_lease_before_its_copies_on_copy_threads_are_done(
        agent: LocalAgent, copy_threads: None, monkeypatch: pytest.MonkeyPatch,
        torch_loaded: bool) -> None:
    """The caller's target fails while copies of the chunks before it still run on the
    copy threads: the window's RELEASEs go out only once those copies are done (each
    copy, once done, finds every lease of the window still held by the agent). In a
    process that has loaded torch (an engine's) a window goes through the tensor path,
    its buffers' copies on the same threads: the same holds there."""
    if torch_loaded:
        import torch  # noqa: F401
    else:  # (the client takes the tensor path wherever torch is loaded)
        monkeypatch.delitem(sys.modules, "torch", raising=False)
    size = 512 * KiB
    keys = [os.urandom(16) for _ in range(8)]
    data = [os.urandom(size) for _ in keys]
    outs = [bytearray(size) for _ in keys]
    failed = threading.Event()
    held: list[int] = []
    copy = copythreads._copy
    one = threading.Lock()  # a client is not shared by threads at once

    with KVPoolClient(agent.socket_path) as c, KVPoolClient(agent.socket_path) as other:
        def watched(*args: object) -> bool:
            failed.wait(5)
            time.sleep(0.05)  # a RELEASE sent meanwhile would be in by now
            done = copy(*args)  # type: ignore[arg-type]
            with one:
                held.append(other.stats()["leases"]["read"])
            return done

        def target(i: int, n: int, meta: bytes) -> bytearray:
            if i == len(keys) - 1:
                failed.set()
                raise RuntimeError("the caller's target failed")
            return outs[i]
        monkeypatch.setattr(copythreads, "_copy", watched)
        assert c.put_many(keys, data) == [True] * len(keys)
        with pytest.raises(RuntimeError, match="target failed"):
            c.get_many_into(keys, target)
        assert held and min(held) == len(keys), held
        assert [bytes(o) for o in outs[: len(held)]] == data[: len(held)]
        # (asked on the window's connection: after its RELEASEs, which have no reply)
        assert c.stats()["leases"]["read"] == 0
        # the client goes on
        assert c.get_many_into(keys, lambda i, n, m: outs[i]) == [size] * len(keys)


def test_a_forked_child_copies_on_threads_of_its_own(agent: LocalAgent,
                                                    copy_threads: None) -> None:
    """A child forked after its parent made its copy threads (an engine forking its
    workers) has none of them: its window's copies run on a pool of its own, not on jobs
    queued for threads that are not there (which would never be done)."""
    size = 512 * KiB
    keys = [os.urandom(16) for _ in range(6)]
    data = [os.urandom(size) for _ in keys]
    with KVPoolClient(agent.socket_path) as c:
        assert c.put_many(keys, data) == [True] * len(keys)
        outs = [bytearray(size) for _ in keys]
        assert c.get_many_into(keys, lambda i, n, m: outs[i]) == [size] * len(keys)
    parents = copythreads._pool
    assert parents is not None
    pid = os.fork()
    if pid == 0:  # the child: its own client, its own copy threads
        ok = False
        try:
            with KVPoolClient(agent.socket_path) as child:
                outs = [bytearray(size) for _ in keys]
                got = child.get_many_into(keys, lambda i, n, m: outs[i])
                ok = got == [size] * len(keys) and [bytes(o) for o in outs] == data and \
                    copythreads._pool is not None and copythreads._pool is not parents
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's window never finished")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_copy_threads_follow_the_cores_and_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert [copythreads.default_threads(n) for n in (1, 2, 4, 7, 8, 12, 16, 64)] == \
        [0, 0, 0, 0, 2, 3, 4, 4]
    monkeypatch.setenv(copythreads.ENV_COPY_THREADS, "0")
    assert copythreads.threads() == 0
    monkeypatch.setenv(copythreads.ENV_COPY_THREADS, "6")
    assert copythreads.threads() == 6
    for bad in ("many", "-1", "1.5"):
        monkeypatch.setenv(copythreads.ENV_COPY_THREADS, bad)
        with pytest.raises(ValueError, match=copythreads.ENV_COPY_THREADS):
            copythreads.threads()
    monkeypatch.delenv(copythreads.ENV_COPY_THREADS)
    assert copythreads.threads() == copythreads.default_threads(len(os.sched_getaffinity(0)))
