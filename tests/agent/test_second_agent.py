"""A second agent started on a running agent's socket or arena is refused and changes nothing.

Before the claim, the second agent resized the arena and rewrote the commit journal before
it found the socket taken: the running agent then served zeros and died of SIGBUS (another
size) or lost its chunks at the next warm restart (the same size).
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

CHUNK = 256 * 1024


def chunk(i: int) -> tuple[bytes, bytes]:
    return i.to_bytes(4, "little") * 4, bytes([i % 251 + 1]) * CHUNK


def second_agent(first: LocalAgent, tmp_path: Path, dram: str, *,
                 same_socket: bool) -> LocalAgent:
    """An agent on the first one's arena, and on its socket or a socket of its own."""
    workdir = first.workdir if same_socket else tmp_path / "second"
    workdir.mkdir(exist_ok=True)
    second = LocalAgent("--no-lock", workdir=workdir, dram=dram,
                        log_path=tmp_path / "second.log", start_timeout=60)
    second.args[second.args.index(str(second.arena_path))] = str(first.arena_path)
    second.arena_path = first.arena_path
    return second


@pytest.mark.parametrize(("dram", "same_socket"), [
    ("16Mi", True), ("32Mi", True), ("16Mi", False), ("32Mi", False),
], ids=["other-size-same-socket", "same-size-same-socket", "other-size-other-socket",
        "same-size-other-socket"])
def test_a_second_agent_on_the_same_arena_is_refused_and_changes_nothing(
        tmp_path: Path, dram: str, same_socket: bool) -> None:
    (tmp_path / "first").mkdir()
    with LocalAgent("--no-lock", workdir=tmp_path / "first", dram="32Mi") as first:
        with KVPoolClient(first.socket_path) as c:
            for i in range(40):
                assert c.put(*chunk(i))
        journal = first.arena_path.with_suffix(".journal")
        before = (first.arena_path.stat().st_size, journal.read_bytes())

        second = second_agent(first, tmp_path, dram, same_socket=same_socket)
        # Never stop() it: that would remove the first agent's files. Its start may return
        # at once (the first agent answers on a shared socket): wait for its exit.
        with contextlib.suppress(RuntimeError):
            second.start()
        assert second.proc is not None
        try:
            assert second.proc.wait(timeout=60) != 0
        finally:
            if second.proc.poll() is None:  # it started after all: end it, files untouched
                second.proc.kill()
                second.proc.wait(timeout=30)
        log = second.log()
        assert "another agent" in log and "nothing was changed" in log, log
        assert (first.arena_path.stat().st_size, journal.read_bytes()) == before

        # The first agent serves every chunk, bytes checked, and its restart is warm.
        with KVPoolClient(first.socket_path) as c:
            for i in range(40):
                key, data = chunk(i)
                assert c.get(key, verify=True) == data
        first.kill(signal.SIGKILL)
        first.start()
        with KVPoolClient(first.socket_path) as c:
            for i in range(40):
                key, data = chunk(i)
                out = bytearray(CHUNK)
                assert c.get_into(key, out, verify=True) == CHUNK and out == data
        assert first.proc is not None and first.proc.poll() is None
